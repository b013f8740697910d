"""A drawn exit trace for a benchmark workload (random weights have no meaningful gate).

Each decode token's depth is drawn, seeded, from ``probs`` (probability of depth
1..R). The engine replays it with ``ExitConfig(mode="trace")``: every token loops
exactly its drawn depth, so the run measures what adaptive depth buys at that
depth histogram. Request ids are the benchmark client's (``{tag}-{index}``).
"""
from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np


def check_probs(probs: Sequence[float], num_loops: int, flag: str = "--trace-depth-probs") -> np.ndarray:
    p = np.asarray(probs, np.float64)
    if p.ndim != 1 or len(p) != num_loops:
        raise ValueError(f"{flag}: give one probability per depth 1..{num_loops} "
                         f"(the model's loops), got {len(p)}")
    if (p < 0).any() or abs(p.sum() - 1.0) > 1e-6:
        raise ValueError(f"{flag} must be >= 0 and sum to 1, got {list(probs)} (sum {p.sum():.6g})")
    return p


def draw_depths(output_lens: dict[str, int], probs: Sequence[float], num_loops: int,
                seed: int, flag: str = "--trace-depth-probs") -> dict[str, list[int]]:
    """{request id: one depth per output token}; ids in sorted order share one seeded stream.
    Entry 0 is R: the first token comes out of prefill, which always runs every loop."""
    p = check_probs(probs, num_loops, flag)
    rng = np.random.default_rng(seed)
    return {rid: [num_loops] + (1 + rng.choice(num_loops, size=output_lens[rid] - 1, p=p)).tolist()
            for rid in sorted(output_lens)}


def workload_ids(tags_and_lens: Sequence[tuple[str, Sequence[int]]]) -> dict[str, int]:
    """{"{tag}-{i}": output length} for each run (tag) of the closed-loop client."""
    return {f"{tag}-{i}": n for tag, lens in tags_and_lens for i, n in enumerate(lens)}


def describe(depths: dict[str, list[int]], probs: Sequence[float], seed: int) -> dict:
    """The trace's decode-token depth histogram (entry 0, the prefill's, left out)."""
    flat = np.concatenate([np.asarray(d[1:], np.int64) for d in depths.values()]) if depths else np.zeros(0)
    hist = {int(k): int(v) for k, v in zip(*np.unique(flat, return_counts=True))}
    return dict(kind="drawn", probs=list(map(float, probs)), seed=seed, requests=len(depths),
                decode_tokens=int(flat.size), mean_depth=float(flat.mean()) if flat.size else None,
                histogram=hist)


def closed_loop_passes(passes_per_request: Sequence[int], slots: int) -> int:
    """Loop passes a perfect closed-loop scheduler needs: ``slots`` rows, requests admitted
    in order, each into the first row that frees up, a row advancing one loop per pass.
    (List scheduling: the makespan of the requests' pass counts on ``slots`` rows.)"""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    free_at = [0] * min(slots, max(1, len(passes_per_request)))
    heapq.heapify(free_at)
    for n in passes_per_request:
        heapq.heappush(free_at, heapq.heappop(free_at) + int(n))
    return max(free_at)


def schedule_bound(depths: Sequence[Sequence[int]], slots: int, num_loops: int) -> dict:
    """How the workload's drain scales DESIGN's ideal speed-up, which assumes full batches:
    the trace's row occupancy under a perfect closed-loop scheduler (in-order admission, no
    bypasses) against fixed depth's. Each request's decode passes are its depths after
    entry 0 (the first token comes out of prefill, which both runs pay alike).

    ``bound_fraction`` = occupancy(trace) / occupancy(fixed). An approximation: it takes a
    pass to cost the same however many rows are busy (the weight-bound regime; the ideal
    charges KV reads per row). Below 1 when rows sit idle while the last, deepest requests
    finish (few requests per row); above 1 when the fixed-depth run drains more (requests
    not a multiple of the rows)."""
    trace = [int(sum(d[1:])) for d in depths]
    fixed = [num_loops * max(0, len(d) - 1) for d in depths]
    p_trace, p_fixed = closed_loop_passes(trace, slots), closed_loop_passes(fixed, slots)
    occ_trace = sum(trace) / (slots * p_trace) if p_trace else 1.0
    occ_fixed = sum(fixed) / (slots * p_fixed) if p_fixed else 1.0
    return dict(passes_trace=p_trace, passes_fixed=p_fixed, occupancy_trace=occ_trace,
                occupancy_fixed=occ_fixed, bound_fraction=occ_trace / occ_fixed)


def loop_passes(steps: dict) -> int:
    """Loop passes an engine run made, from its ``steps_by_kind``: the windows' passes and
    the host-scheduled ones."""
    return steps.get("window_passes", 0) + steps.get("loop", 0)


def pass_split(fixed_seconds: float, fixed_passes: int, trace_seconds: float, trace_passes: int) -> dict:
    """Splits the speed-up of a trace run over a fixed-depth run of the same tokens,
    fixed_seconds / trace_seconds, into two factors: the loop passes the trace saved
    (``pass_ratio`` = fixed_passes / trace_passes) and how much more wall time each of its
    passes took (``pass_cost_ratio``, wall seconds a pass with everything in them: prefill,
    heads, host gaps). speed-up = pass_ratio / pass_cost_ratio. The first is the scheduler's
    share, to set against ``schedule_bound``'s passes_fixed / passes_trace (a perfect
    scheduler's); the second is the rest (1 when an adaptive pass costs what a fixed-depth
    one does)."""
    if min(fixed_passes, trace_passes) < 1 or min(fixed_seconds, trace_seconds) <= 0:
        raise ValueError(f"pass_split needs runs with passes and time, got fixed {fixed_passes} passes in "
                         f"{fixed_seconds} s, trace {trace_passes} passes in {trace_seconds} s")
    fixed_pass, trace_pass = fixed_seconds / fixed_passes, trace_seconds / trace_passes
    return dict(pass_ratio=fixed_passes / trace_passes, pass_cost_ratio=trace_pass / fixed_pass,
                fixed_ms_per_pass=fixed_pass * 1e3, trace_ms_per_pass=trace_pass * 1e3)

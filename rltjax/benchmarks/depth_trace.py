"""A drawn exit trace for a benchmark workload (random weights have no meaningful gate).

Each decode token's depth is drawn, seeded, from ``probs`` (probability of depth
1..R). The engine replays it with ``ExitConfig(mode="trace")``: every token loops
exactly its drawn depth, so the run measures what adaptive depth buys at that
depth histogram. Request ids are the benchmark client's (``{tag}-{index}``).
"""
from __future__ import annotations

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

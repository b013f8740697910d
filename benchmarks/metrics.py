"""Latency and throughput statistics from per-request token timestamps.

Per request (times in seconds on one monotonic clock):

- TTFT = first token arrival - request start;
- end-to-end (e2e) = end - start, where end is when the response completed;
- TPOT = (e2e - TTFT) / (output tokens - 1), for requests with more than one token;
- ITL = the gaps between consecutive token arrivals (one per arrival after the
  first; a streamed chunk that carries several tokens is one arrival, as in
  vLLM's benchmark, and the count of tokens comes from the server's usage).

Percentiles interpolate linearly between order statistics (numpy's default),
so p50 of [1, 2, 3, 4] is 2.5. Summaries are in milliseconds; throughput is
over the benchmark's wall time (first start to last end).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import numpy as np

from benchmarks.depth_trace import closed_loop_passes

PERCENTILES = (50, 95, 99)


@dataclasses.dataclass
class RequestTiming:
    """What a client saw of one request."""
    start: float
    arrivals: list[float] = dataclasses.field(default_factory=list)   # token (or chunk) arrival times
    end: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0           # tokens generated (usage count; >= len(arrivals))
    exit_depths: list[int] | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and bool(self.arrivals)


def ttft(t: RequestTiming) -> float:
    return t.arrivals[0] - t.start


def e2e(t: RequestTiming) -> float:
    return t.end - t.start


def tpot(t: RequestTiming) -> float | None:
    """Mean time per output token after the first (None for one-token requests)."""
    if t.output_tokens < 2:
        return None
    return (e2e(t) - ttft(t)) / (t.output_tokens - 1)


def itls(t: RequestTiming) -> list[float]:
    return list(np.diff(t.arrivals)) if len(t.arrivals) > 1 else []


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; NaN for no values."""
    if len(values) == 0:
        return float("nan")
    return float(np.percentile(np.asarray(values, float), q))


def stats_ms(values: Iterable[float]) -> dict[str, float]:
    """mean / std / p50 / p95 / p99 / max of values in seconds, reported in milliseconds."""
    v = np.asarray(list(values), float) * 1e3
    out = dict(count=int(v.size), mean=float(v.mean()) if v.size else float("nan"),
               std=float(v.std()) if v.size else float("nan"))
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(v, q)
    out["max"] = float(v.max()) if v.size else float("nan")
    return out


def mean_decode_depth(timings: Sequence[RequestTiming]) -> float | None:
    """Mean loops per decode token: exit_depths[1:] of every request (entry 0 is the prompt's, always R)."""
    depths = [d for t in timings if t.exit_depths for d in t.exit_depths[1:]]
    return float(np.mean(depths)) if depths else None


def pass_occupancy(timings: Sequence[RequestTiming], loop_passes: int, wall_s: float, rows: int) -> dict | None:
    """How a run's decode work filled the engine's loop passes (in process: the engine's pass
    count). Each decode token costs its exit depth in row-passes, so

        decode tokens/s = active_rows_per_pass / (mean depth * wall_ms_per_pass)

    exactly, which splits a throughput gap into rows the passes did not carry (the drain at
    the end of a closed loop, rows idle between a request's end and the next admission) and
    the wall time of a pass (its kernels, plus prefill steps and host time spread over the
    passes). ``perfect_occupancy``: the same requests (in order) under a perfect closed-loop
    scheduler (``depth_trace.closed_loop_passes``): what the drain alone leaves, so
    occupancy / perfect_occupancy is the engine's own share. ``rows``: the concurrency.
    None without passes or recorded exit depths."""
    work = [int(sum(t.exit_depths[1:])) for t in timings if t.ok and t.exit_depths]
    row_passes = sum(work)
    if not loop_passes or not row_passes or rows < 1:
        return None
    active = row_passes / loop_passes
    return dict(loop_passes=int(loop_passes), row_passes=int(row_passes), active_rows_per_pass=active,
                occupancy=active / rows, perfect_occupancy=row_passes / (rows * closed_loop_passes(work, rows)),
                wall_ms_per_pass=1e3 * wall_s / loop_passes)


def summarize(timings: Sequence[RequestTiming], wall_s: float | None = None) -> dict:
    """Throughput and latency statistics of one run (failed requests are counted, not timed)."""
    done = [t for t in timings if t.ok]
    if wall_s is None:
        wall_s = (max(t.end for t in done) - min(t.start for t in done)) if done else 0.0
    out_tokens = sum(t.output_tokens for t in done)
    in_tokens = sum(t.prompt_tokens for t in done)
    per = lambda v: v / wall_s if wall_s > 0 else float("nan")
    return dict(
        completed=len(done), failed=len(timings) - len(done), duration_s=wall_s,
        input_tokens=in_tokens, output_tokens=out_tokens,
        request_throughput=per(len(done)), output_throughput=per(out_tokens),
        total_token_throughput=per(out_tokens + in_tokens),
        ttft_ms=stats_ms(ttft(t) for t in done),
        tpot_ms=stats_ms(x for x in map(tpot, done) if x is not None),
        itl_ms=stats_ms(x for t in done for x in itls(t)),
        e2e_ms=stats_ms(e2e(t) for t in done),
        mean_decode_depth=mean_decode_depth(done),
        errors=sorted({t.error for t in timings if t.error})[:5])

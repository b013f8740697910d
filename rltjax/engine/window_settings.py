"""Decode windows as they run: ``WindowSettings``, resolved once by ``resolve_window``.

A window runs K loop passes (or speculative rounds) over a row bucket; per bucket it either
carries prompt tokens (mixed prefill) or takes waiting requests as standby entries.
``engine.settings.resolve_settings`` calls ``resolve_window`` after the feature rules have
passed; nothing else derives these values.
"""
from __future__ import annotations

import dataclasses

from rltjax.engine_config import DEFAULT_DECODE_WINDOW, ExecutionConfig, SchedulerConfig, SpeculativeConfig


def bucket(n: int) -> int:
    """Smallest power of two >= n."""
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class SpecSettings:
    """Self-speculative rounds as they run (``window.speculative``)."""
    num_tokens: int      # K: drafts a round makes at most
    draft_loops: int     # d
    target_loops: int    # D
    rounds: int          # rounds a decode window runs

    @property
    def columns(self) -> int:
        """Output tokens a window can make per row (a round makes up to K + 1)."""
        return self.rounds * (self.num_tokens + 1)


def spec_settings(config: SpeculativeConfig | None, num_loops: int) -> SpecSettings | None:
    if config is None:
        return None
    return SpecSettings(config.num_speculative_tokens, config.draft_loops, config.target_loops or num_loops,
                        config.rounds_per_window)


@dataclasses.dataclass(frozen=True)
class WindowSettings:
    """Decode windows as they run: K passes a window, its trip, and per row bucket whether
    it carries prompts (mixed prefill) or takes requests as standby entries."""
    num_passes: int                          # K
    fixed_trip: bool                         # exactly K passes (no predicate read between passes)
    trace_width: int                         # width of a row's recorded trace (trace mode)
    buckets: tuple[int, ...]                 # the row buckets windows run
    prompt_tokens: tuple[tuple[int, int], ...]   # (row bucket, prompt tokens it carries), mixed buckets only
    swap_every_pass: bool                    # standby entries wait past a window's start
    speculative: SpecSettings | None = None  # rounds of drafts and a verify instead of loop passes

    def prompt_tokens_for(self, rows: int) -> int:
        """Prompt tokens a window of this row bucket carries (0: none; it takes standby entries)."""
        return dict(self.prompt_tokens).get(rows, 0)

    @property
    def mixed_buckets(self) -> tuple[int, ...]:
        return tuple(b for b, _ in self.prompt_tokens)

    def standby_for(self, rows: int) -> bool:
        return rows not in self.mixed_buckets

    @property
    def uses_standby(self) -> bool:
        return any(self.standby_for(b) for b in self.buckets)

    def bucket_for(self, n: int) -> int:
        """The row bucket of a window over n requests (at most the largest)."""
        return min(max(bucket(n), self.buckets[0]), self.buckets[-1])


def window_passes(execution: ExecutionConfig, scheduler: SchedulerConfig) -> int:
    """K: as asked, or DEFAULT_DECODE_WINDOW where windows can run (refill, heads at once)."""
    if execution.decode_window is not None:
        return execution.decode_window
    runs = scheduler.mode == "refill" and scheduler.min_coda_batch_size == 1
    return DEFAULT_DECODE_WINDOW if runs else 0


def fixed_trip(execution: ExecutionConfig, has_boundary: bool) -> bool:
    """window_trip ``auto``: fixed, except for models with boundary stages, whose prelude would
    then run every pass (on an H200 the fixed trip was 14% / 24% faster than early stop at 1 /
    8 Ouro-1.4B streams: the GPU no longer waits on the host between passes)."""
    return execution.window_trip == "fixed" or (execution.window_trip == "auto" and not has_boundary)


def mixed_prompt_tokens(steps, window_buckets, most_tokens: int) -> tuple[tuple[int, int], ...]:
    """((row bucket, prompt tokens its windows carry), ...) for mixed prefill's (rows, T) steps:
    the T of the last step a bucket reaches, capped at the largest prefill batch; buckets below
    the first step and steps of T = 0 carry none."""
    carried = []
    for rows in window_buckets:
        reached = [t for at, t in sorted(steps) if rows >= at]
        if reached and reached[-1]:
            carried.append((rows, min(reached[-1], most_tokens)))
    return tuple(carried)


@dataclasses.dataclass(frozen=True)
class WindowInputs:
    """What ``resolve_window`` reads, already resolved by ``resolve_settings``."""
    passes: int                      # K (window_passes)
    fixed: bool                      # fixed_trip
    row_buckets: tuple[int, ...]     # the engine's row buckets
    largest_token_bucket: int        # the largest prefill batch's token bucket
    max_num_seqs: int
    num_loops: int                   # R
    trace_width: int                 # max_model_len in trace mode, else 1
    auto_mixed: tuple                # mixed prefill's steps under "auto" where it can run, else ()


def resolve_window(execution: ExecutionConfig, speculative: SpeculativeConfig | None,
                   w: WindowInputs) -> WindowSettings | None:
    """The decode windows as they run (None: no windows)."""
    if not w.passes:
        return None
    rows_cap = execution.decode_window_rows
    buckets = tuple(b for b in w.row_buckets if rows_cap is None or b <= rows_cap)
    steps = execution.mixed_prefill_steps()
    if steps is None:       # auto: where it can run (the rules refuse only an explicit T)
        steps = w.auto_mixed if rows_cap is None else ()
    prompt_tokens = mixed_prompt_tokens(steps, buckets, w.largest_token_bucket)
    uses_standby = any(b not in dict(prompt_tokens) for b in buckets)
    # entries wait past a window's start only when its rows cannot hold every request: the
    # swap then runs every pass, else once a window (every pass cost the fixed-depth bench_cdb
    # run 0.9% on an H200)
    spec = spec_settings(speculative, w.num_loops)
    # a speculative window's K is its output columns (positions its pages cover); its standby
    # entries take rows at its start only (rounds are not passes)
    return WindowSettings(spec.columns if spec else w.passes, w.fixed, w.trace_width, buckets, prompt_tokens,
                          swap_every_pass=uses_standby and buckets[-1] < w.max_num_seqs and not spec,
                          speculative=spec)

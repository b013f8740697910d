"""Which decode windows an engine runs: K, the trip, the trace width and mixed prefill,
resolved from ExecutionConfig against the exit mode, the scheduler and the model."""
from __future__ import annotations

import dataclasses

from rltjax.engine_config import AUTO_MIXED_PREFILL, DEFAULT_DECODE_WINDOW, EngineConfigError

WINDOW_MODES = ("ouro", "ouro_delayed", "random_lookahead", "fixed", "trace", "latent_diff")


@dataclasses.dataclass(frozen=True)
class WindowSettings:
    num_passes: int              # K (0: no windows)
    fixed_trip: bool
    trace_width: int             # width of WindowRows.trace
    # mixed prefill: (rows, T) steps, ascending; a window of at least `rows` rows carries prompts
    # of up to T tokens (the last step it reaches); () or windows below the first step: none
    # (they keep standby entries)
    mixed_prefill: tuple[tuple[int, int], ...]

    def spec(self, exit_mode: str, layered: bool) -> dict | None:
        """The windows' static settings for ``ModelRunner(window_spec=...)``; None without windows."""
        if not self.num_passes:
            return None
        return dict(num_passes=self.num_passes, mode=exit_mode, layered=layered, fixed_trip=self.fixed_trip)


def window_settings(execution_config, scheduler_config, exit_mode: str, *, arch: str, num_loops: int,
                    has_boundary: bool, max_model_len: int, kv_layout: str) -> WindowSettings:
    passes = resolve_window_passes(execution_config.decode_window, scheduler_config, exit_mode, arch)
    fixed = resolve_window_trip(execution_config.window_trip, has_boundary)
    asked = execution_config.mixed_prefill_tokens
    steps = execution_config.mixed_prefill_steps()
    if steps is None:       # auto: where it can run (config_rules refuse only an explicit T)
        runs = (kv_layout == "last_exited" and execution_config.decode_window_rows is None
                and not mixed_prefill_blocker(passes, fixed, has_boundary, num_loops, arch))
        steps = AUTO_MIXED_PREFILL if runs else ()
    return WindowSettings(passes, fixed, trace_width(exit_mode, max_model_len), resolve_mixed_prefill(
        steps, asked, passes, fixed, has_boundary, num_loops, arch))


def resolve_window_passes(asked: int | None, scheduler_config, exit_mode: str, arch: str) -> int:
    """K of an engine's decode windows: as asked (ExecutionConfig.decode_window), or, when None,
    DEFAULT_DECODE_WINDOW where windows can run and 0 elsewhere."""
    possible = exit_mode in WINDOW_MODES
    if asked is None:
        return DEFAULT_DECODE_WINDOW if (possible and scheduler_config.mode == "refill"
                                         and scheduler_config.min_coda_batch_size == 1) else 0
    if asked and not possible:
        raise EngineConfigError(
            f"ExecutionConfig.decode_window={asked}: decode windows run exit modes {WINDOW_MODES}; this "
            f"engine has {arch} with exit mode {exit_mode!r} (use decode_window=0)")
    return asked


def trace_width(exit_mode: str, max_model_len: int) -> int:
    """Width of WindowRows.trace: trace mode carries each request's whole recorded trace (at
    most max_model_len outputs), so windows continue on the device; other modes need none."""
    return max_model_len if exit_mode == "trace" else 1


def resolve_window_trip(asked: str, has_boundary: bool) -> bool:
    """Whether windows run a fixed trip (ExecutionConfig.window_trip). ``auto``: fixed, except
    for models with boundary stages (Huginn), whose prelude would then run every pass (on an
    H200 the fixed trip with a static-sampler head was 14% / 24% faster than early stop at
    1 / 8 Ouro-1.4B streams: the GPU no longer waits on the host between passes)."""
    return asked == "fixed" or (asked == "auto" and not has_boundary)


def resolve_mixed_prefill(steps: tuple[tuple[int, int], ...], asked, window_passes: int, fixed_trip: bool,
                          has_boundary: bool, num_loops: int, arch: str) -> tuple[tuple[int, int], ...]:
    """ExecutionConfig.mixed_prefill_tokens (``asked``, for the error) as ascending (rows, T)
    steps (auto resolved already), checked against the engine's windows and model; () where
    every T is 0. Auto never fails here: it resolves to () where windows cannot take prompts."""
    if not any(t for _, t in steps):
        return ()
    if why := mixed_prefill_blocker(window_passes, fixed_trip, has_boundary, num_loops, arch):
        raise EngineConfigError(f"ExecutionConfig.mixed_prefill_tokens={asked}: {why}; set it to 0")
    return steps


def prompt_tokens_by_bucket(steps: tuple[tuple[int, int], ...], buckets, most_tokens: int) -> dict[int, int]:
    """{row bucket: prompt tokens its windows carry} for mixed prefill's (rows, T) steps: the
    T of the last step a bucket reaches, capped at ``most_tokens`` (the largest prefill
    batch); buckets below the first step are left out."""
    carried, steps = {}, sorted(steps)
    for bucket in buckets:
        reached = [t for rows, t in steps if bucket >= rows]
        if reached and reached[-1]:
            carried[bucket] = min(reached[-1], most_tokens)
    return carried


def mixed_prefill_blocker(window_passes: int, fixed_trip: bool, has_boundary: bool, num_loops: int,
                          arch: str) -> str | None:
    """Why these windows and this model cannot run mixed prefill (None when they can)."""
    return ("decode windows do not run here (ExecutionConfig.decode_window resolved to 0)" if not window_passes
            else f"{arch} has boundary stages (its prelude / coda KV)" if has_boundary
            else "the windows stop early (window_trip early_stop)" if not fixed_trip
            else f"decode_window={window_passes} leaves no pass after the prompts' R={num_loops} loops"
            if window_passes <= num_loops else None)

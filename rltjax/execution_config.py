"""``ExecutionConfig``: how device work is compiled and dispatched (kernels, XLA options,
decode windows, mixed prefill, start-up compilation), and the defaults measured for it."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Mapping

from rltjax.config_checks import _bad, _is_int
from rltjax.kernels import BACKENDS

ATTN_IMPLS = ("auto", "xla", "pallas")
MATMUL_IMPLS = ("auto", "xla", "pallas")
KERNEL_BACKENDS = BACKENDS
WINDOW_TRIPS = ("auto", "early_stop", "fixed")
# K of decode windows when ExecutionConfig.decode_window is None and windows can run. A row
# whose request finishes inside window w is refilled after w + 1 (the host reads each window
# one window late), about 1.5 K idle passes a finish, so a shorter window keeps rows fuller;
# each window boundary costs a little. On an H200 (Ouro-1.4B shapes, ShareGPT closed loop,
# alternating on one machine) K=8 against 16: +0.6% at 8 streams (K=4: +0.3%), +0.3% at 32,
# and a third less time to first token; K = 16 windows beat step-by-step passes at 1, 8 and 32
# streams (scripts/bench_serving.py, scripts/bench_cdb.py).
DEFAULT_DECODE_WINDOW = 8
# ExecutionConfig.mixed_prefill_tokens=None (auto): (rows, T) steps, ascending: windows of at
# least `rows` rows carry prompts of up to T tokens (the last step a window's rows reach);
# smaller ones keep standby entries. On an H200 (Ouro-1.4B shapes, ShareGPT closed loop,
# alternating on one machine) T=128 against off: +1.6% at 32 streams and +2.0% at 64, mean
# TTFT +20 ms; at 8 streams within a run's noise; in every row bucket its executables made
# start-up 65 s cold / 17.5 s warm (scripts/bench_serving.py).
# ShareGPT's prompts are short (p50 24 tokens): most fit 128. T=32 from 8 rows ({8: 32, 32:
# 128}) gave +1.1% at 8 streams, but its 7 more executables put the cold start at 64 rows at
# 55-64 s against the 60 s target: a user's choice.
AUTO_MIXED_PREFILL = ((32, 128),)


def _per_row_bucket_ok(value, ok: Callable[[Any], bool]) -> bool:
    """None, one value ``ok`` accepts, or a non-empty {power-of-two rows: such a value}."""
    if value is None or ok(value):
        return True
    return isinstance(value, Mapping) and bool(value) and all(
        _is_int(rows) and rows >= 1 and rows & (rows - 1) == 0 and ok(v) for rows, v in value.items())


def _attn_splits_ok(value) -> bool:
    return _per_row_bucket_ok(value, lambda s: _is_int(s) and 1 <= s <= 64)


def _mixed_prefill_ok(value) -> bool:
    return _per_row_bucket_ok(value, lambda t: _is_int(t) and (t == 0 or (32 <= t <= 8192 and t & (t - 1) == 0)))


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rltjax" / "xla"


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    """How device work is compiled and dispatched.

    attn_impl: paged attention implementation (``auto`` = Pallas on GPU, XLA elsewhere).
    attn_num_splits: the decode attention kernel's key splits per row (flash-decoding; the
    splits' partial results are combined after it). None (default) picks
    ``kernels.paged_attention_launch.default_launch`` per batch bucket; set it to tune (like
    SGLang's ``--triton-attention-num-kv-splits``): an int for every decode batch, or
    {rows: splits} for the decode batches padded to those row buckets (powers of two from
    min(8, max_num_seqs) up to max_num_seqs; the others keep the default). Prefill and the XLA
    path ignore it.
    matmul_impl: decode projections: ``auto`` (the default: on a GPU, the attention projections
    (q|k|v, o) of decode batches of up to ``kernels.skinny_matmul.MAX_ROWS`` (64) rows run on
    the weight-streaming Pallas kernel, which beat XLA's split-K GEMMs there on an H200, and
    Ouro's MLP on its fused kernels: the gate | up pair with its SiLU-multiply in one, down
    (like o) handing split-K partial sums to the residual-norm kernel, and Ouro's heads of up to
    8 rows on the kernel, which a fixed-trip window skips on passes where no row exits; the rest
    is XLA's dot; where attention runs on XLA, everything does), ``xla`` (XLA's dot everywhere)
    or ``pallas`` (every projection of at most MAX_ROWS rows on the kernels, Nanbeige's and
    Huginn's too, and Ouro's and Nanbeige's heads); prefill batches always use XLA's dot.
    kernel_backend: the Pallas backend of the decode kernels: ``triton`` (the default) or
    ``mosaic``: Mosaic GPU (Hopper GPUs, compute capability 9.x; CPU tests in interpret mode)
    for the decode projections matmul_impl puts on kernels (16-bit weights, dimensions in
    multiples of 64) and for decode attention where attn_impl runs the kernels (16-bit KV,
    head_dim a multiple of 64, pages of a multiple of 8 keys; RoPE then runs in XLA), Triton
    for the rest (prefill attention, the residual norm). Alone on an H200 the Mosaic projection
    kernels stream q|k|v, o, gate and down 3-25% faster (scripts/bench_skinny.py), and the Mosaic
    attention kernel is 3-6% faster at 32-64 rows of 2,048 keys on an H100 but 17-37% slower at
    ShareGPT's (scripts/bench_decode_attention.py --backends); the engine on them was 11-17%
    slower at 1-32 streams on an H100 (ShareGPT in process, scripts/bench_serving.py
    --kernel-backend): hence not the default. The rules refuse it where no decode kernel runs
    (attn_impl "xla", which puts the projections on XLA too, unless matmul_impl "pallas" on one
    device).
    interpret: run the Pallas kernels in interpret mode (CPU testing of the "pallas" impls).
    decode_window: K > 0 runs decode as device-side windows of up to K loop passes
    (``rltjax.engine.decode_window``) whenever every running request is decoding; 0 runs
    every pass as its own engine step; None (default) picks DEFAULT_DECODE_WINDOW where the
    engine can run windows (refill, min_coda_batch_size 1) and 0 elsewhere.
    decode_window_rows: the most rows a decode window runs (a power of two >= 8); requests
    admitted beyond them (up to SchedulerConfig.max_num_seqs) are prefilled and wait on the
    device, each taking the row of the next request to finish in the pass after it finishes
    (``rltjax.engine.standby``), so a finished request's row is not left idle until the host
    reads the window one window late. None (default): every admitted request has a row.
    Not with mixed prefill.
    window_trip: how a decode window's loop runs: ``early_stop`` (a while loop that ends when
    no row is active; the head runs under a cond, only on passes where a row exits),
    ``fixed`` (exactly K passes and a head every pass: no predicate for XLA to read back to
    the host between passes) or ``auto`` (default: fixed, except early stop for models with
    boundary stages, whose prelude would run every pass). Same outputs either way.
    async_scheduling: a step-by-step loop pass is launched before the previous pass's exit
    signals are read (they arrive with ``copy_to_host_async`` and are applied one pass late);
    needs an exit mode that decides one pass ahead (ouro_delayed, random_lookahead, trace, fixed).
    xla_options: XLA compiler options for every engine executable, {name: value} (e.g.
    {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUSTOM_CALL,WHILE,CONDITIONAL"}); an
    unknown name fails at the first compile with XLA's message. On a GPU the engine adds
    ``xla_disable_hlo_passes=rematerialization`` (``jit_options.GPU_DEFAULT_OPTIONS``: XLA's
    remat pass miscomputed decode windows over a full-size KV pool); passes a caller disables
    are added to it. Where the decode projections run on the engine's kernels (Ouro's shapes
    on the Pallas kernels, matmul_impl not ``xla``, max_num_seqs <= 64) it also adds
    ``xla_gpu_enable_triton_gemm=False`` unless the caller sets it
    (``KERNEL_DECODE_OPTIONS``: cuBLAS for the prefill's GEMMs, a shorter cold start at equal
    speed). Empty elsewhere: XLA's defaults.
    compile_ahead: compile every bucket at start-up (else on first use).
    compilation_cache_dir: XLA's persistent compilation cache (None disables it).
    executable_cache: with compile_ahead and a compilation_cache_dir, the start-up also keeps
    each compiled step in its ``executables`` folder, keyed on the engine's code, the device,
    the configuration and the step's argument shapes (``engine.executable_store``); a later
    start with the same key loads it without tracing or lowering Python (the warm start).
    Each key's code and settings get a folder; a start keeps the 4 most recently used others.
    mixed_prefill_tokens: T > 0 (a power of two): requests admitted while a decode window runs
    whose whole prompts fit this many tokens run their R loops inside the next window's first
    R passes, with the decoding rows (one GEMM over both), instead of a prefill step of their
    own; their first token then comes with that window's outputs (capped at the largest
    prefill batch: no admission holds more). 0: off. ``{rows: T}``: a T per window size, from
    ``rows`` rows up to the next key (T = 0 there: off), e.g. ``{8: 32, 16: 0, 32: 128}``;
    windows below the smallest key keep standby entries. Needs fixed-trip decode windows
    (K > R), the last_exited layout, a model without boundary stages and no
    decode_window_rows. None (auto, the default): AUTO_MIXED_PREFILL's T per window size
    where all of that holds (T = 128 in windows of 32 rows or more; smaller windows keep
    standby entries), else off; it trades time to first token, which then waits for a window,
    for fewer prefill steps.
    """
    attn_impl: str = "auto"
    attn_num_splits: int | Mapping[int, int] | None = None
    matmul_impl: str = "auto"
    kernel_backend: str = "triton"
    interpret: bool = False
    decode_window: int | None = None
    decode_window_rows: int | None = None
    window_trip: str = "auto"
    async_scheduling: bool = False
    xla_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    compile_ahead: bool = True
    compilation_cache_dir: str | None = dataclasses.field(default_factory=lambda: str(default_cache_dir()))
    executable_cache: bool = True
    show_progress: bool = True
    mixed_prefill_tokens: int | Mapping[int, int] | None = None

    def __post_init__(self) -> None:
        if self.attn_impl not in ATTN_IMPLS:
            _bad("ExecutionConfig", "attn_impl", self.attn_impl, f"choose one of {ATTN_IMPLS}")
        if not _attn_splits_ok(self.attn_num_splits):
            _bad("ExecutionConfig", "attn_num_splits", self.attn_num_splits,
                 "must be None, an integer in [1, 64], or {rows: splits} with power-of-two decode row buckets "
                 "as keys and integers in [1, 64] as values")
        if self.matmul_impl not in MATMUL_IMPLS:
            _bad("ExecutionConfig", "matmul_impl", self.matmul_impl, f"choose one of {MATMUL_IMPLS}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            _bad("ExecutionConfig", "kernel_backend", self.kernel_backend, f"choose one of {KERNEL_BACKENDS}")
        if self.decode_window is not None and not (_is_int(self.decode_window) and 0 <= self.decode_window <= 1024):
            _bad("ExecutionConfig", "decode_window", self.decode_window, "must be an integer in [0, 1024]")
        r = self.decode_window_rows
        if r is not None and (not _is_int(r) or r < 8 or r & (r - 1)):
            _bad("ExecutionConfig", "decode_window_rows", r, "must be None or a power of two >= 8")
        if self.window_trip not in WINDOW_TRIPS:
            _bad("ExecutionConfig", "window_trip", self.window_trip, f"choose one of {WINDOW_TRIPS}")
        if not _mixed_prefill_ok(self.mixed_prefill_tokens):
            _bad("ExecutionConfig", "mixed_prefill_tokens", self.mixed_prefill_tokens,
                 "must be 0 (off), None (auto), a power of two in [32, 8192], or {rows: T} with power-of-two "
                 "window row buckets as keys and 0 or such a T as values")
        for name, value in dict(self.xla_options).items():
            if not (isinstance(name, str) and name.startswith("xla_")):
                _bad("ExecutionConfig", "xla_options", name, "names are XLA debug options such as 'xla_gpu_...'")
            if not isinstance(value, (str, int, float, bool)):
                _bad("ExecutionConfig", "xla_options", f"{name}={value!r}", "values are str, int, float or bool")

    def mixed_prefill_steps(self) -> tuple[tuple[int, int], ...] | None:
        """mixed_prefill_tokens as ascending (rows, T) steps: None for auto, () for off, one
        step from 1 row for a single T."""
        m = self.mixed_prefill_tokens
        if m is None:
            return None
        if isinstance(m, Mapping):
            return tuple(sorted(m.items()))
        return ((1, m),) if m else ()

    @property
    def asks_mixed_prefill(self) -> bool:
        """Whether the caller asked for mixed prefill in some window (auto does not count)."""
        return any(t for _, t in self.mixed_prefill_steps() or ())


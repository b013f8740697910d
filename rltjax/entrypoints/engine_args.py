"""Engine flags shared by every command that builds an engine (vLLM-style names)."""
from __future__ import annotations

import argparse
import json

from rltjax.engine_config import (ATTN_IMPLS, DEFAULT_DECODE_WINDOW, DEFAULT_PREFILL_CHUNK,
                                  DEFAULT_PREFILL_TOKENS_KERNEL, DEFAULT_PREFILL_TOKENS_XLA, EXIT_MODES, MATMUL_IMPLS,
                                  KV_LAYOUTS, SCHEDULER_MODES, WINDOW_TRIPS, CacheConfig, ExecutionConfig, ExitConfig,
                                  SchedulerConfig, default_cache_dir)


def mixed_prefill_tokens(text: str) -> int | dict[int, int] | None:
    """--mixed-prefill-tokens: "auto" (None: ExecutionConfig's auto mode), T, or
    ROWS:T[,ROWS:T...] (a T per window size; values are checked by ExecutionConfig)."""
    if text == "auto":
        return None
    try:
        return _int_or_rows_map(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected auto, T or ROWS:T[,ROWS:T...] with each ROWS once, "
                                         f"e.g. 8:32,16:0,32:128") from None


def _int_or_rows_map(text: str) -> int | dict[int, int]:
    """'N' -> N; 'ROWS:N,ROWS:N' -> {ROWS: N, ...}; ValueError on a malformed or repeated item."""
    if ":" not in text:
        return int(text)
    pairs = [item.split(":") for item in text.split(",")]
    if any(len(pair) != 2 for pair in pairs):
        raise ValueError(text)
    values = {int(rows): int(n) for rows, n in pairs}
    if len(values) != len(pairs):
        raise ValueError(text)
    return values


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine flags shared by generate, serve and bench, one argument group per config."""
    for add in (_model_arguments, _cache_arguments, _scheduler_arguments, _exit_arguments, _kernel_arguments,
                _window_arguments, _compile_arguments):
        add(p)


def _model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="parameter dtype (default: the checkpoint's)")
    g.add_argument("--hf-overrides", default=None,
                   help='JSON object of config.json fields to override (of --model, or of a benchmark\'s --preset), '
                        'e.g. \'{"total_ut_steps": 2}\'')
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's position limit)")


def _cache_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV cache")
    g.add_argument("--kv-layout", default="last_exited", choices=KV_LAYOUTS,
                   help="last_exited: one KV plane per loop depth (exact); shared: one plane (less memory)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    g.add_argument("--num-pages", type=int, default=None, help="KV pool size in pages (overrides "
                   "--gpu-memory-utilization)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of free device memory (after weights) given to the KV pool")
    g.add_argument("--cache-max-loops", type=int, default=None,
                   help="deepest recurrence a request may ask for (default: the model's loop count R); "
                        "above R only for models that allow it (Huginn); last_exited keeps this many planes")


def _scheduler_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scheduler")
    g.add_argument("--scheduler-mode", default="refill", choices=SCHEDULER_MODES,
                   help="refill: Continuous Depth Batching; no_refill: a cohort loops until all rows exit")
    g.add_argument("--max-num-seqs", type=int, default=16, help="requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"prefill tokens per step (default: {DEFAULT_PREFILL_TOKENS_KERNEL} where prefill attention "
                        f"runs on the Pallas prefill kernel, else {DEFAULT_PREFILL_TOKENS_XLA})")
    g.add_argument("--prefill-chunk-size", type=int, default=None,
                   help=f"prompt tokens per request per step (default: min({DEFAULT_PREFILL_CHUNK}, the budget))")
    g.add_argument("--max-prefill-batches-before-decode", type=int, default=1,
                   help="prefill batches in a row before a decode step runs, while requests decode")
    g.add_argument("--min-coda-batch-size", type=int, default=1,
                   help="heads wait for this many rows unless no loop work remains")


def _exit_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("exits")
    g.add_argument("--exit-mode", default="ouro", choices=[m for m in EXIT_MODES if m != "trace"],
                   help="how a decode token picks its loop count (latent_diff: Huginn's relative latent change)")
    g.add_argument("--lookahead-seed", type=int, default=0, help="seed of random_lookahead's frozen head")


def _kernel_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("kernels")
    g.add_argument("--attn-impl", default="auto", choices=ATTN_IMPLS,
                   help="paged attention: auto = Pallas kernel on GPU, XLA elsewhere")
    g.add_argument("--attn-num-splits", type=parse_attn_splits, default=None, metavar="N | ROWS:N,...",
                   help="decode attention kernel: key splits per row, for every decode batch (N) or per decode "
                        "row bucket (e.g. 32:1,64:1; the buckets not named keep the default); default: "
                        "picked per batch bucket")
    g.add_argument("--matmul-impl", default="auto", choices=MATMUL_IMPLS,
                   help="decode projections: auto = on GPU where attention runs on the Pallas kernels, "
                        "q|k|v and o of <= 64 decode rows on the weight-streaming Pallas kernel, Ouro's "
                        "gate|up with its activation on one kernel and its o and down handing split-K partial "
                        "sums to the residual-norm kernel, Ouro's heads of <= 8 rows on the kernel, which a "
                        "fixed-trip window skips on passes where no row exits, XLA's dot for the rest; "
                        "xla = XLA's dot; pallas = the kernels for every projection of <= 64 rows and the heads")
    g.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                   help="an XLA compiler option for every engine executable (repeatable), e.g. "
                        "xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL,WHILE,CONDITIONAL (on a GPU the "
                        "engine always disables XLA's rematerialization pass, and XLA's Triton GEMMs where the decode "
                        "projections run on its kernels (Ouro's shapes on the Pallas kernels, --matmul-impl not "
                        "xla, up to 64 requests) unless xla_gpu_enable_triton_gemm is given)")


def _window_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("decode windows")
    g.add_argument("--decode-window", type=int, default=None, metavar="K",
                   help="decode as device-side windows of up to K loop passes (0: one pass per step; "
                        f"default: {DEFAULT_DECODE_WINDOW} where windows can run)")
    g.add_argument("--decode-window-rows", type=int, default=None, metavar="N",
                   help="the most rows a decode window runs (a power of two >= 8): requests admitted beyond "
                        "them (up to --max-num-seqs) wait prefilled on the device and take the row of the next "
                        "request to finish, in the pass after it (default: a row for every admitted request)")
    g.add_argument("--window-trip", default="auto", choices=WINDOW_TRIPS,
                   help="decode windows: stop when no row is active, heads only on exit passes "
                        "(early_stop), or run exactly K passes with a head every pass (fixed: "
                        "nothing for the GPU to wait on the host for between passes); auto: fixed, "
                        "except early_stop for models with boundary stages (Huginn)")
    g.add_argument("--mixed-prefill-tokens", type=mixed_prefill_tokens, default=None, metavar="T | ROWS:T,...",
                   help="prompts admitted while a window runs, up to T tokens in all (a power of two), run "
                        "their loops inside the next window's first passes with the decoding rows instead of "
                        "a prefill step (0: off; auto, the default: 128, capped at the largest prefill batch, in "
                        "windows of 32+ rows where windows can take them); ROWS:T,... sets a T per window size, "
                        "from ROWS rows up to the next ROWS (0: off there), e.g. 8:32,16:0,32:128; smaller windows "
                        "keep standby entries")
    g.add_argument("--async-scheduling", action="store_true",
                   help="launch each loop pass before reading the previous pass's exit signals "
                        "(exit modes ouro_delayed, random_lookahead, fixed)")


def _compile_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("start-up")
    g.add_argument("--no-compile-ahead", action="store_true",
                   help="compile batch shapes on first use instead of at start-up")
    g.add_argument("--compilation-cache-dir", default=str(default_cache_dir()),
                   help="XLA persistent compilation cache, and the engine's compiled steps in its 'executables' "
                        "folder ('' disables both)")
    g.add_argument("--no-executable-cache", action="store_true",
                   help="do not keep compiled steps in the cache directory's 'executables' folder (a warm "
                        "start then traces and lowers every step again before XLA's cache finds it)")


def parse_attn_splits(text: str):
    """'N' -> N; 'ROWS:N,ROWS:N' -> {ROWS: N, ...} (values are checked by ExecutionConfig)."""
    try:
        return _int_or_rows_map(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected N or ROWS:N[,ROWS:N...] with each ROWS once, "
                                         f"e.g. 32:1,64:1") from None


def parse_xla_options(items: list[str]) -> dict:
    """["name=value", ...] -> {name: int | float | bool | str}."""
    options = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--xla-option {item!r}: expected NAME=VALUE")
        lowered = value.lower()
        if lowered in ("true", "false"):
            options[name] = lowered == "true"
        else:
            try:
                options[name] = int(value)
            except ValueError:
                try:
                    options[name] = float(value)
                except ValueError:
                    options[name] = value
    return options


def hf_overrides_from_args(args: argparse.Namespace) -> dict | None:
    """``--hf-overrides`` parsed (None when unset)."""
    return json.loads(args.hf_overrides) if args.hf_overrides else None


def configs_from_args(args: argparse.Namespace) -> dict:
    """Keyword arguments for ``build_engine`` / ``LLM`` from parsed flags."""
    return dict(
        dtype=args.dtype,
        hf_overrides=hf_overrides_from_args(args),
        cache_config=CacheConfig(kv_layout=args.kv_layout, page_size=args.page_size, num_pages=args.num_pages,
                                 gpu_memory_utilization=args.gpu_memory_utilization,
                                 max_loops=args.cache_max_loops),
        scheduler_config=SchedulerConfig(
            mode=args.scheduler_mode, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, prefill_chunk_size=args.prefill_chunk_size,
            max_prefill_batches_before_decode=args.max_prefill_batches_before_decode,
            min_coda_batch_size=args.min_coda_batch_size, max_model_len=args.max_model_len),
        exit_config=ExitConfig(mode=args.exit_mode, lookahead_seed=args.lookahead_seed),
        execution_config=ExecutionConfig(attn_impl=args.attn_impl, attn_num_splits=args.attn_num_splits,
                                         matmul_impl=args.matmul_impl,
                                         xla_options=parse_xla_options(args.xla_option),
                                         compile_ahead=not args.no_compile_ahead,
                                         executable_cache=not args.no_executable_cache,
                                         decode_window=args.decode_window, window_trip=args.window_trip,
                                         decode_window_rows=args.decode_window_rows,
                                         async_scheduling=args.async_scheduling,
                                         mixed_prefill_tokens=args.mixed_prefill_tokens,
                                         compilation_cache_dir=args.compilation_cache_dir or None))

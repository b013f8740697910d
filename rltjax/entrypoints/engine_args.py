"""Engine flags shared by every command that builds an engine (vLLM-style names)."""
from __future__ import annotations

import argparse
import json

from rltjax.parallel import ParallelConfig
from rltjax.engine_config import (ATTN_IMPLS, DEFAULT_DECODE_WINDOW, DEFAULT_PREFILL_CHUNK,
                                  DEFAULT_PREFILL_TOKENS_KERNEL, DEFAULT_PREFILL_TOKENS_XLA, EXIT_MODES, MATMUL_IMPLS,
                                  KERNEL_BACKENDS, KV_ALLOCATIONS, KV_LAYOUTS, PREEMPTION_MODES, SCHEDULER_MODES,
                                  SCHEDULING_POLICIES, WINDOW_TRIPS, CacheConfig, ExecutionConfig, ExitConfig,
                                  SchedulerConfig, SpeculativeConfig, default_cache_dir)


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


def add_engine_arguments(p: argparse.ArgumentParser, *, compile_ahead: bool = True) -> None:
    """The engine flags shared by generate, serve and bench, one argument group per config.
    Each help is one line; the config classes' docstrings (``rltjax.engine_config``) say more.
    compile_ahead: this command's default for ``--compile-ahead``."""
    for add in (_model_arguments, _cache_arguments, _scheduler_arguments, _exit_arguments, _kernel_arguments,
                _window_arguments, _speculative_arguments):
        add(p)
    _compile_arguments(p, compile_ahead)
    g = p.add_argument_group("devices")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="devices each engine spans (weights and KV split by heads)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="M",
                   help="engines side by side, each on its own devices; requests go to the least loaded")


def _model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="parameter dtype (default: the checkpoint's)")
    g.add_argument("--hf-overrides", default=None, metavar="JSON",
                   help='config.json fields to override, e.g. \'{"total_ut_steps": 2}\'')
    g.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="longest prompt + output in tokens (default: the model's position limit)")


def _cache_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV cache")
    g.add_argument("--kv-layout", default="last_exited", choices=KV_LAYOUTS,
                   help="last_exited: a KV plane per loop depth (exact); shared: one plane (less memory)")
    g.add_argument("--page-size", type=int, default=16, metavar="N", help="tokens per KV page")
    g.add_argument("--num-pages", type=int, default=None, metavar="N",
                   help="KV pool size in pages (default: from --gpu-memory-utilization)")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None, metavar="BYTES",
                   help="KV pool size in bytes, boundary pool included (instead of --num-pages)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                   help="fraction of the device memory free after the weights for the largest step's "
                        "temporaries, a reserve and the KV pool")
    g.add_argument("--kv-allocation", default="incremental", choices=KV_ALLOCATIONS,
                   help="incremental: pages as tokens are written (preempts when short); "
                        "lifetime: a request's pages for prompt + max_tokens at admission")
    g.add_argument("--kv-watermark", type=float, default=0.01, metavar="F",
                   help="fraction of the pool admission leaves free for running requests to grow (incremental)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                   help="share full pages of prompt KV between requests with the same prompt prefix")
    g.add_argument("--swap-space", type=float, default=4.0, metavar="GiB",
                   help="host memory for swapped requests (--preemption-mode swap)")
    g.add_argument("--cache-max-loops", type=int, default=None, metavar="N",
                   help="deepest recurrence a request may ask for (default: the model's R; above R: Huginn)")


def _scheduler_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scheduler")
    g.add_argument("--scheduler-mode", default="refill", choices=SCHEDULER_MODES,
                   help="refill: Continuous Depth Batching; no_refill: a cohort loops until all its rows exit")
    g.add_argument("--max-num-seqs", type=int, default=16, metavar="N", help="requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help=f"prefill tokens per step (default: {DEFAULT_PREFILL_TOKENS_KERNEL} on the prefill kernel, "
                        f"else {DEFAULT_PREFILL_TOKENS_XLA})")
    g.add_argument("--prefill-chunk-size", type=int, default=None, metavar="N",
                   help=f"prompt tokens per request per step (default: min({DEFAULT_PREFILL_CHUNK}, the budget))")
    g.add_argument("--max-prefill-batches-before-decode", type=int, default=1, metavar="N",
                   help="prefill batches in a row before decoding requests get a step")
    g.add_argument("--min-coda-batch-size", type=int, default=1, metavar="N",
                   help="heads wait for this many rows unless no loop work remains")
    g.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES,
                   help="priority: a request's priority (lower first) orders admission and may preempt")
    g.add_argument("--preemption-mode", default="swap", choices=PREEMPTION_MODES,
                   help="how a preempted request keeps its work: swap (a host copy; recompute when --swap-space is "
                        "full) or recompute (replay its recorded depths)")


def _exit_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("exits")
    g.add_argument("--exit-mode", default="ouro", choices=[m for m in EXIT_MODES if m != "trace"],
                   help="how a token picks its loop count (latent_diff: Huginn's relative latent change)")
    g.add_argument("--lookahead-seed", type=int, default=0, metavar="N", help="seed of random_lookahead's head")


def _kernel_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("kernels")
    g.add_argument("--attn-impl", default="auto", choices=ATTN_IMPLS,
                   help="paged attention: auto = the Pallas kernels on a GPU, XLA elsewhere")
    g.add_argument("--attn-num-splits", type=parse_attn_splits, default=None, metavar="N|ROWS:N,...",
                   help="decode attention key splits per row, for all or per row bucket (default: per bucket)")
    g.add_argument("--matmul-impl", default="auto", choices=MATMUL_IMPLS,
                   help="decode projections: auto = the Pallas kernels where they win (Ouro's shapes, GPU)")
    g.add_argument("--kernel-backend", default="triton", choices=KERNEL_BACKENDS,
                   help="decode kernels' backend: projections and decode attention (mosaic: Mosaic GPU on Hopper, "
                        "where it takes the shapes)")
    g.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                   help="an XLA compiler option for every engine executable (repeatable)")


def _window_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("decode windows")
    g.add_argument("--decode-window", type=int, default=None, metavar="K",
                   help=f"loop passes per device-side decode window (0: one pass per step; "
                        f"default: {DEFAULT_DECODE_WINDOW} where windows run)")
    g.add_argument("--decode-window-rows", type=int, default=None, metavar="N",
                   help="most rows a window runs; the other requests wait prefilled on the device")
    g.add_argument("--window-trip", default="auto", choices=WINDOW_TRIPS,
                   help="fixed: exactly K passes; early_stop: stop when no row is active; auto: fixed but Huginn")
    g.add_argument("--mixed-prefill-tokens", type=mixed_prefill_tokens, default=None, metavar="T|ROWS:T,...",
                   help="prompt tokens a window carries in its first passes (0: off; default: auto)")
    g.add_argument("--async-scheduling", action="store_true",
                   help="launch each pass before reading the last one's exit signals (delayed exit modes)")


def _speculative_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("self-speculative decoding (with --exit-mode fixed)")
    g.add_argument("--speculative-tokens", type=int, default=None, metavar="K",
                   help="drafts a round makes at most (unset: no speculation)")
    g.add_argument("--draft-loops", type=int, default=2, metavar="d", help="loops a draft runs")
    g.add_argument("--target-loops", type=int, default=None, metavar="D",
                   help="the depth drafts are verified at (default: the model's R)")
    g.add_argument("--speculative-rounds", type=int, default=1, metavar="N", help="rounds per decode window")


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    if args.speculative_tokens is None:
        return None
    return SpeculativeConfig(args.speculative_tokens, args.draft_loops, args.target_loops, args.speculative_rounds)


def _compile_arguments(p: argparse.ArgumentParser, compile_ahead: bool) -> None:
    g = p.add_argument_group("start-up")
    g.add_argument("--compile-ahead", action=argparse.BooleanOptionalAction, default=compile_ahead,
                   help="compile every batch shape at start-up (off: each on first use)")
    g.add_argument("--compilation-cache-dir", default=str(default_cache_dir()), metavar="DIR",
                   help="XLA's persistent cache and the engine's compiled steps ('' disables both)")
    g.add_argument("--no-executable-cache", action="store_true",
                   help="keep no compiled steps in the cache directory's 'executables' folder")


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
                                 max_loops=args.cache_max_loops, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                                 kv_allocation=args.kv_allocation, kv_watermark=args.kv_watermark,
                                 enable_prefix_caching=args.enable_prefix_caching, swap_space=args.swap_space),
        scheduler_config=SchedulerConfig(
            mode=args.scheduler_mode, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, prefill_chunk_size=args.prefill_chunk_size,
            max_prefill_batches_before_decode=args.max_prefill_batches_before_decode,
            min_coda_batch_size=args.min_coda_batch_size, max_model_len=args.max_model_len,
            policy=args.scheduling_policy, preemption_mode=args.preemption_mode),
        exit_config=ExitConfig(mode=args.exit_mode, lookahead_seed=args.lookahead_seed),
        execution_config=ExecutionConfig(attn_impl=args.attn_impl, attn_num_splits=args.attn_num_splits,
                                         matmul_impl=args.matmul_impl, kernel_backend=args.kernel_backend,
                                         xla_options=parse_xla_options(args.xla_option),
                                         compile_ahead=args.compile_ahead,
                                         executable_cache=not args.no_executable_cache,
                                         decode_window=args.decode_window, window_trip=args.window_trip,
                                         decode_window_rows=args.decode_window_rows,
                                         async_scheduling=args.async_scheduling,
                                         mixed_prefill_tokens=args.mixed_prefill_tokens,
                                         compilation_cache_dir=args.compilation_cache_dir or None),
        parallel_config=ParallelConfig(args.tensor_parallel_size, args.data_parallel_size),
        speculative_config=speculative_config(args))

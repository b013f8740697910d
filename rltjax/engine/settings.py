"""Every engine option resolved once: ``EngineSettings``.

``resolve_settings`` turns the user's configs (``rltjax.engine_config``), the model and the
platform into one frozen record: the loop cap and KV planes, the exit mode as it runs, the
prefill budgets, which attention and projection kernels run, the XLA options, the row and
token buckets the executables are compiled for, and the decode windows (K, trip, mixed
prefill per row bucket, standby entries; ``engine.window_settings``, called from here).
Every ``"auto"`` and every ``None`` default is decided here and nowhere else; the feature
rules are checked here, from one table (``engine.rules``). The scheduler, executor, runner
and warm-up read the record; none of them derives a setting again.
"""
from __future__ import annotations

import dataclasses
import logging

import jax

from rltjax.cache.paged_kv import PagedKVBackend
from rltjax.engine.exit_policy import RAW_SIGNAL_MODES
from rltjax.engine.rules import RuleInputs, check_rules, mixed_prefill_blocker
from rltjax.engine.window_settings import (WindowInputs, WindowSettings, bucket, fixed_trip, resolve_window,
                                           window_passes)
from rltjax.engine_config import (AUTO_MIXED_PREFILL, DEFAULT_PREFILL_CHUNK,
                                  DEFAULT_PREFILL_TOKENS_KERNEL, DEFAULT_PREFILL_TOKENS_XLA, CacheConfig,
                                  EngineConfigError, ExecutionConfig, ExitConfig, SchedulerConfig, SpeculativeConfig)
from rltjax.jit_options import engine_options
from rltjax.kernels.mosaic_common import hopper
from rltjax.kernels.paged_attention import decode_kernel, kernel_probe, kernel_unsupported
from rltjax.kernels.prefill_attention import DEFAULT_BLOCK_Q
from rltjax.kernels.skinny_matmul import MAX_ROWS, SINGLE_PASS_MAX_K
from rltjax.models.base import boundary_kv_layers, loop_limit, signal_kind

NUM_TOP_LOGPROBS = 20
MIN_TOKEN_BUCKET = 32   # prefill token counts pad to >= this: fewer executables, negligible padding
MIN_ROW_BUCKET = 8      # loop/head/window rows pad to >= this: a pass is weight-bound, 8 rows cost as 1
PREFILL_BLOCK_Q = DEFAULT_BLOCK_Q   # prefill-kernel query rows: chunks start at multiples of it

log = logging.getLogger(__name__)


def buckets_up_to(limit: int, smallest: int = 1) -> tuple[int, ...]:
    """Powers of two from ``smallest`` (capped at bucket(limit)) up to bucket(limit)."""
    top = bucket(limit)
    return tuple(b for b in (1 << i for i in range(top.bit_length())) if min(smallest, top) <= b < limit) + (top,)


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    arch: str
    num_loops: int               # R
    loop_limit: int              # the deepest recurrence the model allows
    loop_cap: int                # the deepest this engine serves (CacheConfig.max_loops)
    num_planes: int              # KV planes a request holds
    layered: bool                # the last_exited layout (else shared)
    has_boundary: bool           # prelude / coda KV (Huginn)
    page_size: int
    exit_mode: str               # as it runs (the ouro modes run fixed on models without a gate)
    exit_config: ExitConfig      # lookahead seed, recorded traces
    scheduler: SchedulerConfig   # prefill budgets filled in
    max_model_len: int
    max_prefill_chunk: int       # the longest chunk one request gets in a prefill batch
    prefill_alignment: int       # prefill chunks start at multiples of this (1: anywhere)
    attention_on_kernel: bool
    attention_kernel: str        # what decode attention runs on at the model's shapes: xla, triton, mosaic
    projections_on_kernels: bool     # every decode batch's projections (decode_projections_on_kernels)
    decode_backend: PagedKVBackend
    prefill_backend: PagedKVBackend
    xla_options: tuple[tuple[str, object], ...]
    row_buckets: tuple[int, ...]     # loop, head and embed steps
    token_buckets: tuple[int, ...]   # prefill steps
    window: WindowSettings | None    # None: no decode windows
    async_scheduling: bool
    compile_ahead: bool
    show_progress: bool
    store_dir: str | None        # the executable store's folder (None: no store)
    num_top: int                 # top logprobs a head computes
    kv_allocation: str = "incremental"   # pages as positions grow, or for a request's lifetime
    kv_watermark: float = 0.0    # fraction of the pool admission leaves free (incremental)
    prefix_caching: bool = False
    swap_space_bytes: int = 0    # host memory for swap preemption
    state_seeded: bool = False   # a prompt's KV depends on the request's seed (Huginn's like-init state)

    @property
    def kv_layout(self) -> str:
        return "last_exited" if self.layered else "shared"

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.max_num_seqs

    @property
    def dummy_slot(self) -> int:
        """The per-slot buffers' last row, which padded rows name (their writes are dropped)."""
        return self.scheduler.max_num_seqs

    @property
    def raw_signal(self) -> bool:
        """Loop passes return the loop's raw signal instead of hazard and lookahead score."""
        return self.exit_mode in RAW_SIGNAL_MODES

    @property
    def prefill_write_planes(self) -> int:
        """Planes a prompt token's loops write: R, or the loop cap when planes reach past R."""
        return max(self.num_loops, self.num_planes)


def prefill_budgets(config: SchedulerConfig, prefill_kernel: bool) -> SchedulerConfig:
    """The token budgets left unset, filled. A prefill step is a pass of its own (decode rows
    wait) and each chunk reads the weights R times, so steps should be large: 128-token chunks
    doubled a 256-token prompt's weight reads (H200, Ouro-1.4B, ShareGPT C = 32: 2,988.7 ->
    3,111.1 tok/s with 1,024 / 512: scripts/bench_serving.py). On the Pallas prefill kernel:
    4,096 tokens a step and a chunk. A long prompt's chunk attends to its whole prefix, and a
    512-token chunk gives the kernel too few programs: a 64K-token prompt's first token came
    1.73x sooner with 4,096-token chunks than with 512 (H100, 12.69 -> 7.34 s; 8,192: 7.29 s;
    scripts/bench_context_sweep.py --cells 65536:1); ShareGPT's throughput is the same as at
    1,024 / 512, a burst of short prompts waits for one large step (scripts/bench_serving.py,
    docs/performance.md "Prefill budgets on ShareGPT"). XLA's dense attention gathers every
    prompt token's whole block table (temporaries grow with tokens x max_model_len), so
    there: 256."""
    budget = config.max_num_batched_tokens or (DEFAULT_PREFILL_TOKENS_KERNEL if prefill_kernel
                                                else DEFAULT_PREFILL_TOKENS_XLA)
    chunk = config.prefill_chunk_size or min(DEFAULT_PREFILL_CHUNK, budget)
    return dataclasses.replace(config, max_num_batched_tokens=budget, prefill_chunk_size=chunk)


def longest_prefill_chunk(config: SchedulerConfig, max_model_len: int, layered: bool) -> int:
    """The longest chunk one request gets in a prefill batch: one position at a time with the
    shared KV layout (a position finishes all its loops before the next one starts), else the
    chunk size, and never more than a prompt can be (a request needs room for one output)."""
    return min(config.prefill_chunk_size, max(1, max_model_len - 1)) if layered else 1


def prefill_batch_bound(max_num_batched_tokens: int, max_num_seqs: int, max_chunk: int, alignment: int) -> int:
    """The most tokens one prefill batch can hold, alignment padding included: the budget (or
    one aligned chunk when the budget is smaller), unless max_num_seqs chunks of at most
    max_chunk tokens each cannot fill it (no larger bucket is compiled)."""
    padded_chunk = -(-max_chunk // alignment) * alignment
    return min(max(max_num_batched_tokens, alignment), max_num_seqs * padded_chunk)


def auto_matmul_shapes(cfg) -> tuple[tuple[int, int], ...]:
    """matmul_impl "auto"'s kernel shapes: the fused q|k|v and the o projection, with K up to
    the kernel's one pass (o may still split K in two where its consumer adds partial sums),
    the regime it beat XLA in on an H200 (Ouro's shapes; none for Nanbeige's or Huginn's wider
    K); only where attention runs on the Pallas kernels."""
    shapes = ((cfg.hidden_size, cfg.q_width + 2 * cfg.kv_width), (cfg.q_width, cfg.hidden_size))
    return tuple(shape for shape in shapes if shape[0] <= SINGLE_PASS_MAX_K)


def auto_head_shapes(cfg) -> tuple[tuple[int, int], ...]:
    """matmul_impl "auto"'s heads on the kernel: the lm_head where K <= the kernel's one pass
    (Ouro's), which a fixed-trip window's head at few rows skips on passes where no row exits."""
    return ((cfg.hidden_size, cfg.vocab_size),) if cfg.hidden_size <= SINGLE_PASS_MAX_K else ()


def decode_projections_on_kernels(cfg, attention_on_kernel: bool, matmul_impl: str, max_num_seqs: int) -> bool:
    """Whether every decode batch's projections run on the engine's kernels rather than XLA's
    dot: Ouro's shapes under matmul_impl auto or pallas, where attention runs on the Pallas
    kernels, and at most the kernels' MAX_ROWS requests (``jit_options.KERNEL_DECODE_OPTIONS``
    then apply)."""
    return (attention_on_kernel and matmul_impl != "xla" and max_num_seqs <= MAX_ROWS
            and len(auto_matmul_shapes(cfg)) == 2 and bool(auto_head_shapes(cfg)))


def attention_on_kernel(execution: ExecutionConfig, cfg, page_size: int, kv_dtype, platform: str) -> bool:
    """Whether paged attention runs on the Pallas kernels ("auto": on a GPU, where they take
    the model's shapes)."""
    q, k = kernel_probe(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, page_size, kv_dtype)
    return execution.attn_impl == "pallas" or (execution.attn_impl == "auto" and platform == "gpu"
                                               and kernel_unsupported(q, k) is None)


def decode_kernel_backend(choice: str, platform: str) -> str:
    """ExecutionConfig.kernel_backend (the decode kernels' backend) checked against the GPU: Mosaic
    GPU's kernels are Hopper's."""
    device = jax.devices()[0]
    if choice == "mosaic" and platform == "gpu" and not hopper(device):
        raise EngineConfigError(f"ExecutionConfig.kernel_backend='mosaic': the Mosaic GPU kernels are for Hopper "
                                f"GPUs (compute capability 9.x); this one is "
                                f"{getattr(device, 'compute_capability', None) or 'unknown'}: use 'triton'")
    return choice


def decode_and_prefill_backends(execution: ExecutionConfig, cfg, *, projections_on_kernel: bool, alignment: int,
                                mesh, platform: str) -> tuple[PagedKVBackend, PagedKVBackend]:
    """The paged-KV backends of decode steps and of prefill steps."""
    decode = PagedKVBackend(attn_impl=execution.attn_impl, interpret=execution.interpret,
                            matmul_impl=execution.matmul_impl, decode_rows=True, num_splits=execution.attn_num_splits,
                            kernel_shapes=auto_matmul_shapes(cfg) if projections_on_kernel else (),
                            head_shapes=auto_head_shapes(cfg) if projections_on_kernel else (),
                            fused_kernels=projections_on_kernel, mesh=mesh,
                            kernel_backend=decode_kernel_backend(execution.kernel_backend, platform))
    # prefill is compute-bound: its projections stay on XLA's dot whatever matmul_impl says
    prefill = dataclasses.replace(decode, matmul_impl="xla", kernel_backend="triton", decode_rows=False,
                                  prefill_block_q=PREFILL_BLOCK_Q if alignment > 1 else 0)
    return decode, prefill


def running_scheduler(scheduler: SchedulerConfig, inputs: RuleInputs, prefill_kernel: bool) -> SchedulerConfig:
    """The scheduler config as it runs: prefill budgets filled in, swap preemption only in one
    process; the rules checked again on the result."""
    scheduler = prefill_budgets(scheduler, prefill_kernel=prefill_kernel)
    if jax.process_count() > 1 and scheduler.preemption_mode == "swap":
        # a page's KV heads live partly on other hosts' devices: no process can copy it out
        log.warning("several processes: preempted requests are recomputed (swap copies a page to one host)")
        scheduler = dataclasses.replace(scheduler, preemption_mode="recompute")
    check_rules(dataclasses.replace(inputs, scheduler=scheduler))
    return scheduler


def store_folder(execution: ExecutionConfig) -> str | None:
    """The executable store's folder. Several processes (jax.distributed) would each store
    their own part of a program, so they have none; XLA's persistent cache still serves them."""
    if (execution.compile_ahead and execution.executable_cache and execution.compilation_cache_dir
            and jax.process_count() == 1):
        return f"{execution.compilation_cache_dir}/executables"
    return None


def resolve_settings(model, *, cache: CacheConfig, scheduler: SchedulerConfig, exit_config: ExitConfig,
                     execution: ExecutionConfig, max_model_len: int, kv_dtype,
                     platform: str | None = None, mesh=None,
                     speculative: SpeculativeConfig | None = None) -> EngineSettings:
    """The one place that resolves the configs against the model (``get_model``'s), the KV
    dtype, the platform (default: jax's backend) and the devices one engine spans (``mesh``:
    a tensor-parallel mesh, ``parallel.Placement``'s; None: one device)."""
    tensor_parallel = mesh.size if mesh is not None else 1
    cfg, platform = model.cfg, platform or jax.default_backend()
    R, has_boundary = cfg.num_loops, boundary_kv_layers(model) > 0
    passes, fixed = window_passes(execution, scheduler), fixed_trip(execution, has_boundary)
    inputs = RuleInputs(cache, scheduler, exit_config, execution, cfg.arch, R, loop_limit(model),
                        signal_kind(model), has_boundary, passes, fixed, tensor_parallel, speculative)
    check_rules(inputs)
    layered = cache.kv_layout == "last_exited"
    on_kernel = attention_on_kernel(execution, cfg, cache.page_size, kv_dtype, platform)
    # the projection kernels stay off under tensor parallelism (they would gather the split
    # weights); attention runs per device on its heads (PagedKVBackend.mesh)
    projections_on_kernel = on_kernel and tensor_parallel == 1
    alignment = PREFILL_BLOCK_Q if layered and on_kernel else 1
    scheduler = running_scheduler(scheduler, inputs, prefill_kernel=alignment > 1)
    longest_chunk = longest_prefill_chunk(scheduler, max_model_len, layered)
    most_tokens = prefill_batch_bound(scheduler.max_num_batched_tokens, scheduler.max_num_seqs, longest_chunk,
                                      alignment)
    decode, prefill = decode_and_prefill_backends(execution, cfg, projections_on_kernel=projections_on_kernel,
                                                  alignment=alignment, mesh=mesh, platform=platform)
    attention_kernel = decode_kernel(decode.kernel_backend, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                     cache.page_size, kv_dtype) if on_kernel else "xla"
    on_kernels = decode_projections_on_kernels(cfg, projections_on_kernel, execution.matmul_impl,
                                               scheduler.max_num_seqs)
    row_buckets = buckets_up_to(scheduler.max_num_seqs, MIN_ROW_BUCKET)
    token_buckets = buckets_up_to(most_tokens, MIN_TOKEN_BUCKET)
    exit_mode = exit_config.mode
    if exit_mode in ("ouro", "ouro_delayed") and not cfg.has_exit_gate:
        exit_mode = "fixed"          # no learned signal: fixed depth (DESIGN section 2)
    # trace mode carries each request's whole recorded trace (at most max_model_len outputs)
    window = resolve_window(execution, speculative, WindowInputs(
        passes, fixed, row_buckets, largest_token_bucket=token_buckets[-1], max_num_seqs=scheduler.max_num_seqs,
        num_loops=R, trace_width=max_model_len if exit_mode == "trace" else 1,
        auto_mixed=AUTO_MIXED_PREFILL if passes and mixed_prefill_blocker(inputs) is None else ()))
    return EngineSettings(
        arch=cfg.arch, num_loops=R, loop_limit=loop_limit(model),
        loop_cap=R if cache.max_loops is None else cache.max_loops, num_planes=cache.num_planes(R),
        layered=layered, has_boundary=has_boundary, page_size=cache.page_size, exit_mode=exit_mode,
        exit_config=exit_config, scheduler=scheduler, max_model_len=max_model_len, max_prefill_chunk=longest_chunk,
        prefill_alignment=alignment, attention_on_kernel=on_kernel, attention_kernel=attention_kernel,
        projections_on_kernels=on_kernels,
        decode_backend=decode, prefill_backend=prefill,
        xla_options=engine_options(tuple(sorted(dict(execution.xla_options).items())), platform, on_kernels),
        row_buckets=row_buckets, token_buckets=token_buckets, window=window,
        async_scheduling=execution.async_scheduling, compile_ahead=execution.compile_ahead,
        show_progress=execution.show_progress, store_dir=store_folder(execution),
        num_top=min(NUM_TOP_LOGPROBS, cfg.vocab_size),
        kv_allocation=cache.kv_allocation, kv_watermark=float(cache.kv_watermark),
        prefix_caching=cache.enable_prefix_caching, swap_space_bytes=int(cache.swap_space * 2**30),
        state_seeded=cfg.arch == "huginn" and cfg.state_init != "zero")

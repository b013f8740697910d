"""How the KV pool is sized: by pages, by bytes, or from device memory after measuring the
largest step.

``CacheConfig.num_pages`` and ``kv_cache_memory_bytes`` fix the pool. Otherwise, on a device
that reports memory statistics (GPU), the pool gets ``gpu_memory_utilization`` of the memory
free after the weights, less the largest step's temporaries and a reserve. The temporaries
are measured, not guessed: the largest prefill, loop, head and decode-window programs are
compiled against a 2-page pool (their temporaries do not depend on the pool's size) and XLA's
memory analysis of each gives its temporary bytes. The measurement is kept in the executable
store's folder (``step_peaks.pkl``, by program), so a warm start compiles nothing for it. The
reserve covers what the analysis does not see (allocator fragmentation, cuBLAS and Triton
workspaces, the swap copies' buffers of one ``SWAP_CHUNK`` piece). Without memory statistics (CPU) the pool holds ``max_num_seqs`` requests of
``max_model_len`` tokens.

``MemoryPlan.line`` is the start-up log line: weights, peak temporaries, reserve, pool
pages and the tokens of context they hold.
"""
from __future__ import annotations

import dataclasses
import hashlib
import pickle
import logging
from pathlib import Path

import jax
import numpy as np

from rltjax.cache.block_tables import BlockTables, pages_needed
from rltjax.engine import verified_file
from rltjax.cache.sizing import KVSizingError, allocate_paged_kv, boundary_num_pages, bytes_per_page

log = logging.getLogger(__name__)

RESERVE_BYTES = 512 * 2**20     # beside the measured peak: workspaces and fragmentation
PROBE_KINDS = ("prefill", "loop", "head", "window", "window_mixed")


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    source: str                    # "num_pages" | "kv_cache_memory_bytes" | "measured" | "max_num_seqs"
    num_pages: int                 # core pool, the scratch page included
    boundary_pages: int            # boundary pool (0: none)
    page_bytes: int                # a core page and its share of the boundary pool
    tokens: int                    # positions of context the pool holds (per plane: a request's)
    weights: int
    peak: int | None = None        # largest step's temporaries (None: not measured)
    reserve: int = 0
    device_free: int | None = None   # bytes free after the weights (None: no statistics)

    def line(self) -> str:
        gib = lambda n: f"{n / 2**30:.2f} GiB"     # noqa: E731
        peak = gib(self.peak) if self.peak is not None else "not measured"
        free = f", {gib(self.device_free)} free after them" if self.device_free is not None else ""
        return (f"memory plan ({self.source}): weights {gib(self.weights)}{free}; peak step temporaries {peak}, "
                f"reserve {gib(self.reserve)}; KV pool {self.num_pages} pages ({gib(self.num_pages * self.page_bytes)}"
                f"), {self.tokens} tokens of context")


def page_bytes_of(cfg, page_size: int, dtype, boundary_layers: int, num_planes: int) -> int:
    """A core page's bytes and its share of the boundary pool (a page per num_planes)."""
    b = bytes_per_page(cfg, page_size, dtype)
    if boundary_layers:
        b += -(-bytes_per_page(cfg, page_size, dtype, boundary_layers) // num_planes)
    return b


def plan_memory(cache, settings, cfg, params, dtype, *, boundary_layers: int, measure, placement=None,
                device=None) -> MemoryPlan:
    """The pool's size. measure: () -> the largest step's temporaries in bytes (called only
    when sizing from device memory); placement: the engine's devices (their first one's memory
    is read; on a tensor-parallel mesh a page and the weights are split over its devices, so
    the plan is per device); device: read this device's memory instead (tests)."""
    P, planes = cache.page_size, settings.num_planes
    shards = placement.tp if placement is not None else 1
    page_bytes = page_bytes_of(cfg, P, dtype, boundary_layers, planes) // shards
    weights = sum(int(x.nbytes) for x in jax.tree.leaves(params)) // shards
    # this process's first device of the engine's (several processes: each reads its own)
    if device is None and placement is not None:
        device = next(d for d in placement.devices if d.process_index == jax.process_index())
    plan = dict(page_bytes=page_bytes, weights=weights)
    if cache.num_pages is not None:
        return _plan("num_pages", cache.num_pages, boundary_layers, planes, P, **plan)
    if cache.kv_cache_memory_bytes is not None:
        pages = cache.kv_cache_memory_bytes // page_bytes
        if pages < 2:
            raise KVSizingError(f"CacheConfig.kv_cache_memory_bytes={cache.kv_cache_memory_bytes}: room for {pages} "
                                f"KV page(s) of {page_bytes} bytes; need at least 2 (page 0 is scratch)")
        return _plan("kv_cache_memory_bytes", pages, boundary_layers, planes, P, **plan)
    stats = (device or jax.devices()[0]).memory_stats() or {}
    if "bytes_limit" not in stats or "bytes_in_use" not in stats:
        pages = 1 + settings.max_num_seqs * planes * pages_needed(settings.max_model_len, P)
        return _plan("max_num_seqs", pages, boundary_layers, planes, P, **plan)
    free = int(stats["bytes_limit"]) - int(stats["bytes_in_use"])
    peak = measure()
    reserve = max(RESERVE_BYTES, peak // 4)
    budget = int(free * cache.gpu_memory_utilization) - peak - reserve
    pages = _agreed(budget // page_bytes)
    if pages < 2:
        raise KVSizingError(
            f"{free / 2**30:.2f} GiB free after the weights; x gpu_memory_utilization "
            f"{cache.gpu_memory_utilization} less the largest step's {peak / 2**30:.2f} GiB and a "
            f"{reserve / 2**30:.2f} GiB reserve leaves room for {max(pages, 0)} KV pages of {page_bytes} bytes: "
            f"raise --gpu-memory-utilization, lower --max-num-seqs or --max-num-batched-tokens, or give --num-pages")
    return _plan("measured", pages, boundary_layers, planes, P, peak=peak, reserve=reserve, device_free=free, **plan)


def _agreed(pages: int) -> int:
    """Several processes (jax.distributed) run one engine: each measured its own device, and all
    must build the same pool, the smallest."""
    if jax.process_count() == 1:
        return pages
    from jax.experimental import multihost_utils
    return int(np.min(multihost_utils.process_allgather(np.int64(pages))))


def _plan(source, pages, boundary_layers, planes, page_size, **kw) -> MemoryPlan:
    return MemoryPlan(source, pages, boundary_num_pages(pages, planes) if boundary_layers else 0,
                      tokens=(pages - 1) // planes * page_size, **kw)


def measure_peak(model, params, settings, cfg, dtype, *, boundary_layers: int, store_dir: str | None,
                 placement=None) -> int:
    """The largest temporaries of the engine's biggest programs (``PROBE_KINDS``, largest
    bucket of each), compiled against a 2-page pool; kept in ``store_dir/step_peaks.pkl``."""
    from rltjax.engine.host_batches import HostBatches
    from rltjax.engine.runner import ModelRunner
    from rltjax.engine.warm_up import bucket_jobs, stand_ins

    P = settings.page_size
    sharding = placement.kv if placement is not None else None
    kv = allocate_paged_kv(cfg, 2, P, dtype, sharding=sharding)
    bkv = (allocate_paged_kv(cfg, 2, P, dtype, num_layers=boundary_layers, sharding=sharding) if boundary_layers
           else None)
    runner = ModelRunner(model, params, kv, bkv, settings, placement)
    width = pages_needed(settings.max_model_len, P)
    batches = HostBatches(settings, BlockTables(settings.max_num_seqs * settings.num_planes, width),
                          BlockTables(settings.max_num_seqs, width) if boundary_layers else None)
    path = Path(store_dir) / "step_peaks.pkl" if store_dir else None
    known = _read(path)
    peaks, fresh = [], {}
    real = runner.steps

    def probe(step):
        def call(*args, **kwargs):
            key = _program_id(step, args, kwargs)     # named without tracing: a warm start traces nothing
            if key in known:
                peak, out_info = known[key]
                peaks.append(peak)
                return stand_ins(out_info, args)
            lowered = step.lower(*args, **kwargs)
            analysis = lowered.compile().memory_analysis()
            peaks.append(int(getattr(analysis, "temp_size_in_bytes", 0) or 0))
            if key is not None:
                fresh[key] = (peaks[-1], lowered.out_info)
            return stand_ins(lowered.out_info, args)
        return call

    runner.steps = type(real)(*(probe(getattr(s, "step", s)) for s in real))
    jobs = {}
    for job in bucket_jobs(runner, batches):        # the largest bucket of each kind, one sampler
        if job.kind in PROBE_KINDS and job.size >= jobs.get(job.kind, job).size:
            jobs[job.kind] = job
    for job in jobs.values():
        job.run()
    if fresh and path is not None:
        _write(path, {**known, **fresh})
    return max(peaks, default=0)


def _program_id(step, args, kwargs) -> str | None:
    """A digest of the call's program (``dispatch.program_key``); None when it cannot be named
    across processes (an argument named by its address)."""
    from rltjax.engine.dispatch import program_key, split_static
    split = split_static(step, args, kwargs)
    if split is None:
        return None
    program = program_key(step, split[0], args, split[1])
    return None if " at 0x" in program else hashlib.sha256(program.encode()).hexdigest()[:32]


def _read(path: Path | None) -> dict:
    try:
        data = verified_file.read(path) if path is not None else None
        return {} if data is None else pickle.loads(data)
    except Exception:  # noqa: BLE001 - a corrupt or foreign file: measure again
        return {}


def _write(path: Path, data: dict) -> None:
    try:
        verified_file.write(path, pickle.dumps(data))
    except OSError as exc:      # a read-only store: measured again next start
        log.debug(f"cannot keep the step peaks in {path}: {exc}")


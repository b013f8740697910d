"""Engine options (vLLM-style config objects), each checked on its own when built.

Exit modes and KV layouts are defined by DESIGN section 2. Which options combine is the one
table of ``rltjax.engine.rules``; every default and ``auto`` is resolved once, by
``rltjax.engine.settings``, when an engine is built. ``ExecutionConfig`` lives in
``rltjax.execution_config`` and is exported here with the others.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from rltjax.config_checks import EngineConfigError, _bad, _is_int, _positive  # noqa: F401 (re-exported)
from rltjax.execution_config import (ATTN_IMPLS, AUTO_MIXED_PREFILL, DEFAULT_DECODE_WINDOW,  # noqa: F401
                                     KERNEL_BACKENDS, MATMUL_IMPLS, WINDOW_TRIPS, ExecutionConfig,
                                     default_cache_dir)

EXIT_MODES = ("ouro", "ouro_delayed", "random_lookahead", "trace", "fixed", "latent_diff")
KV_LAYOUTS = ("last_exited", "shared")
KV_ALLOCATIONS = ("incremental", "lifetime")
SCHEDULER_MODES = ("refill", "no_refill")
SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")



@dataclasses.dataclass(frozen=True)
class ExitConfig:
    """How a decode token decides its depth.

    mode: ``ouro`` (cumulative gate hazard, same step), ``ouro_delayed`` (trigger
    at r exits after r+1), ``random_lookahead`` (seeded random Linear(h->1)
    scoring "exit after one more loop"), ``trace`` (replay recorded depths),
    ``fixed`` (always max_loops), ``latent_diff`` (zero-shot, models whose loop
    signal is the relative latent change ||s_r - s_{r-1}|| / ||s_r||, e.g. Huginn:
    exit at r >= min_loops once it is below q). A request with exit_threshold 1,
    or a model without a learned gate in the ``ouro`` modes, runs fixed depth.
    """
    mode: str = "ouro"
    lookahead_seed: int = 0
    depths_by_request: Mapping[str, Sequence[int]] | None = None

    def __post_init__(self) -> None:
        if self.mode not in EXIT_MODES:
            _bad("ExitConfig", "mode", self.mode, f"choose one of {EXIT_MODES}")
        if self.mode == "trace" and self.depths_by_request is None:
            raise EngineConfigError("ExitConfig.depths_by_request is required when mode='trace'")
        if not isinstance(self.lookahead_seed, int) or self.lookahead_seed < 0:
            _bad("ExitConfig", "lookahead_seed", self.lookahead_seed, "must be an int >= 0")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Paged KV. num_pages: explicit pool size (page 0 is scratch); else
    gpu_memory_utilization of the free device memory measured after weights load
    (devices without memory statistics, e.g. CPU, size the pool for max_num_seqs
    full-length sequences instead).

    max_loops: the deepest recurrence any request may ask for
    (``SamplingParams.max_loops``); None means the model's loop count R. Only models
    that allow recurrence beyond R (Huginn: up to ``loop_limit``) accept more. It
    sizes the ``last_exited`` layout: every request owns max_loops planes (prompt
    tokens run R loops and fill planes R..max_loops by their depth-R KV), so KV
    memory per request grows linearly with it; ``shared`` keeps one plane whatever
    it is. Requests asking for more are rejected at ``add_request``.

    Models with boundary stages (Huginn's prelude/coda) get a second pool with one
    plane of P + K layers and the same page size; it is sized in proportion to this
    one (1 + (num_pages - 1) // planes pages), so it never limits admission.

    kv_cache_memory_bytes: the pool's size in bytes (boundary pool included), instead of
    num_pages or gpu_memory_utilization.
    kv_allocation: ``incremental`` (pages are taken as positions are written; admission
    leaves ``kv_watermark`` of the pool free; the running requests are preempted when it
    runs short) or ``lifetime`` (a request's pages for its prompt and max_tokens are taken
    at admission: no preemption for pages, fewer requests at once).
    enable_prefix_caching: full pages of prompt KV are kept after their request ends and
    mapped by later requests whose prompts start with the same tokens (a chained hash).
    swap_space: GiB of host memory for swap preemption (SchedulerConfig.preemption_mode).
    """
    kv_layout: str = "last_exited"
    page_size: int = 16
    num_pages: int | None = None
    gpu_memory_utilization: float = 0.9
    max_loops: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_allocation: str = "incremental"
    kv_watermark: float = 0.01
    enable_prefix_caching: bool = False
    swap_space: float = 4.0

    def __post_init__(self) -> None:
        if self.kv_layout not in KV_LAYOUTS:
            _bad("CacheConfig", "kv_layout", self.kv_layout, f"choose one of {KV_LAYOUTS}")
        if self.page_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            _bad("CacheConfig", "page_size", self.page_size, "must be a power of two in 1..128")
        _positive("CacheConfig", num_pages=self.num_pages, max_loops=self.max_loops)
        if self.num_pages is not None and self.num_pages < 2:
            _bad("CacheConfig", "num_pages", self.num_pages, "needs >= 2 (page 0 is scratch)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            _bad("CacheConfig", "gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 1]")
        _positive("CacheConfig", kv_cache_memory_bytes=self.kv_cache_memory_bytes)
        if self.kv_cache_memory_bytes is not None and self.num_pages is not None:
            _bad("CacheConfig", "kv_cache_memory_bytes", self.kv_cache_memory_bytes,
                 "give the pool's size once: num_pages or kv_cache_memory_bytes, not both")
        if self.kv_allocation not in KV_ALLOCATIONS:
            _bad("CacheConfig", "kv_allocation", self.kv_allocation, f"choose one of {KV_ALLOCATIONS}")
        if not (isinstance(self.kv_watermark, (int, float)) and 0.0 <= self.kv_watermark < 1.0):
            _bad("CacheConfig", "kv_watermark", self.kv_watermark, "must be a fraction in [0, 1)")
        if not isinstance(self.enable_prefix_caching, bool):
            _bad("CacheConfig", "enable_prefix_caching", self.enable_prefix_caching, "must be True or False")
        if not (isinstance(self.swap_space, (int, float)) and self.swap_space >= 0):
            _bad("CacheConfig", "swap_space", self.swap_space, "must be >= 0 (GiB of host memory)")

    def num_planes(self, num_loops: int) -> int:
        """Core KV planes per request: one per depth up to the cap (last_exited) or one (shared)."""
        cap = num_loops if self.max_loops is None else self.max_loops
        return max(num_loops, cap) if self.kv_layout == "last_exited" else 1


DEFAULT_PREFILL_TOKENS_KERNEL = 4096
DEFAULT_PREFILL_TOKENS_XLA = 256
DEFAULT_PREFILL_CHUNK = 4096


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Loop-level continuous batching (DESIGN section 2, Scheduling)."""
    mode: str = "refill"
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None   # prefill token budget per step (None: engine.settings.prefill_budgets)
    prefill_chunk_size: int | None = None       # per-request chunk ceiling (None: min(4096, the budget))
    max_prefill_batches_before_decode: int = 1
    admission_scan_limit: int = 32
    max_admission_bypasses: int = 8
    min_coda_batch_size: int = 1
    max_model_len: int | None = None        # None: the model's position limit
    policy: str = "fcfs"                    # "priority": SamplingParams.priority orders and preempts
    preemption_mode: str = "swap"           # how a preempted request keeps its work (engine.preemption)

    def __post_init__(self) -> None:
        if self.mode not in SCHEDULER_MODES:
            _bad("SchedulerConfig", "mode", self.mode, f"choose one of {SCHEDULER_MODES}")
        if self.policy not in SCHEDULING_POLICIES:
            _bad("SchedulerConfig", "policy", self.policy, f"choose one of {SCHEDULING_POLICIES}")
        if self.preemption_mode not in PREEMPTION_MODES:
            _bad("SchedulerConfig", "preemption_mode", self.preemption_mode, f"choose one of {PREEMPTION_MODES}")
        _positive("SchedulerConfig", max_num_seqs=self.max_num_seqs,
                  max_num_batched_tokens=self.max_num_batched_tokens,
                  prefill_chunk_size=self.prefill_chunk_size,
                  max_prefill_batches_before_decode=self.max_prefill_batches_before_decode,
                  admission_scan_limit=self.admission_scan_limit,
                  min_coda_batch_size=self.min_coda_batch_size, max_model_len=self.max_model_len)
        if not isinstance(self.max_admission_bypasses, int) or self.max_admission_bypasses < 0:
            _bad("SchedulerConfig", "max_admission_bypasses", self.max_admission_bypasses, "must be an int >= 0")



@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Self-speculative decoding (docs/semantics.md): each round drafts up to
    ``num_speculative_tokens`` tokens one after another at ``draft_loops`` loops, then verifies
    them in one batch of the remaining loops up to ``target_loops`` (None: the model's R).
    Greedy output equals plain decoding at target_loops; sampled output keeps its
    distribution (rejection sampling). ``rounds_per_window``: rounds one decode window runs on
    the device; windows are launched back to back and read one late, so 1 (the default) costs
    no host wait and streams each round's tokens as they are read."""
    num_speculative_tokens: int = 4
    draft_loops: int = 2
    target_loops: int | None = None
    rounds_per_window: int = 1

    def __post_init__(self) -> None:
        _positive("SpeculativeConfig", num_speculative_tokens=self.num_speculative_tokens,
                  draft_loops=self.draft_loops, target_loops=self.target_loops,
                  rounds_per_window=self.rounds_per_window)
        if self.target_loops is not None and self.draft_loops >= self.target_loops:
            _bad("SpeculativeConfig", "draft_loops", self.draft_loops,
                 f"must be below target_loops ({self.target_loops}): the draft is the first loops of the target")


def check_kv_layout(kv_layout: str) -> str:
    if kv_layout not in KV_LAYOUTS:
        raise EngineConfigError(f"kv_layout={kv_layout!r}: choose one of {KV_LAYOUTS}")
    return kv_layout


def validate_trace_depths(depths: Sequence[int], *, num_loops: int, min_loops: int,
                          max_loops: int, max_tokens: int, request_id: str) -> list[int]:
    """Trace replay rules: length >= max_tokens, first entry R, others in [min, max]."""
    depths = list(depths)
    where = f"ExitConfig.depths_by_request[{request_id!r}]"
    if len(depths) < max_tokens:
        raise EngineConfigError(f"{where}: {len(depths)} depths recorded, max_tokens needs {max_tokens}")
    if depths[0] != num_loops:
        raise EngineConfigError(f"{where}[0]={depths[0]}: the prefill depth must be R={num_loops}")
    for i, d in enumerate(depths[1:max_tokens], start=1):
        if not isinstance(d, int) or not min_loops <= d <= max_loops:
            raise EngineConfigError(f"{where}[{i}]={d!r}: must be within [min_loops={min_loops}, "
                                    f"max_loops={max_loops}]")
    return depths

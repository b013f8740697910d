"""``LLM``: the offline Python API, in vLLM's shape.

    llm = LLM("path/to/ouro", dtype="bfloat16",
              cache_config=CacheConfig(kv_layout="last_exited"),
              scheduler_config=SchedulerConfig(max_num_seqs=32),
              exit_config=ExitConfig(mode="ouro"))
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=64, exit_threshold=0.6))
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from rltjax.checkpoints.loader import load_checkpoint
from rltjax.cache.sizing import allocate_paged_kv
from rltjax.engine.executable_store import ExecutableStore
from rltjax.engine.llm_engine import LLMEngine
from rltjax.engine.memory_plan import measure_peak, plan_memory
from rltjax.engine.outputs import RequestOutput
from rltjax.engine.settings import resolve_settings
from rltjax.engine_config import CacheConfig, ExecutionConfig, ExitConfig, SchedulerConfig, SpeculativeConfig
from rltjax.models.base import boundary_kv_layers, get_model
from rltjax.engine.replicas import EngineReplicas
from rltjax.models.layers import split_layer_stacks
from rltjax.parallel import ParallelConfig, Placement, check_heads
from rltjax.progress import progress
from rltjax.sampling_params import SamplingParams
from rltjax.tokenizer import Tokenizer

Prompt = str | Sequence[int] | Mapping[str, Any]
log = logging.getLogger(__name__)


def setup_compilation_cache(path: str | None) -> None:
    """Point JAX's persistent compilation cache at ``path`` (None or "": leave it as it is)."""
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def build_engine(model_dir, *, dtype=None, hf_overrides=None, cache_config: CacheConfig | None = None,
                 scheduler_config: SchedulerConfig | None = None, exit_config: ExitConfig | None = None,
                 execution_config: ExecutionConfig | None = None, params=None, cfg=None,
                 tokenizer=None, parallel_config: ParallelConfig | None = None,
                 speculative_config: SpeculativeConfig | None = None) -> LLMEngine | EngineReplicas:
    """An LLMEngine from a checkpoint directory (or from given params + cfg, e.g. random weights;
    the engine keeps its own per-layer copy, so a caller that keeps ``params`` holds the weights
    twice, and the KV pool is sized with both in memory). ``parallel_config``: tensor parallel
    over several devices, and data-parallel replicas (``EngineReplicas``) of such engines;
    ``speculative_config``: self-speculative decoding."""
    parallel_config = parallel_config or ParallelConfig()
    execution_config = execution_config or ExecutionConfig()
    setup_compilation_cache(execution_config.compilation_cache_dir)
    groups = parallel_config.device_groups()
    if params is None:
        t0 = time.perf_counter()
        ckpt = load_checkpoint(model_dir, dtype=dtype, hf_overrides=hf_overrides)
        log.info(f"loaded {ckpt.cfg.arch} from {ckpt.model_dir} ({ckpt.dtype.name}) in {time.perf_counter() - t0:.1f}s")
        cfg, params = ckpt.cfg, ckpt.params
        tokenizer = tokenizer or Tokenizer.from_dir(ckpt.model_dir)
        del ckpt
    if len(groups) > 1 or len(groups[0]) > 1:
        # spread over devices: each replica or shard is put from host memory, not from a whole
        # copy on the first device (which would also shrink that device's KV pool)
        params = jax.device_get(params)
    source = [params]       # the one reference: a single engine's split copy replaces it (not two
    del params              # copies of the weights in memory while the KV pool is sized)
    build = functools.partial(_build_one, source, cfg, tokenizer, cache_config or CacheConfig(),
                              scheduler_config or SchedulerConfig(), exit_config or ExitConfig(), execution_config,
                              speculative_config)
    if len(groups) == 1:
        return build(groups[0], keep_source=False)
    engines = []
    for i, group in enumerate(groups):
        log.info(f"replica {i} of {len(groups)} on {', '.join(str(d) for d in group)}")
        engines.append(build(group))
    return EngineReplicas(engines)


def _build_one(source: list, cfg, tokenizer, cache_config, scheduler_config, exit_config, execution_config,
               speculative_config, devices, keep_source: bool = True) -> LLMEngine:
    # The engine reads the layers per layer (``ModelRunner``): split them now and keep that one
    # copy, so the KV pool below is sized without a second copy of the weights in memory.
    placement = Placement(devices)
    check_heads(cfg, placement.tp)
    params = placement.put_params(split_layer_stacks(source[0] if keep_source else source.pop()))
    max_model_len = min(cfg.max_position, scheduler_config.max_model_len or cfg.max_position)
    dtype = params.embed.dtype
    model = get_model(cfg)
    settings = resolve_settings(model, cache=cache_config, scheduler=scheduler_config, exit_config=exit_config,
                                execution=execution_config, max_model_len=max_model_len, kv_dtype=dtype,
                                mesh=placement.mesh, speculative=speculative_config)
    boundary_layers = boundary_kv_layers(model)      # Huginn's prelude + coda; 0 for plain models
    measure = functools.partial(measure_peak, model, params, settings, cfg, dtype, boundary_layers=boundary_layers,
                                store_dir=_peaks_dir(settings), placement=placement)
    plan = plan_memory(cache_config, settings, cfg, params, dtype, boundary_layers=boundary_layers, measure=measure,
                       placement=placement)
    log.info(plan.line())
    kv = allocate_paged_kv(cfg, plan.num_pages, cache_config.page_size, dtype, sharding=placement.kv)
    log.info(f"KV pool: {plan.num_pages} pages of {cache_config.page_size} tokens x {settings.num_planes} plane(s) "
             f"({settings.kv_layout}); {settings.max_num_seqs} requests at once")
    boundary_kv = None
    if boundary_layers:
        boundary_kv = allocate_paged_kv(cfg, plan.boundary_pages, cache_config.page_size, dtype,
                                        num_layers=boundary_layers, sharding=placement.kv)
    return LLMEngine(model, params, kv, settings=settings, tokenizer=tokenizer, boundary_kv=boundary_kv,
                     placement=placement)


def _peaks_dir(settings) -> str | None:
    """The executable store's folder for this code and device (the measured peaks live there)."""
    if not settings.store_dir:
        return None
    store = ExecutableStore.open(settings.store_dir)
    return str(store.directory) if store is not None else None


class LLM:
    def __init__(self, model: str, *, dtype: str | None = None, hf_overrides: Mapping[str, Any] | None = None,
                 cache_config: CacheConfig | None = None, scheduler_config: SchedulerConfig | None = None,
                 exit_config: ExitConfig | None = None, execution_config: ExecutionConfig | None = None,
                 tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                 parallel_config: ParallelConfig | None = None, num_prefill_workers: int = 0,
                 num_decode_workers: int = 0, speculative_config: SpeculativeConfig | None = None):
        """tensor_parallel_size: devices each engine spans; data_parallel_size: engines side by
        side (vLLM's names; or a ``parallel_config``); they take the first tp x dp of ``jax.devices()``.
        num_prefill_workers / num_decode_workers: prefill/decode disaggregation over worker
        processes (``rltjax.disagg``); ``close()`` stops them. speculative_config: self-speculative
        decoding (``SpeculativeConfig``; the decode workers speculate under disaggregation)."""
        if num_prefill_workers or num_decode_workers:
            from rltjax.disagg.coordinator import DisaggEngine
            configs = dict(dtype=dtype, hf_overrides=hf_overrides, cache_config=cache_config or CacheConfig(),
                           scheduler_config=scheduler_config or SchedulerConfig(),
                           exit_config=exit_config or ExitConfig(), execution_config=execution_config or
                           ExecutionConfig(), parallel_config=parallel_config or ParallelConfig(tensor_parallel_size),
                           speculative_config=speculative_config)
            self.engine = DisaggEngine(model, configs, num_prefill=num_prefill_workers,
                                       num_decode=num_decode_workers)
            self._next_id = 0
            return
        self.engine = build_engine(model, dtype=dtype, hf_overrides=hf_overrides, cache_config=cache_config,
                                   scheduler_config=scheduler_config, exit_config=exit_config,
                                   execution_config=execution_config, speculative_config=speculative_config,
                                   parallel_config=parallel_config or ParallelConfig(tensor_parallel_size,
                                                                                     data_parallel_size))
        self._next_id = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop worker processes (disaggregation); a no-op for an engine in this process."""
        if hasattr(self.engine, "close"):
            self.engine.close()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order."""
        if isinstance(prompts, np.ndarray) and prompts.ndim == 1:
            prompts = prompts.tolist()
        if not isinstance(prompts, (str, Mapping, Sequence, np.ndarray)):
            raise TypeError(f"prompts: a string, a list of token ids, a {{'prompt_token_ids': [...]}} dict or a "
                            f"list of those, got {type(prompts).__name__}")
        if isinstance(prompts, (str, Mapping)) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if not isinstance(sampling_params, Sequence):
            raise TypeError(f"sampling_params: a SamplingParams, a list of them or None, "
                            f"got {type(sampling_params).__name__}")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(sampling_params)} for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, sp in zip(prompts, sampling_params):
                rid = str(self._next_id)
                self._next_id += 1
                self.engine.add_request(rid, prompt, sp)
                ids.append(rid)
            self._run(set(ids), use_tqdm and len(ids) > 1)
            return [self.engine.get_output(rid) for rid in ids]
        finally:   # rejected input, an interrupt or a dead device: leave nothing behind
            for rid in ids:
                self.engine.abort_request(rid)
                self.engine.forget(rid)

    def _run(self, ids: set[str], show: bool) -> None:
        bar = progress(len(ids), "requests", enabled=show)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in ids:
                    bar.update(1)
        bar.close()

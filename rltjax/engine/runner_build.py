"""The ModelRunner an LLMEngine drives, built from the engine's resolved configuration."""
from __future__ import annotations

from rltjax.cache.paged_kv import PagedKV
from rltjax.engine.exit_policy import ExitPolicy
from rltjax.engine.runner import ModelRunner
from rltjax.engine.scheduler import max_prefill_chunk
from rltjax.engine.window_config import WindowSettings
from rltjax.engine_config import ExecutionConfig, ExitConfig, SchedulerConfig
from rltjax.reference.exits import lookahead_weights


def build_runner(model, params, kv: PagedKV, *, scheduler_config: SchedulerConfig, exit_config: ExitConfig,
                 execution_config: ExecutionConfig, exit_policy: ExitPolicy, windows: WindowSettings,
                 num_planes: int, layered: bool, max_model_len: int,
                 boundary_kv: PagedKV | None = None) -> ModelRunner:
    """scheduler_config with its prefill defaults applied; windows: ``window_settings``'s;
    layered: the last_exited layout (chunked prefill)."""
    cfg = model.cfg
    return ModelRunner(
        model, params, kv, max_num_seqs=scheduler_config.max_num_seqs,
        max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
        attn_impl=execution_config.attn_impl, attn_num_splits=execution_config.attn_num_splits,
        matmul_impl=execution_config.matmul_impl,
        xla_options=tuple(sorted(dict(execution_config.xla_options).items())),
        lookahead_w=lookahead_weights(exit_config.lookahead_seed, cfg.hidden_size, cfg.initializer_range),
        num_planes=num_planes, boundary_kv=boundary_kv, prefill_write_planes=max(cfg.num_loops, num_planes),
        raw_signal=exit_policy.raw_signal, interpret=execution_config.interpret, chunked_prefill=layered,
        window_spec=windows.spec(exit_policy.mode, layered), window_trace_width=windows.trace_width,
        max_prefill_chunk=max_prefill_chunk(scheduler_config, max_model_len, not layered),
        mixed_prefill=windows.mixed_prefill,
        window_rows=execution_config.decode_window_rows)

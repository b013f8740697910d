"""The one table of feature rules: which engine options combine.

Every rule lives in ``COMBINATION_RULES``, checked once by ``check_combination`` when an
engine is built, instead of ``if/raise`` chains spread through the engine. Each option on
its own is checked by its config object (``rltjax.engine_config``).
"""
from __future__ import annotations

from typing import Callable

from rltjax.engine_config import (DEFAULT_PREFILL_TOKENS_KERNEL, DEFAULT_PREFILL_TOKENS_XLA, CacheConfig,
                                  EngineConfigError, ExecutionConfig, ExitConfig, SchedulerConfig)

# (description, predicate over the configs that must NOT hold, fix). One row per rule.
COMBINATION_RULES: list[tuple[str, Callable[..., bool], str]] = [
    ("prefill_chunk_size cannot exceed max_num_batched_tokens",
     lambda c, s, e, x: None not in (s.prefill_chunk_size, s.max_num_batched_tokens)
     and s.prefill_chunk_size > s.max_num_batched_tokens,
     "lower SchedulerConfig.prefill_chunk_size or raise max_num_batched_tokens (left unset, the budget is "
     f"{DEFAULT_PREFILL_TOKENS_KERNEL} where prefill runs on the Pallas prefill kernel, else "
     f"{DEFAULT_PREFILL_TOKENS_XLA})"),
    ("min_coda_batch_size cannot exceed max_num_seqs (heads would wait forever)",
     lambda c, s, e, x: s.min_coda_batch_size > s.max_num_seqs,
     "lower SchedulerConfig.min_coda_batch_size"),
    ("decode windows run refill scheduling only (no_refill cohorts wait on the host)",
     lambda c, s, e, x: (x.decode_window or 0) > 0 and s.mode != "refill",
     "use SchedulerConfig.mode='refill' or ExecutionConfig.decode_window=0"),
    ("decode windows run every head at once (min_coda_batch_size must be 1)",
     lambda c, s, e, x: (x.decode_window or 0) > 0 and s.min_coda_batch_size > 1,
     "use SchedulerConfig.min_coda_batch_size=1 or ExecutionConfig.decode_window=0"),
    ("async scheduling reads exit signals one pass late: the same-step modes ouro and latent_diff "
     "need each pass's signal before the next pass",
     lambda c, s, e, x: x.async_scheduling and e.mode in ("ouro", "latent_diff"),
     "use ExitConfig.mode='ouro_delayed' (or random_lookahead) or ExecutionConfig.async_scheduling=False"),
    ("mixed prefill runs inside decode windows",
     lambda c, s, e, x: x.asks_mixed_prefill and x.decode_window == 0,
     "leave ExecutionConfig.decode_window unset (or > 0) or set mixed_prefill_tokens=0"),
    ("mixed prefill needs fixed-trip windows and the last_exited KV layout",
     lambda c, s, e, x: x.asks_mixed_prefill and (x.window_trip == "early_stop" or c.kv_layout != "last_exited"),
     "use ExecutionConfig.window_trip='auto' or 'fixed' and CacheConfig.kv_layout='last_exited', "
     "or mixed_prefill_tokens=0"),
    ("decode_window_rows limits decode windows",
     lambda c, s, e, x: x.decode_window_rows is not None and x.decode_window == 0,
     "leave ExecutionConfig.decode_window unset (or > 0) or decode_window_rows=None"),
    ("decode_window_rows places requests on the device, which mixed prefill's prompt rows cannot share",
     lambda c, s, e, x: x.decode_window_rows is not None and x.asks_mixed_prefill,
     "set ExecutionConfig.decode_window_rows=None or mixed_prefill_tokens=0"),
    ("the Pallas kernel needs page_size >= 8",
     lambda c, s, e, x: x.attn_impl == "pallas" and c.page_size < 8,
     "use CacheConfig.page_size >= 8 or ExecutionConfig.attn_impl='xla'"),
]


def check_combination(cache: CacheConfig, scheduler: SchedulerConfig, exit_config: ExitConfig,
                      execution: ExecutionConfig) -> None:
    for description, violated, fix in COMBINATION_RULES:
        if violated(cache, scheduler, exit_config, execution):
            raise EngineConfigError(f"unsupported option combination: {description}; {fix}")

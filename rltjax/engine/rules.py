"""The one table of feature rules: which engine options combine, on which models.

Each option on its own is checked by its config object (``rltjax.engine_config``); which
options combine with each other and with the model is ``RULES``, checked once by
``check_rules`` when the engine's settings are resolved (``engine.settings``). A rule names
the flags it is about and how to fix the combination. New features add rows here, not
``if``/``raise`` chains downstream.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from rltjax.engine.exit_policy import SAME_STEP_MODES
from rltjax.engine_config import (DEFAULT_PREFILL_TOKENS_KERNEL, DEFAULT_PREFILL_TOKENS_XLA, CacheConfig,
                                  EngineConfigError, ExecutionConfig, ExitConfig, SchedulerConfig, SpeculativeConfig)


@dataclasses.dataclass(frozen=True)
class RuleInputs:
    """The configs, the model's facts and the two choices the rules depend on once resolved."""
    cache: CacheConfig
    scheduler: SchedulerConfig
    exit: ExitConfig
    execution: ExecutionConfig
    arch: str
    num_loops: int            # R
    loop_limit: int           # the deepest recurrence the model allows
    signal_kind: str          # "gate", "latent_diff" or "none" (models.base.signal_kind)
    has_boundary: bool        # prelude / coda KV (Huginn)
    window_passes: int        # K, resolved (0: no windows)
    fixed_trip: bool          # resolved window_trip
    tensor_parallel: int = 1  # devices one engine spans
    speculative: SpeculativeConfig | None = None


@dataclasses.dataclass(frozen=True)
class ServerInputs:
    """How ``rltjax serve`` spreads engines over processes: what its rows are about."""
    prefill_workers: int = 0      # --num-prefill-workers
    decode_workers: int = 0       # --num-decode-workers
    processes: int = 1            # --num-processes (one engine over several hosts)
    data_parallel: int = 1        # --data-parallel-size


@dataclasses.dataclass(frozen=True)
class Rule:
    what: str | Callable[[RuleInputs], str]    # the combination, in words (with the values given)
    broken: Callable[[RuleInputs], bool]       # true when these inputs break the rule
    fix: str                                   # what to change (flags named)
    scope: type = RuleInputs                   # which inputs the row reads (one engine's, or the server's)


def _disagg(i: ServerInputs) -> bool:
    return bool(i.prefill_workers or i.decode_workers)


def mixed_prefill_blocker(i: RuleInputs) -> str | None:
    """Why this engine's windows cannot carry prompts (mixed prefill), None when they can."""
    if not i.window_passes:
        return "decode windows do not run here (ExecutionConfig.decode_window resolved to 0)"
    if i.has_boundary:
        return f"{i.arch} has boundary stages (its prelude / coda KV)"
    if not i.fixed_trip:
        return "the windows stop early (window_trip early_stop)"
    if i.window_passes <= i.num_loops:
        return f"decode_window={i.window_passes} leaves no pass after the prompts' R={i.num_loops} loops"
    if i.cache.kv_layout != "last_exited":
        return "the shared KV layout prefills one position at a time"
    if i.speculative is not None:
        return "speculative rounds replace the windows' loop passes"
    return None


def _cap(i: RuleInputs) -> int:
    return i.num_loops if i.cache.max_loops is None else i.cache.max_loops


def _windows_asked(i: RuleInputs) -> bool:
    return (i.execution.decode_window or 0) > 0


def _target(i: RuleInputs) -> int:
    """Speculation's target depth D as it runs (None: R)."""
    return i.speculative.target_loops or i.num_loops


def _runs_fixed(i: RuleInputs) -> bool:
    """Every token runs its max_loops: mode fixed, or an ouro mode on a model without a gate."""
    return i.exit.mode == "fixed" or (i.exit.mode in ("ouro", "ouro_delayed") and i.signal_kind == "none")


def _spec(i: RuleInputs) -> bool:
    return i.speculative is not None


RULES: tuple[Rule, ...] = (
    Rule(lambda i: f"CacheConfig.max_loops={i.cache.max_loops}: must be in [R={i.num_loops}, {i.loop_limit}] for "
         f"{i.arch} (prompt tokens run R loops; the model allows at most {i.loop_limit})",
         lambda i: not i.num_loops <= _cap(i) <= i.loop_limit,
         "set CacheConfig.max_loops within that range (None: R)"),
    Rule("prefill_chunk_size cannot exceed max_num_batched_tokens",
         lambda i: None not in (i.scheduler.prefill_chunk_size, i.scheduler.max_num_batched_tokens)
         and i.scheduler.prefill_chunk_size > i.scheduler.max_num_batched_tokens,
         "lower SchedulerConfig.prefill_chunk_size or raise max_num_batched_tokens (left unset, the budget is "
         f"{DEFAULT_PREFILL_TOKENS_KERNEL} where prefill runs on the Pallas prefill kernel, else "
         f"{DEFAULT_PREFILL_TOKENS_XLA})"),
    Rule("min_coda_batch_size cannot exceed max_num_seqs (heads would wait forever)",
         lambda i: i.scheduler.min_coda_batch_size > i.scheduler.max_num_seqs,
         "lower SchedulerConfig.min_coda_batch_size"),
    Rule("ExitConfig.mode='latent_diff' needs a model whose loop signal is the relative latent change (Huginn)",
         lambda i: i.exit.mode == "latent_diff" and i.signal_kind != "latent_diff",
         "use another ExitConfig.mode for this model"),
    Rule("decode windows run refill scheduling only (no_refill cohorts wait on the host)",
         lambda i: _windows_asked(i) and i.scheduler.mode != "refill",
         "use SchedulerConfig.mode='refill' or ExecutionConfig.decode_window=0"),
    Rule("decode windows run every head at once (min_coda_batch_size must be 1)",
         lambda i: _windows_asked(i) and i.scheduler.min_coda_batch_size > 1,
         "use SchedulerConfig.min_coda_batch_size=1 or ExecutionConfig.decode_window=0"),
    Rule("async scheduling reads exit signals one pass late: the same-step modes ouro and latent_diff "
         "need each pass's signal before the next pass",
         lambda i: i.execution.async_scheduling and i.exit.mode in SAME_STEP_MODES,
         "use ExitConfig.mode='ouro_delayed' (or random_lookahead) or ExecutionConfig.async_scheduling=False"),
    Rule("decode_window_rows limits decode windows",
         lambda i: i.execution.decode_window_rows is not None and i.execution.decode_window == 0,
         "leave ExecutionConfig.decode_window unset (or > 0) or decode_window_rows=None"),
    Rule("decode_window_rows places requests on the device, which mixed prefill's prompt rows cannot share",
         lambda i: i.execution.decode_window_rows is not None and i.execution.asks_mixed_prefill,
         "set ExecutionConfig.decode_window_rows=None or mixed_prefill_tokens=0"),
    Rule(lambda i: f"ExecutionConfig.mixed_prefill_tokens={i.execution.mixed_prefill_tokens}: "
         f"{mixed_prefill_blocker(i)}; mixed prefill runs inside decode windows (fixed-trip windows of more than R "
         "passes, the last_exited KV layout, a model without boundary stages)",
         lambda i: i.execution.asks_mixed_prefill and mixed_prefill_blocker(i) is not None,
         "leave ExecutionConfig.decode_window and window_trip at their defaults (or K > R, 'fixed') and "
         "CacheConfig.kv_layout='last_exited', or set mixed_prefill_tokens=0"),
    Rule(lambda i: f"tensor_parallel_size={i.tensor_parallel} with matmul_impl='pallas': the projection kernels "
         "would gather the split weights onto every device",
         lambda i: i.tensor_parallel > 1 and i.execution.matmul_impl == "pallas",
         "leave ExecutionConfig.matmul_impl at 'auto' (XLA's projections under tensor parallelism) or use 'xla'"),
    Rule(lambda i: "ExecutionConfig.kernel_backend='mosaic' picks the decode kernels' backend, but attn_impl='xla' "
         "puts attention on XLA and, with it, " + (f"matmul_impl='{i.execution.matmul_impl}'" if i.tensor_parallel == 1
                                                    else f"tensor_parallel_size={i.tensor_parallel}")
         + " the projections",
         lambda i: i.execution.kernel_backend == "mosaic" and i.execution.attn_impl == "xla" and (
             i.execution.matmul_impl != "pallas" or i.tensor_parallel > 1),
         "leave kernel_backend at 'triton', or run decode attention or the projections on the kernels "
         "(attn_impl 'auto' or 'pallas'; matmul_impl 'pallas' on one device)"),
    Rule("speculative decoding runs its rounds inside decode windows",
         lambda i: _spec(i) and not i.window_passes,
         "leave ExecutionConfig.decode_window unset (or > 0), SchedulerConfig.mode='refill' and "
         "min_coda_batch_size=1, or drop the speculative config"),
    Rule(lambda i: f"speculative decoding verifies every token at the fixed depth target_loops={_target(i)}, "
         f"which ExitConfig.mode={i.exit.mode!r} does not run",
         lambda i: _spec(i) and not _runs_fixed(i),
         "use ExitConfig.mode='fixed' (--exit-mode fixed)"),
    Rule("speculative drafts read earlier tokens' KV at their own depth: the last_exited KV layout (the shared "
         "layout's one plane would hold a draft's shallow KV where the target reads full depth)",
         lambda i: _spec(i) and i.cache.kv_layout != "last_exited",
         "use CacheConfig.kv_layout='last_exited'"),
    Rule(lambda i: f"speculative decoding on {i.arch}: its prelude / coda write boundary KV per token, which "
         "drafting does not run",
         lambda i: _spec(i) and i.has_boundary,
         "serve this model without a speculative config"),
    Rule(lambda i: f"SpeculativeConfig target_loops={_target(i)} with draft_loops={i.speculative.draft_loops}: the "
         f"target must be deeper than the draft and at most the engine's loop cap {_cap(i)}",
         lambda i: _spec(i) and not i.speculative.draft_loops < _target(i) <= _cap(i),
         "lower draft_loops, or set target_loops within (draft_loops, CacheConfig.max_loops or R]"),
    Rule("prefill/decode disaggregation needs both kinds of worker",
         lambda i: bool(i.prefill_workers) != bool(i.decode_workers),
         "give --num-prefill-workers and --num-decode-workers together (both >= 1)", ServerInputs),
    Rule("prefill/decode disaggregation runs its workers under one coordinator, not in a jax.distributed job",
         lambda i: _disagg(i) and i.processes > 1,
         "leave --num-processes at 1 (workers may run on other hosts: --disagg-remote-workers)", ServerInputs),
    Rule("prefill/decode disaggregation with data-parallel replicas (each worker is one engine)",
         lambda i: _disagg(i) and i.data_parallel > 1,
         "add decode workers instead of --data-parallel-size", ServerInputs),
    Rule("data-parallel replicas in a jax.distributed job: process 0 drives one engine over every process's devices",
         lambda i: i.processes > 1 and i.data_parallel > 1,
         "run a separate job per replica instead of --data-parallel-size", ServerInputs),
    Rule("the Pallas kernel needs page_size >= 8",
         lambda i: i.execution.attn_impl == "pallas" and i.cache.page_size < 8,
         "use CacheConfig.page_size >= 8 or ExecutionConfig.attn_impl='xla'"),
)


def check_rules(inputs: RuleInputs | ServerInputs) -> None:
    """Raise EngineConfigError for the first rule of these inputs' scope they break."""
    for rule in RULES:
        if rule.scope is type(inputs) and rule.broken(inputs):
            what = rule.what(inputs) if callable(rule.what) else rule.what
            raise EngineConfigError(f"unsupported option combination: {what}; {rule.fix}")

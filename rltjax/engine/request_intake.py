"""A new request, checked against the engine before it is queued: its prompt, sampling
params, loop range and (trace mode) recorded depths. Every rejection is a
``RequestRejectedError`` naming the request and the field."""
from __future__ import annotations

import dataclasses
import secrets
from typing import Any, Iterator, Mapping, Sequence

from rltjax.engine.sequence import Request, RequestRejectedError, prompt_token_ids
from rltjax.engine_config import ExitConfig, validate_trace_depths
from rltjax.sampling_params import SamplingParams, SamplingParamsError


def new_request(request_id: str, prompt: str | Sequence[int] | Mapping[str, Any], params: SamplingParams | None,
                *, tokenizer, cfg, loop_limit: int, loop_cap: int, exit_config: ExitConfig,
                arrivals: Iterator[int], policy: str = "fcfs") -> Request:
    """The Request for ``add_request``'s arguments. loop_limit: the model's deepest loop;
    loop_cap: this engine's (CacheConfig.max_loops, which sized the KV planes); arrivals: the
    engine's arrival counter (a request rejected here takes no number)."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise RequestRejectedError(f"request {request_id!r}: params must be a SamplingParams")
    text, ids = prompt_token_ids(request_id, prompt, tokenizer, cfg.vocab_size)
    try:
        # unset max_loops means R; a request may ask for more up to the model's limit and
        # this engine's cap
        min_loops, max_loops = params.resolved_loops(cfg.num_loops if params.max_loops is None else loop_limit)
        if max_loops > loop_cap:
            raise SamplingParamsError(
                f"SamplingParams.max_loops={max_loops}: exceeds this engine's loop cap "
                f"CacheConfig.max_loops={loop_cap} (the model allows up to {loop_limit}; "
                f"raise CacheConfig.max_loops to serve deeper requests)")
        params.token_vocab_check(cfg.vocab_size)
        if params.priority != 0 and policy != "priority":
            raise SamplingParamsError(
                f"SamplingParams.priority={params.priority}: this engine schedules first come, first served; "
                f"start it with --scheduling-policy priority (SchedulerConfig(policy='priority')) to use priorities")
        trace = None
        if exit_config.mode == "trace":
            trace = validate_trace_depths(
                (exit_config.depths_by_request or {}).get(request_id, ()), num_loops=cfg.num_loops,
                min_loops=min_loops, max_loops=max_loops, max_tokens=params.max_tokens, request_id=request_id)
    except (SamplingParamsError, ValueError) as exc:
        raise RequestRejectedError(f"request {request_id!r}: {exc}") from exc
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    return Request(request_id, ids, params, seed, next(arrivals), min_loops, max_loops, prompt=text, trace_depths=trace)


def resolve_seed(params: SamplingParams | None) -> SamplingParams:
    """``params`` with its seed drawn now if it has none (what ``new_request`` would draw), so
    another process given the same params samples the same tokens."""
    params = params or SamplingParams()
    return params if params.seed is not None else dataclasses.replace(params, seed=secrets.randbits(63))

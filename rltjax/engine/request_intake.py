"""A new request, checked against the engine before it is queued: its prompt, sampling
params, loop range and (trace mode) recorded depths. Every rejection is a
``RequestRejectedError`` naming the request and the field."""
from __future__ import annotations

import dataclasses
import secrets
from typing import Any, Iterator, Mapping, Sequence

from rltjax.engine.sequence import Request, RequestRejectedError, prompt_token_ids
from rltjax.engine_config import validate_trace_depths
from rltjax.sampling_params import SamplingParams, SamplingParamsError


def new_request(request_id: str, prompt: str | Sequence[int] | Mapping[str, Any], params: SamplingParams | None,
                *, tokenizer, cfg, settings, arrivals: Iterator[int]) -> Request:
    """The Request for ``add_request``'s arguments. settings: the engine's (``EngineSettings``:
    the model's deepest loop, this engine's loop cap that sized the KV planes, the exit config,
    the scheduling policy, speculation); arrivals: the engine's arrival counter (a request
    rejected here takes no number)."""
    loop_limit, loop_cap, exit_config = settings.loop_limit, settings.loop_cap, settings.exit_config
    spec = settings.window.speculative if settings.window is not None else None
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise RequestRejectedError(f"request {request_id!r}: params must be a SamplingParams")
    text, ids = prompt_token_ids(request_id, prompt, tokenizer, cfg.vocab_size)
    try:
        # unset max_loops means R; a request may ask for more up to the model's limit and
        # this engine's cap
        # (a speculative engine's default is its target depth)
        default = cfg.num_loops if spec is None else spec.target_loops
        min_loops, max_loops = params.resolved_loops(default if params.max_loops is None else loop_limit)
        if max_loops > loop_cap:
            raise SamplingParamsError(
                f"SamplingParams.max_loops={max_loops}: exceeds this engine's loop cap "
                f"CacheConfig.max_loops={loop_cap} (the model allows up to {loop_limit}; "
                f"raise CacheConfig.max_loops to serve deeper requests)")
        params.token_vocab_check(cfg.vocab_size)
        spec_tokens = speculative_tokens(params, max_loops, spec)
        if params.priority != 0 and settings.scheduler.policy != "priority":
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
    return Request(request_id, ids, params, seed, next(arrivals), min_loops, max_loops, prompt=text, trace_depths=trace,
                   spec_tokens=spec_tokens)


def speculative_tokens(params: SamplingParams, max_loops: int, spec) -> int:
    """The drafts a round makes for this request: SamplingParams.num_speculative_tokens (None:
    the engine's K), none where the engine does not speculate."""
    asked = params.num_speculative_tokens
    if spec is None:
        if asked:
            raise SamplingParamsError(
                f"SamplingParams.num_speculative_tokens={asked}: this engine does not speculate (start it with "
                "a SpeculativeConfig, or --speculative-tokens K --draft-loops d)")
        return 0
    if asked is not None and asked > spec.num_tokens:
        raise SamplingParamsError(f"SamplingParams.num_speculative_tokens={asked}: this engine drafts at most "
                                  f"{spec.num_tokens} tokens a round (SpeculativeConfig.num_speculative_tokens)")
    if max_loops > spec.target_loops:
        raise SamplingParamsError(
            f"SamplingParams.max_loops={max_loops}: this engine verifies at target_loops={spec.target_loops}, the "
            f"deepest a request runs here (ask for at most {spec.target_loops} loops)")
    return spec.num_tokens if asked is None else asked


def resolve_seed(params: SamplingParams | None) -> SamplingParams:
    """``params`` with its seed drawn now if it has none (what ``new_request`` would draw), so
    another process given the same params samples the same tokens."""
    params = params or SamplingParams()
    return params if params.seed is not None else dataclasses.replace(params, seed=secrets.randbits(63))

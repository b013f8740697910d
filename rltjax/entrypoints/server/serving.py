"""The request flow shared by /v1/completions and /v1/chat/completions.

validate -> capacity (429) -> tokenize (off the event loop; long prompts in worker
processes, see tokenize_pool.py) -> length checks -> submit -> stream SSE chunks, or wait for the final output
while watching for a client disconnect. Whatever way a request ends, its
stream is closed, and closing aborts an unfinished request: a client that
goes away never leaves KV pages behind.

Streamed text never shows what it might have to take back: the detokenizer
holds back incomplete UTF-8, and ``StopChecker.releasable`` holds back a tail
that could still become a stop string, so the concatenated stream equals the
non-streamed text.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from rltjax.engine.llm_engine import RequestRejectedError
from rltjax.engine.outputs import StopChecker
from rltjax.entrypoints.server.async_engine import AsyncEngine, EngineUnavailable
from rltjax.entrypoints.server.formatting import SSE_DONE, ChatFormat, CompletionFormat, Echo, TokenStrings, sse
from rltjax.entrypoints.server.protocol import APIError, error_body, sampling_error_param
from rltjax.entrypoints.server.reasoning import ReasoningParser
from rltjax.entrypoints.server.request_stream import RequestStream
from rltjax.entrypoints.server.tokenize_pool import Limits, Prepared, RequestReader
from rltjax.sampling_params import SamplingParams, SamplingParamsError


@dataclasses.dataclass
class ServingContext:
    engine: AsyncEngine
    served_names: list[str]
    max_waiting_requests: int | None = None
    tokenizer_workers: int = 2
    reasoning_parser: str | None = None
    _tokens: TokenStrings | None = None
    _reader: RequestReader | None = None

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    @property
    def token_strings(self) -> TokenStrings:
        if self._tokens is None:   # the tokenizer exists once the engine has loaded
            self._tokens = TokenStrings(self.engine.engine.tokenizer)
        return self._tokens

    async def read(self, kind, raw: bytes) -> Prepared:
        """The body parsed, checked and tokenized (tokenize_pool.py): 503 while the engine is not up."""
        self.available()
        if self._reader is None:
            eng = self.engine.engine
            limits = Limits(tuple(self.served_names), eng.scheduler.max_model_len)
            self._reader = RequestReader(eng.tokenizer, limits, self.tokenizer_workers)
        return await self._reader.read(kind, raw)

    def available(self) -> None:
        try:
            self.engine.check_available()
        except EngineUnavailable as exc:
            raise APIError(503, str(exc)) from None

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()


class _ClosingStream(StreamingResponse):
    """Closes the request stream however the response ends (even if it never starts)."""

    def __init__(self, content, stream: RequestStream):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._stream = stream

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()


def _sampling_params(body, max_tokens: int, logprobs: int | None, aliases=None,
                     prompt_logprobs: int | None = None) -> SamplingParams:
    """``aliases`` names the request field behind a SamplingParams field when they differ."""
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            seed=body.seed, stop=body.stop or (), stop_token_ids=body.stop_token_ids or (),
            ignore_eos=body.ignore_eos, min_loops=body.min_loops, max_loops=body.max_loops,
            exit_threshold=body.exit_threshold, logprobs=logprobs, priority=body.priority,
            prompt_logprobs=prompt_logprobs, num_speculative_tokens=body.num_speculative_tokens)
    except SamplingParamsError as exc:
        param = sampling_error_param(str(exc))
        raise APIError(400, str(exc), (aliases or {}).get(param, param)) from None


def _rejection_param(message: str, prompt_field: str) -> str | None:
    if "SamplingParams." in message:
        return sampling_error_param(message)
    if "KV pages" in message or "max_model_len" in message:
        return "max_tokens"
    return prompt_field if "prompt" in message else None


async def create_completion(ctx: ServingContext, request: Request, prep: Prepared):
    body, echo = prep.body, None
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    if body.echo:   # the prompt's logprobs come with the completion's (vLLM, and lm-eval's loglikelihood)
        echo = Echo(prep.echo_text, prep.ids, hide_output=max_tokens == 0)
        max_tokens = max(max_tokens, 1)    # max_tokens 0: one token is sampled and not shown
    params = _sampling_params(body, max_tokens, body.logprobs,
                              prompt_logprobs=body.logprobs if body.echo else None)
    stream = _open(ctx, "cmpl")
    try:
        fmt = CompletionFormat(stream.request_id, ctx.model_name, int(time.time()), ctx.token_strings,
                               body.logprobs, bool(body.stream_options and body.stream_options.include_usage),
                               echo=echo)
        return await _run(ctx, request, stream, prep.ids, params, body.stream, fmt, prep.field, False)
    except BaseException:
        stream.close()
        raise


async def create_chat_completion(ctx: ServingContext, request: Request, prep: Prepared):
    body = prep.body
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    aliases = {"logprobs": "top_logprobs"}
    if body.max_completion_tokens is not None:
        aliases["max_tokens"] = "max_completion_tokens"
    params = _sampling_params(body, 16 if max_tokens is None else max_tokens, logprobs, aliases)
    stream = _open(ctx, "chatcmpl")
    try:
        fmt = ChatFormat(stream.request_id, ctx.model_name, int(time.time()), ctx.token_strings, logprobs,
                         bool(body.stream_options and body.stream_options.include_usage),
                         reasoning=ReasoningParser(ctx.reasoning_parser) if ctx.reasoning_parser else None)
        return await _run(ctx, request, stream, prep.ids, params, body.stream, fmt, prep.field,
                          max_tokens is None)
    except BaseException:
        stream.close()
        raise


def _open(ctx: ServingContext, prefix: str) -> RequestStream:
    try:
        ctx.engine.check_available()
        limit = ctx.max_waiting_requests
        if limit is not None and ctx.engine.waiting_estimate() >= limit:
            raise APIError(429, f"the server is busy: {limit} request(s) are already waiting; retry later",
                           headers={"Retry-After": "1"})
        return ctx.engine.open_stream(f"{prefix}-{uuid.uuid4().hex}")
    except EngineUnavailable as exc:
        raise APIError(503, str(exc)) from None


async def _run(ctx, request, stream, ids, params, streaming, fmt, prompt_field, default_max_tokens):
    sched = ctx.engine.engine.scheduler
    limit = sched.max_model_len
    if len(ids) >= limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens; the {prompt_field} has "
                            f"{len(ids)} tokens, leaving no room to generate", prompt_field)
    if default_max_tokens:   # vLLM: up to the context limit; here also no more than the KV pool can hold
        pool = (sched.allocator.num_pages - 1) // sched.num_planes * sched.page_size - len(ids) + 1
        params = dataclasses.replace(params, max_tokens=max(1, min(limit - len(ids), pool)))
    elif len(ids) + params.max_tokens > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens; you requested "
                            f"{len(ids) + params.max_tokens} ({len(ids)} in the {prompt_field}, "
                            f"{params.max_tokens} for the completion)", "max_tokens")
    try:
        await ctx.engine.submit(stream, {"prompt_token_ids": ids}, params)
    except RequestRejectedError as exc:
        raise APIError(400, str(exc), _rejection_param(str(exc), prompt_field)) from None
    except EngineUnavailable as exc:
        raise APIError(503, str(exc)) from None
    if streaming:
        return _ClosingStream(_sse(stream, fmt, StopChecker(params, ())), stream)
    try:
        out = await _final_or_disconnect(request, stream)
    finally:
        stream.close()
    if out is None:   # the client is gone; nobody reads this
        return JSONResponse(error_body(499, "client closed the request"), status_code=499)
    if out.finish_reason == "error":
        return JSONResponse(error_body(500, f"generation failed: {out.error}"), status_code=500)
    return JSONResponse(fmt.response(out))


async def _final_or_disconnect(request: Request, stream: RequestStream):
    final = asyncio.ensure_future(stream.final())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({final, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not final.done():
            final.cancel()
    return final.result() if final in done else None


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(stream: RequestStream, fmt, checker: StopChecker):
    sent_text = sent_tokens = 0
    out = None
    try:
        for first in fmt.first_chunks():
            yield sse(first)
        async for out in stream:
            if out.finish_reason == "error":
                yield sse(error_body(500, f"generation failed: {out.error}"))
                break
            out = fmt.view(out)
            text = out.text if out.finished else out.text[:checker.releasable(out.text)]
            delta, finish = text[sent_text:], out.finish_reason if out.finished else None
            if (delta or finish or fmt.pending_echo()
                    or (fmt.logprobs is not None and len(out.token_ids) > sent_tokens)):
                chunk = fmt.chunk(delta, out, sent_tokens, finish)
                if chunk is not None:
                    yield sse(chunk)
            sent_text, sent_tokens = max(sent_text, len(text)), len(out.token_ids)
        if fmt.include_usage and out is not None:
            yield sse(fmt.usage_chunk(out))
        yield SSE_DONE
    finally:
        stream.close()

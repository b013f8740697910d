"""Reading a request body into a validated request and its prompt's token ids, without
stalling the server.

The ``tokenizers`` library holds the GIL while it encodes (about 1 us a
character), and parsing a 10 MB JSON body holds it for ~20 ms, so a large
request handled in the server process pauses the event loop and the engine
thread. Small bodies are prepared in a thread (a few ms of GIL at most); large
ones go whole (parse, checks, tokenization) to worker processes, started on
first need, whose GIL is their own. Either way ``Tokenizer.encode_bounded``
stops as soon as a prompt is proven longer than the model's limit, so a
hopeless prompt costs about the limit's worth of tokenizing, not the whole
prompt. ``tests/test_server_large_prompts.py`` measures /health and a running
stream while 10 MB prompts arrive.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import multiprocessing
import os
from concurrent.futures.process import BrokenProcessPool

from rltjax.entrypoints.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, TokenizeRequest,
                                                parse_body)
from rltjax.tokenizer import PromptTooLong, TemplateKwargsError, Tokenizer

# Bodies up to this many bytes are prepared in a thread of the server process: about
# 20 ms of GIL at the tiny fixture's measured ~1.1 us a character.
INLINE_BYTES = 16_384
TOKENIZE_LIMIT = 8      # /tokenize counts up to this many contexts' worth of tokens

Body = CompletionRequest | ChatCompletionRequest | TokenizeRequest


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a request is checked against before it reaches the engine."""
    served_names: tuple[str, ...]
    max_model_len: int


@dataclasses.dataclass
class Prepared:
    body: Body
    ids: list[int]
    field: str          # the request field that holds the prompt ("prompt" or "messages")
    echo_text: str | None = None    # /v1/completions with echo: the prompt as text


def prepare(tok: Tokenizer | None, kind: type[Body], raw: bytes, limits: Limits) -> Prepared:
    """Parse and check a body and tokenize its prompt; every problem is an APIError naming the field."""
    body = parse_body(kind, raw)
    if body.model is not None and body.model not in limits.served_names:
        raise APIError(404, f"The model `{body.model}` does not exist.", "model")
    body.unsupported()
    if isinstance(body, TokenizeRequest):
        return _tokenize(tok, body, limits)
    if isinstance(body, CompletionRequest):
        prompt, field = body.single_prompt(), "prompt"
        if isinstance(prompt, list):
            _check_length(prompt, limits, field)     # before an echo decodes it
            echo = _need(tok, field).decode(prompt, skip_special_tokens=False) if body.echo else None
            return Prepared(body, prompt, field, echo)
        text = prompt
    else:
        field = "messages"
        text = _need(tok, field).apply_chat_template([m.as_dict() for m in body.messages], True, False,
                                                      body.chat_template_kwargs)
    try:
        return Prepared(body, _need(tok, field).encode_bounded(text, limits.max_model_len), field,
                        text if isinstance(body, CompletionRequest) and body.echo else None)
    except PromptTooLong as exc:
        raise APIError(400, f"This model's maximum context length is {limits.max_model_len} tokens; the "
                            f"{field} has at least {exc.at_least} tokens", field) from None


def _tokenize(tok: Tokenizer | None, body: TokenizeRequest, limits: Limits) -> Prepared:
    """Counted in full up to TOKENIZE_LIMIT x the context (lm-eval tokenizes whole documents and
    truncates them itself); beyond, refused after a bounded count, like a prompt."""
    field = "prompt" if body.prompt is not None else "messages"
    text = body.prompt if body.prompt is not None else _need(tok, field).apply_chat_template(
        [m.as_dict() for m in body.messages], body.add_generation_prompt, False, body.chat_template_kwargs)
    limit = TOKENIZE_LIMIT * limits.max_model_len
    try:
        return Prepared(body, _need(tok, field).encode_bounded(text, limit, body.add_special_tokens), field)
    except PromptTooLong as exc:
        raise APIError(400, f"{field}: at least {exc.at_least} tokens; /tokenize counts up to {limit} "
                            f"({TOKENIZE_LIMIT} x the context)", field) from None


def _check_length(ids: list[int], limits: Limits, field: str) -> None:
    if len(ids) >= limits.max_model_len:
        raise APIError(400, f"This model's maximum context length is {limits.max_model_len} tokens; the {field} "
                            f"has {len(ids)} tokens, leaving no room to generate", field)


def _need(tok: Tokenizer | None, field: str) -> Tokenizer:
    if tok is None:
        raise APIError(400, f"{field}: this model has no tokenizer; send the prompt as token ids", field)
    return tok


def _prepare_checked(tok, kind, raw, limits) -> Prepared:
    try:
        return prepare(tok, kind, raw, limits)
    except TemplateKwargsError as exc:
        raise APIError(400, f"chat_template_kwargs: {exc}", "chat_template_kwargs") from None
    except ValueError as exc:   # the chat template's own errors
        raise APIError(400, f"messages: {exc}", "messages") from None


_worker_tokenizer: Tokenizer | None = None


def _init_worker(tok: Tokenizer | None) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tok
    # below the server's own threads: where cores are few, the engine's host loop and the event
    # loop (running streams, /health) go first, a long prompt's tokenizing waits
    # (tests/test_server_large_prompts.py measures both)
    os.nice(10)


def _prepare_in_worker(kind, raw, limits) -> Prepared:
    return _prepare_checked(_worker_tokenizer, kind, raw, limits)


class RequestReader:
    """``read(kind, raw)`` -> Prepared, in a thread or a worker process by the body's size."""

    def __init__(self, tokenizer: Tokenizer | None, limits: Limits, workers: int):
        self.tokenizer, self.limits, self.workers = tokenizer, limits, workers
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    async def read(self, kind: type[Body], raw: bytes) -> Prepared:
        if len(raw) <= INLINE_BYTES or self.workers <= 0:
            return await asyncio.to_thread(_prepare_checked, self.tokenizer, kind, raw, self.limits)
        loop = asyncio.get_running_loop()
        for attempt in (0, 1):
            pool = self._executor()
            try:
                return await loop.run_in_executor(pool, _prepare_in_worker, kind, raw, self.limits)
            except BrokenProcessPool:   # a worker died (killed, out of memory): start afresh once
                if self._pool is pool:  # not a fresh pool a sibling request already made
                    self.close()
                if attempt:
                    raise

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            # spawn, not fork: the server process runs threads (the engine's, XLA's) that fork would copy
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker, initargs=(self.tokenizer,))
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

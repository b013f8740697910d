"""OpenAI response bodies and stream chunks for completions and chat completions.

Kept apart from the request flow (``serving.py``) so the wire format can be read
in one place. Field names follow the OpenAI API; vLLM's ``stop_reason`` is
added to choices, as vLLM does.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from rltjax.engine.outputs import RequestOutput
from rltjax.entrypoints.server.reasoning import ReasoningParser, Split


# Characters Python's str.splitlines (and clients built on it, e.g. httpx's iter_lines) takes
# for line ends although JSON allows them raw (json.dumps escapes the control characters
# below U+0020 itself): escaped, so an event stays one line.
_LINE_ENDS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False).translate(_LINE_ENDS)}\n\n"


def wire_logprob(x: float | None) -> float | None:
    """A logprob as JSON can carry it: -inf as -9999.0 (vLLM's convention), NaN as null."""
    if x is None or x != x:
        return None
    return max(float(x), -9999.0) if x != float("inf") else None


SSE_DONE = "data: [DONE]\n\n"


class TokenStrings:
    """The text of single tokens, for logprobs (a partial UTF-8 byte shows as U+FFFD, as in vLLM)."""

    def __init__(self, tokenizer):
        decode = (lambda t: f"token_id:{t}") if tokenizer is None else (
            lambda t: tokenizer.decode([t], skip_special_tokens=False))
        self._decode = functools.lru_cache(maxsize=65536)(decode)

    def __call__(self, token_id: int) -> str:
        return self._decode(int(token_id))


def usage(out: RequestOutput) -> dict[str, int]:
    p, c = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


class _Format:
    object_name = ""
    chunk_object = ""

    def __init__(self, request_id: str, model: str, created: int, tokens: TokenStrings,
                 logprobs: int | None, include_usage: bool):
        self.request_id, self.model, self.created = request_id, model, created
        self.tokens, self.logprobs, self.include_usage = tokens, logprobs, include_usage

    def _envelope(self, obj: str, choices: list, **extra) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any]:
        return self._envelope(self.chunk_object, [], usage=usage(out))

    def _chunk_extra(self) -> dict[str, Any]:
        return {"usage": None} if self.include_usage else {}

    def view(self, out: RequestOutput) -> RequestOutput:
        """The output as the client sees it."""
        return out

    def pending_echo(self) -> bool:
        """Whether the next chunk must go out even without new text (it carries the echo)."""
        return False


@dataclasses.dataclass(frozen=True)
class Echo:
    """``echo``: the prompt goes in front of the completion (its text, and its ids for logprobs);
    ``hide_output``: ``max_tokens: 0``, the one token the engine samples is not shown."""
    text: str
    token_ids: list[int]
    hide_output: bool = False


class CompletionFormat(_Format):
    object_name = chunk_object = "text_completion"

    def __init__(self, *args, echo: Echo | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._offset = 0   # text_offset of the next streamed token
        self.echo, self._echo_due = echo, echo is not None   # the echo goes out once, first

    def view(self, out: RequestOutput) -> RequestOutput:
        if self.echo is None or not self.echo.hide_output:
            return out
        return dataclasses.replace(out, token_ids=[], text="", logprobs=None if out.logprobs is None else [])

    def _logprobs(self, out: RequestOutput, start: int, echo: bool) -> dict[str, list] | None:
        if self.logprobs is None or out.logprobs is None:
            return None
        res: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        entries = zip(out.token_ids[start:], out.logprobs[start:])
        if echo:   # the prompt's own: its first token has nothing before it (null, as in vLLM)
            entries = [*zip(self.echo.token_ids, out.prompt_logprobs or [None] * len(self.echo.token_ids)),
                       *entries]
        for tok, entry in entries:
            s = self.tokens(tok)
            res["tokens"].append(s)
            res["token_logprobs"].append(None if entry is None else wire_logprob(entry.get(tok)))
            res["top_logprobs"].append(None if entry is None else
                                       {self.tokens(t): wire_logprob(lp) for t, lp in entry.items()})
            res["text_offset"].append(self._offset)
            self._offset += len(s)
        return res

    def _take_echo(self) -> tuple[str, bool]:
        due, self._echo_due = self._echo_due, False
        return (self.echo.text if due else ""), due

    def response(self, out: RequestOutput) -> dict[str, Any]:
        out = self.view(out)
        prefix, echo = self._take_echo()
        choice = {"index": 0, "text": prefix + out.text, "logprobs": self._logprobs(out, 0, echo),
                  "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
        return self._envelope(self.object_name, [choice], usage=usage(out))

    def chunk(self, delta: str, out: RequestOutput, start: int, finish: str | None) -> dict[str, Any]:
        prefix, echo = self._take_echo()
        choice = {"index": 0, "text": prefix + delta, "logprobs": self._logprobs(out, start, echo),
                  "finish_reason": finish, "stop_reason": out.stop_reason if finish else None}
        return self._envelope(self.chunk_object, [choice], **self._chunk_extra())

    def pending_echo(self) -> bool:
        return self._echo_due

    def first_chunks(self) -> list[dict[str, Any]]:
        return []


class ChatFormat(_Format):
    object_name, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, *args, reasoning: ReasoningParser | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.reasoning = reasoning
        self._released = ""           # streamed text so far (the deltas joined)
        self._sent = Split("", "")    # of which sent as reasoning / content

    def _split_delta(self, delta: str, finish: str | None) -> dict[str, str]:
        """A streamed text delta as reasoning_content and content deltas."""
        self._released += delta
        now = self.reasoning.split(self._released, finish is not None)
        out = {"reasoning_content": now.reasoning[len(self._sent.reasoning):],
               "content": now.content[len(self._sent.content):]}
        self._sent = now      # a released prefix splits into prefixes of the final parts
        return {k: v for k, v in out.items() if v}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        s = self.tokens(token_id)
        return {"token": s, "logprob": wire_logprob(logprob), "bytes": list(s.encode("utf-8"))}

    def _logprobs(self, out: RequestOutput, start: int) -> dict[str, list] | None:
        if self.logprobs is None or out.logprobs is None:
            return None
        content = []
        for tok, entry in zip(out.token_ids[start:], out.logprobs[start:]):
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:self.logprobs]
            content.append({**self._entry(tok, entry.get(tok)),
                            "top_logprobs": [self._entry(t, lp) for t, lp in top]})
        return {"content": content}

    def response(self, out: RequestOutput) -> dict[str, Any]:
        message = {"role": "assistant", "content": out.text}
        if self.reasoning is not None:
            split = self.reasoning.split(out.text, True)
            message = {"role": "assistant", "content": split.content or None,
                       "reasoning_content": split.reasoning or None}
        choice = {"index": 0, "message": message,
                  "logprobs": self._logprobs(out, 0), "finish_reason": out.finish_reason,
                  "stop_reason": out.stop_reason}
        return self._envelope(self.object_name, [choice], usage=usage(out))

    def chunk(self, delta: str, out: RequestOutput, start: int, finish: str | None) -> dict[str, Any] | None:
        logprobs = self._logprobs(out, start)
        if self.reasoning is None:
            fields = {"content": delta} if delta or not finish else {}
        else:
            fields = self._split_delta(delta, finish)
            if not fields and not finish and not (logprobs and logprobs["content"]):
                return None      # held back: could still be a marker
        choice = {"index": 0, "delta": fields, "logprobs": logprobs, "finish_reason": finish}
        if finish:
            choice["stop_reason"] = out.stop_reason
        return self._envelope(self.chunk_object, [choice], **self._chunk_extra())

    def first_chunks(self) -> list[dict[str, Any]]:
        """OpenAI's first chat chunk carries the role and no text."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return [self._envelope(self.chunk_object, [choice], **self._chunk_extra())]

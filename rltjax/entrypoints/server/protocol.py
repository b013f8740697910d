"""OpenAI request bodies as strict pydantic models, and OpenAI-style errors.

Models forbid unknown fields and run in strict mode (``"5"`` is not an
integer), so a client mistake is a 400 that names the field instead of a
silently ignored option. Numeric ranges are left to ``SamplingParams``: it is
the single source of truth for what the engine accepts, and its errors name
the field too (``SamplingParams.top_p=...``), which ``sampling_error_param``
maps back to the request field.
"""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

_STRICT = ConfigDict(extra="forbid", strict=True)
# Nested request objects whose inner location is worth naming (messages[2].content).
_NESTED = ("messages", "stream_options")


class APIError(Exception):
    """An error the client should see as ``{"error": {...}}`` with this status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
             500: "internal_server_error"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def __reduce__(self):   # crosses from a tokenizing process intact
        return APIError, (self.status, self.message, self.param, self.headers)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = APIError.TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _param_from_loc(loc: tuple) -> str | None:
    if not loc:
        return None
    out = str(loc[0])
    if loc[0] in _NESTED:
        for part in loc[1:]:
            if isinstance(part, int):
                out += f"[{part}]"
            else:              # a field name; anything after it is a union-branch tag
                out += f".{part}"
                break
    return out


def parse_body(model: type[BaseModel], raw: bytes) -> BaseModel:
    """Validate a raw JSON body; any problem becomes a 400 naming the first bad field."""
    try:
        return model.model_validate_json(raw or b"")
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON: {err['msg']}") from None
        param = _param_from_loc(tuple(err["loc"]))
        where = f"{param}: " if param else "request body: "
        raise APIError(400, where + err["msg"], param) from None


def sampling_error_param(message: str) -> str | None:
    m = re.search(r"SamplingParams\.(\w+)", message)
    return m.group(1) if m else None


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by both endpoints: OpenAI's, then vLLM's and rltjax's extras."""
    model_config = _STRICT
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extras (vLLM names where vLLM has them)
    top_k: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_loops: int = 1
    max_loops: int | None = None
    exit_threshold: float = 1.0
    priority: int = 0           # lower runs first (a server started with --scheduling-policy priority)
    num_speculative_tokens: int | None = None   # drafts a speculative round makes (0: none; None: the server's)

    def unsupported(self) -> None:
        """Options the OpenAI API has but this server cannot honour: 400, naming them."""
        if self.n != 1:
            raise APIError(400, "n: only n=1 is supported (send several requests instead)", "n")
        for field in ("presence_penalty", "frequency_penalty"):
            if getattr(self, field) != 0.0:
                raise APIError(400, f"{field}: penalties are not supported (use 0)", field)
        if self.logit_bias:
            raise APIError(400, "logit_bias: not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed when stream=true", "stream_options")


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of: only best_of=1 is supported", "best_of")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens: 0 only with echo=true (the prompt's logprobs alone)", "max_tokens")
        if self.suffix:
            raise APIError(400, "suffix: not supported", "suffix")

    def single_prompt(self) -> str | list[int]:
        """The one prompt this request carries (a list of several is a 400)."""
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) != 1:
                raise APIError(400, f"prompt: a list of {len(p)} prompts was sent; this server takes one "
                                    "prompt per request", "prompt")
            p = p[0]
        if not p:
            raise APIError(400, "prompt: the prompt is empty", "prompt")
        return p


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None   # extra template variables (vLLM's name)

    def unsupported(self) -> None:
        super().unsupported()
        if not self.messages:
            raise APIError(400, "messages: at least one message is required", "messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs=true", "top_logprobs")


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False     # as the completion routes encode a prompt
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "prompt: send exactly one of prompt or messages", "prompt")


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]

"""Reasoning parsers (vLLM's ``--reasoning-parser``): a thinking model's ``<think>...</think>``
goes to ``reasoning_content``, the rest to ``content``, in responses and streamed deltas.

``deepseek_r1``: everything before ``</think>`` is reasoning (the chat template may open
the ``<think>`` in the prompt); no ``</think>`` at all: all reasoning.
``qwen3``: reasoning only when the output opens with ``<think>``; otherwise all content
(thinking switched off, e.g. ``chat_template_kwargs: {"enable_thinking": false}``).

The split works on the output's text, so the markers must survive detokenization:
``check_tokenizer`` refuses a tokenizer that marks them special (they would be dropped).
While streaming, a tail that could still become a marker is held back, so the streamed
deltas add up to the final split.
"""
from __future__ import annotations

import dataclasses

REASONING_PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


@dataclasses.dataclass(frozen=True)
class Split:
    reasoning: str
    content: str


def _held(text: str, marker: str) -> int:
    """How many characters may go out: all but a tail that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return len(text) - n
    return len(text)


class ReasoningParser:
    def __init__(self, name: str):
        if name not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser {name!r}: choose one of {', '.join(REASONING_PARSERS)}")
        self.name = name

    def split(self, text: str, finished: bool) -> Split:
        """The reasoning and the content of ``text`` (all of it when ``finished``, else what is safe)."""
        opened = text.startswith(START)
        if not opened and not finished and START.startswith(text):      # may still open: hold it
            return Split("", "")
        if self.name == "qwen3" and not opened:
            return Split("", text)
        body = text[len(START):] if opened else text
        end = body.find(END)
        if end < 0:
            return Split(body if finished else body[:_held(body, END)], "")
        return Split(body[:end], body[end + len(END):])


def check_tokenizer(tokenizer, name: str) -> None:
    """The markers must reach the text: refuse a tokenizer that decodes them away."""
    ReasoningParser(name)
    if tokenizer is None:
        raise ValueError(f"--reasoning-parser {name}: the model has no tokenizer")
    special = {t.content for t in tokenizer.backend.get_added_tokens_decoder().values() if t.special}
    dropped = [m for m in (START, END) if m in special]
    if dropped:
        raise ValueError(f"--reasoning-parser {name}: this tokenizer marks {', '.join(dropped)} as special, so "
                         f"decoded text drops it and the reasoning cannot be found")

"""What a request returns, and the text side of generation: detokenizing and stopping.

Text is produced one token at a time, so two things can go wrong that a final
``tokenizer.decode`` never sees:

* a byte-level BPE token may end in the middle of a multi-byte UTF-8 character
  (emoji, CJK); decoding it alone yields U+FFFD, which a stream must not show
  because the next token turns it into the real character;
* a stop string may be spread over several tokens, so it can only be found by
  looking back across token boundaries, and a stream must not show its first
  characters before it is known whether the string completes.

``IncrementalDetokenizer`` handles the first, ``StopChecker`` the second.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from rltjax.sampling_params import SamplingParams
from rltjax.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
# Prompt tokens decoded in front of the output: tokenizers whose decoder depends
# on the left context (sentencepiece strips the first token's leading space) need it.
PROMPT_CONTEXT_TOKENS = 5


@dataclasses.dataclass
class RequestOutput:
    """One request's state as the engine reports it (vLLM's names, one completion)."""
    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    exit_depths: list[int] = dataclasses.field(default_factory=list)  # [0]: prefill depth
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"; None: running
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None   # per prompt token; [0] None
    finished: bool = False
    stop_reason: int | str | None = None  # stop token id or stop string; None for EOS
    error: str | None = None
    num_cached_tokens: int = 0        # prompt tokens whose KV came from the prefix cache
    metrics: dict[str, float | None] = dataclasses.field(default_factory=lambda: {
        "arrival_time": None, "first_token_time": None, "finished_time": None})


class IncrementalDetokenizer:
    """Turns output ids into text deltas that never hold a half-decoded character.

    Each step decodes only a short window ``ids[prefix:]``: the tokens emitted
    by the previous step plus the ones not yet emitted, so the cost per token is
    O(window), not O(length). ``_emitted`` counts the characters of the window's
    decode already handed out.

    Why the window may start anywhere that was once "clean": if the decoded
    text of some tokens ends in a real character (not U+FFFD), no byte after
    them can change it (a lossy UTF-8 decoder only looks ahead while a
    character is incomplete), so decode(a + b) == decode(a) + decode(b).
    For the same reason the text in front of a trailing run of U+FFFD is
    final: only that run can still change, into a character once its last
    bytes arrive. It is held back until then, or until ``flush`` at the end
    (a genuinely invalid sequence stays U+FFFD, exactly as the full decode).

    Invariant: ``"".join(deltas) + flush() == tokenizer.decode(output_ids)``
    for byte-level tokenizers (for context-dependent decoders it is the text
    as decoded after the prompt, which is what a reader should see).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        ctx = [int(i) for i in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]]
        if self._decode(ctx).endswith(REPLACEMENT):
            ctx = []  # a prompt ending mid-character would leak into the output's text
        self._ids: list[int] = ctx
        self._num_context = len(ctx)
        self._prefix = 0                      # window start in _ids
        self._read = len(ctx)                 # end of the last clean decode
        self._emitted = len(self._decode(ctx))  # chars of decode(_ids[_prefix:]) handed out
        self.text = ""                        # concatenation of everything returned

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context:]

    def add_token(self, token_id: int) -> str:
        """Append one output id; return the text that is now final (maybe "")."""
        self._ids.append(int(token_id))
        window = self._decode(self._ids[self._prefix:])
        stable = window.rstrip(REPLACEMENT)
        delta = window[self._emitted:len(stable)] if len(stable) > self._emitted else ""
        self._emitted += len(delta)
        if len(stable) == len(window):
            # Clean end: slide the window so it keeps only the tokens just read
            # (left context for the next step) and nothing older.
            self._prefix, self._read = self._read, len(self._ids)
            self._emitted = len(self._decode(self._ids[self._prefix:]))
        self.text += delta
        return delta

    def flush(self) -> str:
        """At finish: return whatever was held back (an incomplete or invalid tail)."""
        window = self._decode(self._ids[self._prefix:])
        delta = window[self._emitted:]
        self._emitted = len(window)
        self.text += delta
        return delta


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class StopChecker:
    """Decides, after each token, whether a request stops and what its text is.

    Engine use, per new token ``t``::

        delta = detok.add_token(t)
        done, reason, stop_reason, text = checker.check(t, detok.text, delta)
        if not done and len(token_ids) == max_tokens:   # length is the engine's call
            done, reason, text = True, "length", detok.text + detok.flush()
        stream_upto = len(text) if done else checker.releasable(detok.text)

    Token stops come first (as in vLLM): EOS (unless ``ignore_eos``) ends with
    stop_reason None, a ``stop_token_ids`` id ends with that id; either way the
    token's own text (``new_delta``, as vLLM drops the last new characters; any
    held-back invalid bytes it released go too) is left out of the text. Stop
    strings end with the string as stop_reason and the text cut just before it
    (the stop string is not included, vLLM's default).
    """

    def __init__(self, sampling_params: SamplingParams, eos_token_ids: Sequence[int]):
        self.ignore_eos = sampling_params.ignore_eos
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        self.stop_token_ids = frozenset(int(i) for i in sampling_params.stop_token_ids)
        stop = sampling_params.stop
        self.stop: tuple[str, ...] = (stop,) if isinstance(stop, str) else tuple(stop)
        self.max_stop_len = max((len(s) for s in self.stop), default=0)

    @property
    def token_stop_ids(self) -> tuple[int, ...]:
        """Token ids that end the request (EOS unless ignored, then stop_token_ids)."""
        eos = () if self.ignore_eos else tuple(sorted(self.eos_token_ids))
        return eos + tuple(sorted(self.stop_token_ids - set(eos)))

    def check(self, token_id: int, text_so_far: str, new_delta: str
              ) -> tuple[bool, str | None, int | str | None, str]:
        """``text_so_far`` already ends with ``new_delta`` (the text this token released).

        Returns (finished, finish_reason, stop_reason, text), text being the
        output text to report (truncated when finished).
        """
        token_id = int(token_id)
        before = text_so_far[:len(text_so_far) - len(new_delta)]
        if token_id in self.eos_token_ids and not self.ignore_eos:
            return True, "stop", None, before
        if token_id in self.stop_token_ids:
            return True, "stop", token_id, before
        if self.stop and new_delta:
            # Any earlier match would have ended the request at an earlier token, so a
            # new one must use at least one character of the delta: search only there.
            start = max(0, len(before) - self.max_stop_len + 1)
            # The match that ends first (then the longer one) is the one a character-
            # by-character check would find, so the cut does not depend on tokenization.
            hits = [(i + len(s), i, s) for s in self.stop
                    if (i := text_so_far.find(s, start)) >= 0]
            if hits:
                _, idx, s = min(hits)
                return True, "stop", s, text_so_far[:idx]
        return False, None, None, text_so_far

    def releasable(self, text_so_far: str) -> int:
        """How many leading characters a stream may show now.

        A trailing piece that could be the start of a stop string is held back
        (at most ``max_stop_len - 1`` characters), so a stop string found later
        never has to be taken back: streamed text is always a prefix of the final
        text, and streaming the rest at finish reproduces it exactly.
        """
        if not self.stop:
            return len(text_so_far)
        return len(text_so_far) - _longest_stop_prefix_suffix(text_so_far, self.stop)

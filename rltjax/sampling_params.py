"""SamplingParams: vLLM's names plus per-request loop controls.

Every field is validated at construction, so a bad request is rejected with
the field's name before it reaches the engine.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

MAX_LOGPROBS = 20


class SamplingParamsError(ValueError):
    """An invalid SamplingParams field; the message names the field."""


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


FLOAT32_MAX = 3.4028234663852886e38
INT32_MAX = 2**31 - 1


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0                  # 0 or -1: no top-k filter
    top_p: float = 1.0
    seed: int | None = None         # None: the engine draws one per request
    min_loops: int = 1
    max_loops: int | None = None    # None: the model's loop count R
    exit_threshold: float = 1.0     # q in [0, 1]; 1 never exits early
    ignore_eos: bool = False
    stop_token_ids: Sequence[int] = ()
    stop: Sequence[str] | str = ()
    logprobs: int | None = None     # number of top logprobs besides the chosen token
    prompt_logprobs: int | None = None   # the same for each prompt token after the first (full depth)
    priority: int = 0               # lower runs first (SchedulerConfig(policy="priority") only)
    num_speculative_tokens: int | None = None   # drafts a speculative round makes (None: the engine's; 0: off)

    def __post_init__(self) -> None:
        def bad(field: str, why: str):
            raise SamplingParamsError(f"SamplingParams.{field}={getattr(self, field)!r}: {why}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        # the device holds these as float32 / int32
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= FLOAT32_MAX:
            bad("temperature", f"must be a finite number >= 0 (0 = greedy), at most {FLOAT32_MAX:.4g}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            bad("top_k", f"must be an integer in [1, {INT32_MAX}], or 0 / -1 to disable")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            bad("seed", "must be an integer in [0, 2**63) or None")
        if not _is_int(self.min_loops) or self.min_loops < 1:
            bad("min_loops", "must be an integer >= 1")
        if self.max_loops is not None and (not _is_int(self.max_loops) or self.max_loops < self.min_loops):
            bad("max_loops", f"must be an integer >= min_loops ({self.min_loops}) or None")
        if not _is_number(self.exit_threshold) or not 0.0 <= self.exit_threshold <= 1.0:
            bad("exit_threshold", "must be in [0, 1] (1 = never exit early)")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be a bool")
        # None means none (as in vLLM and the OpenAI API's null)
        if self.stop is None or isinstance(self.stop, str):
            self.stop = () if self.stop is None else (self.stop,)
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        self.stop = tuple(self.stop)
        self.stop_token_ids = () if self.stop_token_ids is None else self.stop_token_ids
        if (not isinstance(self.stop_token_ids, (list, tuple))
                or any(not _is_int(t) or t < 0 for t in self.stop_token_ids)):
            bad("stop_token_ids", "must be a list of non-negative integers")
        self.stop_token_ids = tuple(self.stop_token_ids)
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        if self.prompt_logprobs is not None and (
                not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        if not _is_int(self.priority):
            bad("priority", "must be an integer")
        if self.num_speculative_tokens is not None and (
                not _is_int(self.num_speculative_tokens) or self.num_speculative_tokens < 0):
            bad("num_speculative_tokens", "must be an integer >= 0 (0: no speculation) or None (the engine's)")

    def resolved_loops(self, num_loops: int) -> tuple[int, int]:
        """(min_loops, max_loops) checked against the model's loop count R."""
        max_loops = num_loops if self.max_loops is None else self.max_loops
        if max_loops > num_loops:
            raise SamplingParamsError(
                f"SamplingParams.max_loops={max_loops}: exceeds the model's loop count {num_loops}")
        if self.min_loops > max_loops:
            raise SamplingParamsError(
                f"SamplingParams.min_loops={self.min_loops}: exceeds max_loops {max_loops}")
        return self.min_loops, max_loops

    def token_vocab_check(self, vocab_size: int) -> None:
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise SamplingParamsError(
                f"SamplingParams.stop_token_ids: ids {bad} are outside the vocabulary (size {vocab_size})")

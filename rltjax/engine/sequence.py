"""A request's host-side state as it moves through prefill, loops and heads."""
from __future__ import annotations

import dataclasses
import enum
import time
from typing import Mapping, Sequence

import numpy as np

from rltjax.sampling_params import SamplingParams


class RequestRejectedError(ValueError):
    """A request that can never run (too long, too large for the KV cache, bad input)."""


class Status(enum.Enum):
    WAITING = "waiting"              # queued, no KV yet
    PREFILLING = "prefilling"        # admitted; prompt positions still to run
    LOOPING = "looping"              # the newest token runs its loops (loops_done of them so far)
    AWAITING_HEAD = "awaiting_head"  # its state is final; the head will sample the next token
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_index: int
    min_loops: int
    max_loops: int
    prompt: str | None = None
    trace_depths: list[int] | None = None
    token_stop_ids: tuple[int, ...] = ()   # ids that end it (EOS unless ignored, stop_token_ids): the device checks them
    spec_tokens: int = 0                 # drafts a speculative round makes for it (0: none)
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)

    status: Status = Status.WAITING
    slot: int | None = None              # row of the device's per-slot state
    tables: list[int] = dataclasses.field(default_factory=list)  # block table per plane
    boundary_table: int | None = None    # block table in the boundary pool (models with prelude/coda KV)
    num_prefilled: int = 0               # prompt positions whose R loops have run
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    exit_depths: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None   # [0] is None (nothing precedes it)
    loops_done: int = 0                  # loops run by the token now looping
    exit_remaining: np.float32 = np.float32(1.0)   # ouro modes: prod of (1 - hazard)
    exit_triggered: bool = False         # delayed modes: exit after the next loop
    cohort: int | None = None            # no_refill: the cohort this token loops with
    bypassed: int = 0                    # admissions that went past this waiting request
    # KV memory (``engine.block_manager``, ``engine.preemption``)
    num_cached_tokens: int = 0           # prompt tokens whose KV came from the prefix cache
    cache_blocks: list = dataclasses.field(default_factory=list)   # prefix-cache blocks its tables hold
    block_keys: list[bytes] | None = None   # the prompt's full pages' prefix-cache keys (computed once)
    num_published: int = 0               # prompt pages offered to the prefix cache so far
    num_preemptions: int = 0
    replay_left: int = 0                 # recompute: outputs whose tokens are rebuilt before it goes on
    replay_mismatches: int = 0           # replayed heads that sampled a token other than its record
    swapped: object | None = None        # swap: its KV and slot state on the host while preempted
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def cursor(self) -> int:
        """Output index of the token now looping or awaiting its head (-1: the last prompt
        token's head): the newest sampled token, or while a recomputed request rebuilds its
        KV (``replay_left``) the one being replayed."""
        return len(self.output_token_ids) - 1 - self.replay_left

    @property
    def decode_position(self) -> int:
        """Position of the token now looping."""
        return self.prompt_len + self.cursor

    @property
    def current_token(self) -> int:
        return self.output_token_ids[self.cursor]

    @property
    def forced_depth(self) -> int | None:
        """The depth the token now looping exits at when it is replayed (its exit was
        recorded before a recompute preemption); None: its exit rule decides."""
        i = self.cursor + 1
        return self.exit_depths[i] if i < len(self.exit_depths) else None

    @property
    def max_positions(self) -> int:
        """Positions this request can ever write (the last sampled token is never written)."""
        return self.prompt_len + self.params.max_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def start_token(self) -> None:
        """The newest sampled token begins its loops."""
        self.status = Status.LOOPING
        self.loops_done = 0
        self.exit_remaining = np.float32(1.0)
        self.exit_triggered = False
        self.cohort = None


def prompt_token_ids(request_id: str, prompt, tokenizer, vocab_size: int) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt: a string (needs a tokenizer), a list of ids or
    {"prompt_token_ids": [...]}; RequestRejectedError names what is wrong."""
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" not in prompt:
            raise RequestRejectedError(f"request {request_id!r}: a dict prompt needs 'prompt_token_ids'")
        prompt = prompt["prompt_token_ids"]
        if isinstance(prompt, str):
            raise RequestRejectedError(f"request {request_id!r}: 'prompt_token_ids' holds token ids, not text")
    if (not isinstance(prompt, (str, Sequence, np.ndarray)) or isinstance(prompt, (bytes, bytearray))
            or (isinstance(prompt, np.ndarray) and prompt.ndim != 1)):
        raise RequestRejectedError(f"request {request_id!r}: a prompt is a string, a list of token ids or "
                                   f"{{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestRejectedError(f"request {request_id!r}: a text prompt needs a tokenizer")
        text, ids = prompt, tokenizer.encode(prompt)
    else:
        text, ids = None, list(prompt)
    if not ids:
        raise RequestRejectedError(f"request {request_id!r}: the prompt is empty")
    if any(not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < vocab_size for t in ids):
        raise RequestRejectedError(f"request {request_id!r}: prompt token ids must be integers in "
                                   f"[0, {vocab_size})")
    return text, [int(t) for t in ids]

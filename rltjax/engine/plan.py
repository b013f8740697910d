"""What the scheduler hands the executor, and what comes back.

A ``Plan`` is one engine step: device steps to launch in order (``PrefillStep``,
``LoopStep``, ``HeadStep``, ``WindowStep``), whether the host must first read what is still
in flight (a window's rows are built from up-to-date request state), and whether the last
step launched is read one step late (decode windows, async loop passes) or with the rest
now. Reading a window gives ``TokenRun``s: each request's tokens of that window, which the
engine applies like a head's.
"""
from __future__ import annotations

import dataclasses
from typing import Union

import numpy as np

from rltjax.engine.sequence import Request


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Prompt positions [start, start + length) of one request in a prefill batch."""
    request: Request
    start: int
    length: int


@dataclasses.dataclass(frozen=True)
class PrefillStep:
    chunks: tuple[Chunk, ...]

    @property
    def rows(self) -> tuple[Request, ...]:
        """Whose work a failed read loses (a scored prefill's prompt logprobs)."""
        return tuple(c.request for c in self.chunks)


@dataclasses.dataclass(frozen=True)
class LoopStep:
    """One loop pass over rows at their own depths; ``late``: its exit signals are read one
    pass late (async scheduling), so the next pass launches before the host reads them."""
    rows: tuple[Request, ...]
    late: bool = False


@dataclasses.dataclass(frozen=True)
class HeadStep:
    rows: tuple[Request, ...]


class RowMap(list):
    """The requests of a window's rows, by row (None: idle). Windows continued with standby
    entries share one map, which each read updates with the rows' swaps."""


@dataclasses.dataclass(frozen=True, eq=False)
class WindowStep:
    """A decode window (``engine.window``): how its rows and standby entries are built.

    A fresh window (``continues`` False) starts from host rows; a continued one from the
    device rows the previous window left, with ``replace`` rows taken from the host (new
    requests placed in finished rows) or new standby entries. ``first``: requests whose first
    head is queued just before the window (their token comes from the device). ``prompt``:
    whole prompts that run their R loops in the window's first passes (mixed prefill), their
    requests waiting in ``prompt_rows``."""
    rows: RowMap
    bucket: int
    standby: bool
    continues: bool
    host_rows: tuple[tuple[int, Request], ...] = ()
    replace: tuple[int, ...] = ()
    entries: tuple[Request, ...] = ()
    reset_standby: bool = False
    first: frozenset[int] = frozenset()          # id() of the requests
    prompt: tuple[Chunk, ...] | None = None
    prompt_rows: tuple[int, ...] = ()
    owners: np.ndarray | None = None             # [max_num_seqs + 1] int32 each slot's request tag (-1: free)
    sampler: str = "truncate"


@dataclasses.dataclass(frozen=True, eq=False)
class SwapOutStep:
    """Copy a preempted request's pages (in pieces, ``engine.swap``) and slot rows to the host;
    its ``Swapped`` record gets the copy when the step is read."""
    request: Request
    pages: list[np.ndarray]           # core pages, a piece each
    boundary_pages: list[np.ndarray]  # boundary pages, as many pieces
    slot: int
    record: object                # the request's ``swap.Swapped``

    @property
    def rows(self) -> tuple:
        """Whose work a failed read loses (the copy: the request could not resume)."""
        return (self.request,)


@dataclasses.dataclass(frozen=True, eq=False)
class SwapInStep:
    """Write a swapped request's host copy into its fresh pages and slot."""
    request: Request
    pages: list[np.ndarray]
    boundary_pages: list[np.ndarray]
    slot: int
    data: list                    # the ``swap.SwapData`` pieces (numpy)


Step = Union[PrefillStep, LoopStep, HeadStep, WindowStep, SwapOutStep, SwapInStep]


@dataclasses.dataclass(frozen=True)
class Plan:
    steps: tuple[Step, ...] = ()
    settle: bool = False          # read everything in flight before launching
    keep_last: bool = False       # the last step launched is read at the next step
    counts: tuple[str, ...] = ()  # step kinds, for the engine's counters
    affected: tuple[Request, ...] = ()   # the requests that error when a launch fails


@dataclasses.dataclass
class TokenRun:
    """Tokens one request made in one window, in order, and what the device left it at: its
    row ``row``'s output columns from ``start`` (logprobs: ``logprobs(j)``)."""
    request: Request
    tokens: list[int]
    depths: list[int]         # exit depth of each
    outputs: object           # the window's WindowOutputs (numpy)
    row: int
    start: int
    left: bool = False        # the device ended the request after them (its row went to another)
    state: "RowState | None" = None   # its exit state after the window (None: it left its row)

    def logprobs(self, j: int) -> tuple:
        """(chosen [], top ids [T], top logprobs [T]) of the run's token j."""
        out, col = self.outputs, self.start + j
        return out.chosen[self.row, col], out.top_ids[self.row, col], out.top_lp[self.row, col]


@dataclasses.dataclass(frozen=True)
class RowState:
    active: bool
    loops_done: int
    remaining: np.float32
    triggered: bool

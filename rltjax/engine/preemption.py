"""Preemption: which running request gives way, and how it comes back exactly.

A request is preempted when the running requests' pages run short as they grow, or when a
waiting request of higher priority (``--scheduling-policy priority``) finds no slot or
pages. The victim is the running request of lowest priority (the largest
``SamplingParams.priority``; every request ties under ``fcfs``), then the latest arrival.

``swap`` copies its pages on every plane, its boundary pages and its slot rows to host
memory (``engine.swap``) and brings them back bit for bit into fresh pages. ``recompute``
frees everything; on resume the prompt is prefilled again (at full depth, the prefix cache
may serve it) and every output token is run again at its recorded exit depth, its head
sampled again with its recorded key (and checked against the token it gave), so the KV it
rebuilds is the KV it had and it goes on as if never stopped. A swap that does not fit the
host budget is recomputed. Preemption runs only when nothing is in flight on the device: the
host state it saves is then the whole state.
"""
from __future__ import annotations

import numpy as np

from rltjax.engine.block_manager import BlockManager
from rltjax.engine.plan import SwapInStep, SwapOutStep
from rltjax.engine.sequence import Request, Status
from rltjax.engine.swap import SwapSpace, Swapped, chunks
from rltjax.engine_config import PREEMPTION_MODES


def victim_order(req: Request, by_priority: bool) -> tuple:
    """Sort key: the largest is preempted first."""
    return (req.params.priority if by_priority else 0, req.arrival_index)


class Preemptor:
    def __init__(self, blocks: BlockManager, *, mode: str, swap_bytes: int, page_bytes: int,
                 boundary_page_bytes: int = 0, slot_bytes: int = 0):
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption mode {mode!r}: choose one of {PREEMPTION_MODES}")
        self.blocks, self.mode = blocks, mode
        self.swap_space = SwapSpace(swap_bytes if mode == "swap" else 0)
        self.page_bytes, self.boundary_page_bytes, self.slot_bytes = page_bytes, boundary_page_bytes, slot_bytes
        self.num_preemptions = 0
        self.num_swapped = 0
        self.num_recomputed = 0

    def preempt(self, req: Request) -> SwapOutStep | None:
        """Take the running request's pages and slot away (the caller puts it back in the
        queue); returns the copy to launch first when it is swapped."""
        self.num_preemptions += 1
        req.num_preemptions += 1
        step = self._swap_out(req) if self.mode == "swap" else None
        self.blocks.release(req)
        if step is None:
            self._rewind(req)
            self.num_recomputed += 1
        else:
            self.num_swapped += 1
        req.status, req.slot, req.cohort = Status.WAITING, None, None
        return step

    def _swap_out(self, req: Request) -> SwapOutStep | None:
        core, boundary = self.blocks.pages_of(req)
        pages = [p for plane in core for p in plane]
        nbytes = len(pages) * self.page_bytes + len(boundary) * self.boundary_page_bytes + self.slot_bytes
        if not self.swap_space.reserve(nbytes):
            return None
        record = Swapped(req.status, self.blocks.covered(req), len(core[0]) if core else 0, nbytes)
        req.swapped = record
        return SwapOutStep(req, *chunks(pages, boundary), req.slot, record)

    def _rewind(self, req: Request) -> None:
        """Recompute: back to an unprefilled prompt whose outputs are replayed."""
        req.replay_left = len(req.output_token_ids)
        req.num_prefilled = req.num_published = 0
        req.loops_done, req.exit_remaining, req.exit_triggered = 0, np.float32(1.0), False

    def can_resume(self, req: Request) -> bool:
        """A swapped request's copy has reached the host (a recomputed one may start at once)."""
        return req.swapped is None or req.swapped.data is not None

    def swap_in(self, req: Request) -> SwapInStep:
        """A swapped request admitted again (its pages and slot given): the copy goes back."""
        record, req.swapped = req.swapped, None
        self.swap_space.free(record.nbytes)
        req.status = record.status
        core, boundary = self.blocks.pages_of(req)
        first, last = record.cached_pages, record.num_pages
        pages = [p for plane in core for p in plane[first:last]]
        step = SwapInStep(req, *chunks(pages, boundary[first:last]), req.slot, record.data)
        self.blocks.publish(req)      # its prompt pages, copies now: offered to the prefix cache again
        return step

    def forget(self, req: Request) -> None:
        """A waiting request leaves for good (abort): its host copy is dropped."""
        if req.swapped is not None:
            self.swap_space.free(req.swapped.nbytes)
            req.swapped = None

"""Admission control: the queues, slots and KV pages of requests, and preemption.

``Admission`` owns the waiting queue (ordered by priority under ``--scheduling-policy
priority``, then arrival), the running requests and their slots, the ``BlockManager`` and
the ``Preemptor``. The scheduler asks it to admit what fits, to give the rows it is about to
run the pages of the tokens they start, and to reserve a decode window's pages; each may
preempt running requests, and queues the swap copies that go to the device first
(``take_moves``). A preemption needs the host state whole: when the last plan left a step
in flight it raises ``Settle`` and the scheduler reads the device first.
"""
from __future__ import annotations

import bisect

from rltjax.engine.block_manager import BlockManager
from rltjax.engine.preemption import Preemptor, victim_order
from rltjax.engine.sequence import Request, Status
from rltjax.engine.settings import EngineSettings


class Settle(Exception):
    """A preemption is due but work is in flight: the host reads it first (the state a
    preemption saves or rewinds must be whole)."""


class Admission:
    def __init__(self, settings: EngineSettings, *, num_pages: int, boundary_num_pages: int = 0,
                 prefix_context: bytes | None = None, page_bytes: int = 0, boundary_page_bytes: int = 0,
                 slot_bytes: int = 0):
        self.s, self.config = settings, settings.scheduler
        self.blocks = BlockManager(num_pages=num_pages, page_size=settings.page_size, num_planes=settings.num_planes,
                                   max_num_seqs=self.config.max_num_seqs, max_model_len=settings.max_model_len,
                                   boundary_num_pages=boundary_num_pages, allocation=settings.kv_allocation,
                                   watermark=settings.kv_watermark, prefix_context=prefix_context)
        self.preemptor = Preemptor(self.blocks, mode=self.config.preemption_mode, swap_bytes=settings.swap_space_bytes,
                                   page_bytes=page_bytes, boundary_page_bytes=boundary_page_bytes,
                                   slot_bytes=slot_bytes)
        self.by_priority = self.config.policy == "priority"
        self.free_slots = list(range(self.config.max_num_seqs - 1, -1, -1))
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.in_flight = False         # the last plan left a step unread on the device
        self._moves: list = []         # swaps queued by admissions and preemptions, launched first

    # -- queue ----------------------------------------------------------------------
    def add(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=self._queue_key)

    def _queue_key(self, r: Request) -> tuple:
        return (r.params.priority if self.by_priority else 0, r.arrival_index)

    def release(self, req: Request) -> None:
        """Free everything a request holds (finish, abort, error). Idempotent."""
        if req in self.waiting:
            self.waiting.remove(req)
            self.preemptor.forget(req)
        if req in self.running:
            self.running.remove(req)
            self.blocks.release(req)
            self.free_slots.append(req.slot)
        req.slot = None
        req.tables = []
        req.boundary_table = None

    def take_moves(self) -> list:
        """The swap steps queued since the last call (they run before the plan's steps)."""
        moves, self._moves = self._moves, []
        return moves

    # -- admission ------------------------------------------------------------------
    def admit(self) -> None:
        """Admit waiting requests in queue order while slots and pages allow; a request that
        does not fit may be passed ``max_admission_bypasses`` times."""
        blocked: list[Request] = []
        for req in list(self.waiting[: self.config.admission_scan_limit]):
            if not self._try_admit(req):
                if not self.free_slots:
                    return
                blocked.append(req)
                if req.bypassed >= self.config.max_admission_bypasses:
                    return                    # fairness: nobody may pass it any more
                continue
            for earlier in blocked:
                earlier.bypassed += 1
            if any(earlier.bypassed >= self.config.max_admission_bypasses for earlier in blocked):
                return                        # the limit holds within one scan too

    def _try_admit(self, req: Request) -> bool:
        """Admit the request if a slot and its pages are free, preempting running requests of
        lower priority for them (policy priority)."""
        while True:
            if self.free_slots and self.preemptor.can_resume(req) and self._take_pages(req):
                self._start(req)
                return True
            victims = [r for r in self.running if r.params.priority > req.params.priority] if self.by_priority else []
            if not victims or not self.preemptor.can_resume(req) or not self._room_with(victims, req):
                return False
            self._preempt(max(victims, key=lambda r: victim_order(r, True)))

    def _room_with(self, victims: list[Request], req: Request) -> bool:
        """Whether preempting every one of ``victims`` could make room for ``req`` (their core
        pages at most, the others' growth room kept): else preempting any is for nothing."""
        freed = sum(len(plane) for v in victims for plane in self.blocks.pages_of(v)[0])
        keep = self.blocks.keep_free(len(self.running) - len(victims))
        room = self.blocks.num_free_pages + self.blocks.held_for(req)[0] + freed - keep
        return room >= self.blocks.admission_pages(req, self._prefix_part(req))

    def _take_pages(self, req: Request) -> bool:
        """Pages for the prompt (or a swapped request's copy), leaving the running requests
        room to grow (``BlockManager.keep_free``)."""
        keep = self.blocks.keep_free(len(self.running))
        if req.swapped is not None:
            return self.blocks.restore(req, req.swapped.positions, keep, self._prefix_part(req))
        return self.blocks.admit(req, self._prefix_part(req), keep)

    def _prefix_part(self, req: Request) -> bytes:
        return prefix_part(req.seed, self.s.state_seeded)

    def _start(self, req: Request) -> None:
        req.slot = self.free_slots.pop()
        self.waiting.remove(req)
        self.running.append(req)
        if req.swapped is not None:
            self._moves.append(self.preemptor.swap_in(req))
        else:
            req.status = Status.PREFILLING

    # -- growth and preemption --------------------------------------------------------
    def _preempt(self, victim: Request) -> None:
        """Give the victim's slot and pages back and queue it again (``engine.preemption``)."""
        if self.in_flight:
            raise Settle
        slot = victim.slot
        step = self.preemptor.preempt(victim)
        self.running.remove(victim)
        self.free_slots.append(slot)
        self.add(victim)
        if step is not None:
            self._moves.append(step)

    def grow_rows(self, rows: list[Request]) -> list[Request]:
        """Pages for the tokens the rows start (each its position, every plane), preempting
        the lowest running requests while the pools run short; returns the rows still running."""
        for r in rows:
            if r.loops_done or r.status is Status.WAITING:
                continue
            while not self.blocks.grow(r, r.decode_position + 1):
                victim = max(self.running, key=lambda q: victim_order(q, self.by_priority))
                self._preempt(victim)
                if victim is r:
                    break
        return [r for r in rows if r.status is not Status.WAITING]

    def reserve_window(self, windows: int, make_room: bool = False) -> bool:
        """Pages for every position the running requests can reach in ``windows`` more windows
        of K passes (a token a pass at most), so no window runs out of pages on the device;
        make_room: preempt the lowest running requests until the rest fit."""
        K = self.s.window.num_passes
        while self.running:
            if all(self.blocks.grow(r, r.prompt_len + len(r.output_token_ids) + K * windows) for r in self.running):
                return True
            if not make_room or len(self.running) == 1:
                return False
            self._preempt(max(self.running, key=lambda q: victim_order(q, self.by_priority)))
        return False

    def windowable(self) -> bool:
        """No running request rebuilds its KV (recompute replays run pass by pass) and none of
        lower priority holds a slot a waiting request could take."""
        if any(r.replay_left for r in self.running):
            return False
        return not (self.by_priority and self.waiting and self.running and min(
            r.params.priority for r in self.waiting) < max(r.params.priority for r in self.running))


def prefix_part(seed: int, state_seeded: bool) -> bytes:
    """What a request adds to the prefix cache's key: its seed where the prompt's KV depends on
    it (a seeded random initial state)."""
    return (seed % 2**64).to_bytes(8, "little") if state_seeded else b""

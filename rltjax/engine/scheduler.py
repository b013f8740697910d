"""Host scheduler: the plan of each engine step.

``schedule`` admits what fits (``engine.admission``: queues, slots, KV pages, preemption)
and returns one ``Plan`` (DESIGN section 2): a prefill chunk
batch, one loop pass over a mixed-depth batch, a head batch, or a decode window over every
decoding request (with the first heads of fresh prompts queued just before it, or, while a
window runs, the admitted prompts riding the next one). ``refill`` (Continuous Depth
Batching) puts every looping token in the next pass, so a token that just got its head joins
rows still deep in their loops; ``no_refill`` (the baseline) loops a cohort until all of it
exits, and only then runs its heads and starts the next cohort. Swap copies that admissions
and preemptions queued go first in the plan. The engine launches the plan and applies its
effects on the requests.
"""
from __future__ import annotations

import dataclasses

from rltjax.engine.admission import Admission, Settle
from rltjax.engine.plan import Chunk, HeadStep, LoopStep, Plan, PrefillStep, SwapOutStep, WindowStep
from rltjax.engine.sequence import Request, Status
from rltjax.engine.settings import EngineSettings
from rltjax.engine.window.planner import WindowPlanner, fits_window


class Scheduler:
    def __init__(self, settings: EngineSettings, *, num_pages: int, boundary_num_pages: int = 0,
                 vocab_size: int = 0, prefix_context: bytes | None = None, page_bytes: int = 0,
                 boundary_page_bytes: int = 0, slot_bytes: int = 0):
        """boundary_num_pages: size of the boundary KV pool (0: the model has none);
        prefix_context: the prefix cache's root context (None: prefix caching off); the
        bytes: a core page, a boundary page and a slot's rows (swap preemption's budget)."""
        self.s = settings
        self.config = settings.scheduler
        self.page_size, self.num_planes, self.max_model_len = settings.page_size, settings.num_planes, \
            settings.max_model_len
        self.admission = Admission(settings, num_pages=num_pages, boundary_num_pages=boundary_num_pages,
                                   prefix_context=prefix_context, page_bytes=page_bytes,
                                   boundary_page_bytes=boundary_page_bytes, slot_bytes=slot_bytes)
        self.windows = WindowPlanner(settings, vocab_size) if settings.window else None
        self.prefill_batches_since_decode = 0
        self.cohort = 0

    # the admission state, as the engine, its stats and tests read it
    waiting = property(lambda self: self.admission.waiting)
    running = property(lambda self: self.admission.running)
    free_slots = property(lambda self: self.admission.free_slots)
    blocks = property(lambda self: self.admission.blocks)
    preemptor = property(lambda self: self.admission.preemptor)
    allocator = property(lambda self: self.admission.blocks.allocator)
    boundary_allocator = property(lambda self: self.admission.blocks.boundary_allocator)

    # -- requests -----------------------------------------------------------------
    def never_fits(self, req: Request) -> str | None:
        """Why a request can never run here (None if it can): checked before queueing."""
        total = req.prompt_len + req.params.max_tokens
        if total > self.max_model_len:
            return (f"prompt ({req.prompt_len} tokens) + max_tokens ({req.params.max_tokens}) = {total} "
                    f"exceeds max_model_len {self.max_model_len}")
        return self.blocks.never_fits(req)

    def add(self, req: Request) -> None:
        self.admission.add(req)

    def release(self, req: Request) -> None:
        """Free everything a request holds (finish, abort, error). Idempotent."""
        self.admission.release(req)

    def launched(self, step) -> None:
        """A step is on the device: the prompt positions it runs all R loops for are done (a
        prefill chunk's progress; whole prompts riding a window start their first token
        there), and their full pages go to the prefix cache. Nothing of this comes back from
        the device."""
        if isinstance(step, PrefillStep):
            for c in step.chunks:
                r = c.request
                r.num_prefilled = c.start + c.length
                self.blocks.publish(r)
                if r.num_prefilled == r.prompt_len:
                    r.status = Status.AWAITING_HEAD
                    r.exit_depths = r.exit_depths or [self.s.num_loops]    # a replay keeps its record
        elif isinstance(step, WindowStep) and step.prompt is not None:
            for c in step.prompt:           # as the window has them: the first token looping
                c.request.num_prefilled = c.request.prompt_len
                self.blocks.publish(c.request)
                c.request.start_token()

    # -- the plan -------------------------------------------------------------------
    def schedule(self) -> Plan:
        """The next step's plan; the swaps that admissions and preemptions queued go first."""
        try:
            plan = self._plan()
        except Settle:
            plan = Plan(settle=True, counts=("preempt_settle",))
        moves = self.admission.take_moves()
        if moves:
            plan = dataclasses.replace(plan, steps=tuple(moves) + plan.steps,
                                       affected=tuple(m.request for m in moves) + plan.affected,
                                       counts=plan.counts + tuple("swap_out" if isinstance(m, SwapOutStep) else
                                                                  "swap_in" for m in moves))
        self.admission.in_flight = plan.keep_last
        return plan

    def _plan(self) -> Plan:
        w = self.windows
        if w is not None and w.inflight and not self._window_continues():
            return self._behind_window()
        kind, rows, chunks = self._next()
        if kind == "prefill":
            return self._prefill_plan(chunks)
        if w is not None and kind == "loop" and len(rows) == len(self.running) and (
                w.inflight or self._fresh_window_fits(make_room=True)):
            # a fresh window's rows are built from the host's state: what is in flight (an
            # async pass's exit signals) is read first; planning it marks the window in flight
            fresh = not w.inflight
            step = w.fresh(list(self.running)) if fresh else w.continued()
            return Plan((step,), settle=fresh, keep_last=True, counts=("window",),
                        affected=tuple(self.running))
        if w is not None and kind == "head" and all(
                r.status is Status.LOOPING or (r.status is Status.AWAITING_HEAD and not r.output_token_ids)
                for r in self.running) and self._fresh_window_fits():
            # fresh prompts' first heads, then a window over every running request queued behind
            # them before the host reads the heads: the window starts those requests from the
            # tokens the heads left on the device, so the GPU need not wait for the host
            running = list(self.running)
            step = w.fresh(running, [r in rows for r in running])
            return Plan((HeadStep(tuple(rows)), step), settle=True, keep_last=True, counts=("window", "head"),
                        affected=tuple(running))
        if kind == "loop":
            rows = self.admission.grow_rows(rows)
            if not rows:              # every row gave way: only the preemptions' swaps run
                return Plan(counts=("preempt",))
            late = self.s.async_scheduling
            return Plan((LoopStep(tuple(rows), late),), keep_last=late, counts=("loop",), affected=tuple(rows))
        if kind == "head":
            return Plan((HeadStep(tuple(rows)),), counts=("head",), affected=tuple(rows))
        if self.waiting and not self.running:
            raise RuntimeError(f"scheduler stalled: {len(self.waiting)} waiting request(s) cannot be admitted "
                               f"into an empty engine (this is a bug)")
        return Plan(counts=("idle",))

    def _fresh_window_fits(self, make_room: bool = False) -> bool:
        """A window over every running request can start now, with its pages reserved
        (make_room: preempting the lowest running requests for them, so the window runs
        with fewer rows rather than falling back to single passes)."""
        return self.admission.windowable() and self.admission.reserve_window(1, make_room)

    def _window_continues(self, admission_tried: bool = False) -> bool:
        """The in-flight window may be continued from the device: ``WindowPlanner.can_continue``
        and pages for one more window beyond it."""
        return (self.windows.can_continue(self.running, self.waiting, self.free_slots, admission_tried)
                and self.admission.windowable() and self.admission.reserve_window(2))

    def _prefill_plan(self, chunks: list[Chunk], counts=("prefill",)) -> Plan:
        return Plan((PrefillStep(tuple(chunks)),), counts=counts, affected=tuple(c.request for c in chunks))

    def _behind_window(self) -> Plan:
        """The in-flight window cannot continue: read it, and first queue what the device can
        run meanwhile. When only an admission stopped it, the next window, continued from the
        device with the new requests in the rows of finished ones, is queued before the host
        reads the window in flight. The new prompts run inside that window's first R passes
        when they fit (mixed prefill); else their prefill step and first heads are queued
        before it, if the prefill completes every prompt and the window has rows for them.
        Otherwise the host drains the window first."""
        w = self.windows
        drain = Plan(counts=("window_read", "window_drain"), affected=tuple(self.running))
        if not w.only_admission_waits(self.running, self.waiting, self.free_slots):
            return drain
        kind, _, chunks = self._next()     # admits; every running request is in the window
        if kind != "prefill":              # nothing admitted (the pages are not free yet)
            if self._window_continues(admission_tried=True):
                return Plan((w.continued(),), keep_last=True, counts=("window_read", "window"),
                            affected=tuple(self.running))
            return drain
        fresh = [c.request for c in chunks]
        left_out = sum(r.status is Status.PREFILLING for r in self.running) > len(fresh)
        scored = any(c.request.params.prompt_logprobs is not None for c in chunks)   # the prefill step scores
        rides = (not left_out and not scored and self.admission.windowable()
                 and fits_window(tuple(chunks), w.prompt_tokens(), self.s.prefill_alignment, w.room()))
        if rides and self.admission.reserve_window(2):
            self.prefill_batches_since_decode = 0
            step = w.admitting(fresh, tuple(chunks))
            return Plan((step,), keep_last=True, counts=("window_read", "mixed_prefill", "window"),
                        affected=tuple(fresh))
        prefill = self._prefill_plan(chunks, counts=("window_read", "prefill"))
        completes = {id(c.request) for c in chunks if c.start + c.length == c.request.prompt_len}
        ready = [r for r in self.running if r.status is Status.AWAITING_HEAD or id(r) in completes]
        if (any(r.status is Status.PREFILLING and id(r) not in completes for r in self.running)
                or len(ready) > w.room() or not self.admission.windowable()
                or not self.admission.reserve_window(2)):
            return Plan(prefill.steps, counts=prefill.counts + ("window_drain",), affected=prefill.affected)
        self.prefill_batches_since_decode = 0
        step = w.admitting(ready)
        return Plan((prefill.steps[0], HeadStep(tuple(ready)), step), keep_last=True,
                    counts=prefill.counts + ("window", "head"), affected=tuple(ready))

    def _next(self) -> tuple[str, list[Request], list[Chunk]]:
        """Admit, then the kind of batch that runs next: (kind, rows, prefill chunks)."""
        self.admission.admit()
        prefilling = [r for r in self.running if r.status is Status.PREFILLING]
        looping = [r for r in self.running if r.status is Status.LOOPING]
        heads = [r for r in self.running if r.status is Status.AWAITING_HEAD]
        decode_work = bool(looping or heads)
        if prefilling and (not decode_work or
                           self.prefill_batches_since_decode < self.config.max_prefill_batches_before_decode):
            self.prefill_batches_since_decode += 1
            return "prefill", [], self._prefill_chunks(prefilling)
        self.prefill_batches_since_decode = 0
        if self.config.mode == "refill":
            if heads and (len(heads) >= self.config.min_coda_batch_size or not looping):
                return "head", heads, []
            if looping:
                return "loop", looping, []
        else:
            in_cohort = [r for r in looping if r.cohort == self.cohort]
            ready = [r for r in heads if r.cohort is None or not in_cohort]
            if ready and (len(ready) >= self.config.min_coda_batch_size or not in_cohort):
                return "head", ready, []
            if in_cohort:
                return "loop", in_cohort, []
            if looping:
                self.cohort += 1
                for r in looping:
                    r.cohort = self.cohort
                return "loop", looping, []
            if heads:
                return "head", heads, []
        if prefilling:
            return "prefill", [], self._prefill_chunks(prefilling)
        return "idle", [], []

    def _prefill_chunks(self, prefilling: list[Request]) -> list[Chunk]:
        budget, align = self.config.max_num_batched_tokens, self.s.prefill_alignment
        chunks = []
        for req in prefilling:
            n = min(budget, self.s.max_prefill_chunk, req.prompt_len - req.num_prefilled)
            if chunks and -(-n // align) * align > budget:    # its padding would overrun the budget
                n = budget // align * align
            if n <= 0:
                break
            chunks.append(Chunk(req, req.num_prefilled, n))
            budget -= -(-n // align) * align
        return chunks

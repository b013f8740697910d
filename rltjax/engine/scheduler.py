"""Host scheduler: admission, KV pages, and which kind of batch runs next.

``schedule`` picks one kind of batch (DESIGN section 2): a prefill chunk batch, one
loop pass over a mixed-depth batch, or a head batch (the engine may run a loop plan as a
decode window, or queue heads and a window together). ``refill``
(Continuous Depth Batching) puts every looping token in the next pass, so a
token that just got its head joins rows still deep in their loops;
``no_refill`` (the baseline) loops a cohort until all of it exits, and only
then runs its heads and starts the next cohort.
"""
from __future__ import annotations

import bisect
import dataclasses

from rltjax.cache.allocator import PageAllocator
from rltjax.cache.block_tables import BlockTables, pages_needed
from rltjax.engine.sequence import Request, Status
from rltjax.engine_config import SchedulerConfig


@dataclasses.dataclass
class StepPlan:
    kind: str                                        # "prefill" | "loop" | "head" | "idle"
    rows: list[Request] = dataclasses.field(default_factory=list)
    chunks: list[tuple[Request, int, int]] = dataclasses.field(default_factory=list)  # (req, start, n)


def prefill_batch_bound(max_num_batched_tokens: int, max_num_seqs: int, max_chunk: int, alignment: int) -> int:
    """The most tokens one prefill batch can hold, alignment padding included: the budget (or
    one aligned chunk when the budget is smaller), unless max_num_seqs chunks of at most
    max_chunk tokens each cannot fill it (the runner compiles no larger bucket)."""
    padded_chunk = -(-max_chunk // alignment) * alignment
    return min(max(max_num_batched_tokens, alignment), max_num_seqs * padded_chunk)


def max_prefill_chunk(config: SchedulerConfig, max_model_len: int, position_sequential_prefill: bool) -> int:
    """The longest chunk one request gets in a prefill batch: one position at a time with the
    shared KV layout, else the chunk size, and never more than a prompt can be (a request
    needs room for at least one output token)."""
    return 1 if position_sequential_prefill else min(config.prefill_chunk_size, max(1, max_model_len - 1))


class Scheduler:
    def __init__(self, config: SchedulerConfig, *, num_pages: int, page_size: int, num_planes: int,
                 max_model_len: int, position_sequential_prefill: bool, boundary_num_pages: int = 0,
                 prefill_alignment: int = 1):
        """boundary_num_pages: size of the boundary KV pool (0: the model has none).
        prefill_alignment: each prefill chunk starts at a multiple of this many rows of the
        batch (the prefill kernel's query blocks); the padding counts against the token budget."""
        if config.max_num_batched_tokens is None or config.prefill_chunk_size is None:
            raise ValueError("Scheduler needs resolved prefill budgets: pass "
                             "SchedulerConfig.with_prefill_defaults(prefill_kernel) (LLMEngine does)")
        self.config = config
        self.page_size = page_size
        self.num_planes = num_planes
        self.max_model_len = max_model_len
        self.position_sequential_prefill = position_sequential_prefill
        self.prefill_alignment = prefill_alignment
        self.allocator = PageAllocator(num_pages)
        self.block_tables = BlockTables(config.max_num_seqs * num_planes,
                                        pages_needed(max_model_len, page_size))
        self.boundary_allocator = self.boundary_tables = None
        if boundary_num_pages:
            self.boundary_allocator = PageAllocator(boundary_num_pages)
            self.boundary_tables = BlockTables(config.max_num_seqs, pages_needed(max_model_len, page_size))
        self.free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.prefill_batches_since_decode = 0
        self.cohort = 0

    # -- capacity ---------------------------------------------------------------
    def pages_for(self, req: Request) -> int:
        return pages_needed(req.max_positions, self.page_size) * self.num_planes

    def boundary_pages_for(self, req: Request) -> int:
        """Boundary-pool pages (one plane); 0 without a boundary pool."""
        return pages_needed(req.max_positions, self.page_size) if self.boundary_allocator else 0

    def never_fits(self, req: Request) -> str | None:
        """Why a request can never run here (None if it can): checked before queueing."""
        total = req.prompt_len + req.params.max_tokens
        if total > self.max_model_len:
            return (f"prompt ({req.prompt_len} tokens) + max_tokens ({req.params.max_tokens}) = {total} "
                    f"exceeds max_model_len {self.max_model_len}")
        usable = self.allocator.num_pages - 1
        if self.pages_for(req) > usable:
            return (f"request needs {self.pages_for(req)} KV pages ({self.num_planes} plane(s) x "
                    f"{pages_needed(req.max_positions, self.page_size)}) but the cache has {usable}")
        if self.boundary_allocator and self.boundary_pages_for(req) > self.boundary_allocator.num_pages - 1:
            return (f"request needs {self.boundary_pages_for(req)} boundary KV pages but the boundary cache "
                    f"has {self.boundary_allocator.num_pages - 1}")
        return None

    def add(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=lambda r: (r.params.priority, r.arrival_index))

    def _admit(self) -> None:
        blocked: list[Request] = []
        for req in list(self.waiting[: self.config.admission_scan_limit]):
            if not self.free_slots:
                return
            need, bneed = self.pages_for(req), self.boundary_pages_for(req)
            if not (self.allocator.can_allocate(need)
                    and (not bneed or self.boundary_allocator.can_allocate(bneed))):
                blocked.append(req)
                if req.bypassed >= self.config.max_admission_bypasses:
                    return                    # fairness: nobody may pass it any more
                continue
            pages = self.allocator.allocate(req.request_id, need)
            per_plane = need // self.num_planes
            req.tables = self.block_tables.assign(req.request_id, self.num_planes)
            for i, table in enumerate(req.tables):
                self.block_tables.append_pages(table, pages[i * per_plane:(i + 1) * per_plane])
            if bneed:
                [req.boundary_table] = self.boundary_tables.assign(req.request_id, 1)
                self.boundary_tables.append_pages(req.boundary_table,
                                                  self.boundary_allocator.allocate(req.request_id, bneed))
            req.slot = self.free_slots.pop()
            req.status = Status.PREFILLING
            self.waiting.remove(req)
            self.running.append(req)
            for earlier in blocked:
                earlier.bypassed += 1
            if any(earlier.bypassed >= self.config.max_admission_bypasses for earlier in blocked):
                return                        # the limit holds within one scan too

    def release(self, req: Request) -> None:
        """Free everything a request holds (finish, abort, error). Idempotent."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
            self.allocator.release(req.request_id)
            self.block_tables.release(req.request_id)
            if req.boundary_table is not None:
                self.boundary_allocator.release(req.request_id)
                self.boundary_tables.release(req.request_id)
            self.free_slots.append(req.slot)
        req.slot = None
        req.tables = []
        req.boundary_table = None

    def decode_queued(self) -> None:
        """Decode work was queued outside ``schedule`` (a window continued behind an
        admission's prefill): prefill batches before the next decode count from zero."""
        self.prefill_batches_since_decode = 0

    # -- what runs next -----------------------------------------------------------
    def schedule(self) -> StepPlan:
        self._admit()
        prefilling = [r for r in self.running if r.status is Status.PREFILLING]
        looping = [r for r in self.running if r.status is Status.LOOPING]
        heads = [r for r in self.running if r.status is Status.AWAITING_HEAD]
        decode_work = bool(looping or heads)
        if prefilling and (not decode_work or
                           self.prefill_batches_since_decode < self.config.max_prefill_batches_before_decode):
            self.prefill_batches_since_decode += 1
            return StepPlan("prefill", chunks=self._prefill_chunks(prefilling))
        self.prefill_batches_since_decode = 0
        if self.config.mode == "refill":
            if heads and (len(heads) >= self.config.min_coda_batch_size or not looping):
                return StepPlan("head", rows=heads)
            if looping:
                return StepPlan("loop", rows=looping)
        else:
            in_cohort = [r for r in looping if r.cohort == self.cohort]
            ready = [r for r in heads if r.cohort is None or not in_cohort]
            if ready and (len(ready) >= self.config.min_coda_batch_size or not in_cohort):
                return StepPlan("head", rows=ready)
            if in_cohort:
                return StepPlan("loop", rows=in_cohort)
            if looping:
                self.cohort += 1
                for r in looping:
                    r.cohort = self.cohort
                return StepPlan("loop", rows=looping)
            if heads:
                return StepPlan("head", rows=heads)
        if prefilling:
            return StepPlan("prefill", chunks=self._prefill_chunks(prefilling))
        return StepPlan("idle")

    def _prefill_chunks(self, prefilling: list[Request]) -> list[tuple[Request, int, int]]:
        budget = self.config.max_num_batched_tokens
        align = self.prefill_alignment
        chunks = []
        for req in prefilling:
            rest = req.prompt_len - req.num_prefilled
            # shared KV: a position finishes all its loops before the next one starts
            ceiling = max_prefill_chunk(self.config, self.max_model_len, self.position_sequential_prefill)
            n = min(budget, ceiling, rest)
            if chunks and -(-n // align) * align > budget:    # its padding would overrun the budget
                n = budget // align * align
            if n <= 0:
                break
            chunks.append((req, req.num_prefilled, n))
            budget -= -(-n // align) * align
        return chunks

"""KV pages of requests: the page allocators, block tables and prefix cache of both pools.

A request holds one block table per plane in the core pool (``last_exited``: one per depth
up to the loop cap; ``shared``: one) and, for models with boundary stages, one table in the
boundary pool; every table covers the same positions. With ``incremental`` allocation (the
default) admission takes pages for the prompt, and the tables grow as tokens are written: a
token's page on every plane when it starts its loops, and before a decode window launches,
the pages its K passes can reach (``grow``). Admission leaves ``watermark`` of the pool and a
page a plane per running request free for the running requests' growth (``keep_free``).
``lifetime`` allocation (for comparison) takes the pages of the prompt and every output at
admission and never grows.

With prefix caching a prompt's full pages map cached blocks (``cache.prefix_cache``) at
admission, up to the page before its last token (the last prompt token always runs, so its
head has a state); the request prefills the rest and publishes each full prompt page once
its prefill is launched. Pages run short: evictable blocks are freed first.
"""
from __future__ import annotations

from rltjax.cache.allocator import PageAllocator
from rltjax.cache.block_tables import BlockTables, pages_needed
from rltjax.cache.prefix_cache import PrefixCache, block_keys, root_key
from rltjax.engine.sequence import Request
from rltjax.engine_config import KV_ALLOCATIONS


class BlockManager:
    def __init__(self, *, num_pages: int, page_size: int, num_planes: int, max_num_seqs: int, max_model_len: int,
                 boundary_num_pages: int = 0, allocation: str = "incremental", watermark: float = 0.0,
                 prefix_context: bytes | None = None):
        """boundary_num_pages: size of the boundary pool (0: the model has none);
        prefix_context: the prefix cache's root context (None: no prefix caching)."""
        if allocation not in KV_ALLOCATIONS:
            raise ValueError(f"allocation={allocation!r}: choose one of {KV_ALLOCATIONS}")
        self.page_size, self.num_planes, self.allocation = page_size, num_planes, allocation
        self.allocator = PageAllocator(num_pages)
        self.block_tables = BlockTables(max_num_seqs * num_planes, pages_needed(max_model_len, page_size))
        self.boundary_allocator = self.boundary_tables = None
        if boundary_num_pages:
            self.boundary_allocator = PageAllocator(boundary_num_pages)
            self.boundary_tables = BlockTables(max_num_seqs, pages_needed(max_model_len, page_size))
        self.watermark_pages = int(watermark * (num_pages - 1)) if allocation == "incremental" else 0
        self.prefix_context = prefix_context
        self.cache = PrefixCache(self.allocator, self.boundary_allocator) if prefix_context is not None else None
        self._held_blocks: dict[str, tuple] = {}    # request id -> (its prompt's block keys, prefix blocks held)

    # -- accounting -----------------------------------------------------------------
    @property
    def usable_pages(self) -> int:
        return self.allocator.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Core pages free now or once the prefix cache evicts what no request uses."""
        return self.allocator.num_free + (self.cache.num_evictable_pages if self.cache is not None else 0)

    @property
    def num_used_pages(self) -> int:
        """Core pages requests hold (cached pages no request uses count as free)."""
        return self.usable_pages - self.num_free_pages

    def pages_for(self, req: Request) -> int:
        """Core pages the request holds at its longest."""
        return pages_needed(req.max_positions, self.page_size) * self.num_planes

    def never_fits(self, req: Request) -> str | None:
        """Why the request's pages can never fit the pools (None if they can)."""
        if self.pages_for(req) > self.usable_pages:
            return (f"request needs {self.pages_for(req)} KV pages ({self.num_planes} plane(s) x "
                    f"{pages_needed(req.max_positions, self.page_size)}) but the cache has {self.usable_pages}")
        bneed = pages_needed(req.max_positions, self.page_size)
        if self.boundary_allocator and bneed > self.boundary_allocator.num_pages - 1:
            return (f"request needs {bneed} boundary KV pages but the boundary cache "
                    f"has {self.boundary_allocator.num_pages - 1}")
        return None

    def covered(self, req: Request) -> int:
        """Positions the request's tables hold pages for."""
        return len(self.block_tables.pages_of(req.tables[0])) * self.page_size if req.tables else 0

    # -- admission ------------------------------------------------------------------
    def keep_free(self, running: int) -> int:
        """Core pages admission leaves free while ``running`` requests run: the watermark, and
        (incremental) a page a plane for each of them to grow into, so a request admitted into
        the last free pages does not preempt another at its next token (none into an empty
        engine: it must be able to start)."""
        if not running or self.allocation == "lifetime":
            return 0
        return self.watermark_pages + running * self.num_planes

    def admit(self, req: Request, request_part: bytes = b"", keep: int = 0) -> bool:
        """Map the request's cached prefix and take pages for the rest of its prompt (lifetime
        allocation: for every position it can write). False, with nothing taken, when that
        would leave fewer than ``keep`` core pages free (``keep_free``). request_part: what
        the request adds to the prefix cache's root key (Huginn's seeded state initialisation).
        A recomputed request takes the pages of the outputs it rebuilds too."""
        P = self.page_size
        blocks = []
        if self.cache is not None:
            if req.block_keys is None:
                req.block_keys = self.prompt_keys(req.prompt_token_ids, request_part)
            blocks = self.cache.match(req.block_keys[:_reusable(req, P)])
        # a recomputed request takes the pages of every output it rebuilds too: admitted on its
        # prompt's alone it would preempt others as it replays (and be preempted again)
        target = req.max_positions if self.allocation == "lifetime" else req.prompt_len + req.replay_left
        fresh = pages_needed(target, P) - len(blocks)
        if not self._can_take(fresh, keep, req):
            if blocks:
                self.cache.release(blocks)
            return False
        if self.cache is not None and not req.num_preemptions:   # a re-admission would count its own pages
            self.cache.record(len(req.block_keys[:(req.prompt_len - 1) // P]) * P, len(blocks) * P)
        self._assign(req)
        self._map(req, blocks)
        req.num_prefilled = len(blocks) * P
        if not req.num_preemptions:      # what the user is told: the first admission's hit
            req.num_cached_tokens = req.num_prefilled
        req.num_published = len(blocks)
        self._take(req, fresh)
        return True

    def admission_pages(self, req: Request, request_part: bytes = b"") -> int:
        """Core pages admitting the request takes now (cached prefix pages excluded), without
        taking them: what a preemption for it must be able to free."""
        P = self.page_size
        if req.swapped is not None:
            target = req.max_positions if self.allocation == "lifetime" else req.swapped.positions
            return pages_needed(target, P) * self.num_planes
        hits = 0
        if self.cache is not None:
            keys = req.block_keys or self.prompt_keys(req.prompt_token_ids, request_part)
            hits = self.cache.peek(keys[:_reusable(req, P)])
        target = req.max_positions if self.allocation == "lifetime" else req.prompt_len + req.replay_left
        return (pages_needed(target, P) - hits) * self.num_planes

    def restore(self, req: Request, positions: int, keep: int = 0, request_part: bytes = b"") -> bool:
        """Pages for the first ``positions`` of a request coming back from swap (lifetime
        allocation: every position it can write): the prefix blocks ``hold`` kept for it, then
        fresh ones; False, with nothing taken, if they do not fit with ``keep`` core pages left
        free."""
        target = req.max_positions if self.allocation == "lifetime" else positions
        keys, blocks = self._held_blocks.get(req.request_id, (None, []))
        fresh = pages_needed(target, self.page_size) - len(blocks)
        if not self._can_take(fresh, keep, req):
            return False
        self._held_blocks.pop(req.request_id, None)
        self._assign(req)
        if blocks:
            self._map(req, blocks)
            req.block_keys = keys
        elif self.cache is not None and req.block_keys is None:
            req.block_keys = self.prompt_keys(req.prompt_token_ids, request_part)
        self._take(req, fresh)
        req.num_published = len(blocks)   # its pages are fresh copies: published again (``publish``)
        return True

    def prompt_keys(self, prompt_token_ids, request_part: bytes = b"") -> list[bytes]:
        """The prefix cache's keys of a prompt's whole pages (``request_part``: what the request
        adds to the root key)."""
        return block_keys(root_key(self.prefix_context, request_part), prompt_token_ids, self.page_size,
                          len(prompt_token_ids) // self.page_size)

    def _map(self, req: Request, blocks) -> None:
        """Cached blocks (each already used by the request) as the first pages of its tables."""
        for plane, table in enumerate(req.tables):
            pages = [b.pages[plane] for b in blocks]
            self.allocator.incref(pages, owner=req.request_id)
            self.block_tables.append_pages(table, pages)
        if self.boundary_tables is not None and blocks:
            bpages = [b.boundary_page for b in blocks]
            self.boundary_allocator.incref(bpages, owner=req.request_id)
            self.boundary_tables.append_pages(req.boundary_table, bpages)
        req.cache_blocks = list(blocks)

    def _assign(self, req: Request) -> None:
        req.tables = self.block_tables.assign(req.request_id, self.num_planes)
        if self.boundary_tables is not None:
            [req.boundary_table] = self.boundary_tables.assign(req.request_id, 1)

    # -- growth ---------------------------------------------------------------------
    def grow(self, req: Request, positions: int) -> bool:
        """Pages for the request's first ``positions`` (capped at what it can write) on every
        plane; False, with nothing taken, when the pools cannot supply them."""
        need = pages_needed(min(positions, req.max_positions), self.page_size) - self.covered(req) // self.page_size
        if need <= 0:
            return True
        if not self._can_take(need, req=req):
            return False
        self._take(req, need)
        return True

    def _can_take(self, pages_per_plane: int, keep: int = 0, req: Request | None = None) -> bool:
        """Whether pages_per_plane fresh pages per plane fit with ``keep`` core pages left free
        (``req``'s own held pages, ``hold``, count as free for it)."""
        held, bheld = self.held_for(req)
        core = pages_per_plane * self.num_planes
        ok = self.num_free_pages + held - core >= keep
        if ok and self.boundary_allocator is not None:
            evictable = self.cache.num_evictable_boundary_pages if self.cache is not None else 0
            ok = self.boundary_allocator.num_free + evictable + bheld >= pages_per_plane
        return ok

    # -- holds (prefill/decode disaggregation) -----------------------------------------
    def hold(self, request_id: str, positions: int, prompt_token_ids=(), request_part: bytes = b"") -> int | None:
        """Hold pages for a request that is not here yet (its prompt runs on another engine):
        the cached blocks of its prompt's prefix (``prompt_token_ids``; none when empty) and
        fresh pages for the rest of its first ``positions`` on every plane and in the boundary
        pool, out of everyone else's reach until it arrives (``restore`` maps them) or
        ``drop_hold``. Returns the prefix pages found here (the other engine need not send
        them), or None, holding nothing, when the fresh pages are not free."""
        keys, blocks = None, []
        if self.cache is not None and len(prompt_token_ids):
            keys = self.prompt_keys(list(prompt_token_ids), request_part)
            blocks = self.cache.match(keys[:(len(prompt_token_ids) - 1) // self.page_size])
        per_plane = pages_needed(positions, self.page_size) - len(blocks)
        core = per_plane * self.num_planes
        held = self._can_take(per_plane)
        if held and self.cache is not None:     # a reservation takes only free pages
            self.cache.evict(core, per_plane if self.boundary_allocator is not None else 0)
        held = held and self.allocator.reserve(request_id, core)
        if held and self.boundary_allocator is not None and not self.boundary_allocator.reserve(request_id,
                                                                                               per_plane):
            self.allocator.release(request_id)
            held = False
        if not held:
            if blocks:
                self.cache.release(blocks)
            return None
        self._held_blocks[request_id] = (keys, blocks)
        return len(blocks)

    def drop_hold(self, request_id: str) -> None:
        """Give back what ``hold`` kept for a request that will not come (or left)."""
        for alloc in (self.allocator, self.boundary_allocator):
            if alloc is not None and alloc.holds(request_id) and not alloc.pages_held_by(request_id):
                alloc.release(request_id)
        _, blocks = self._held_blocks.pop(request_id, (None, []))
        if blocks:
            self.cache.release(blocks)

    def held_for(self, req: Request | None) -> tuple[int, int]:
        """(core, boundary) pages held for the request (``hold``) and not yet taken."""
        if req is None:
            return 0, 0
        return tuple(a.reserved_for(req.request_id) if a is not None and a.holds(req.request_id) else 0
                     for a in (self.allocator, self.boundary_allocator))

    def _take(self, req: Request, pages_per_plane: int) -> None:
        """Append pages_per_plane fresh pages to each of the request's tables (``_can_take``
        said they exist: the prefix cache evicts what it must)."""
        if pages_per_plane <= 0:
            return
        core = pages_per_plane * self.num_planes
        if self.cache is not None:      # what the request's hold does not cover must be free
            held, bheld = self.held_for(req)
            self.cache.evict(core - held, pages_per_plane - bheld if self.boundary_allocator is not None else 0)
        pages = self.allocator.allocate(req.request_id, core)
        for i, table in enumerate(req.tables):
            self.block_tables.append_pages(table, pages[i * pages_per_plane:(i + 1) * pages_per_plane])
        if self.boundary_tables is not None:
            self.boundary_tables.append_pages(req.boundary_table,
                                              self.boundary_allocator.allocate(req.request_id, pages_per_plane))

    # -- prefix cache ---------------------------------------------------------------
    def publish(self, req: Request) -> None:
        """Offer the prompt pages the request's launched prefill has completed to the cache."""
        if self.cache is None or req.block_keys is None:
            return
        full = min(req.num_prefilled, req.prompt_len) // self.page_size
        for i in range(req.num_published, full):
            pages = tuple(self.block_tables.pages_of(t)[i] for t in req.tables)
            bpage = self.boundary_tables.pages_of(req.boundary_table)[i] if self.boundary_tables else None
            block = self.cache.publish(req.block_keys[i], pages, bpage)
            if block is not None:
                req.cache_blocks.append(block)
        req.num_published = max(req.num_published, full)

    # -- release --------------------------------------------------------------------
    def release(self, req: Request) -> None:
        """Every page, table and cached block the request holds. Idempotent."""
        if self.allocator.holds(req.request_id):
            self.allocator.release(req.request_id)
        if req.tables:
            self.block_tables.release(req.request_id)
        if req.boundary_table is not None:
            if self.boundary_allocator.holds(req.request_id):
                self.boundary_allocator.release(req.request_id)
            self.boundary_tables.release(req.request_id)
        if self.cache is not None and req.cache_blocks:
            self.cache.release(req.cache_blocks)
        req.tables, req.boundary_table, req.cache_blocks = [], None, []

    def pages_of(self, req: Request) -> tuple[list[list[int]], list[int]]:
        """The request's pages per core plane, and its boundary pages ([] without a pool)."""
        core = [self.block_tables.pages_of(t) for t in req.tables]
        boundary = self.boundary_tables.pages_of(req.boundary_table) if req.boundary_table is not None else []
        return core, boundary

    def check_invariants(self) -> None:
        self.allocator.check_invariants()
        if self.boundary_allocator is not None:
            self.boundary_allocator.check_invariants()
        if self.cache is not None:
            self.cache.check_invariants()


def _reusable(req: Request, page_size: int) -> int:
    """Prompt pages a request may take from the prefix cache: whole pages before its last
    token (which must run for its first head); none when it asks for prompt logprobs, whose
    prefill must run every prompt token."""
    return 0 if req.params.prompt_logprobs is not None else (req.prompt_len - 1) // page_size

"""KV pages of requests: the page allocators and block tables of both pools.

A request holds one block table per plane in the core pool (``last_exited``: one per depth
up to the loop cap; ``shared``: one) and, for models with boundary stages, one table in the
boundary pool. Pages are reserved for a request's whole lifetime at admission (its prompt
and max_tokens), so a decode window never runs out of pages on the device.
"""
from __future__ import annotations

from rltjax.cache.allocator import PageAllocator
from rltjax.cache.block_tables import BlockTables, pages_needed
from rltjax.engine.sequence import Request


class BlockManager:
    def __init__(self, *, num_pages: int, page_size: int, num_planes: int, max_num_seqs: int, max_model_len: int,
                 boundary_num_pages: int = 0):
        """boundary_num_pages: size of the boundary pool (0: the model has none)."""
        self.page_size = page_size
        self.num_planes = num_planes
        self.allocator = PageAllocator(num_pages)
        self.block_tables = BlockTables(max_num_seqs * num_planes, pages_needed(max_model_len, page_size))
        self.boundary_allocator = self.boundary_tables = None
        if boundary_num_pages:
            self.boundary_allocator = PageAllocator(boundary_num_pages)
            self.boundary_tables = BlockTables(max_num_seqs, pages_needed(max_model_len, page_size))

    def pages_for(self, req: Request) -> int:
        return pages_needed(req.max_positions, self.page_size) * self.num_planes

    def boundary_pages_for(self, req: Request) -> int:
        """Boundary-pool pages (one plane); 0 without a boundary pool."""
        return pages_needed(req.max_positions, self.page_size) if self.boundary_allocator else 0

    def never_fits(self, req: Request) -> str | None:
        """Why the request's pages can never fit the pools (None if they can)."""
        usable = self.allocator.num_pages - 1
        if self.pages_for(req) > usable:
            return (f"request needs {self.pages_for(req)} KV pages ({self.num_planes} plane(s) x "
                    f"{pages_needed(req.max_positions, self.page_size)}) but the cache has {usable}")
        if self.boundary_allocator and self.boundary_pages_for(req) > self.boundary_allocator.num_pages - 1:
            return (f"request needs {self.boundary_pages_for(req)} boundary KV pages but the boundary cache "
                    f"has {self.boundary_allocator.num_pages - 1}")
        return None

    def can_allocate(self, req: Request) -> bool:
        bneed = self.boundary_pages_for(req)
        return (self.allocator.can_allocate(self.pages_for(req))
                and (not bneed or self.boundary_allocator.can_allocate(bneed)))

    def allocate(self, req: Request) -> None:
        """The request's pages for its lifetime, on every plane and the boundary pool."""
        need, bneed = self.pages_for(req), self.boundary_pages_for(req)
        pages = self.allocator.allocate(req.request_id, need)
        per_plane = need // self.num_planes
        req.tables = self.block_tables.assign(req.request_id, self.num_planes)
        for i, table in enumerate(req.tables):
            self.block_tables.append_pages(table, pages[i * per_plane:(i + 1) * per_plane])
        if bneed:
            [req.boundary_table] = self.boundary_tables.assign(req.request_id, 1)
            self.boundary_tables.append_pages(req.boundary_table,
                                              self.boundary_allocator.allocate(req.request_id, bneed))

    def release(self, req: Request) -> None:
        """Every page and table the request holds."""
        self.allocator.release(req.request_id)
        self.block_tables.release(req.request_id)
        if req.boundary_table is not None:
            self.boundary_allocator.release(req.request_id)
            self.boundary_tables.release(req.request_id)
        req.tables = []
        req.boundary_table = None

"""Host-side page allocator for the paged KV cache: free list, refcounts, reservations.

Page 0 is never handed out: padded batch rows write their K/V there, so a
padded row can never clobber a live page. Usable pages = num_pages - 1.

Every page reference has a holder: an *owner* (a request id; `release(owner)`
drops all of its references at once) or nobody (an *unowned* reference: the
prefix cache's). refcount[p] = unowned refs + owner refs, and a page
returns to the free list when it reaches zero.

A *reservation* sets pages aside for an owner without picking them, so
admission can guarantee a request's whole lifetime fits: `allocate` draws
from the owner's reservation first, and nobody else can allocate into it.
Accounting: num_free + num_used + num_reserved + 1 (scratch) == num_pages,
where num_free counts only pages that nobody has reserved.

The engine's block manager (``rltjax.engine.block_manager``) allocates as sequences grow
(``allocate``), and its prefix cache (``rltjax.cache.prefix_cache``) keeps an unowned
reference to each cached page while the requests mapping it hold owned ones, so
``release(rid)`` drops only the request's references and eviction is ``free(pages)``.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Hashable, Iterable

import numpy as np

SCRATCH_PAGE = 0


class AllocatorError(RuntimeError):
    """Misuse of the allocator (double free, unknown owner, ...); state is unchanged."""


class OutOfPagesError(AllocatorError):
    """An allocation the owner's reservation and the unreserved pool cannot cover."""

    def __init__(self, owner: Hashable, requested: int, available: int):
        self.owner, self.requested, self.available = owner, requested, available
        super().__init__(f"out of KV pages: owner {owner!r} requested {requested} "
                         f"page(s) but only {available} are available to it")


@dataclasses.dataclass
class _Owner:
    pages: list[int] = dataclasses.field(default_factory=list)  # one entry per reference held
    reserved: int = 0                                           # reserved, not yet allocated


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1 (page 0 is scratch), got {num_pages}")
        self.num_pages = num_pages
        # LIFO: recently freed pages are reused first (warm in cache, easy to reason about).
        self._free: list[int] = list(range(num_pages - 1, SCRATCH_PAGE, -1))
        self._refcount = np.zeros(num_pages, np.int32)
        self._unowned_refs = np.zeros(num_pages, np.int32)
        self._ever_allocated = np.zeros(num_pages, bool)  # tells "double free" from "never allocated"
        self._owners: dict[Hashable, _Owner] = {}
        self._total_reserved = 0

    # -- accounting ---------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages anyone may allocate: unallocated and not reserved."""
        return len(self._free) - self._total_reserved

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    @property
    def num_reserved(self) -> int:
        """Reserved pages not yet allocated by their owner."""
        return self._total_reserved

    def can_allocate(self, num_pages: int) -> bool:
        """Whether an owner with no reservation could allocate num_pages now."""
        return num_pages <= self.num_free

    def holds(self, owner: Hashable) -> bool:
        """Whether owner holds any page reference or reservation."""
        return owner in self._owners

    def reserved_for(self, owner: Hashable) -> int:
        return self._owner(owner).reserved

    def pages_held_by(self, owner: Hashable) -> list[int]:
        return list(self._owner(owner).pages)

    def refcount(self, page: int) -> int:
        return int(self._refcount[page])

    # -- operations ---------------------------------------------------------
    def reserve(self, owner: Hashable, num_pages: int) -> bool:
        """Set num_pages aside for owner (adds to any existing reservation).

        Returns False, changing nothing, if the unreserved pool is too small.
        """
        if num_pages < 0:
            raise ValueError(f"cannot reserve a negative number of pages ({num_pages})")
        if num_pages > self.num_free:
            return False
        self._owners.setdefault(owner, _Owner()).reserved += num_pages
        self._total_reserved += num_pages
        return True

    def allocate(self, owner: Hashable, num_pages: int) -> list[int]:
        """Hand num_pages fresh pages (refcount 1) to owner, reservation first."""
        if num_pages < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({num_pages})")
        state = self._owners.get(owner)
        reserved = state.reserved if state else 0
        available = reserved + self.num_free
        if num_pages > available:
            raise OutOfPagesError(owner, num_pages, available)
        state = self._owners.setdefault(owner, _Owner())
        from_reservation = min(num_pages, reserved)
        state.reserved -= from_reservation
        self._total_reserved -= from_reservation
        pages = [self._free.pop() for _ in range(num_pages)]
        self._refcount[pages] = 1
        self._ever_allocated[pages] = True
        state.pages.extend(pages)
        return pages

    def incref(self, pages: Iterable[int], owner: Hashable | None = None) -> None:
        """Add one reference to each allocated page, held by owner (or unowned)."""
        pages = list(pages)
        for page in pages:
            self._check_allocated(page, "incref")
        if owner is None:
            np.add.at(self._unowned_refs, pages, 1)
        else:
            self._owners.setdefault(owner, _Owner()).pages.extend(pages)
        np.add.at(self._refcount, pages, 1)

    def free(self, pages: Iterable[int], owner: Hashable | None = None) -> None:
        """Drop one reference per listed page, held by owner (or an unowned one).

        Pages reaching refcount 0 return to the free list. All checks run
        before any change, so a rejected call leaves the state untouched.
        """
        pages = list(pages)
        counts = collections.Counter(pages)
        if owner is not None:
            held = collections.Counter(self._owner(owner).pages)
        for page, count in counts.items():
            self._check_allocated(page, "free")
            if owner is None and count > self._unowned_refs[page]:
                raise AllocatorError(
                    f"page {page} has {self._unowned_refs[page]} unowned reference(s), "
                    f"cannot free {count}; free owned pages with owner= or release(owner)")
            if owner is not None and count > held[page]:
                raise AllocatorError(f"owner {owner!r} holds {held[page]} reference(s) to "
                                     f"page {page}, cannot free {count}")
        if owner is None:
            np.subtract.at(self._unowned_refs, pages, 1)
        else:
            for page in pages:
                self._owners[owner].pages.remove(page)
        self._drop_refs(pages)

    def release(self, owner: Hashable) -> None:
        """Free every reference owner holds and drop its reservation (finish/abort/preempt)."""
        state = self._owner(owner)
        del self._owners[owner]
        self._total_reserved -= state.reserved
        self._drop_refs(state.pages)

    # -- internals ----------------------------------------------------------
    def _drop_refs(self, pages: list[int]) -> None:
        np.subtract.at(self._refcount, pages, 1)
        # Ascending push order is arbitrary; dedupe so a page with two refs freed at once is pushed once.
        self._free.extend(p for p in dict.fromkeys(pages) if self._refcount[p] == 0)

    def _owner(self, owner: Hashable) -> _Owner:
        if owner not in self._owners:
            raise AllocatorError(f"unknown owner {owner!r}: it holds no pages or reservation")
        return self._owners[owner]

    def _check_allocated(self, page: int, op: str) -> None:
        if page == SCRATCH_PAGE:
            raise AllocatorError(f"cannot {op} page 0: it is the scratch page, never allocated")
        if not 0 < page < self.num_pages:
            raise AllocatorError(f"cannot {op} page {page}: out of range [1, {self.num_pages})")
        if self._refcount[page] == 0:
            what = "double free" if op == "free" and self._ever_allocated[page] else "not allocated"
            raise AllocatorError(f"cannot {op} page {page}: {what} (page {page} is free)")

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert SCRATCH_PAGE not in free and self._refcount[SCRATCH_PAGE] == 0, "scratch page leaked"
        used = {p for p in range(1, self.num_pages) if self._refcount[p] > 0}
        assert not free & used, f"pages both free and used: {sorted(free & used)}"
        assert (self._refcount >= 0).all(), "negative refcount"
        assert self.num_free + self.num_used + self.num_reserved + 1 == self.num_pages
        assert len(used) == self.num_used and self.num_free >= 0
        assert self._total_reserved == sum(o.reserved for o in self._owners.values())
        expected = self._unowned_refs.copy()
        for state in self._owners.values():
            assert state.reserved >= 0
            np.add.at(expected, state.pages, 1)
        assert (expected == self._refcount).all(), "refcounts disagree with holders"

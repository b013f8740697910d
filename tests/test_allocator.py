"""Host-side paged KV cache: PageAllocator (stateful, against a model) and BlockTables."""
from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rltjax.cache.allocator import AllocatorError, OutOfPagesError, PageAllocator
from rltjax.cache.block_tables import BlockTableError, BlockTables, pages_needed

OWNERS = ["a", "b", "c", "d"]


def snapshot(alloc: PageAllocator):
    """Everything observable about the allocator, to prove a rejected call changed nothing."""
    owners = {o: (sorted(s.pages), s.reserved) for o, s in alloc._owners.items()}
    return (list(alloc._free), alloc._refcount.tolist(), alloc._unowned_refs.tolist(), owners,
            alloc.num_free, alloc.num_used, alloc.num_reserved)


class AllocatorMachine(RuleBasedStateMachine):
    """Random reserve/allocate/incref/free/release sequences against a plain-dict model."""

    @initialize(num_pages=st.integers(1, 12))
    def setup(self, num_pages):
        self.alloc = PageAllocator(num_pages)
        self.num_pages = num_pages
        self.held: dict[str, collections.Counter] = {}   # owner -> page multiset (one per ref)
        self.reserved: dict[str, int] = {}
        self.unowned = collections.Counter()

    # -- model helpers --
    def refcount(self, page):
        return self.unowned[page] + sum(c[page] for c in self.held.values())

    def used(self):
        return {p for p in range(1, self.num_pages) if self.refcount(p) > 0}

    def model_free(self):
        return self.num_pages - 1 - len(self.used()) - sum(self.reserved.values())

    def register(self, owner):
        self.held.setdefault(owner, collections.Counter())
        self.reserved.setdefault(owner, 0)

    def expect_rejected(self, fn, error=AllocatorError, match=None):
        before = snapshot(self.alloc)
        with pytest.raises(error, match=match):
            fn()
        assert snapshot(self.alloc) == before, "a rejected call changed the state"

    # -- rules --
    @rule(owner=st.sampled_from(OWNERS), n=st.integers(0, 6))
    def reserve(self, owner, n):
        expected = n <= self.model_free()
        assert self.alloc.reserve(owner, n) == expected
        if expected:
            self.register(owner)
            self.reserved[owner] += n

    @rule(owner=st.sampled_from(OWNERS), n=st.integers(0, 6))
    def allocate(self, owner, n):
        own = self.reserved.get(owner, 0)
        available = own + self.model_free()
        if n > available:
            self.expect_rejected(lambda: self.alloc.allocate(owner, n), OutOfPagesError)
            return
        self.do_allocate(owner, n)

    @precondition(lambda self: any(self.reserved.values()))
    @rule(data=st.data())
    def allocate_within_reservation(self, data):
        # A reservation is honoured even when other owners exhausted the pool.
        owner = data.draw(st.sampled_from(sorted(o for o, r in self.reserved.items() if r)))
        self.do_allocate(owner, data.draw(st.integers(1, self.reserved[owner])))

    def do_allocate(self, owner, n):
        used_before = self.used()
        pages = self.alloc.allocate(owner, n)
        assert len(pages) == n == len(set(pages))
        assert 0 not in pages and not set(pages) & used_before
        assert all(1 <= p < self.num_pages for p in pages)
        self.register(owner)
        self.reserved[owner] -= min(n, self.reserved[owner])
        self.held[owner].update(pages)

    @precondition(lambda self: self.used())
    @rule(data=st.data())
    def incref(self, data):
        pages = data.draw(st.lists(st.sampled_from(sorted(self.used())), min_size=1, max_size=3))
        owner = data.draw(st.sampled_from([None, *OWNERS]))
        self.alloc.incref(pages, owner=owner)
        if owner is None:
            self.unowned.update(pages)
        else:
            self.register(owner)
            self.held[owner].update(pages)

    @precondition(lambda self: self.used())
    @rule(data=st.data())
    def free_valid(self, data):
        holders = [o for o, c in self.held.items() if +c] + ([None] if +self.unowned else [])
        owner = data.draw(st.sampled_from(holders))
        refs = list((self.unowned if owner is None else self.held[owner]).elements())
        pages = data.draw(st.lists(st.sampled_from(refs), min_size=1, max_size=len(refs)))
        pages = list((collections.Counter(pages) & collections.Counter(refs)).elements())
        self.alloc.free(pages, owner=owner)
        (self.unowned if owner is None else self.held[owner]).subtract(pages)

    @rule(data=st.data())
    def free_invalid(self, data):
        # Pages with no reference (free, scratch, out of range): double free / not allocated.
        unheld = [p for p in range(self.num_pages + 1) if self.refcount(p) == 0]
        page = data.draw(st.sampled_from(unheld))
        owner = data.draw(st.sampled_from([None, *self.held]))
        self.expect_rejected(lambda: self.alloc.free([page], owner=owner), match=f"page {page}")

    @precondition(lambda self: self.used())
    @rule(data=st.data())
    def free_not_held_by_owner(self, data):
        page = data.draw(st.sampled_from(sorted(self.used())))
        owner = data.draw(st.sampled_from([None, *self.held]))
        holding = self.unowned if owner is None else self.held[owner]
        if holding[page] == 0:
            self.expect_rejected(lambda: self.alloc.free([page], owner=owner), match=f"page {page}")

    @rule(owner=st.sampled_from(OWNERS))
    def release(self, owner):  # finish, abort, rejection, preemption: any point in a lifetime
        if owner not in self.held:
            self.expect_rejected(lambda: self.alloc.release(owner), match=repr(owner))
            return
        self.alloc.release(owner)
        del self.held[owner], self.reserved[owner]

    @rule()
    def release_everything(self):
        for owner in list(self.held):
            self.release(owner)
        self.alloc.free(list(self.unowned.elements()))
        self.unowned.clear()
        assert self.alloc.num_free == self.num_pages - 1, "pages leaked"
        assert self.alloc.num_used == 0 and self.alloc.num_reserved == 0

    @invariant()
    def accounting_is_exact(self):
        if not hasattr(self, "alloc"):
            return
        self.alloc.check_invariants()
        assert self.alloc.num_used == len(self.used())
        assert self.alloc.num_reserved == sum(self.reserved.values())
        assert self.alloc.num_free == self.model_free()
        for page in range(self.num_pages):
            assert self.alloc.refcount(page) == self.refcount(page)
        for owner, pages in self.held.items():
            assert sorted(self.alloc.pages_held_by(owner)) == sorted(pages.elements())
            assert self.alloc.reserved_for(owner) == self.reserved[owner]


AllocatorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                              deadline=None)
TestAllocatorStateful = AllocatorMachine.TestCase


# -- error messages -----------------------------------------------------------

def test_free_scratch_page_is_rejected():
    with pytest.raises(AllocatorError, match="page 0.*scratch"):
        PageAllocator(4).free([0])


def test_double_free_names_the_page():
    alloc = PageAllocator(4)
    page, = alloc.allocate("r1", 1)
    alloc.free([page], owner="r1")
    with pytest.raises(AllocatorError, match=f"page {page}: double free"):
        alloc.free([page])


def test_free_never_allocated_page():
    with pytest.raises(AllocatorError, match="page 3: not allocated"):
        PageAllocator(4).free([3])
    with pytest.raises(AllocatorError, match=r"page 9: out of range"):
        PageAllocator(4).free([9])


def test_free_page_the_owner_does_not_hold():
    alloc = PageAllocator(4)
    page, = alloc.allocate("r1", 1)
    alloc.allocate("r2", 1)
    with pytest.raises(AllocatorError, match=f"owner 'r2' holds 0 reference.*page {page}"):
        alloc.free([page], owner="r2")
    with pytest.raises(AllocatorError, match=f"page {page} has 0 unowned"):
        alloc.free([page])  # an owned page must go through its owner
    with pytest.raises(AllocatorError, match=f"owner 'r1' holds 1 reference.*cannot free 2"):
        alloc.free([page, page], owner="r1")
    alloc.check_invariants()


def test_unknown_owner():
    alloc = PageAllocator(4)
    for call in (lambda: alloc.release("ghost"), lambda: alloc.free([1], owner="ghost"),
                 lambda: alloc.pages_held_by("ghost")):
        with pytest.raises(AllocatorError, match="unknown owner 'ghost'"):
            call()


def test_incref_free_page():
    with pytest.raises(AllocatorError, match="cannot incref page 2: not allocated"):
        PageAllocator(4).incref([2])


def test_out_of_pages_names_owner_requested_available():
    alloc = PageAllocator(6)  # 5 usable
    assert alloc.reserve("r1", 2)
    alloc.allocate("r2", 1)
    with pytest.raises(OutOfPagesError, match="owner 'r2' requested 3 page.*only 2") as info:
        alloc.allocate("r2", 3)
    assert (info.value.owner, info.value.requested, info.value.available) == ("r2", 3, 2)
    assert isinstance(info.value, AllocatorError)
    assert alloc.allocate("r1", 4) and alloc.num_free == 0  # reservation first, then the pool


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(0)
    with pytest.raises(ValueError):
        PageAllocator(4).reserve("r", -1)
    with pytest.raises(ValueError):
        PageAllocator(4).allocate("r", -1)


# -- scenarios the docstring promises ------------------------------------------

def test_reservation_survives_pool_exhaustion():
    alloc = PageAllocator(8)
    assert alloc.reserve("r1", 3) and not alloc.reserve("r2", 5)
    alloc.allocate("r2", 4)  # incremental, no reservation: takes every unreserved page
    assert not alloc.can_allocate(1)
    assert len(alloc.allocate("r1", 3)) == 3 and alloc.reserved_for("r1") == 0
    with pytest.raises(OutOfPagesError):
        alloc.allocate("r1", 1)
    alloc.release("r1"), alloc.release("r2")
    assert alloc.num_free == 7


def test_shared_prefix_pages_outlive_one_owner():
    alloc = PageAllocator(6)
    prefix = alloc.allocate("r1", 2)
    alloc.incref(prefix)                # prefix cache keeps its own reference
    alloc.incref(prefix, owner="r2")    # a second request reuses the prefix
    alloc.release("r1")
    assert alloc.num_used == 2 and all(alloc.refcount(p) == 2 for p in prefix)
    alloc.release("r2")
    alloc.free(prefix)                  # eviction
    assert alloc.num_free == 5 and alloc.num_used == 0
    alloc.check_invariants()


def test_preempt_then_readmit():
    alloc = PageAllocator(5)
    assert alloc.reserve("r1", 4)
    alloc.allocate("r1", 2)
    alloc.release("r1")                 # preempt: pages and the rest of the reservation return
    assert alloc.num_free == 4 and alloc.reserve("r1", 4)
    alloc.check_invariants()


# -- block tables ----------------------------------------------------------------

def test_pages_needed():
    assert [pages_needed(n, 4) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    with pytest.raises(ValueError):
        pages_needed(3, 0)


@given(page_size=st.integers(1, 16), pages=st.lists(st.integers(1, 999), min_size=1, max_size=8),
       data=st.data())
@settings(max_examples=100, deadline=None)
def test_slot_for_and_slots_for_match_formula(page_size, pages, data):
    tables = BlockTables(max_tables=3, max_pages_per_table=8)
    idx, = tables.assign("s", num_planes=1)
    tables.append_pages(idx, pages[:1])
    tables.append_pages(idx, pages[1:])  # appending continues in position order
    assert tables.pages_of(idx) == pages
    position = data.draw(st.integers(0, len(pages) * page_size - 1))
    assert tables.slot_for(idx, position, page_size) == (pages[position // page_size],
                                                         position % page_size)
    beyond = data.draw(st.integers(len(pages) * page_size, len(pages) * page_size + 50))
    with pytest.raises(BlockTableError, match=f"position {beyond} is outside table {idx}"):
        tables.slot_for(idx, beyond, page_size)
    with pytest.raises(BlockTableError):
        tables.slot_for(idx, -1, page_size)
    # slots_for (a prompt chunk at once) equals slot_for per position, errors included
    capacity = len(pages) * page_size
    positions = np.array(data.draw(st.lists(st.integers(0, capacity - 1), max_size=40)), np.int32)
    got_pages, got_offsets = tables.slots_for(idx, positions, page_size)
    assert got_pages.dtype == got_offsets.dtype == np.int32
    assert list(zip(got_pages.tolist(), got_offsets.tolist())) == [tables.slot_for(idx, int(p), page_size)
                                                                   for p in positions]
    bad = data.draw(st.sampled_from([-1, capacity, capacity + 7]))
    mixed = np.insert(positions, data.draw(st.integers(0, len(positions))), bad)
    with pytest.raises(BlockTableError, match=f"position {bad} is outside table {idx}"):
        tables.slots_for(idx, mixed, page_size)


def test_planes_get_distinct_tables_and_release_resets_rows():
    tables = BlockTables(max_tables=6, max_pages_per_table=4)
    deep = tables.assign("looped", num_planes=4)   # last_exited layout, R = 4
    flat = tables.assign("shared", num_planes=1)   # shared layout
    assert len(set(deep + flat)) == 5 and tables.num_free_tables == 1
    assert tables.tables_of("looped") == deep
    for plane, idx in enumerate(deep):
        tables.append_pages(idx, [10 * plane + 1, 10 * plane + 2])
    tables.append_pages(flat[0], [7])
    assert tables.release("looped") == deep
    assert (tables.array[deep] == 0).all() and tables.array[flat[0], 0] == 7
    assert tables.array.dtype == np.int32 and tables.array.shape == (6, 4)
    with pytest.raises(BlockTableError, match=f"table {deep[0]} is not assigned"):
        tables.pages_of(deep[0])
    again = tables.assign("next", num_planes=5)    # released rows are reusable
    assert set(deep) <= set(again) and all(tables.pages_of(i) == [] for i in again)


def test_block_table_errors():
    tables = BlockTables(max_tables=2, max_pages_per_table=2)
    idx, = tables.assign("s", 1)
    with pytest.raises(BlockTableError, match="'s' already has"):
        tables.assign("s", 1)
    with pytest.raises(BlockTableError, match="'t' needs 2 table.*only 1"):
        tables.assign("t", 2)
    with pytest.raises(BlockTableError, match="scratch page 0"):
        tables.append_pages(idx, [3, 0])
    with pytest.raises(BlockTableError, match="exceeds max_pages_per_table=2"):
        tables.append_pages(idx, [3, 4, 5])
    with pytest.raises(BlockTableError, match="unknown sequence 'u'"):
        tables.release("u")
    assert tables.pages_of(idx) == []  # rejected appends changed nothing

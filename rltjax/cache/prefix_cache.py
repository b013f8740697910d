"""Prefix caching: full pages of prompt KV, shared between requests by a chained hash.

A *block* is one page-sized run of prompt positions: its page on every core plane and, for
models with boundary stages, its boundary-pool page. Block i of a prompt is keyed by

    key_i = blake2b(key_{i-1} || token ids of positions [i * page_size, (i + 1) * page_size))

with key_{-1} the *root*: a digest of everything else that changes what those pages hold
(the model's fingerprint, dtype, KV layout, planes, loop count, page size, and for Huginn's
seeded state initialisation the request's seed). Equal keys therefore mean equal pages: a
prompt position's K/V depends only on the tokens up to it, since every prompt token runs all
R loops and a prompt is prefilled in position order.

Only pages that prompt prefill wrote completely are published. Decoded tokens exit at their
own depths, so a page holding them differs from the same tokens prefilled as a later prompt
(a second chat turn that contains the first answer); such pages are never published.

The cache holds one unowned allocator reference to each page of a block (``PageAllocator``);
a request using the block holds its own. A block no request uses is *evictable*: it stays
mapped, and is freed least recently used first when pages run short. Blocks a request used
are queued for eviction deepest first, so a chain is shortened from its end.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Sequence

import numpy as np

from rltjax.cache.allocator import PageAllocator


@dataclasses.dataclass(eq=False)
class CachedBlock:
    key: bytes
    pages: tuple[int, ...]          # one page per core plane
    boundary_page: int | None       # the boundary pool's page (None: no boundary pool)
    users: int = 0                  # requests whose block tables hold it


@dataclasses.dataclass
class PrefixCacheStats:
    queries: int = 0                # prompt tokens looked up
    hits: int = 0                   # prompt tokens found
    evictions: int = 0              # blocks evicted


def root_key(context: bytes, request_part: bytes = b"") -> bytes:
    """key_{-1}: the engine's context (``prefix_context``) and what a request adds to it."""
    return hashlib.blake2b(context + b"|" + request_part, digest_size=16).digest()


def block_keys(root: bytes, tokens: Sequence[int], page_size: int, num_blocks: int) -> list[bytes]:
    """Keys of the first ``num_blocks`` full pages of ``tokens``."""
    ids = np.asarray(tokens[:num_blocks * page_size], np.int64)
    keys, parent = [], root
    for i in range(num_blocks):
        parent = hashlib.blake2b(parent + ids[i * page_size:(i + 1) * page_size].tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    def __init__(self, allocator: PageAllocator, boundary_allocator: PageAllocator | None = None):
        self.allocator, self.boundary_allocator = allocator, boundary_allocator
        self._blocks: dict[bytes, CachedBlock] = {}
        self._evictable: collections.OrderedDict[bytes, CachedBlock] = collections.OrderedDict()  # LRU first
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def num_evictable_pages(self) -> int:
        """Core pages the cache alone holds (freed by eviction)."""
        return sum(len(b.pages) for b in self._evictable.values())

    @property
    def num_blocks_in_use(self) -> int:
        """Cached blocks some request's tables hold."""
        return len(self._blocks) - len(self._evictable)

    @property
    def num_evictable_boundary_pages(self) -> int:
        return sum(b.boundary_page is not None for b in self._evictable.values())

    def match(self, keys: Sequence[bytes]) -> list[CachedBlock]:
        """The longest run of cached blocks from the start of ``keys``, each now used by the
        caller (``release`` gives them back)."""
        found = []
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                break
            found.append(block)
        for block in found:
            self._use(block)
        return found

    def peek(self, keys: Sequence[bytes]) -> int:
        """How many blocks from the start of ``keys`` are cached (nothing changes)."""
        n = 0
        while n < len(keys) and keys[n] in self._blocks:
            n += 1
        return n

    def record(self, query_tokens: int, hit_tokens: int) -> None:
        """An admitted request's lookup: prompt tokens asked for and found."""
        self.stats.queries += query_tokens
        self.stats.hits += hit_tokens

    def publish(self, key: bytes, pages: tuple[int, ...], boundary_page: int | None) -> CachedBlock | None:
        """A block a request's prefill just wrote, used by that request; None (nothing
        changes) when the key is cached already (another request wrote the same pages)."""
        if key in self._blocks:
            return None
        self.allocator.incref(pages)
        if boundary_page is not None:
            self.boundary_allocator.incref([boundary_page])
        block = CachedBlock(key, tuple(pages), boundary_page, users=1)
        self._blocks[key] = block
        return block

    def release(self, blocks: Sequence[CachedBlock]) -> None:
        """A request no longer uses these blocks (in prompt order); the unused ones become
        evictable, the deepest first."""
        for block in reversed(blocks):
            if block.users < 1:
                raise RuntimeError("prefix cache: block released more often than used (this is a bug)")
            block.users -= 1
            if block.users == 0 and self._blocks.get(block.key) is block:
                self._evictable[block.key] = block

    def evict(self, core_pages: int, boundary_pages: int = 0) -> int:
        """Free evictable blocks, least recently used first, until the allocators have
        ``core_pages`` (and ``boundary_pages``) free or nothing is left; returns blocks freed."""
        freed = 0
        while self._evictable and (self.allocator.num_free < core_pages or (
                self.boundary_allocator is not None and self.boundary_allocator.num_free < boundary_pages)):
            _, block = self._evictable.popitem(last=False)
            self._drop(block)
            freed += 1
        self.stats.evictions += freed
        return freed

    def clear(self) -> None:
        """Forget every block (the device's pages are no longer trusted); blocks still in use
        lose only the cache's reference."""
        for block in list(self._blocks.values()):
            self._drop(block)
        self._evictable.clear()

    def _use(self, block: CachedBlock) -> None:
        block.users += 1
        self._evictable.pop(block.key, None)

    def _drop(self, block: CachedBlock) -> None:
        del self._blocks[block.key]
        self.allocator.free(block.pages)
        if block.boundary_page is not None:
            self.boundary_allocator.free([block.boundary_page])

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        for key, block in self._blocks.items():
            assert block.users >= 0, "negative block users"
            assert (key in self._evictable) == (block.users == 0), "evictable set disagrees with users"
            for page in block.pages:      # the cache's reference and one per user
                assert self.allocator.refcount(page) == 1 + block.users, \
                    f"page {page}: refcount {self.allocator.refcount(page)}, {block.users} user(s) + the cache"
        assert all(self._blocks.get(k) is b for k, b in self._evictable.items()), "evictable block not cached"

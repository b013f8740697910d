"""Swap preemption: a request's KV pages and slot state copied to host memory and back.

``swap_out`` gathers a piece of the request's pages (every core plane, then its boundary
pages) and its rows of the per-slot buffers into one ``SwapData``, whose host copy starts at
once; ``swap_in`` scatters a host copy into the request's fresh pages and slot. A request
moves in pieces of ``SWAP_CHUNK`` pages, padded with the scratch page 0: one executable each
way, and a device buffer of one piece whatever the request's length (the scratch page's
content is never read for a result, so the padding's reads and writes are harmless). The
copies are bit for bit: a request swapped back in continues exactly where it stopped, in
the middle of a token's loops too (its exit state stays on the host ``Request``).

``SwapSpace`` keeps the host budget (``CacheConfig.swap_space``): a victim whose copy does
not fit is recomputed instead (``engine.preemption``).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import struct

from rltjax.cache.paged_kv import PagedKV
from rltjax.engine.sequence import Status
from rltjax.jit_options import engine_jit


@struct.dataclass
class SwapData:
    k: jax.Array               # [L, Hkv, n, page_size, Dh]: the request's core pages, plane by plane
    v: jax.Array
    bk: jax.Array | None       # its boundary pages (None: no boundary pool)
    bv: jax.Array | None
    state: jax.Array           # [D] its slot_state row
    inject: jax.Array | None   # its slot_inject row (boundary models)
    token: jax.Array           # its slot_tokens entry


@dataclasses.dataclass(eq=False)
class Swapped:
    """A preempted request's copy (``Request.swapped``) and where it stood."""
    status: Status             # what it resumes as
    positions: int             # positions its tables covered
    num_pages: int             # pages per plane
    nbytes: int                # host bytes reserved for it
    data: SwapData | None = None   # numpy once the copy is read
    cached_pages: int = 0      # pages per plane the copy leaves out: the prefix cache's (a handoff)


SWAP_CHUNK = 64       # pages a copy moves (one executable; a bounded device buffer)


def chunks(pages, boundary_pages) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The core and boundary page lists cut into ``SWAP_CHUNK``-page pieces, in lockstep (as
    many pieces of each), padded with the scratch page."""
    n = max(1, -(-max(len(pages), len(boundary_pages)) // SWAP_CHUNK))

    def cut(ids):
        out = np.zeros((n, SWAP_CHUNK), np.int32)
        out.reshape(-1)[:len(ids)] = ids
        return list(out)
    return cut(pages), cut(boundary_pages)


@engine_jit()
def swap_out(kv: PagedKV, bkv: PagedKV | None, slot_state, slot_inject, slot_tokens, pages, bpages, slot):
    """The pages' K/V (core, and boundary when ``bkv``) and the slot's rows, gathered."""
    return SwapData(kv.k[:, :, pages], kv.v[:, :, pages],
                    None if bkv is None else bkv.k[:, :, bpages], None if bkv is None else bkv.v[:, :, bpages],
                    slot_state[slot], None if slot_inject is None else slot_inject[slot], slot_tokens[slot])


@engine_jit(donate_argnames=("kv", "bkv", "slot_state", "slot_inject", "slot_tokens"))
def swap_in(kv: PagedKV, bkv: PagedKV | None, slot_state, slot_inject, slot_tokens, pages, bpages, slot,
            data: SwapData):
    """``swap_out``'s inverse into (possibly other) pages and slot; the donated state comes back."""
    kv = PagedKV(kv.k.at[:, :, pages].set(data.k), kv.v.at[:, :, pages].set(data.v))
    if bkv is not None:
        bkv = PagedKV(bkv.k.at[:, :, bpages].set(data.bk), bkv.v.at[:, :, bpages].set(data.bv))
    slot_state = slot_state.at[slot].set(data.state)
    if slot_inject is not None:
        slot_inject = slot_inject.at[slot].set(data.inject)
    return kv, bkv, slot_state, slot_inject, slot_tokens.at[slot].set(data.token)


class SwapSpace:
    """Host memory for swapped requests, in bytes."""

    def __init__(self, capacity_bytes: int):
        self.capacity = int(capacity_bytes)
        self.used = 0

    def reserve(self, nbytes: int) -> bool:
        if self.used + nbytes > self.capacity:
            return False
        self.used += nbytes
        return True

    def free(self, nbytes: int) -> None:
        if nbytes > self.used:
            raise RuntimeError(f"swap space: freeing {nbytes} bytes of {self.used} held (this is a bug)")
        self.used -= nbytes

"""Writes into the paged pool: per-layer row writes and copy-on-exit.

Every update indexes the pool by its own dims, (layer, head, page, offset),
never by a flat element offset: a pool of L * Hkv * num_pages * page_size * Dh
elements exceeds 2**31 on large devices, and per-dim int32 indices cannot
overflow where a flattened one would.

Copy-on-exit (``last_exited``). When a decode token at position j exits at
depth e < cap (R, or the engine's loop cap CacheConfig.max_loops above R), its
plane-e entry is copied into planes e+1..cap at position j, so
a later query at depth d reads plane min(d, e) without any per-key depth logic
in attention. Ordering requirement: the copy must run after the pass that
wrote the token's plane-e K/V (its loop e) and before any later query at a
plane > e can read position j, i.e. before the next loop pass that holds a
later position of the same sequence. Decode never runs position j+1 before
token j has exited (it is sampled from j's head), so issuing the copies
between passes suffices. Prompt tokens run all R loops and need no copy (planes
above R, when the cap exceeds R, are written by their last prefill loop).
All copies of one ``copy_slots`` call read the pool before any is written, so
a batch must not contain a slot as both a source and a destination (exit
copies never do: distinct tokens own distinct slots).
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kernels.paged_attention_ref import paged_write_ref

from rltjax.jit_options import engine_jit


def write_kv(kv, layer, k: jax.Array, v: jax.Array, write_page: jax.Array, write_offset: jax.Array):
    """Scatter rows' K/V [N, Hkv, Dh] into layer ``layer`` at (write_page, write_offset).

    write_page may also be [M, N]: each row is then written to M pages at its offset (a
    prompt's last loop filling the planes beyond R). Padded rows target page 0 (scratch):
    those writes are dropped (``kernels.paged_attention_ref.paged_write_ref``).
    """
    return type(kv)(*paged_write_ref(kv.k, kv.v, k, v, write_page, write_offset, layer=layer))


def copy_kv_slots(kv, src_page: jax.Array, src_offset: jax.Array, dst_page: jax.Array,
                  dst_offset: jax.Array):
    """Copy M slots src -> dst over all layers and heads at once; [M] int32 each.

    Padding entries have dst page 0; their writes are dropped (page 0 is scratch, never a
    real destination). Written, the padding would land on one slot many times over and
    XLA's scatter serialises on it: dropping them made H200 decode windows 5-9% faster
    (docs/performance.md). The copies that land have distinct destinations (distinct
    tokens and planes own distinct slots), so XLA may scatter without atomics
    (``unique_indices``). Traceable: decode windows call it inside their loop;
    ``copy_slots`` is the same copy as its own jitted call.
    """
    dst_page = jnp.where(dst_page == 0, kv.k.shape[2], dst_page)   # out of bounds: dropped
    src = (slice(None), slice(None), src_page, src_offset)   # gathered block [L, Hkv, M, Dh]
    dst = (slice(None), slice(None), dst_page, dst_offset)
    return type(kv)(k=kv.k.at[dst].set(kv.k[src], mode="drop", unique_indices=True),
                    v=kv.v.at[dst].set(kv.v[src], mode="drop", unique_indices=True))


# The pool is donated: the update is in place, the caller must use the returned kv.
copy_slots = engine_jit(donate_argnums=(0,))(copy_kv_slots)


def _table(table_of_plane, seq: int, plane: int) -> int:
    if callable(table_of_plane):
        return int(table_of_plane(seq, plane))
    return int(np.asarray(table_of_plane)[seq, plane])


def exit_copy_slots(block_tables_np: np.ndarray, table_of_plane: Callable[[int, int], int] | np.ndarray,
                    seq: int, position: int, exit_depth: int, num_loops: int, page_size: int):
    """Slots to copy for one token of ``seq`` at ``position`` exiting at ``exit_depth`` (1-based).

    num_loops: the number of planes (R, or the engine's loop cap above R).
    table_of_plane: (seq, plane) -> table index, or an array [num_seqs, R];
    plane p (0-based) serves queries at depth p + 1. Returns
    (src_page, src_offset, dst_page, dst_offset), int32 arrays of length
    R - exit_depth (empty when the token ran all loops).
    """
    if not 1 <= exit_depth <= num_loops:
        raise ValueError(f"exit_depth={exit_depth} must be in [1, {num_loops}]")
    block, offset = divmod(position, page_size)
    src_page = int(block_tables_np[_table(table_of_plane, seq, exit_depth - 1), block])
    dst_pages = [int(block_tables_np[_table(table_of_plane, seq, p), block])
                 for p in range(exit_depth, num_loops)]
    n = len(dst_pages)
    return (np.full(n, src_page, np.int32), np.full(n, offset, np.int32),
            np.asarray(dst_pages, np.int32).reshape(n), np.full(n, offset, np.int32))


def pack_copies(copies: Sequence[tuple[np.ndarray, ...]], batch: int):
    """Concatenate exit_copy_slots results and pad to ``batch`` with page-0 -> page-0 entries.

    A fixed batch keeps ``copy_slots`` at one compiled shape.
    """
    parts = [np.concatenate([c[i] for c in copies] or [np.zeros(0, np.int32)]) for i in range(4)]
    m = len(parts[0])
    if m > batch:
        raise ValueError(f"{m} copies exceed the copy batch of {batch}; split them over several calls")
    return tuple(jnp.asarray(np.pad(p.astype(np.int32), (0, batch - m))) for p in parts)

"""Writes into the paged pool: per-layer row writes, written through to deeper planes.

Every update indexes the pool by its own dims, (layer, head, page, offset),
never by a flat element offset: a pool of L * Hkv * num_pages * page_size * Dh
elements exceeds 2**31 on large devices, and per-dim int32 indices cannot
overflow where a flattened one would.

Write-through (``last_exited``). A decode token at position j running loop d
writes its K/V to plane d - 1 and to every deeper plane below its cap (R, or the
engine's loop cap CacheConfig.max_loops above R; ``write_planes``). Each loop
overwrites its own plane and those below it in turn, so the deeper planes always
hold the token's newest K/V: when it exits at depth e they hold its depth-e K/V,
and a later query at depth d reads plane min(d, e) with no copy and no per-key
depth logic in attention. A later position of the same sequence runs only after
token j has exited (it is sampled from j's head), so it never reads a deeper
plane's entry for j before j's last write. Prompt tokens run all R loops (planes
above R, when the cap exceeds R, are written by their last prefill loop).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.paged_attention_ref import paged_write_ref


def write_kv(kv, layer, k: jax.Array, v: jax.Array, write_page: jax.Array, write_offset: jax.Array):
    """Scatter rows' K/V [N, Hkv, Dh] into layer ``layer`` at (write_page, write_offset).

    write_page may also be [M, N]: each row is then written to M pages at its offset (a
    prompt's last loop filling the planes beyond R). Padded rows target page 0 (scratch):
    those writes are dropped (``kernels.paged_attention_ref.paged_write_ref``).
    """
    return type(kv)(*paged_write_ref(kv.k, kv.v, k, v, write_page, write_offset, layer=layer))


def write_planes(plane: int, max_loops: int, num_planes: int) -> range:
    """Host side: the planes a row at ``plane`` (0-based: its loop's plane) writes its K/V to,
    its own and every deeper one below its cap min(num_planes, max_loops)."""
    return range(plane, min(num_planes, max_loops))


def write_through_pages(plane_tables: jax.Array, plane: jax.Array, max_loops: jax.Array, positions: jax.Array,
                        active: jax.Array, block_tables: jax.Array, page_size: int) -> jax.Array:
    """Device side of ``write_planes`` for B rows -> [planes, B] pages (0 outside a row's
    write planes, and for inactive rows: dropped). plane_tables [B, planes] each row's block
    table per plane; plane, max_loops, positions [B] int32; active [B] bool."""
    num_planes = plane_tables.shape[1]
    planes = jnp.arange(num_planes)[:, None]                                    # [P, 1]
    cap = jnp.minimum(num_planes, max_loops)[None, :]
    through = active[None, :] & (planes >= plane[None, :]) & (planes < cap)     # [P, B]
    block = jnp.maximum(positions, 0) // page_size
    return jnp.where(through, block_tables[plane_tables.T, block[None, :]], 0)

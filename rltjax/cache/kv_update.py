"""Writes into the paged pool: per-layer row writes, written through to deeper planes.

Every update indexes the pool by its own dims, (layer, head, page, offset),
never by a flat element offset: a pool of L * Hkv * num_pages * page_size * Dh
elements exceeds 2**31 on large devices, and per-dim int32 indices cannot
overflow where a flattened one would.

Write-through (``last_exited``). A decode token at position j running loop d
writes its K/V to plane d - 1 and to every deeper plane below its cap, min(the
engine's planes, the request's max_loops) (``write_plane_mask``): planes past a
request's own max_loops serve depths it never runs. Each loop
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
import numpy as np

from rltjax.kernels.paged_attention_ref import paged_write_ref


def write_kv(kv, layer, k: jax.Array, v: jax.Array, write_page: jax.Array, write_offset: jax.Array):
    """Scatter rows' K/V [N, Hkv, Dh] into layer ``layer`` at (write_page, write_offset).

    write_page may also be [M, N]: each row is then written to M pages at its offset (a
    prompt's last loop filling the planes beyond R; a decode row written through to its
    deeper planes). Page 0 (scratch: padded rows, planes a row does not write) is dropped
    (``kernels.paged_attention_ref.paged_write_ref``).
    """
    return type(kv)(*paged_write_ref(kv.k, kv.v, k, v, write_page, write_offset, layer=layer))


def write_plane_mask(plane, max_loops, num_planes: int):
    """[num_planes, B] bool: the planes each of B rows writes its K/V to, its own (``plane``,
    0-based: its loop's plane) and every deeper one below its cap min(num_planes, max_loops).
    plane, max_loops [B] int arrays, numpy (the step path's host batches) or jax (decode
    windows, on the device)."""
    planes = np.arange(num_planes)[:, None]                                    # [P, 1]
    return (planes >= plane[None, :]) & (planes < max_loops.clip(max=num_planes)[None, :])


def write_through_pages(plane_tables, plane, max_loops, positions, active, block_tables, page_size: int):
    """Pages of ``write_plane_mask`` for B rows -> [planes, B] int32 (0 outside a row's write
    planes, and for inactive rows: dropped). plane_tables [B, planes] each row's block table per
    plane; plane, max_loops, positions [B] int; active [B] bool. numpy in (the step path's host
    batches), numpy out; jax in (decode windows, on the device), jax out."""
    xp = np if isinstance(block_tables, np.ndarray) else jnp
    through = active[None, :] & write_plane_mask(plane, max_loops, plane_tables.shape[1])    # [P, B]
    block = xp.maximum(positions, 0) // page_size
    return xp.where(through, block_tables[plane_tables.T, block[None, :]], 0).astype(xp.int32)

"""Writes into the per-slot device buffers (``slot_state``, ``slot_inject``, ``slot_tokens``).

Each buffer has ``max_num_seqs + 1`` rows; the last is the dummy slot that padded rows
name. Its content is never read for a result (padded rows re-embed or are inactive), so
rows naming it write nothing: left in, every padded row of a batch would write that one
row, a scatter with repeated indices that XLA:GPU serialises (for 16-bit elements an
atomic compare-and-swap loop per element). The rows that remain name distinct slots (one
row per request), so XLA may scatter them without atomics.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def set_slots(buffer: jax.Array, slots: jax.Array, values: jax.Array) -> jax.Array:
    """buffer.at[slots].set(values), the dummy slot's (buffer's last row) writes dropped.
    buffer [S + 1, ...], slots [B] int32 (distinct except for the dummy slot), values [B, ...]."""
    dummy = buffer.shape[0] - 1
    slots = jnp.where(slots == dummy, buffer.shape[0], slots)       # out of bounds: dropped
    return buffer.at[slots].set(values.astype(buffer.dtype), mode="drop", unique_indices=True)

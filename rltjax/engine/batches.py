"""The device steps' inputs, one typed pytree per kind of call.

Each batch is padded to a power-of-two bucket on the host (``host_batches``) and handed to
its jitted step (``device_steps``) as one argument; a pytree's leaves keep their field
order, so a step's program takes its arrays in the order declared here. Padded rows name
the dummy slot and write the scratch page (page 0), so they change nothing. The warm-up
builds all-padding batches of every bucket from the same types (``padding``), so what it
compiles is what steady state calls. Decode windows' rows and prompts are in
``engine.window.state``.
"""
from __future__ import annotations

import jax
import numpy as np
from flax import struct

from rltjax.cache.paged_kv import PagedMeta


@struct.dataclass
class BoundaryInputs:
    """Boundary-pool rows of a call (models with prelude / coda KV): where each row writes
    and reads there, and its request's seed (Huginn's random initial state)."""
    meta: PagedMeta           # one plane: positions, pages, offsets, tables, lengths, block tables
    seeds: jax.Array          # [N, 2] uint32: (hi, lo) words of the request seed


@struct.dataclass
class PrefillBatch:
    """Prompt tokens [T] that run all R loops; loop d writes and reads plane d."""
    tokens: jax.Array         # [T] int32
    positions: jax.Array      # [T] int32 (-1: alignment padding)
    write_page: jax.Array     # [P, T] int32 page per written plane (P = max(R, loop cap))
    write_offset: jax.Array   # [T] int32
    row_tables: jax.Array     # [R, T] int32 table each token reads at loop d
    lengths: jax.Array        # [T] int32 keys visible (position + 1; 0 for padding)
    block_tables: jax.Array   # [num_tables, pages_per_table] int32
    out_slots: jax.Array      # [T] int32 a prompt's last token: its request's slot; others the dummy
    boundary: BoundaryInputs | None = None
    targets: jax.Array | None = None   # [T] int32 the next prompt token of each (prompt logprobs; None: none)


@struct.dataclass
class EmbedBatch:
    """Boundary models: the prelude of the rows starting a token (fills their slots)."""
    slots: jax.Array          # [B] int32
    tokens: jax.Array         # [B] int32
    boundary: BoundaryInputs


@struct.dataclass
class LoopBatch:
    """One loop pass over rows at their own depths."""
    slots: jax.Array          # [B] int32
    tokens: jax.Array         # [B] int32 the token each row loops (embedded where it starts)
    starting: jax.Array       # [B] bool the row's first loop
    positions: jax.Array      # [B] int32
    write_page: jax.Array     # [P, B] int32 own plane and the deeper ones (write-through; 0: dropped)
    write_offset: jax.Array   # [B] int32
    row_tables: jax.Array     # [B] int32 the table each row reads (its plane's)
    lengths: jax.Array        # [B] int32
    block_tables: jax.Array   # [num_tables, pages_per_table] int32


@struct.dataclass
class HeadBatch:
    """Heads of rows whose state is final: sampling with each request's params and key."""
    slots: jax.Array          # [B] int32
    temperature: jax.Array    # [B] f32
    top_k: jax.Array          # [B] int32
    top_p: jax.Array          # [B] f32
    seed_hi: jax.Array        # [B] uint32
    seed_lo: jax.Array        # [B] uint32
    output_index: jax.Array   # [B] int32 the sampled token's index in its request's output
    boundary_meta: PagedMeta | None = None   # boundary models: where the coda writes its KV


def pad_rows(a: np.ndarray, n: int, value=0) -> np.ndarray:
    """``a`` padded along its first axis to n rows with ``value``."""
    return np.pad(a, [(0, n - a.shape[0])] + [(0, 0)] * (a.ndim - 1), constant_values=value)


def pad_columns(a: np.ndarray, n: int) -> np.ndarray:
    """A [P, N] array padded to [P, n] with zeros (the scratch page)."""
    return np.pad(a, ((0, 0), (0, n - a.shape[1])))

"""Merging the decode attention kernel's key splits (flash-decoding split-K).

Each split of a (row, head) leaves a normalized partial output o [Dh] and its log-sum-exp lse
(float32). The merge weights split s by exp(lse_s - max lse) and divides by their sum; a split
with no keys (lse = -inf) weighs 0, and a row with no keys at all comes out 0.

``combine_splits`` does it in XLA after the kernel (one more kernel a layer). ``merge_last_split``
does it inside the kernel (``paged_attention_pallas(merge_splits=True)``): the last split of a
(row, head) to finish, told by an atomic counter, merges every split's partials and resets the
counter to 0, with the same formula, so the two agree bit for bit where the same float32 sums
are taken in the same order (interpret mode; the tests pin it there).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.triton_common import next_pow2

NEG_INF = float("-inf")


def combine_splits(o: jax.Array, lse: jax.Array, dtype) -> jax.Array:
    """Merges [S, N, H, Dh] normalized partials with their [S, N, H] log-sum-exps."""
    m = jnp.max(lse, axis=0)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m[None])                                           # 0 for empty splits
    den = jnp.sum(w, axis=0)
    out = jnp.sum(w[..., None] * o, axis=0) / jnp.where(den > 0, den, 1.0)[..., None]
    return out.astype(dtype)


def merge_last_split(out_ref, count_ref, o_ref, lse_ref, row, head, num_splits: int, chunks,
                     interpret: bool):
    """In a kernel program of (row, head), after its partial stores to o_ref [S, N, H, Dh] and
    lse_ref [S, N, H]: the program that finds itself last on count_ref[row, head] (int32, 0
    before the call) writes the merged out_ref[row, head] and resets the counter.

    Ordering on the GPU: a CTA barrier puts every thread's partial stores before the counter's
    acq_rel (GPU scope) atomic, and the merge reads the partials with volatile loads, past a
    stale L1. (jax 0.11.2 cannot lower cache_modifier=".cg": its lookup table's keys lack the
    dot.) Interpret mode runs the programs one after another and has no barrier to lower."""
    if not interpret:
        plgpu.debug_barrier()
    ticket = plgpu.atomic_add(count_ref, (row, head), jnp.int32(1))

    @pl.when(ticket == num_splits - 1)
    def _merge():
        split = jax.lax.broadcasted_iota(jnp.int32, (next_pow2(num_splits),), 0)
        live = split < num_splits
        split = jnp.minimum(split, num_splits - 1)       # array indices: interpret mode's gather
        lse = plgpu.load(lse_ref.at[split, row, head], mask=live, other=NEG_INF, volatile=True)   # [Sp]
        m = jnp.max(lse)
        weights = jnp.exp(lse - jnp.where(m == NEG_INF, 0.0, m))
        den = jnp.sum(weights)
        for off, width in chunks:
            cols = off + jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)
            o = plgpu.load(o_ref.at[split[:, None], row, head, cols], mask=live[:, None], other=0.0,
                           volatile=True)                                             # [Sp, w]
            merged = jnp.sum(weights[:, None] * o, axis=0) / jnp.where(den > 0, den, 1.0)
            plgpu.store(out_ref.at[row, head, pl.ds(off, width)], merged.astype(out_ref.dtype))
        plgpu.atomic_add(count_ref, (row, head), jnp.int32(-num_splits))

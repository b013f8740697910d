"""Key splits of the attention kernels (flash-decoding split-K; decode on Triton and Mosaic GPU,
prefill on Triton): which blocks a split takes, its log-sum-exp, and the merge.

Each split of a (row, head) leaves a normalized partial output o [Dh] and its log-sum-exp lse
(float32). The merge weights split s by exp(lse_s - max lse) and divides by their sum; a split
with no keys (lse = -inf) weighs 0, and a row with no keys at all comes out 0.

It runs in XLA after the kernel (one small fusion a layer). Merging inside the kernel instead
(the last split of a (row, head) to finish, told by an atomic counter) was slower at every shape
measured (scripts/bench_decode_attention.py; docs/performance.md, "Tried and rejected").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rltjax.kernels.triton_common import cdiv


def split_range(n_blocks, split, num_splits: int):
    """Split ``split`` of ``num_splits``'s key blocks [start, stop) of ``n_blocks`` (traced):
    consecutive shares of ceil(n_blocks / num_splits), the last ones shorter or empty."""
    per_split = cdiv(n_blocks, num_splits)
    start = split * per_split
    return start, jnp.minimum(start + per_split, n_blocks)


def log_sum_exp(m, total):
    """An online softmax's running max and sum as a log-sum-exp (-inf where the sum is 0: no key)."""
    has = total > 0
    return jnp.where(has, m + jnp.log(jnp.where(has, total, 1.0)), float("-inf"))


def combine_splits(o: jax.Array, lse: jax.Array, dtype) -> jax.Array:
    """Merges [S, N, H, Dh] normalized partials with their [S, N, H] log-sum-exps."""
    m = jnp.max(lse, axis=0)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m[None])                                           # 0 for empty splits
    den = jnp.sum(w, axis=0)
    out = jnp.sum(w[..., None] * o, axis=0) / jnp.where(den > 0, den, 1.0)[..., None]
    return out.astype(dtype)

"""Pure-XLA depth-aware paged attention: the CPU path and the kernels' oracle.

Layout (shared by every implementation in this package):
  k_pages, v_pages: [Hkv, num_pages, page_size, Dh]   one layer's pool; head-major
                    so one (head, page) block is contiguous; or the stacked
                    [L, Hkv, num_pages, page_size, Dh] pool with a ``layer`` index,
                    so a layer scan never slices (copies) one layer out of it
  block_tables:     [num_tables, pages_per_table] int32   one table per (sequence, plane)
  q:                [N, H, Dh]   one row per query token
  row_tables:       [N] int32    which block table a row reads (its sequence at its plane)
  lengths:          [N] int32    keys 0..length-1 are visible (position + 1: causal)
Returns [N, H, Dh] in q's dtype; softmax and accumulation in float32. Query
head h reads KV head h // (H // Hkv). Rows with length 0 return zeros.

``paged_write_ref`` is the row write that ``paged_attention_write`` fuses with the read:
  k_new, v_new:     [N, Hkv, Dh]  each row's new K/V
  write_page:       [N] or [M, N] int32  page(s) it goes to (page 0 is scratch: not written)
  write_offset:     [N] int32     its offset in them

``rope_rotate_half_ref`` is the rotary embedding ``paged_attention_write`` may apply to q and
the new keys first (Llama-style rotate-half; cos, sin: [N, Dh / 2] float32 per row).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def paged_attention_ref(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                        block_tables: jax.Array, row_tables: jax.Array, lengths: jax.Array,
                        *, layer: jax.Array | None = None, scale: float | None = None) -> jax.Array:
    if k_pages.ndim == 4:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    n, num_heads, head_dim = q.shape
    _, num_kv, _, page_size, _ = k_pages.shape
    group = num_heads // num_kv
    pages = block_tables[row_tables]                                  # [N, P]
    # One gather per pool: (layer, all heads, pages) -> [N, P, Hkv, S, Dh]
    keys = jnp.moveaxis(k_pages[layer, :, pages], 2, 0)               # [Hkv, N, P, S, Dh]
    values = jnp.moveaxis(v_pages[layer, :, pages], 2, 0)
    t = pages.shape[1] * page_size
    keys = keys.reshape(num_kv, n, t, head_dim)                       # [Hkv, N, T, Dh]
    values = values.reshape(num_kv, n, t, head_dim)
    scale = head_dim ** -0.5 if scale is None else scale
    qg = q.reshape(n, num_kv, group, head_dim).astype(jnp.float32)
    scores = jnp.einsum("nkgd,kntd->nkgt", qg, keys.astype(jnp.float32)) * scale
    visible = jnp.arange(t)[None, :] < lengths[:, None]               # [N, T]
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    probs = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    probs = jnp.where(visible[:, None, None, :], probs, 0.0)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("nkgt,kntd->nkgd", probs, values.astype(jnp.float32))
    return out.reshape(n, num_heads, head_dim).astype(q.dtype)


def paged_write_ref(k_pages: jax.Array, v_pages: jax.Array, k_new: jax.Array, v_new: jax.Array,
                    write_page: jax.Array, write_offset: jax.Array, *, layer=None):
    """Scatters rows' K/V into the (stacked) pools -> (k_pages, v_pages).

    The advanced indices (layer, page, offset) are split by the head slice, so the indexed
    block is [N, Hkv, Dh] (or [M, N, Hkv, Dh]; k/v broadcast over M). Writes to page 0
    are dropped (sent out of bounds), so every write that lands has its own slot and XLA
    may scatter without atomics (``unique_indices``).
    """
    stacked = k_pages.ndim == 5
    write_page = jnp.where(write_page == 0, k_pages.shape[-3], write_page)   # out of bounds: dropped
    idx = ((layer,) if stacked else ()) + (slice(None), write_page, write_offset)
    return (k_pages.at[idx].set(k_new.astype(k_pages.dtype), mode="drop", unique_indices=True),
            v_pages.at[idx].set(v_new.astype(v_pages.dtype), mode="drop", unique_indices=True))


def rope_rotate_half_ref(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE: x [N, H, Dh], cos/sin [N, Dh / 2] float32 -> [N, H, Dh] in x's dtype.

    With x = (lo, hi) halves: (lo cos - hi sin, hi cos + lo sin), computed in float32 and
    cast back once; the kernel computes the same terms. (Equal to the upstream PyTorch code
    in float32; its bfloat16 runs round cos / sin and each term to bfloat16.)"""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    lo, hi = x32[..., :half], x32[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([lo * c - hi * s, hi * c + lo * s], axis=-1).astype(x.dtype)

"""Helpers shared by the Pallas Triton kernels (decode ``paged_attention_pallas``, prefill
``prefill_attention``): Triton block shapes are powers of two, and both kernels read the
stacked per-layer pool in place."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def kernel_rope_supported(head_dim: int) -> bool:
    """The decode kernel rotates (rotate-half RoPE) power-of-two head_dims in registers."""
    return head_dim >= 32 and is_pow2(head_dim)


def cdiv(a, b: int):
    """ceil(a / b) of a traced a >= 0 (truncating division is floor division there)."""
    return jax.lax.div(a + (b - 1), b)


def head_dim_chunks(head_dim: int) -> tuple[tuple[int, int], ...]:
    """(offset, width) power-of-two pieces of head_dim, widest first: 96 -> (0, 64), (64, 32)."""
    chunks, off = [], 0
    for bit in reversed(range(head_dim.bit_length())):
        width = 1 << bit
        if head_dim & width:
            chunks.append((off, width))
            off += width
    return tuple(chunks)


def stacked_pool(k_pages, v_pages, layer):
    """Both kernels read the stacked [L, Hkv, P, S, Dh] pool at a layer index ([1] int32, may
    be traced); a single layer's [Hkv, P, S, Dh] pool becomes L = 1, layer 0."""
    if k_pages.ndim == 4:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    return k_pages, v_pages, jnp.asarray(layer, jnp.int32).reshape(1)

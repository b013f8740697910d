"""Projections at decode batch sizes: the one public entry point, validated, dispatching by impl.

    skinny_matmul(x [M, K], w [K, N] or [L, K, N], layer=None) -> [M, N] in x's dtype

Semantics: x @ w[layer] with float32 accumulation (`skinny_matmul_ref`). impl:
  "xla"    the reference, XLA's own dot (any backend, any shape);
  "pallas" the weight-streaming Pallas Triton kernel (`kernels.pallas_skinny`);
           interpret=True runs it on CPU.
There is no "auto": on an H200 at Ouro-1.4B shapes the kernel beat XLA over a whole loop
pass only at M = 1 (by 10%; up to 2x on single projections at M = 1 and 8) and lost at the
engine's decode buckets
(M >= 8: a pass took 3.9 ms against XLA's 2.6 ms at M = 8; docs/performance.md), so XLA
is the default and the kernel is opt-in until it is tuned.
Kernel-supported: M <= MAX_ROWS, K and N multiples of 16 (blocks are the largest powers
of two up to the requested block_k / block_n that divide them), bfloat16 / float16 /
float32 weights. A Mosaic GPU or jax-triton port replaces the
"pallas" branch and nothing else.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.pallas_skinny import DEFAULT_BLOCK_K, DEFAULT_BLOCK_N, skinny_matmul_pallas

MAX_ROWS = 64           # beyond this XLA's tiled GEMMs fill the GPU by themselves
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
IMPLS = ("xla", "pallas")


def skinny_matmul_ref(x: jax.Array, w: jax.Array, layer=None) -> jax.Array:
    """x [M, K] @ w[layer] [K, N] -> [M, N] in x's dtype, float32 accumulation."""
    if w.ndim == 3:
        w = jax.lax.dynamic_index_in_dim(w, jnp.asarray(layer, jnp.int32).reshape(()), keepdims=False)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def fit_block(dim: int, preferred: int) -> int | None:
    """The largest power of two <= preferred (and >= 16) that divides dim."""
    b = 1 << (max(preferred, 1).bit_length() - 1)
    while b >= 16:
        if dim % b == 0:
            return b
        b //= 2
    return None


def kernel_unsupported(x, w, block_n: int = DEFAULT_BLOCK_N, block_k: int = DEFAULT_BLOCK_K) -> str | None:
    """Why the kernel cannot take these shapes/dtypes (None when it can)."""
    (m, k), n = x.shape, w.shape[-1]
    if m > MAX_ROWS:
        return f"x has {m} rows; the kernel is for at most {MAX_ROWS}"
    for dim, size, block, flag in (("K", k, block_k, "block_k"), ("N", n, block_n, "block_n")):
        if block < 16:
            return f"{flag}={block}: blocks must be at least 16 (tensor-core tiles)"
        if fit_block(size, block) is None:
            return f"{dim}={size} must be a multiple of 16 for the kernel"
    if x.dtype != w.dtype:
        return f"x is {x.dtype} but w is {w.dtype}; the kernel multiplies in one dtype"
    if w.dtype not in KERNEL_DTYPES:
        return f"kernel dtypes are bfloat16/float16/float32, got {w.dtype}"
    return None


def skinny_matmul(x: jax.Array, w: jax.Array, layer=None, *, impl: str = "xla", interpret: bool = False,
                  block_n: int = DEFAULT_BLOCK_N, block_k: int = DEFAULT_BLOCK_K,
                  k_splits: int | None = None) -> jax.Array:
    """x [M, K] @ w [K, N] (or w[layer] of a stacked [L, K, N]; layer an int32 scalar, may be
    traced) -> [M, N] in x's dtype."""
    if impl not in IMPLS:
        raise ValueError(f"skinny_matmul: impl: choose one of {IMPLS}, got {impl!r}")
    if x.ndim != 2 or w.ndim not in (2, 3):
        raise ValueError(f"skinny_matmul: x must be [M, K] and w [K, N] or [L, K, N]; got {x.shape}, {w.shape}")
    if x.shape[1] != w.shape[-2]:
        raise ValueError(f"skinny_matmul: x has K={x.shape[1]} but w has K={w.shape[-2]}")
    if (w.ndim == 3) != (layer is not None):
        raise ValueError("skinny_matmul: a stacked [L, K, N] weight needs layer=, a [K, N] one must not get it")
    why_not = kernel_unsupported(x, w, block_n, block_k)
    if impl == "pallas" and why_not:
        raise ValueError(f"skinny_matmul: {why_not}")
    if impl == "xla":
        return skinny_matmul_ref(x, w, layer)
    if w.ndim == 2:
        w, layer = w[None], 0
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    block_n, block_k = fit_block(w.shape[-1], block_n), fit_block(w.shape[-2], block_k)
    if k_splits is not None and (w.shape[-2] // block_k) % k_splits:
        raise ValueError(f"skinny_matmul: k_splits={k_splits} must divide K / block_k = {w.shape[-2] // block_k}")
    return skinny_matmul_pallas(x, w, layer, block_n=block_n, block_k=block_k, k_splits=k_splits,
                                interpret=interpret)

"""What both decode-projection kernels (Triton: ``skinny_matmul_pallas``, Mosaic GPU:
``skinny_matmul_mosaic``) and their dispatcher (``skinny_matmul``) share: the row, K and K-split
limits, the split sums' hand-over and the SwiGLU activation's rounding."""
from __future__ import annotations

import jax
import jax.numpy as jnp

MAX_ROWS = 64               # beyond this XLA's tiled GEMMs fill the GPU by themselves
SINGLE_PASS_MAX_K = 2048    # one program streams all of K up to this (measured); longer K is split
MAX_PARTIAL_SUMS = 8        # K splits a product hands on at most: a partial_sums consumer holds every
                            # one in registers (Triton and Mosaic); Mosaic's whole products are capped
                            # too (XLA reads every split to add them), Triton's follow its kernel_config


def fewer_splits(steps: int, splits: int, most: int = MAX_PARTIAL_SUMS) -> int:
    """``splits`` if <= most, else the largest divisor of ``steps`` (K / block_k) that is."""
    return splits if splits <= most else max(s for s in range(1, most + 1) if steps % s == 0)


def split_sums_out(out: jax.Array, splits: int, partial_sums: bool, dtype) -> jax.Array:
    """A kernel's [S, M, N] K-split sums (or [M, N] when S = 1) as the caller asked for them:
    [S, M, N] partial sums, or the product: S > 1 summed in float32 and rounded to ``dtype``,
    S = 1 as the kernel wrote it."""
    if partial_sums:
        return out if splits > 1 else out[None]
    return out.sum(axis=0).astype(dtype) if splits > 1 else out


def silu_mul(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up in their dtype: computed in float32 and rounded once, on every backend
    and whatever XLA fuses (left to XLA, bf16 rounded after each op on a CPU and not inside a
    GPU fusion). The gate | up kernel rounds the same. In bfloat16 the upstream PyTorch code
    rounds twice (SiLU, then the product): at most one step apart."""
    g32 = gate.astype(jnp.float32)
    return (g32 / (1.0 + jnp.exp(-g32)) * up.astype(jnp.float32)).astype(gate.dtype)

"""What both decode-projection kernels (Triton: ``skinny_matmul_pallas``, Mosaic GPU:
``skinny_matmul_mosaic``) and their dispatcher (``skinny_matmul``) share: the row and K limits
and the SwiGLU activation's rounding."""
from __future__ import annotations

import jax
import jax.numpy as jnp

MAX_ROWS = 64               # beyond this XLA's tiled GEMMs fill the GPU by themselves
SINGLE_PASS_MAX_K = 2048    # one program streams all of K up to this (measured); longer K is split


def silu_mul(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up in their dtype: computed in float32 and rounded once, on every backend
    and whatever XLA fuses (left to XLA, bf16 rounded after each op on a CPU and not inside a
    GPU fusion). The gate | up kernel rounds the same. In bfloat16 the upstream PyTorch code
    rounds twice (SiLU, then the product): at most one step apart."""
    g32 = gate.astype(jnp.float32)
    return (g32 / (1.0 + jnp.exp(-g32)) * up.astype(jnp.float32)).astype(gate.dtype)

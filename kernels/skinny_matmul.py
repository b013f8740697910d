"""Projections at decode batch sizes: the one public entry point, validated, dispatching by impl.

    skinny_matmul(x [M, K], w [K, N] or [L, K, N], layer=None) -> [M, N] in x's dtype
    skinny_matmul(..., partial_sums=True) -> [S, M, N]: S K-splits' sums, for a consumer
        that adds them up itself (``kernels.residual_norm``), so no reduction kernel runs
    skinny_matmul(..., skip=flag) -> zeros where the traced bool flag is true: the kernel
        then does not read the weight (a head whose logits no row keeps)
    gated_up(x [M, K], w_gate, w_up [K, F] or [L, K, F], layer=None) -> silu(x @ w_gate) * (x @ w_up)

Semantics: x @ w[layer] with float32 accumulation (`skinny_matmul_ref`). impl:
  "xla"    the reference, XLA's own dot (any backend, any shape);
  "pallas" the weight-streaming Pallas Triton kernel (`kernels.skinny_matmul_pallas`);
           interpret=True runs it on CPU.
`kernel_config` picks the kernel's blocks and K splits from the shape. Measured on an
H200 at 1-8 rows (scripts/bench_skinny.py): for K <= 2048 one pass over K
(no split, narrow column tiles, the output rounded in the kernel) took 8.7 us at
Ouro-1.4B's q|k|v (2048 x 6144) and 5.3 us at o (2048 x 2048), against XLA's split-K
GEMM plus its reduction, 9.8 and 5.8 us, so the engine's "auto" puts the attention
projections here (``PagedKVBackend.kernel_shapes``), the gate / up pair through
``gated_up``'s kernel, which also applies the activation, and every decode projection of Ouro
up to 64 rows (wider tiles from 32 rows:
q|k|v 9.9 / 10.2 us against XLA's 10.9 / 12.7 at 32 / 64 rows), o and down as split-K partial
sums that the residual-norm kernel adds (with the norm at 8 rows: o 6.8 against 7.6 us in one
pass, down 10.3 against 11.2 for XLA's GEMM, reduction and norm). A decode head of up to 8
rows runs here too, skipped (``skip``) on a window's passes where no
row exits (``PagedKVBackend.head_matmul``).
backend (for impl "pallas"): "triton" (the kernels above) or "mosaic": the Mosaic GPU
kernels (``kernels.skinny_matmul_mosaic``, Hopper) for the operands and products they take,
the Triton ones for the rest. On an H200 at Ouro-1.4B's shapes (scripts/bench_skinny.py) the
Mosaic kernel streamed q|k|v in 7.96 us against 8.86, gate 7.47 against 8.43 and down 8.34
against 9.10 at 8 rows, and was ahead at every row count up to 64; yet the engine on it was
2-4% slower at 1-32 streams on an H100 (scripts/bench_serving.py --kernel-backend mosaic), so
Triton stays the engine's default (``ExecutionConfig.kernel_backend``).
Kernel-supported: M <= MAX_ROWS, K and N multiples of 16 (blocks are the largest powers
of two up to the configured ones that divide them), bfloat16 / float16 / float32
weights in x's dtype; ``gated_up``'s kernel also K <= SINGLE_PASS_MAX_K (above it, impl
"pallas" runs the two products on the split kernel and the activation in XLA). A Mosaic
GPU or jax-triton port replaces the "pallas" branches and nothing else.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rltjax.kernels import BACKENDS
from rltjax.kernels.skinny_matmul_pallas import choose_splits, gated_up_pallas, skinny_matmul_pallas
from rltjax.kernels.skinny_matmul_mosaic import (gated_mosaic_config, gated_mosaic_unsupported, gated_up_mosaic,
                                                 mosaic_config, mosaic_unsupported, skinny_matmul_mosaic)
from rltjax.kernels.skinny_common import (MAX_PARTIAL_SUMS, MAX_ROWS, SINGLE_PASS_MAX_K, fewer_splits, silu_mul,
                                          split_sums_out)
from rltjax.kernels.triton_common import next_pow2

KERNEL_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
IMPLS = ("xla", "pallas")


def skinny_matmul_ref(x: jax.Array, w: jax.Array, layer=None) -> jax.Array:
    """x [M, K] @ w[layer] [K, N] -> [M, N] in x's dtype, float32 accumulation."""
    if w.ndim == 3:
        w = jax.lax.dynamic_index_in_dim(w, jnp.asarray(layer, jnp.int32).reshape(()), keepdims=False)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def gated_up_ref(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, layer=None) -> jax.Array:
    """silu(x @ w_gate[layer]) * (x @ w_up[layer]) [M, F] in x's dtype: a SwiGLU MLP's
    activation, each product rounded to x's dtype first (as two projections are)."""
    # Two dots that share x: XLA:GPU's dot merger would make them one by concatenating the two
    # weights on every call (92 MB of copy traffic and an f32 [M, 2F] product a layer at Ouro-1.4B's
    # prefill of 1,024 rows on an H200: scripts/bench_prefill.py); the barrier gives up its own x.
    x_up = jax.lax.optimization_barrier(x)
    return silu_mul(skinny_matmul_ref(x, w_gate, layer), skinny_matmul_ref(x_up, w_up, layer))


def check_operands(name: str, x, w, layer) -> None:
    """x [M, K] against a weight [K, N] (layer None) or a stacked [L, K, N] (layer given)."""
    if x.ndim != 2 or w.ndim not in (2, 3):
        raise ValueError(f"{name}: x must be [M, K] and w [K, N] or [L, K, N]; got {x.shape}, {w.shape}")
    if x.shape[1] != w.shape[-2]:
        raise ValueError(f"{name}: x has K={x.shape[1]} but w has K={w.shape[-2]}")
    if (w.ndim == 3) != (layer is not None):
        raise ValueError(f"{name}: a stacked [L, K, N] weight needs layer=, a [K, N] one must not get it")


def fit_block(dim: int, preferred: int) -> int | None:
    """The largest power of two <= preferred (and >= 16) that divides dim."""
    b = 1 << (max(preferred, 1).bit_length() - 1)
    while b >= 16:
        if dim % b == 0:
            return b
        b //= 2
    return None


def kernel_unsupported(x, w, block_n: int = 16, block_k: int = 16) -> str | None:
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


# the pipelines' buffers: under an H100 / H200's 227 KB a block with room (the configs were
# measured there; a GPU with less shared memory a block needs a smaller budget)
SMEM_BYTES = 160 * 1024


def fitting_stages(stage_bytes: int, most: int) -> int:
    """Pipeline stages whose buffers fit SMEM_BYTES: Triton keeps stages - 1 of them in
    flight (2..most)."""
    return max(2, min(most, 1 + SMEM_BYTES // stage_bytes))


# vocabulary-wide products (a head): from this many columns wider tiles stream faster
WIDE_N = 16384


def base_config(m: int, k: int, n: int, partial_sums: bool) -> tuple[int, int, int, int, int | None]:
    """``kernel_config``'s choice before overrides: (block_n, block_k, warps, most stages, K splits;
    None: ``choose_splits``)."""
    if n >= WIDE_N and k <= SINGLE_PASS_MAX_K and m <= 16 and not partial_sums:
        return 64, 128, 4, 3, 1
    if k > SINGLE_PASS_MAX_K:      # 32 x 128 blocks: choose_splits gives 4 splits at Ouro's down
        return 32, 128, 2, 4, None
    if partial_sums and (k // (fit_block(k, 256) or 16)) % 2 == 0:
        return 32, 256, 4, 4, 2
    if m <= 16:                    # narrow tiles: enough programs without splitting K
        return (16, 256, 2, 5, 1) if n <= 2048 else (32, 128, 2, 5, 1)
    return (32 if n <= 2048 else 64), 256, 4, 4, 1


def kernel_config(m: int, k: int, n: int, block_n: int | None = None, block_k: int | None = None,
                  k_splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                  partial_sums: bool = False, itemsize: int = 2) -> dict:
    """The kernel's blocks, K splits, warps and pipeline stages for an [m, k] @ [k, n] product
    (m: the padded, power-of-two row count); explicit arguments override. Measured on an
    H200 (`scripts/bench_skinny.py`, `scripts/bench_mlp.py --sweep`):
    - K <= SINGLE_PASS_MAX_K, up to 16 rows: one pass over K in narrow tiles (16 or 32 x 256 / 128);
      from 32 rows 64- (N > 2048) or 32-column tiles x 256, four warps.
    - partial_sums (the consumer adds split-K partial sums: ``kernels.residual_norm``) with
      K <= SINGLE_PASS_MAX_K in an even number of 256-wide steps: two K splits in 32 x 256
      tiles, four warps (Ouro's o projection into the norm: 6.5-6.8 us against 7.5 in one pass
      at 1-8 rows).
    - longer K: split across programs in 32 x 128 blocks, two warps (4 splits of Ouro's down
      into the norm: 10.1 / 10.3 / 11.4 us at 1 / 8 / 32 rows, 11.3 / 12.5 with 4 warps and 3
      stages at 8 / 32 rows).
    - N >= WIDE_N (a head) with K <= SINGLE_PASS_MAX_K, up to 16 rows, whole products (not
      partial_sums): 64 x 128 tiles, four warps, 3 stages (measured at Ouro's 2048 x 49152 lm_head
      only: 48.9 / 48.4 us at 1 / 8 rows against 56.8 / 61.1 in the narrow tiles and XLA's
      48.7 / 47.6; from 32 rows XLA's GEMM is faster).
    Stages: as many as fit SMEM_BYTES, up to 5 for one pass at <= 16 rows and 4 otherwise: bf16
    tiles get 3-4 at 32-64 rows (64 x 256 tiles at 64 rows and 4 stages overflowed an H200's
    shared memory), float32 2-3."""
    bn, bk, warps, most, splits = base_config(m, k, n, partial_sums)
    bn, bk = fit_block(n, block_n or bn), fit_block(k, block_k or bk)
    if k_splits is None:           # a block_k override may leave an odd step count: one split
        k_splits = choose_splits(k, n, bn, bk) if splits is None else splits if (k // bk) % splits == 0 else 1
    stages = num_stages or fitting_stages((max(m, 16) * bk + bk * bn) * itemsize, most)
    return dict(block_n=bn, block_k=bk, k_splits=k_splits, num_warps=num_warps or warps, num_stages=stages)


def skinny_matmul(x: jax.Array, w: jax.Array, layer=None, *, impl: str = "xla", interpret: bool = False,
                  block_n: int | None = None, block_k: int | None = None, k_splits: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None,
                  partial_sums: bool = False, skip: jax.Array | None = None, widen: bool = False,
                  backend: str = "triton") -> jax.Array:
    """x [M, K] @ w [K, N] (or w[layer] of a stacked [L, K, N]; layer an int32 scalar, may be
    traced) -> [M, N] in x's dtype. The keyword sizes override `kernel_config` (tuning).
    partial_sums: -> [S, M, N], whose sum over S in float32, rounded to x's dtype, is the
    product: the kernel's S K-splits' float32 sums unreduced (S = 1: the product itself).
    skip: a bool scalar (may be traced): true gives zeros, and the kernel reads no weight.
    widen: the product (rounded to x's dtype) comes as float32, written so by the kernel."""
    if impl not in IMPLS:
        raise ValueError(f"skinny_matmul: impl: choose one of {IMPLS}, got {impl!r}")
    if backend not in BACKENDS:
        raise ValueError(f"skinny_matmul: backend: choose one of {BACKENDS}, got {backend!r}")
    check_operands("skinny_matmul", x, w, layer)
    if skip is not None:
        skip = jnp.asarray(skip)
        if skip.shape != () or skip.dtype != jnp.bool_:
            raise ValueError(f"skinny_matmul: skip: expected a bool scalar, got {skip.dtype} {skip.shape}")
        if partial_sums:
            raise ValueError("skinny_matmul: skip is for whole products; partial_sums hands on split-K sums")
    if widen and partial_sums:
        raise ValueError("skinny_matmul: widen is for whole products; partial_sums are float32 already")
    out_dtype = jnp.float32 if widen else x.dtype
    why_not = kernel_unsupported(x, w, block_n or 16, block_k or 16)
    if impl == "pallas" and why_not:
        raise ValueError(f"skinny_matmul: {why_not}")
    if k_splits is not None and k_splits < 1:
        raise ValueError(f"skinny_matmul: k_splits={k_splits} must be >= 1")
    if impl == "xla":
        out = skinny_matmul_ref(x, w, layer)
        if skip is not None:
            out = jnp.where(skip, jnp.zeros_like(out), out)
        return out[None] if partial_sums else out.astype(out_dtype)
    (m, k), n = x.shape, w.shape[-1]
    if m == 0:
        return jnp.zeros((1, 0, n), x.dtype) if partial_sums else jnp.zeros((0, n), out_dtype)
    tuned = any(v is not None for v in (block_n, block_k, k_splits, num_warps, num_stages))
    if backend == "mosaic" and not tuned and (out := mosaic_product(x, w, layer, skip, partial_sums, widen,
                                                                     interpret)) is not None:
        return out
    # the kernel's tiles take power-of-two rows (the engine's buckets are); others are padded here
    rows = next_pow2(m)
    config = kernel_config(rows, k, n, block_n=block_n, block_k=block_k, k_splits=k_splits, num_warps=num_warps,
                           num_stages=num_stages, partial_sums=partial_sums, itemsize=jnp.dtype(x.dtype).itemsize)
    if partial_sums and k_splits is None:
        config["k_splits"] = fewer_splits(k // config["block_k"], config["k_splits"])
    if partial_sums and config["k_splits"] > MAX_PARTIAL_SUMS:
        raise ValueError(f"skinny_matmul: partial_sums takes at most {MAX_PARTIAL_SUMS} K splits (the consumer "
                         f"holds every partial sum in registers), got k_splits={k_splits}")
    if (k // config["block_k"]) % config["k_splits"]:
        raise ValueError(f"skinny_matmul: k_splits={k_splits} must divide K / block_k = {k} / {config['block_k']} "
                         f"= {k // config['block_k']} (block_k is the largest power of two <= the one asked "
                         f"that divides K)")
    xp = jnp.pad(x, ((0, rows - m), (0, 0))) if rows != m else x
    if w.ndim == 2:
        w, layer = w[None], 0
    flag = None if skip is None else skip.astype(jnp.int32).reshape(1)
    out = skinny_matmul_pallas(xp, w, jnp.asarray(layer, jnp.int32).reshape(1), flag, interpret=interpret,
                               widen=widen and config["k_splits"] == 1, **config)
    out = split_sums_out(out, config["k_splits"], partial_sums, x.dtype)
    out = out if partial_sums else out.astype(out_dtype)
    return out if rows == m else out[..., :m, :]


def mosaic_product(x, w, layer, skip, partial_sums: bool, widen: bool, interpret: bool):
    """``skinny_matmul``'s kernel branch on the Mosaic GPU kernel at ``mosaic_config`` (any 1-64
    rows: no padding), or None where it does not take the operands or the output form (the
    Triton kernel runs, as it does for calls that name tiles: those are the Triton kernel's)."""
    (m, k), n = x.shape, w.shape[-1]
    config = mosaic_config(m, k, n, partial_sums=partial_sums)
    if (widen and config["k_splits"] > 1) or mosaic_unsupported(x, w, **config):
        return None
    flag = None if skip is None else skip.astype(jnp.int32)
    out = skinny_matmul_mosaic(x, w, layer, flag, widen=widen, interpret=interpret, **config)
    return split_sums_out(out, config["k_splits"], partial_sums, x.dtype)


def gated_config(m: int, k: int, f: int, block_n: int | None = None, block_k: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None, itemsize: int = 2) -> dict:
    """``gated_up``'s blocks, warps and stages: one pass over K in 64 x 128 tiles of each weight,
    four warps, 4 stages (the best of sweeps on an H200 at Ouro's 2048 x 5632 pair,
    `scripts/bench_mlp.py --sweep`: two warps took 14.85 us at 8 rows against 13.57 with four).
    Fewer stages where the buffers would pass SMEM_BYTES, each stage an x tile and two weight
    tiles (bf16 64 x 256 tiles at 32 rows and 4 stages asked for 240 KB of the 232 KB): float32
    gets 3 up to 32 rows and 2 at 64. (bf16 at 64 rows: 15.2 us at 4 stages, 26.3 at 2.)"""
    bn, bk = fit_block(f, block_n or 64), fit_block(k, block_k or 128)
    stages = num_stages or fitting_stages((max(m, 16) * bk + 2 * bk * bn) * itemsize, 4)
    return dict(block_n=bn, block_k=bk, num_warps=num_warps or 4, num_stages=stages)


def gated_up(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, layer=None, *, impl: str = "xla",
             interpret: bool = False, backend: str = "triton", **config) -> jax.Array:
    """silu(x @ w_gate) * (x @ w_up): x [M, K], weights [K, F] (or stacked [L, K, F] with layer)
    -> [M, F] in x's dtype. impl "pallas": both products in one kernel, which also applies the
    activation (K up to SINGLE_PASS_MAX_K: one pass); config overrides ``gated_config``.
    backend "mosaic": the Mosaic GPU pair kernel where it takes the operands (config unused)."""
    if impl not in IMPLS:
        raise ValueError(f"gated_up: impl: choose one of {IMPLS}, got {impl!r}")
    if backend not in BACKENDS:
        raise ValueError(f"gated_up: backend: choose one of {BACKENDS}, got {backend!r}")
    if w_gate.shape != w_up.shape or w_gate.dtype != w_up.dtype:
        raise ValueError(f"gated_up: w_gate and w_up must share a shape and dtype, got "
                         f"{w_gate.dtype} {w_gate.shape} and {w_up.dtype} {w_up.shape}")
    check_operands("gated_up", x, w_gate, layer)
    if impl == "xla":
        return gated_up_ref(x, w_gate, w_up, layer)
    if x.shape[1] > SINGLE_PASS_MAX_K and not kernel_unsupported(x, w_gate):
        # the pair's kernel makes one pass over K: longer K on the split kernel, activation in XLA
        mm = lambda w: skinny_matmul(x, w, layer, impl="pallas", interpret=interpret, backend=backend)  # noqa: E731
        return silu_mul(mm(w_gate), mm(w_up))
    if why_not := gated_unsupported(x, w_gate):
        raise ValueError(f"gated_up: {why_not}")
    (m, k), f = x.shape, w_gate.shape[-1]
    if m == 0:
        return jnp.zeros((0, f), x.dtype)
    mosaic = gated_mosaic_config(m, k, f) if backend == "mosaic" and not config else None
    if mosaic and not gated_mosaic_unsupported(x, w_gate, **mosaic):
        return gated_up_mosaic(x, w_gate, w_up, layer, interpret=interpret, **mosaic)
    rows = next_pow2(m)
    xp = jnp.pad(x, ((0, rows - m), (0, 0))) if rows != m else x
    if w_gate.ndim == 2:
        w_gate, w_up, layer = w_gate[None], w_up[None], 0
    out = gated_up_pallas(xp, w_gate, w_up, jnp.asarray(layer, jnp.int32).reshape(1), interpret=interpret,
                          **gated_config(rows, k, f, **config, itemsize=jnp.dtype(x.dtype).itemsize))
    return out[:m]


def gated_unsupported(x, w_gate) -> str | None:
    """Why ``gated_up``'s kernel cannot take these shapes / dtypes (None when it can; impl
    "pallas" still runs K > SINGLE_PASS_MAX_K, on the split kernel)."""
    if x.shape[1] > SINGLE_PASS_MAX_K:
        return f"K={x.shape[1]}: the kernel makes one pass over K, up to {SINGLE_PASS_MAX_K}"
    return kernel_unsupported(x, w_gate)

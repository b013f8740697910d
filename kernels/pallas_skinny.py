"""Weight-streaming matmul for few rows (decode projections): a Pallas Triton kernel.

    x [M, K] @ w[layer] [K, N] -> partial sums [S, Mp, N] float32 (S = k_splits)

Decode runs every projection at M = 1..64 rows, where the cost is reading the
weight once. XLA's GEMMs at these shapes launch few programs (N / tile of them)
and read weights at ~30-40% of bandwidth on an H200 (docs/performance.md). Here
the grid is (N / block_n, S): each program owns one column tile over 1/S of K
(S is raised towards MIN_PROGRAMS programs, at most K / block_k: 128 programs for
a 2048 x 2048 weight at the default blocks, 352 for 2048 x 5632), and each
streams its [K/S, block_n] slab in block_k steps with a float32 accumulator. The
S partial sums are added by XLA (tiny: S x Mp x N float32).

The weight goes in stacked ([L, K, N]) with a layer index, like the paged pool of
the attention kernels: a per-layer slice handed to a custom call would make XLA
copy the layer's weight first. Rows are padded to Mp >= 16 (the tensor-core tile).
Triton constraints: block_n, block_k and Mp are powers of two; K % block_k == 0,
N % block_n == 0 (validated by `kernels.skinny_matmul`). float32 dots run at IEEE
precision (Triton's default would be TF32).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

DEFAULT_BLOCK_N = 128
DEFAULT_BLOCK_K = 256
MIN_PROGRAMS = 264      # two per H200 multiprocessor: the split count is raised to reach this


def padded_rows(m: int) -> int:
    return max(16, 1 << (m - 1).bit_length())


def choose_splits(k: int, n: int, block_n: int, block_k: int, min_programs: int = MIN_PROGRAMS) -> int:
    """The smallest divisor S of K / block_k with (N / block_n) * S >= min_programs, or
    K / block_k (one block_k step per program) when no divisor gets there."""
    steps = k // block_k
    tiles = n // block_n
    for s in range(1, steps + 1):
        if steps % s == 0 and tiles * s >= min_programs:
            return s
    return steps


def _kernel(layer_ref, x_ref, w_ref, o_ref, *, block_n: int, block_k: int, steps: int):
    j = pl.program_id(0)
    split = pl.program_id(1)
    layer = layer_ref[0]
    cols = pl.ds(j * block_n, block_n)
    rows = x_ref.shape[0]
    precision = jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

    def body(i, acc):
        k0 = (split * steps + i) * block_k
        xs = x_ref[:, pl.ds(k0, block_k)]                              # [Mp, bk]
        ws = w_ref[layer, pl.ds(k0, block_k), cols]                    # [bk, bn]
        return acc + plgpu.dot(xs, ws, precision=precision)            # [Mp, bn] f32

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((rows, block_n), jnp.float32))
    o_ref[split, :, cols] = acc


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "k_splits", "num_warps", "num_stages",
                                             "interpret"))
def skinny_matmul_pallas(x, w, layer, *, block_n: int = DEFAULT_BLOCK_N, block_k: int = DEFAULT_BLOCK_K,
                         k_splits: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                         interpret: bool = False):
    """The kernel; callers go through `kernels.skinny_matmul.skinny_matmul`.
    x [M, K], w [L, K, N], layer [1] int32 -> [M, N] in x's dtype."""
    m, k = x.shape
    _, _, n = w.shape
    if k_splits is None:
        k_splits = choose_splits(k, n, block_n, block_k)
    steps = k // block_k // k_splits
    rows = padded_rows(m)
    if num_stages is None:   # H200: three stages of a 64-row tile overflowed shared memory
        num_stages = 2 if rows >= 64 else 3   # (64 x 49152 lm_head, 8 K steps); <= 32 rows ran at 3
    xp = jnp.pad(x, ((0, rows - m), (0, 0))).astype(w.dtype)
    whole = lambda shape: pl.BlockSpec(shape, lambda j, s: (0,) * len(shape))
    partial = pl.pallas_call(
        functools.partial(_kernel, block_n=block_n, block_k=block_k, steps=steps),
        grid=(n // block_n, k_splits),
        in_specs=[whole((1,)), whole(xp.shape), whole(w.shape)],
        out_specs=whole((k_splits, rows, n)),
        out_shape=jax.ShapeDtypeStruct((k_splits, rows, n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"rlt_skinny_matmul_bn{block_n}_bk{block_k}_s{k_splits}",
    )(layer, xp, w)
    return partial.sum(axis=0)[:m].astype(x.dtype)

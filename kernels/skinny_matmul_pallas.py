"""Weight-streaming matmul for few rows (decode projections): a Pallas Triton kernel.

    x [M, K] @ w[layer] [K, N] -> [M, N] in x's dtype (k_splits = 1)
                               -> partial sums [S, M, N] float32 (k_splits = S > 1)

At decode batch sizes (the engine's buckets up to 64 rows)
a projection's cost is reading the weight once. The grid is (N / block_n, S): each program owns one column tile over 1/S of K
and streams its [K/S, block_n] slab in block_k steps into a float32 accumulator.
With S = 1 the program writes its tile rounded to x's dtype: no reduction kernel and
no conversion kernel run after it, which is what makes it beat XLA's split-K GEMMs
(a GEMM, then a reduction) at Ouro's q|k|v shape on an H200 (narrow tiles give the grid
enough programs: 6144 / 32 = 192). S > 1 hands the partial sums on for the caller to add:
for long K, where one program per column tile would stream too much alone, and for a
consumer that adds them as it reads them (the residual-norm kernel; Ouro's o and down).

Tensor-core dots need >= 16 rows. Fewer rows (M a power of two) are replicated in
registers to 16 and the copies' identical results collapsed again (max over copies:
exact), so no padded copy of x is made in XLA and only M rows are written.

Weights go in stacked ([L, K, N]) with a layer index, like the paged pool of the
attention kernels: a per-layer slice handed to a custom call would make XLA copy the
layer's weight first. Blocks: block_n, block_k powers of two dividing N and K
(validated by `kernels.skinny_matmul`). float32 dots run at IEEE precision (Triton's
default would be TF32).

A skip flag (a device scalar) lets the caller drop a product it will discard without a
host round trip: the engine's fixed-trip decode windows compute a head every pass (no
branch for XLA to read on the host), and on a pass where no row exits the head's kernel
writes zeros instead of streaming the lm_head.

``gated_up_pallas`` is the same stream over two weights of one shape at once, the gate and
up projections of a SwiGLU MLP: each program owns one column tile of both and writes
silu(gate) * up for it, so the activation needs no kernel of its own (on an H200 it was
1.6 us a layer at 8 rows, its own launch and a round trip of both products).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_PROGRAMS = 256      # choose_splits: split K until the grid has this many programs
DOT_ROWS = 16


def choose_splits(k: int, n: int, block_n: int, block_k: int, min_programs: int = MIN_PROGRAMS) -> int:
    """The smallest divisor S of K / block_k with (N / block_n) * S >= min_programs, or
    K / block_k (one block_k step per program) when no divisor gets there."""
    steps = k // block_k
    tiles = n // block_n
    for s in range(1, steps + 1):
        if steps % s == 0 and tiles * s >= min_programs:
            return s
    return steps


def _to_dot_rows(x):
    """[M, bk] -> [max(M, 16), bk]: rows replicated up to the tensor-core tile."""
    m = x.shape[0]
    if m >= DOT_ROWS:
        return x
    return jnp.broadcast_to(x[None], (DOT_ROWS // m, m, x.shape[1])).reshape(DOT_ROWS, x.shape[1])


def _from_dot_rows(acc, m: int):
    """[max(M, 16), bn] -> [M, bn]: the replicas' results are identical; max returns one."""
    if m >= DOT_ROWS:
        return acc
    return jnp.max(acc.reshape(DOT_ROWS // m, m, acc.shape[1]), axis=0)


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _kernel(layer_ref, x_ref, w_ref, *refs, block_n: int, block_k: int, steps: int, skippable: bool):
    j, split = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    cols = pl.ds(j * block_n, block_n)
    m = x_ref.shape[0]
    skip_ref, o_ref = refs if skippable else (None, refs[0])

    def store(acc):                # acc [M, bn] float32
        if len(o_ref.shape) == 2:      # one split: the whole sum, rounded once to x's dtype
            o_ref[:, cols] = acc.astype(x_ref.dtype).astype(o_ref.dtype)
        else:
            o_ref[split, :, cols] = acc

    def product():
        def body(i, acc):
            k0 = (split * steps + i) * block_k
            xs = _to_dot_rows(x_ref[:, pl.ds(k0, block_k)])                    # [16, bk]
            ws = w_ref[layer, pl.ds(k0, block_k), cols]                        # [bk, bn]
            return acc + plgpu.dot(xs, ws, precision=_precision(x_ref.dtype))  # [16, bn] f32

        store(_from_dot_rows(jax.lax.fori_loop(0, steps, body, jnp.zeros((max(m, DOT_ROWS), block_n),
                                                                          jnp.float32)), m))

    if not skippable:
        product()
        return
    # skip != 0: the caller discards the product (a head on a pass where no row exits), so
    # the weight is not read; zeros are written, so the output is defined either way
    skip = skip_ref[0]
    pl.when(skip == 0)(product)
    pl.when(skip != 0)(lambda: store(jnp.zeros((m, block_n), jnp.float32)))


def _gated_kernel(layer_ref, x_ref, wg_ref, wu_ref, o_ref, *, block_n: int, block_k: int, steps: int):
    j = pl.program_id(0)
    layer = layer_ref[0]
    cols = pl.ds(j * block_n, block_n)
    m, dtype = x_ref.shape[0], x_ref.dtype
    rows = max(m, DOT_ROWS)
    # Fewer than 16 rows are read as 16 with the rest masked to zero, not replicated as in
    # ``_kernel``: on an H200 replication cost this kernel 0.6-1.0 us a layer at 1-8 rows (the
    # single-product kernel lost 0.4-0.9 us with masking instead; scripts/bench_mlp.py).
    live = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < m                 # [16, 1]

    def body(i, accs):
        k0 = i * block_k
        if m < DOT_ROWS:
            xs = plgpu.load(x_ref.at[pl.ds(0, rows), pl.ds(k0, block_k)], mask=live, other=0)   # [16, bk]
        else:
            xs = x_ref[:, pl.ds(k0, block_k)]
        gate = plgpu.dot(xs, wg_ref[layer, pl.ds(k0, block_k), cols], precision=_precision(dtype))
        up = plgpu.dot(xs, wu_ref[layer, pl.ds(k0, block_k), cols], precision=_precision(dtype))
        return accs[0] + gate, accs[1] + up                               # [16, bn] f32 each

    zeros = jnp.zeros((rows, block_n), jnp.float32)
    gate, up = jax.lax.fori_loop(0, steps, body, (zeros, zeros))
    # ``kernels.skinny_matmul.silu_mul``'s rounding: each product rounded to x's dtype as the
    # two projections' outputs are, then silu(gate) * up in float32, rounded once
    gate, up = (a.astype(dtype).astype(jnp.float32) for a in (gate, up))
    act = (gate / (1.0 + jnp.exp(-gate)) * up).astype(o_ref.dtype)               # [16, bn]
    if m < DOT_ROWS:
        plgpu.store(o_ref.at[pl.ds(0, rows), cols], act, mask=live)
    else:
        o_ref[:, cols] = act


def _layer_spec(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "k_splits", "num_warps", "num_stages",
                                             "interpret", "widen"))
def skinny_matmul_pallas(x, w, layer, skip=None, *, block_n: int, block_k: int, k_splits: int = 1,
                         num_warps: int = 4, num_stages: int = 3, interpret: bool = False, widen: bool = False):
    """x [M, K] (M a power of two), w [L, K, N], layer [1] int32 -> [M, N] in x's dtype
    (k_splits = 1) or [S, M, N] float32 partial sums (k_splits = S). skip: None or [1] int32;
    nonzero writes zeros without reading the weight. widen (k_splits = 1): the product rounded
    to x's dtype is stored as float32 (a head's logits: no conversion kernel after it)."""
    m, k = x.shape
    if m < 1 or m & (m - 1):
        raise ValueError(f"skinny_matmul_pallas: x has {m} rows; the kernel takes a power of two "
                         f"(skinny_matmul pads)")
    n = w.shape[-1]
    steps = k // block_k // k_splits
    if k_splits == 1:
        out_shape = jax.ShapeDtypeStruct((m, n), jnp.float32 if widen else x.dtype)
    else:
        out_shape = jax.ShapeDtypeStruct((k_splits, m, n), jnp.float32)
    args = [layer, x.astype(w.dtype), w] + ([] if skip is None else [skip])
    return pl.pallas_call(
        functools.partial(_kernel, block_n=block_n, block_k=block_k, steps=steps, skippable=skip is not None),
        grid=(n // block_n, k_splits),
        in_specs=[_layer_spec(a.shape) for a in args],
        out_specs=_layer_spec(out_shape.shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"rlt_skinny_bn{block_n}_bk{block_k}_s{k_splits}{'_skip' if skip is not None else ''}",
    )(*args)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "num_warps", "num_stages", "interpret"))
def gated_up_pallas(x, w_gate, w_up, layer, *, block_n: int, block_k: int, num_warps: int = 2,
                    num_stages: int = 3, interpret: bool = False):
    """x [M, K] (M a power of two), w_gate, w_up [L, K, F], layer [1] int32 ->
    silu(x @ w_gate[layer]) * (x @ w_up[layer]) [M, F] in x's dtype. One pass over K."""
    m, k = x.shape
    if m < 1 or m & (m - 1):
        raise ValueError(f"gated_up_pallas: x has {m} rows; the kernel takes a power of two (gated_up pads)")
    f = w_gate.shape[-1]
    out_shape = jax.ShapeDtypeStruct((m, f), x.dtype)
    return pl.pallas_call(
        functools.partial(_gated_kernel, block_n=block_n, block_k=block_k, steps=k // block_k),
        grid=(f // block_n,),
        in_specs=[_layer_spec((1,)), _layer_spec(x.shape), _layer_spec(w_gate.shape), _layer_spec(w_up.shape)],
        out_specs=_layer_spec(out_shape.shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"rlt_gated_up_bn{block_n}_bk{block_k}",
    )(layer, x.astype(w_gate.dtype), w_gate, w_up)

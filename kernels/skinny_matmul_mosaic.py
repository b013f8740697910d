"""Weight-streaming matmul for few rows (decode projections): a Pallas Mosaic GPU kernel (Hopper).

    x [M, K] @ w[layer] [K, N] -> [M, N] in x's dtype (k_splits = 1; widen: rounded so, stored float32)
                               -> partial sums [S, M, N] float32 (k_splits = S > 1)
    gated_up_mosaic: silu(x @ w_gate[layer]) * (x @ w_up[layer]) -> [M, F] in x's dtype

The same stream as the Triton kernel (``kernels.skinny_matmul_pallas``): grid (N / block_n, S),
each block owns one column tile over 1/S of K. Here the weight tiles come in by TMA through an
``emit_pipeline`` of D = ``max_concurrent_steps`` SMEM slots and are multiplied by wgmma, one
warpgroup a block; a step's wgmma is awaited one step later (``delay_release=1``), so a slot is
refilled a step after it was read and D - 1 copies are in flight while a block waits.

Design:
- Swapped operands: wgmma's M side is 64 rows a warpgroup, decode has 1-64. Each step computes
  out^T [block_n, Mp] += w_tile^T [block_n, block_k] @ x_tile^T [block_k, Mp]: the weight tile,
  read from SMEM through a transposed view (wgmma takes those for 16-bit types only, hence no
  float32), is the 64-row operand and the rows are wgmma's N (Mp: M rounded up to 8, its least).
  The x block asks TMA for Mp rows; the M..Mp ones lie past x's end, which TMA zero-fills rather than
  reads, so no padded copy of x is made, and they only reach out^T's columns >= M, never stored.
- Both tiles are 128-byte swizzled in (8, 64) tiles, the layout wgmma reads: block_n and block_k
  multiples of 64.
- Layer: a scalar read from GMEM in the kernel indexes the stacked weight's ref
  (``w_gmem.at[layer]``) before the pipeline slices it; the TMA descriptor spans [L, K, N], so
  XLA copies nothing. A skip flag (optional) is read the same way: nonzero writes zeros without
  starting the stream.
- Output: the [block_n, Mp] float32 accumulator is stored transposed into an SMEM [Mp, block_n]
  tile and its first M rows go to GMEM by one TMA store, rounded to x's dtype (S = 1) or float32;
  widen (S = 1, a head's logits) rounds to x's dtype and stores float32: no conversion kernel after.
- Gate | up (``gated_up_mosaic``, one pass over K): each slot holds an x tile and a tile of both
  weights, each step issues two wgmmas into two accumulators (two wgmma groups, so the wait
  leaves 2 in flight), and the epilogue applies ``kernels.skinny_matmul.silu_mul``'s rounding
  (each product rounded to x's dtype, silu(gate) * up in float32, rounded once) before the store.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from rltjax.kernels.mosaic_common import DTYPES, SMEM_LIMIT, TILE, launch_settings, swizzled
from rltjax.kernels.skinny_common import MAX_ROWS, SINGLE_PASS_MAX_K, fewer_splits, silu_mul
from rltjax.kernels.skinny_matmul_pallas import choose_splits

SMEM_BUDGET = 192 * 1024    # the configs' pipeline slots: under SMEM_LIMIT with room to spare
ACC_REGISTERS = 128         # float32 accumulator registers a thread (of 255): a 256 x 64 out^T tile's
MIN_BLOCKS = 128            # splits: about one block per SM (132 on an H100 SXM)


def padded_rows(m: int) -> int:
    """wgmma's N side: M rounded up to a multiple of 8."""
    return max(8, -(-m // 8) * 8)


def stage_bytes(m: int, block_n: int, block_k: int, itemsize: int = 2, weights: int = 1) -> int:
    """One pipeline slot: an x tile and ``weights`` weight tiles (2: the gate | up pair)."""
    return (padded_rows(m) + weights * block_n) * block_k * itemsize


def smem_bytes(m: int, block_n: int, block_k: int, steps: int, itemsize: int = 2, weights: int = 1) -> int:
    """Shared memory of a block: ``steps`` slots, whose space the output tile (at most float32)
    reuses after the stream, and 1 KB for barriers and alignment (as lowered: 48 bytes at 6 slots)."""
    slots = steps * stage_bytes(m, block_n, block_k, itemsize, weights)
    return max(slots, padded_rows(m) * block_n * 4) + 1024


def _depth(m: int, block_n: int, block_k: int, weights: int = 1) -> int:
    """As many pipeline slots (3-6) as fit SMEM_BUDGET."""
    return max(3, min(6, SMEM_BUDGET // stage_bytes(m, block_n, block_k, weights=weights)))


def mosaic_config(m: int, k: int, n: int, partial_sums: bool = False) -> dict:
    """Default tiles for an [m, k] @ [k, n] product: 64-column tiles (the most blocks wgmma
    allows), 128-deep K steps, one pass over K up to SINGLE_PASS_MAX_K for whole products, else
    the fewest K splits giving MIN_BLOCKS blocks (at most MAX_PARTIAL_SUMS: ``fewer_splits``), and
    as many pipeline slots (3-6) as fit SMEM_BUDGET. scripts/bench_skinny.py on an H200 at 8 and
    64 rows: within 0.1 us of the best swept point for q|k|v and down; o at 8 rows took 4.55 us
    in 256-deep steps against 5.23 here."""
    block_n = TILE
    block_k = 128 if k % 128 == 0 else TILE
    whole = not partial_sums and k <= SINGLE_PASS_MAX_K
    splits = 1 if whole else fewer_splits(k // block_k, choose_splits(k, n, block_n, block_k, MIN_BLOCKS))
    return dict(block_n=block_n, block_k=block_k, k_splits=splits, max_concurrent_steps=_depth(m, block_n, block_k))


def gated_mosaic_config(m: int, k: int, f: int) -> dict:
    """``gated_up_mosaic``'s tiles (not yet measured): 64 x 128 tiles of each weight, as many
    slots (3-6) as fit SMEM_BUDGET with two weight tiles a slot (Ouro's pair: 5 up to 16 rows, 4
    at 32-64). One pass over K, whatever K."""
    block_k = 128 if k % 128 == 0 else TILE
    return dict(block_n=TILE, block_k=block_k, max_concurrent_steps=_depth(m, TILE, block_k, weights=2))


def _unsupported(x, w, block_n: int, block_k: int, k_splits: int, max_concurrent_steps: int,
                 weights: int) -> str | None:
    if x.ndim != 2 or w.ndim not in (2, 3) or x.shape[1] != w.shape[-2]:
        return f"x must be [M, K] and w [K, N] or [L, K, N]; got {x.shape}, {w.shape}"
    (m, k), n = x.shape, w.shape[-1]
    if not 1 <= m <= MAX_ROWS:
        return f"x has {m} rows; the kernel takes 1 to {MAX_ROWS}"
    if x.dtype != w.dtype or w.dtype not in DTYPES:
        return f"x and w must share a dtype, bfloat16 or float16; got {x.dtype}, {w.dtype}"
    if block_n % TILE or block_k % TILE or block_n > 256:
        return f"block_n={block_n}, block_k={block_k}: multiples of {TILE} (block_n at most 256) for wgmma"
    if n % block_n:
        return f"N={n} must be a multiple of block_n={block_n}"
    if k_splits < 1 or k % (block_k * k_splits):
        return f"K={k} must be a multiple of block_k * k_splits = {block_k} * {k_splits}"
    if max_concurrent_steps < 1:
        return f"max_concurrent_steps={max_concurrent_steps} must be >= 1"
    if (regs := weights * block_n * padded_rows(m) // 128) > ACC_REGISTERS:
        return (f"{weights} float32 accumulator(s) of {block_n} x {padded_rows(m)}: {regs} registers a thread, "
                f"over {ACC_REGISTERS}")
    depth = min(max_concurrent_steps, k // block_k // k_splits)
    need = smem_bytes(m, block_n, block_k, depth, x.dtype.itemsize, weights)
    if need > SMEM_LIMIT:
        return f"{need} bytes of shared memory asked for, over the {SMEM_LIMIT} a block has"
    return None


def mosaic_unsupported(x, w, *, block_n: int = TILE, block_k: int = TILE, k_splits: int = 1,
                       max_concurrent_steps: int = 4) -> str | None:
    """Why the kernel cannot take these operands / tiles (None when it can)."""
    return _unsupported(x, w, block_n, block_k, k_splits, max_concurrent_steps, weights=1)


def gated_mosaic_unsupported(x, w_gate, *, block_n: int = TILE, block_k: int = TILE,
                             max_concurrent_steps: int = 4) -> str | None:
    """Why ``gated_up_mosaic`` cannot take these operands / tiles (None when it can): as
    ``mosaic_unsupported``, a slot holding two weight tiles and a block two accumulators."""
    return _unsupported(x, w_gate, block_n, block_k, 1, max_concurrent_steps, weights=2)


def _stream(x_gmem, w_gmems, j, split, *, block_n: int, block_k: int, steps: int, depth: int):
    """out^T tiles [block_n, rows] float32, one a weight, of split ``split``'s steps of K."""
    rows, count = padded_rows(x_gmem.shape[0]), len(w_gmems)
    # a slot is refilled only after the wgmmas reading it are done: with one step's wgmmas left in
    # flight (delay 1) the refill waits a step; with one step in all there is nothing to refill
    delay = 1 if steps > 1 and depth > 1 else 0
    first = split * steps

    def spec(shape, index):
        return plgpu.BlockSpec(shape, index, transforms=swizzled(), delay_release=delay)

    def step(x_smem, w_smems, acc_refs):
        for w_smem, acc_ref in zip(w_smems, acc_refs):
            plgpu.wgmma(acc_ref, w_smem.T, x_smem.T)        # [bn, bk] @ [bk, rows]
        plgpu.wgmma_wait(delay * count)                     # each wgmma commits a group of its own

    def run(*acc_refs):
        plgpu.emit_pipeline(
            lambda _, x_smem, *w_smems: step(x_smem, w_smems, acc_refs), grid=(steps,), max_concurrent_steps=depth,
            in_specs=[spec((rows, block_k), lambda i: (0, first + i))]
            + [spec((block_k, block_n), lambda i: (first + i, j)) for _ in w_gmems],
        )(x_gmem, *w_gmems)
        return tuple(acc_ref[...] for acc_ref in acc_refs)

    return pl.run_scoped(run, *[plgpu.ACC((block_n, rows), jnp.float32) for _ in w_gmems])


def _kernel(layer_gmem, x_gmem, *refs, weights: int, skippable: bool, epilogue, **tiles):
    """refs: ``weights`` stacked weights, the skip flag (skippable), the output. ``epilogue`` maps
    the accumulators to the out^T tile stored (cast to the output's dtype)."""
    w_gmems, rest = refs[:weights], refs[weights:]
    skip_gmem, o_gmem = rest if skippable else (None, rest[0])
    j, split = lax.axis_index("n"), lax.axis_index("s")
    m = x_gmem.shape[0]

    def product():
        layer = layer_gmem[0]
        accs = _stream(x_gmem, [w.at[layer] for w in w_gmems], j, split, **tiles)
        _store(o_gmem, epilogue(*accs), j, split, m, transposed=True)

    if not skippable:
        product()
        return
    skip = skip_gmem[0]
    pl.when(skip == 0)(product)
    pl.when(skip != 0)(lambda: _store(o_gmem, jnp.zeros((padded_rows(m), tiles["block_n"]), jnp.float32), j, split,
                                      m, transposed=False))


def _store(o_gmem, value, j, split, m: int, *, transposed: bool):
    """The tile (out^T [bn, rows] or out [rows, bn]) -> o_gmem's [m, bn] tile by TMA."""
    block_n = value.shape[0] if transposed else value.shape[1]
    rows = value.shape[1] if transposed else value.shape[0]

    def write(o_smem):
        if transposed:
            # through the transposed view each thread's register pairs must be adjacent rows of
            # out^T (columns of o_smem): the transposed wgmma layout (layout inference finds no
            # store of float32 in the plain one)
            o_smem.T[...] = plgpu.layout_cast(value.astype(o_smem.dtype), plgpu.Layout.WGMMA_TRANSPOSED)
        else:
            o_smem[...] = value.astype(o_smem.dtype)
        plgpu.commit_smem()
        cols = pl.ds(j * block_n, block_n)
        dst = o_gmem.at[:, cols] if len(o_gmem.shape) == 2 else o_gmem.at[split, :, cols]
        plgpu.copy_smem_to_gmem(o_smem if m == rows else o_smem.at[pl.ds(0, m)], dst)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(write, plgpu.SMEM((rows, block_n), o_gmem.dtype))


def _silu_mul(gate, up, *, dtype):
    """``silu_mul`` of the two float32 products rounded to ``dtype``."""
    return silu_mul(gate.astype(dtype), up.astype(dtype))


def _launch(args, out_type, *, k_splits: int, interpret, name: str, **kernel):
    """plgpu.kernel over (N / block_n, k_splits) blocks, one warpgroup each."""
    return plgpu.kernel(
        functools.partial(_kernel, **kernel), out_type=out_type,
        grid=(out_type.shape[-1] // kernel["block_n"], k_splits), grid_names=("n", "s"), kernel_name=name,
        **launch_settings(interpret),
    )(*args)


def _layer(layer):
    return jnp.asarray(layer, jnp.int32).reshape(1)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "k_splits", "max_concurrent_steps",
                                             "interpret", "widen"))
def skinny_matmul_mosaic(x, w, layer, skip=None, *, block_n: int, block_k: int, k_splits: int = 1,
                         max_concurrent_steps: int = 4, interpret=False, widen: bool = False):
    """x [M, K] (1 <= M <= 64), w [L, K, N] (or [K, N]), layer an int32 scalar or [1] (traced)
    -> [M, N] in x's dtype (k_splits = 1) or [S, M, N] float32 partial sums (k_splits = S).
    skip: None or an int scalar / [1]; nonzero writes zeros without reading the weight.
    widen (k_splits = 1): the product rounded to x's dtype is stored as float32 (a head's logits).
    interpret: True or an ``InterpretGPUParams`` (e.g. detect_races=True) runs the kernel in
    Mosaic GPU interpret mode (CPU)."""
    config = dict(block_n=block_n, block_k=block_k, k_splits=k_splits, max_concurrent_steps=max_concurrent_steps)
    if why_not := mosaic_unsupported(x, w, **config):
        raise ValueError(f"skinny_matmul_mosaic: {why_not}")
    if widen and k_splits != 1:
        raise ValueError(f"skinny_matmul_mosaic: widen is for whole products (k_splits=1), got k_splits={k_splits}; "
                         f"partial sums are float32 already")
    if w.ndim == 2:
        w, layer = w[None], 0
    (m, k), n = x.shape, w.shape[-1]
    if k_splits == 1:
        out_type = jax.ShapeDtypeStruct((m, n), jnp.float32 if widen else x.dtype)
        epilogue = lambda acc: acc.astype(x.dtype)      # widen: then float32, exactly
    else:
        out_type, epilogue = jax.ShapeDtypeStruct((k_splits, m, n), jnp.float32), lambda acc: acc
    args = [_layer(layer), x, w] + ([] if skip is None else [jnp.asarray(skip).astype(jnp.int32).reshape(1)])
    steps = k // block_k // k_splits
    return _launch(args, out_type, k_splits=k_splits, interpret=interpret, weights=1, skippable=skip is not None,
                   epilogue=epilogue, block_n=block_n, block_k=block_k, steps=steps,
                   depth=min(max_concurrent_steps, steps),
                   name=f"rlt_skinny_mgpu_bn{block_n}_bk{block_k}_s{k_splits}{'_f32' if widen else ''}"
                        f"{'_skip' if skip is not None else ''}")


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "max_concurrent_steps", "interpret"))
def gated_up_mosaic(x, w_gate, w_up, layer, *, block_n: int, block_k: int, max_concurrent_steps: int = 4,
                    interpret=False):
    """x [M, K] (1 <= M <= 64), w_gate, w_up [L, K, F] (or [K, F]), layer an int32 scalar or [1]
    (traced) -> silu(x @ w_gate[layer]) * (x @ w_up[layer]) [M, F] in x's dtype, rounded as
    ``kernels.skinny_matmul.gated_up_ref``. One pass over K streaming both weights."""
    if w_gate.shape != w_up.shape or w_gate.dtype != w_up.dtype:
        raise ValueError(f"gated_up_mosaic: w_gate and w_up must share a shape and dtype, got "
                         f"{w_gate.dtype} {w_gate.shape} and {w_up.dtype} {w_up.shape}")
    config = dict(block_n=block_n, block_k=block_k, max_concurrent_steps=max_concurrent_steps)
    if why_not := gated_mosaic_unsupported(x, w_gate, **config):
        raise ValueError(f"gated_up_mosaic: {why_not}")
    if w_gate.ndim == 2:
        w_gate, w_up, layer = w_gate[None], w_up[None], 0
    (m, k), f = x.shape, w_gate.shape[-1]
    steps = k // block_k
    return _launch([_layer(layer), x, w_gate, w_up], jax.ShapeDtypeStruct((m, f), x.dtype), k_splits=1,
                   interpret=interpret, weights=2, skippable=False,
                   epilogue=functools.partial(_silu_mul, dtype=x.dtype), block_n=block_n, block_k=block_k,
                   steps=steps, depth=min(max_concurrent_steps, steps),
                   name=f"rlt_gated_up_mgpu_bn{block_n}_bk{block_k}")

"""Paged decode attention on Pallas Mosaic GPU (Hopper): the Triton kernel's semantics
(``kernels.paged_attention_pallas``; oracle ``kernels.paged_attention_ref``), its fused write
included, on TMA and wgmma.

Grid (row, KV head, split), one warpgroup a block; split s of a row owns blocks [s * per,
(s + 1) * per) of its ``pages_per_block``-page key blocks, as in the Triton kernel.

Design:
- Pages by TMA: each block's pages come in by one TMA copy a page (the page id read from the
  row's block table in GMEM) into consecutive rows of a K and a V SMEM slot; D =
  ``max_concurrent_steps`` slots keep the next D - 1 blocks in flight while one is computed.
  Page ids past the row's pages read page 0 (always allocated), masked like every key past
  the row's length.
- Swapped operands, as in ``kernels.skinny_matmul_mosaic``: wgmma's M side is 64 rows, a KV
  head's query group has 1-8. Scores are computed transposed, s^T [block_k, C] = K [block_k,
  Dh] @ q^T [Dh, C], with the keys as the 64-row operand and C = ``query_columns`` query rows as
  wgmma's N; the softmax runs down the columns; out^T [Dh, C] += V^T [Dh, block_k] @ p^T
  [block_k, C], V read through a transposed SMEM view and p stored to SMEM in bf16/fp16.
- Query columns: TMA needs a tiled box to start at a multiple of 8 rows, so a block loads the
  8-aligned run of C flattened query rows holding its group (column c0 = its first head's row
  mod 8); the other columns are neighbouring heads, computed and never stored.
- Fused write (``new_kv``): the split that owns the row's last block (the one holding
  position length - 1) stores the row's new K/V for its KV head on every write plane (page
  != 0) by TMA, waits until the stores have completed, then streams its blocks, so it reads
  its own new key from the pool; no other program reads that slot. RoPE is applied by XLA
  before (``kernels.paged_attention.paged_attention_write``).
- Output: split 1 writes out [N, H, Dh] in q's dtype; more splits write normalized float32
  partials and their log-sum-exps, merged by ``kernels.split_merge.combine_splits``.

Not yet measured on a GPU: the Triton kernel stays the default (``kernels.paged_attention``'s
backend argument); the GPU tests compare the two (tests/test_paged_attention_mosaic.py).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from rltjax.kernels.paged_attention_launch import default_num_splits
from rltjax.kernels.split_merge import combine_splits
from rltjax.kernels.triton_common import cdiv

DTYPES = (jnp.bfloat16, jnp.float16)    # wgmma reads transposed SMEM operands in 16 bits only
TILE = 64                               # a 128-byte swizzle row of 16-bit elements
BLOCK_KEYS = 64                         # keys a block: wgmma's M for the scores
MAX_COLUMNS = 64                        # query rows a block computes (wgmma's N)
SMEM_LIMIT = 227 * 1024                 # an H100 / H200 block's opt-in shared memory
NEG_INF = float("-inf")


def query_columns(num_heads: int, group: int) -> int:
    """C: the 8-aligned run of flattened query rows that holds every group (c0 + group <= C)."""
    aligned = math.gcd(math.gcd(num_heads, group), 8)
    return -(-(8 - aligned + group) // 8) * 8


def smem_bytes(columns: int, block_k: int, head_dim: int, steps: int, itemsize: int = 2) -> int:
    """A block's SMEM: K and V slots, the q tile, p, the output tile (float32) and barriers."""
    slots = 2 * steps * block_k * head_dim * itemsize
    return slots + columns * (head_dim + block_k) * itemsize + columns * (head_dim + 1) * 4 + 1024


def mosaic_unsupported(q, k_pages, *, pages_per_block: int, max_concurrent_steps: int = 3) -> str | None:
    """Why the kernel cannot take these operands (None when it can)."""
    num_heads, head_dim = q.shape[-2:]
    num_kv, page_size = k_pages.shape[-4], k_pages.shape[-2]
    if q.dtype not in DTYPES or k_pages.dtype != q.dtype:
        return f"q and the pools must share a dtype, bfloat16 or float16; got {q.dtype}, {k_pages.dtype}"
    if head_dim % TILE or not TILE <= head_dim <= 256:
        return f"head_dim must be a multiple of {TILE} in {TILE}..256, got {head_dim}"
    if page_size % 8:
        return f"page_size must be a multiple of 8 (TMA tiles), got {page_size}"
    block_k = pages_per_block * page_size
    if block_k % TILE or block_k > 256:
        return f"pages_per_block * page_size = {block_k} keys must be a multiple of {TILE} up to 256 (wgmma's M)"
    if (cols := query_columns(num_heads, num_heads // num_kv)) > MAX_COLUMNS:
        return f"{cols} query columns a KV head (group {num_heads // num_kv}): the kernel takes up to {MAX_COLUMNS}"
    if (need := smem_bytes(cols, block_k, head_dim, max_concurrent_steps)) > SMEM_LIMIT:
        return f"{need} bytes of shared memory asked for, over the {SMEM_LIMIT} a block has"
    return None


def default_pages_per_block(page_size: int) -> int:
    """BLOCK_KEYS keys a block (pages of up to 64 keys; larger pages take one page a block)."""
    return max(1, BLOCK_KEYS // page_size)


def _block_range(length, split, *, splits: int, page_size: int, pages_per_block: int):
    """(n_pages, first block, end block, owner): this split's blocks of the row's keys, and the
    split that owns the row's last block (split 0 for a row without keys)."""
    n_pages = cdiv(length, page_size)
    n_blocks = cdiv(n_pages, pages_per_block)
    per = cdiv(n_blocks, splits)
    start = split * per
    owner = lax.div(jnp.maximum(n_blocks - 1, 0), jnp.maximum(per, 1))
    return n_pages, start, jnp.minimum(start + per, n_blocks), owner


def _write_new(k_new_g, v_new_g, write_page_g, write_offset_g, k_g, v_g, row, kvh, layer):
    """Stores the row's new K/V of this KV head at (page, offset) of every write plane whose
    page is not 0, and waits until the stores have completed (the caller then reads them)."""
    num_kv, head_dim = k_g.shape[1], k_g.shape[-1]
    offset = write_offset_g[row]

    def body(new_s, bar):
        for new_g, pool_g in ((k_new_g, k_g), (v_new_g, v_g)):
            plgpu.copy_gmem_to_smem(new_g.at[pl.ds(row * num_kv + kvh, 1)], new_s, bar)
            plgpu.barrier_wait(bar)
            for plane in range(write_page_g.shape[0]):
                page = write_page_g[plane, row]
                pl.when(page != 0)(lambda: plgpu.copy_smem_to_gmem(
                    new_s, pool_g.at[layer, kvh, page, pl.ds(offset, 1)]))
            plgpu.wait_smem_to_gmem(0)        # complete (not only read): the loads below see them

    pl.run_scoped(body, plgpu.SMEM((1, head_dim), k_g.dtype), plgpu.Barrier(num_barriers=1))


def _attend(q_s, k_g, v_g, tables_g, table, layer, kvh, length, n_pages, start, stop, *,
            page_size: int, pages_per_block: int, depth: int, scale: float):
    """Online softmax over blocks [start, stop) -> (out^T [Dh, C], running max [C], running
    sum [C]) float32."""
    columns, head_dim = q_s.shape
    block_k = pages_per_block * page_size
    last_page = tables_g.shape[1] - 1
    steps = jnp.maximum(stop - start, 0)
    swizzled = (plgpu.TilingTransform((8, TILE)), plgpu.SwizzleTransform(128))

    def issue(b, slot, k_s, v_s, k_bar, v_bar):
        for p in range(pages_per_block):
            index = b * pages_per_block + p
            page = jnp.where(index < n_pages, tables_g[table, jnp.minimum(index, last_page)], 0)
            rows = pl.ds(p * page_size, page_size)
            plgpu.copy_gmem_to_smem(k_g.at[layer, kvh, page], k_s.at[slot, rows], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_g.at[layer, kvh, page], v_s.at[slot, rows], v_bar.at[slot])

    def stream(k_s, v_s, p_s, k_bar, v_bar):
        bufs = (k_s, v_s, k_bar, v_bar)
        for i in range(depth):
            pl.when(i < steps)(functools.partial(issue, start + i, i, *bufs))

        def step(i, carry):
            o, m, total = carry
            slot = lax.rem(i, depth)
            plgpu.barrier_wait(k_bar.at[slot])
            s = _product(k_s.at[slot], q_s.T, (block_k, columns)) * scale
            key = (start + i) * block_k + plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
            s = jnp.where(key < length, s, NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=0))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [1]))
            total = total * alpha + p.sum(axis=0)
            p_s.T[...] = plgpu.layout_cast(p.astype(p_s.dtype), plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.commit_smem()
            plgpu.barrier_wait(v_bar.at[slot])
            pv = _product(v_s.at[slot].T, p_s.T, (head_dim, columns))
            o = o * lax.broadcast_in_dim(alpha, o.shape, [1]) + pv
            pl.when(i + depth < steps)(functools.partial(issue, start + i + depth, slot, *bufs))
            return o, m_new, total

        # Every block of [start, stop) holds a visible key, so m is finite after its first
        # block and exp(-inf - m) = 0: the masking makes no NaN.
        columns_layout = plgpu.Layout.WGMMA.reduce(0)
        init = (plgpu.layout_cast(jnp.zeros((head_dim, columns), jnp.float32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((columns,), NEG_INF, jnp.float32), columns_layout),
                plgpu.layout_cast(jnp.zeros((columns,), jnp.float32), columns_layout))
        return lax.fori_loop(0, steps, step, init)

    slot_shape = (depth, block_k, head_dim)
    return pl.run_scoped(stream, plgpu.SMEM(slot_shape, k_g.dtype, transforms=swizzled),
                         plgpu.SMEM(slot_shape, v_g.dtype, transforms=swizzled),
                         plgpu.SMEM((columns, block_k), k_g.dtype, transforms=swizzled),
                         plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=depth),
                         plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=depth))


def _product(a, b, shape):
    """a @ b by wgmma into a fresh float32 accumulator, awaited -> [M, N] float32. (A fresh
    accumulator each block: Mosaic GPU's interpret mode runs wgmma only into scoped ones.)"""
    def run(acc):
        plgpu.wgmma(acc, a, b)
        return acc[...]
    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _kernel(layer_g, lengths_g, row_tables_g, tables_g, q_g, k_g, v_g, *refs, heads: int, group: int,
            page_size: int, pages_per_block: int, depth: int, splits: int, scale: float, fused: bool):
    """refs: (k_new, v_new, write_page, write_offset) when fused, then the outputs: out (one
    split) or (o, lse). k_g, v_g: the stacked pools (mutable where fused)."""
    new_kv, outs = (refs[:4], refs[4:]) if fused else (None, refs)
    row, kvh, split = lax.axis_index("row"), lax.axis_index("kvh"), lax.axis_index("split")
    layer = layer_g[0]
    capacity = tables_g.shape[1] * page_size
    length = jnp.clip(lengths_g[row], 0, capacity)
    n_pages, start, stop, owner = _block_range(length, split, splits=splits, page_size=page_size,
                                               pages_per_block=pages_per_block)
    if fused:
        pl.when(split == owner)(lambda: _write_new(*new_kv, k_g, v_g, row, kvh, layer))
    first = row * heads + kvh * group                  # the group's first flattened query row
    aligned = pl.multiple_of(lax.div(first, 8) * 8, 8)
    column = first - aligned                           # its column in the block's q tile
    columns, head_dim = query_columns(heads, group), q_g.shape[-1]

    def body(q_s, q_bar):
        plgpu.copy_gmem_to_smem(q_g.at[pl.ds(aligned, columns)], q_s, q_bar)
        plgpu.barrier_wait(q_bar)
        o, m, total = _attend(q_s, k_g, v_g, tables_g, row_tables_g[row], layer, kvh, length, n_pages, start,
                              stop, page_size=page_size, pages_per_block=pages_per_block, depth=depth, scale=scale)
        has = total > 0
        o = o * lax.broadcast_in_dim(1.0 / jnp.where(has, total, 1.0), o.shape, [1])
        lse = jnp.where(has, m + jnp.log(jnp.where(has, total, 1.0)), NEG_INF)
        _store(outs, o, lse, split, first, column, group)

    swizzled = (plgpu.TilingTransform((8, TILE)), plgpu.SwizzleTransform(128))
    pl.run_scoped(body, plgpu.SMEM((columns, head_dim), q_g.dtype, transforms=swizzled),
                  plgpu.Barrier(num_barriers=1))


def _store(outs, o, lse, split, first, column, group: int):
    """out^T's group columns -> rows [first, first + group) of out (or split's partials, with
    their log-sum-exps, one scalar store each: a TMA box is at least 16 bytes)."""
    head_dim, columns = o.shape

    def write(o_s, lse_s):
        o_s.T[...] = plgpu.layout_cast(o.astype(o_s.dtype), plgpu.Layout.WGMMA_TRANSPOSED)
        plgpu.commit_smem()
        rows = pl.ds(first, group)
        plgpu.copy_smem_to_gmem(o_s.at[pl.ds(column, group)], outs[0].at[rows] if len(outs) == 1
                                else outs[0].at[split, rows])
        if len(outs) == 2:
            lse_s[...] = lse
            plgpu.commit_smem()         # a warpgroup barrier: each thread reads what others stored
            for g in range(group):
                outs[1][split, first + g] = lse_s[column + g]
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(write, plgpu.SMEM((columns, head_dim), outs[0].dtype), plgpu.SMEM((columns,), jnp.float32))


@functools.partial(jax.jit, static_argnames=("scale", "pages_per_block", "num_splits", "max_concurrent_steps",
                                             "interpret", "return_partials"))
def paged_attention_mosaic(q, k_pages, v_pages, block_tables, row_tables, lengths, *, layer=None,
                           scale: float | None = None, pages_per_block: int | None = None,
                           num_splits: int | None = None, max_concurrent_steps: int = 3, interpret=False,
                           return_partials: bool = False, new_kv=None):
    """The kernel; callers go through ``kernels.paged_attention`` (backend="mosaic").

    q [N, H, Dh]; k_pages, v_pages: one layer's [Hkv, P, S, Dh] pool or the stacked [L, Hkv, P,
    S, Dh] pool with ``layer`` (int32, may be traced). new_kv = (k_new, v_new [N, Hkv, Dh],
    write_page [M, N], write_offset [N]): each row's new K/V is stored first (key position
    lengths - 1), and (out, k_pages, v_pages) is returned, the pools updated in place (donate
    them). return_partials (num_splits > 1): the raw (o [S, N, H, Dh], lse [S, N, H]) float32.
    interpret: True or an ``InterpretGPUParams`` runs Mosaic GPU's interpreter (CPU)."""
    unstacked = k_pages.ndim == 4
    if unstacked:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    n, heads, head_dim = q.shape
    num_kv, page_size = k_pages.shape[1], k_pages.shape[3]
    group = heads // num_kv
    ppb = pages_per_block or default_pages_per_block(page_size)
    if why_not := mosaic_unsupported(q, k_pages, pages_per_block=ppb, max_concurrent_steps=max_concurrent_steps):
        raise ValueError(f"paged_attention_mosaic: {why_not}")
    splits = num_splits or default_num_splits(n, num_kv, block_tables.shape[1], ppb, page_size)
    columns = query_columns(heads, group)
    flat = q.reshape(n * heads, head_dim)
    rows_needed = ((n - 1) * heads + (num_kv - 1) * group) // 8 * 8 + columns
    if rows_needed > n * heads:                          # the last group's 8-aligned run
        flat = jnp.pad(flat, ((0, rows_needed - n * heads), (0, 0)))
    if splits == 1:
        out_type = [jax.ShapeDtypeStruct((n * heads, head_dim), q.dtype)]
    else:
        out_type = [jax.ShapeDtypeStruct((splits, n * heads, head_dim), jnp.float32),
                    jax.ShapeDtypeStruct((splits, n * heads), jnp.float32)]
    fused = new_kv is not None
    args = [jnp.asarray(layer, jnp.int32).reshape(1), lengths, row_tables, block_tables, flat]
    if fused:
        k_new, v_new, write_page, write_offset = new_kv
        k_ref, v_ref = jax.new_ref(k_pages), jax.new_ref(v_pages)
        args += [k_ref, v_ref, k_new.reshape(n * num_kv, head_dim), v_new.reshape(n * num_kv, head_dim),
                 write_page.reshape(-1, n), write_offset]
    else:
        args += [k_pages, v_pages]
    kernel = functools.partial(_kernel, heads=heads, group=group, page_size=page_size, pages_per_block=ppb,
                               depth=max_concurrent_steps, splits=splits, fused=fused,
                               scale=head_dim ** -0.5 if scale is None else float(scale))
    outs = plgpu.kernel(
        kernel, out_type=out_type, grid=(n, num_kv, splits), grid_names=("row", "kvh", "split"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=(plgpu.InterpretGPUParams() if interpret is True else interpret) or None,
        kernel_name=f"rlt_paged_attention_mgpu{'_write' if fused else ''}_g{group}_ppb{ppb}_s{splits}",
    )(*args)
    if splits == 1:
        out = outs[0].reshape(n, heads, head_dim)
    else:
        o, lse = outs[0].reshape(splits, n, heads, head_dim), outs[1].reshape(splits, n, heads)
        out = (o, lse) if return_partials else combine_splits(o, lse, q.dtype)
    if not fused:
        return out
    k_pages, v_pages = jax.freeze(k_ref), jax.freeze(v_ref)
    return out, *((k_pages[0], v_pages[0]) if unstacked else (k_pages, v_pages))

"""Paged decode attention on Pallas Mosaic GPU (Hopper): the Triton kernel's semantics
(``kernels.paged_attention_pallas``; oracle ``kernels.paged_attention_ref``), its fused write
included, on TMA and wgmma. Grid (row, KV head, split), one warpgroup a block; split s of a row
owns blocks [s * per, (s + 1) * per) of its ``pages_per_block``-page key blocks.

- Pages by TMA: one copy a page (its id read from the row's block table) into consecutive rows
  of a K and a V SMEM slot; D slots keep D - 1 blocks in flight while one is computed. Ids past
  the row's pages read page 0 (always allocated), masked like every key past its length.
- Swapped operands (as ``kernels.skinny_matmul_mosaic``): wgmma's M side is 64 rows, a KV head's
  query group 1-8. s^T [block_k, C] = K [block_k, Dh] @ q^T [Dh, C], keys the 64-row operand and
  C = ``query_columns`` query rows wgmma's N; the softmax runs down the columns; out^T [Dh, C] +=
  V^T [Dh, block_k] @ p^T [block_k, C], V through a transposed SMEM view, p stored to SMEM.
- Query columns: a tiled TMA box starts at a multiple of 8 rows, so a block loads the 8-aligned
  run of C flattened query rows holding its group (first head at column c0); the other columns
  are neighbouring heads, computed and never stored.
- Fused write (``new_kv``): as in the Triton kernel, the pool is read below each row's newest key
  (position length - 1), which split 0 folds in from k_new / v_new: their 8-aligned run of rows
  goes into a zeroed 64-row K and V tile at the start, and one more masked block runs after the
  pool's. Split 0 also stores the new K/V on every write plane (page != 0) from staged SMEM rows,
  waited on only at the block's exit: no block uses that slot's pool value (the last pool block
  may copy its page meanwhile, the slot masked; the pool holds only finite K/V or zeros). RoPE is
  applied by XLA before (``kernels.paged_attention.paged_attention_write``).
- Output: one split writes out [N, H, Dh] in q's dtype; more write float32 partials and their
  log-sum-exps, merged by ``kernels.split_merge.combine_splits``.

Launch rules (what it takes, D): ``kernels.paged_attention_mosaic_launch``. The Triton kernel
stays the default (docs/performance.md; scripts/bench_decode_attention.py --backends).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from rltjax.kernels.paged_attention_launch import default_num_splits
from rltjax.kernels.mosaic_common import launch_settings, swizzled
from rltjax.kernels.paged_attention_mosaic_launch import NEWEST_ROWS, mosaic_launch, query_columns
from rltjax.kernels.split_merge import combine_splits, log_sum_exp, split_range
from rltjax.kernels.triton_common import cdiv

NEG_INF = float("-inf")


def _softmax_block(k_tile, v_tile, p_s, q_s, visible, carry, wait_v, scale: float):
    """One block of keys (k_tile, v_tile [block_k, Dh] in SMEM, ``visible`` [block_k, C]) into the
    running (out^T [Dh, C], max [C], sum [C]), float32; ``wait_v()`` runs before V is read."""
    o, m, total = carry
    s = jnp.where(visible, _product(k_tile, q_s.T, visible.shape) * scale, NEG_INF)
    m_new = jnp.maximum(m, s.max(axis=0))
    # a column with no visible key yet keeps max -inf: subtract 0 there (p = 0, alpha = 0)
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - lax.broadcast_in_dim(m_safe, s.shape, [1]))
    p_s.T[...] = plgpu.layout_cast(p.astype(p_s.dtype), plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()
    wait_v()
    pv = _product(v_tile.T, p_s.T, (o.shape[0], s.shape[1]))
    return o * lax.broadcast_in_dim(alpha, o.shape, [1]) + pv, m_new, total * alpha + p.sum(axis=0)


def _key_iota(shape):
    return plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)


def _attend(q_s, p_s, k_g, v_g, tables_g, table, layer, kvh, length, n_pages, start, stop, init, *,
            page_size: int, pages_per_block: int, depth: int, scale: float):
    """Online softmax over the pool's blocks [start, stop) of keys < length from ``init``."""
    columns, head_dim = q_s.shape
    block_k = pages_per_block * page_size
    last_page = tables_g.shape[1] - 1
    steps = jnp.maximum(stop - start, 0)

    def issue(b, slot, k_s, v_s, k_bar, v_bar):
        for p in range(pages_per_block):
            index = b * pages_per_block + p
            page = jnp.where(index < n_pages, tables_g[table, jnp.minimum(index, last_page)], 0)
            rows = pl.ds(p * page_size, page_size)
            plgpu.copy_gmem_to_smem(k_g.at[layer, kvh, page], k_s.at[slot, rows], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_g.at[layer, kvh, page], v_s.at[slot, rows], v_bar.at[slot])

    def stream(k_s, v_s, k_bar, v_bar):
        bufs = (k_s, v_s, k_bar, v_bar)
        for i in range(depth):
            pl.when(i < steps)(functools.partial(issue, start + i, i, *bufs))

        def step(i, carry):
            slot = lax.rem(i, depth)
            plgpu.barrier_wait(k_bar.at[slot])
            visible = (start + i) * block_k + _key_iota((block_k, columns)) < length
            carry = _softmax_block(k_s.at[slot], v_s.at[slot], p_s, q_s, visible, carry,
                                   lambda: plgpu.barrier_wait(v_bar.at[slot]), scale)
            pl.when(i + depth < steps)(functools.partial(issue, start + i + depth, slot, *bufs))
            return carry
        return lax.fori_loop(0, steps, step, init)

    slot_shape = (depth, block_k, head_dim)
    return pl.run_scoped(stream, plgpu.SMEM(slot_shape, k_g.dtype, transforms=swizzled()),
                         plgpu.SMEM(slot_shape, v_g.dtype, transforms=swizzled()),
                         plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=depth),
                         plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=depth))


def _product(a, b, shape):
    """a @ b by wgmma into a fresh float32 accumulator, awaited -> [M, N] float32. (A fresh
    accumulator each block: Mosaic GPU's interpret mode runs wgmma only into scoped ones.)"""
    def run(acc):
        plgpu.wgmma(acc, a, b)
        return acc[...]
    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _aligned(first):
    """(the 8-aligned row at or before ``first``, first's offset from it): TMA boxes of tiled
    SMEM start at multiples of the 8-row tile."""
    aligned = pl.multiple_of(lax.div(first, 8) * 8, 8)
    return aligned, first - aligned


def _empty_state(head_dim: int, columns: int):
    """The running (out^T, max, sum) before any key, in the layouts the blocks produce."""
    columns_layout = plgpu.Layout.WGMMA.reduce(0)
    return (plgpu.layout_cast(jnp.zeros((head_dim, columns), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((columns,), NEG_INF, jnp.float32), columns_layout),
            plgpu.layout_cast(jnp.zeros((columns,), jnp.float32), columns_layout))


def _with_newest(attend, new_kv, k_g, v_g, q_s, p_s, *, row, kvh, layer, split, length, scale: float):
    """``attend(init)`` over the pool, then each row's newest key (position length - 1) folded in
    from k_new / v_new by split 0, which also stores them on every write plane (page != 0). No
    block uses that slot's pool value, so the stores need no wait; their SMEM source is kept
    until the output's store waits for the reads."""
    k_new_g, v_new_g, write_page_g, write_offset_g = new_kv
    num_kv, head_dim = k_g.shape[1], k_g.shape[-1]
    source = row * num_kv + kvh
    aligned, newest = _aligned(source)
    own = (split == 0) & (length > 0)

    def body(tiles, stages, tile_bar, stage_bar):
        for tile in tiles:          # zeros past the 8 loaded rows: masked keys must be finite
            tile[...] = plgpu.layout_cast(jnp.zeros(tile.shape, tile.dtype), plgpu.Layout.WGMMA)
        plgpu.commit_smem()

        @pl.when(own)
        def _load():
            for new_g, tile in zip((k_new_g, v_new_g), tiles):
                plgpu.copy_gmem_to_smem(new_g.at[pl.ds(aligned, 8)], tile.at[pl.ds(0, 8)], tile_bar)

        @pl.when(split == 0)
        def _stage():
            for new_g, stage in zip((k_new_g, v_new_g), stages):
                plgpu.copy_gmem_to_smem(new_g.at[pl.ds(source, 1)], stage, stage_bar)

        state = attend(_empty_state(head_dim, q_s.shape[0]))
        pl.when(split == 0)(lambda: _store_newest(stages, stage_bar, write_page_g, write_offset_g, k_g, v_g,
                                                  row, kvh, layer))
        pl.when(own)(lambda: plgpu.barrier_wait(tile_bar))
        visible = (_key_iota((NEWEST_ROWS, q_s.shape[0])) == newest) & own
        return _softmax_block(*tiles, p_s, q_s, visible, state, lambda: None, scale)

    tile = plgpu.SMEM((NEWEST_ROWS, head_dim), k_g.dtype, transforms=swizzled())
    stage = plgpu.SMEM((1, head_dim), k_g.dtype)
    return pl.run_scoped(body, (tile, tile), (stage, stage), plgpu.Barrier(num_arrivals=2),
                         plgpu.Barrier(num_arrivals=2))


def _store_newest(stages, stage_bar, write_page_g, write_offset_g, k_g, v_g, row, kvh, layer):
    """The row's new K/V (staged in SMEM) -> (page, offset) of each write plane with page != 0."""
    plgpu.barrier_wait(stage_bar)
    offset = write_offset_g[row]
    for plane in range(write_page_g.shape[0]):
        page = write_page_g[plane, row]
        for stage, pool_g in zip(stages, (k_g, v_g)):
            pl.when(page != 0)(functools.partial(plgpu.copy_smem_to_gmem, stage,
                                                 pool_g.at[layer, kvh, page, pl.ds(offset, 1)]))


def _kernel(layer_g, lengths_g, row_tables_g, tables_g, q_g, k_g, v_g, *refs, heads: int, group: int,
            page_size: int, pages_per_block: int, depth: int, splits: int, scale: float, fused: bool):
    """refs: (k_new, v_new, write_page, write_offset) when fused, then the outputs: out (one
    split) or (o, lse). k_g, v_g: the stacked pools (mutable where fused)."""
    new_kv, outs = (refs[:4], refs[4:]) if fused else (None, refs)
    row, kvh, split = lax.axis_index("row"), lax.axis_index("kvh"), lax.axis_index("split")
    layer = layer_g[0]
    length = jnp.clip(lengths_g[row], 0, tables_g.shape[1] * page_size)
    pool_length = jnp.maximum(length - 1, 0) if fused else length    # fused: the newest key is k_new's
    n_pages = cdiv(pool_length, page_size)
    start, stop = split_range(cdiv(n_pages, pages_per_block), split, splits)
    first = row * heads + kvh * group                  # the group's first flattened query row
    aligned, column = _aligned(first)
    columns, head_dim = query_columns(heads, group), q_g.shape[-1]

    def body(q_s, p_s, q_bar):
        plgpu.copy_gmem_to_smem(q_g.at[pl.ds(aligned, columns)], q_s, q_bar)

        def attend(init):
            plgpu.barrier_wait(q_bar)
            return _attend(q_s, p_s, k_g, v_g, tables_g, row_tables_g[row], layer, kvh, pool_length, n_pages,
                           start, stop, init, page_size=page_size, pages_per_block=pages_per_block, depth=depth,
                           scale=scale)
        if fused:
            o, m, total = _with_newest(attend, new_kv, k_g, v_g, q_s, p_s, row=row, kvh=kvh, layer=layer,
                                       split=split, length=length, scale=scale)
        else:
            o, m, total = attend(_empty_state(head_dim, columns))
        o = o * lax.broadcast_in_dim(1.0 / jnp.where(total > 0, total, 1.0), o.shape, [1])
        _store(outs, o, log_sum_exp(m, total), split, first, column, group)

    pl.run_scoped(body, plgpu.SMEM((columns, head_dim), q_g.dtype, transforms=swizzled()),
                  plgpu.SMEM((columns, pages_per_block * page_size), q_g.dtype, transforms=swizzled()),
                  plgpu.Barrier(num_barriers=1))


def _store(outs, o, lse, split, first, column, group: int):
    """out^T's group columns -> rows [first, first + group) of out (or split's partials, with
    their log-sum-exps, one scalar store each: a TMA box is at least 16 bytes). Its wait covers
    every store this block issued (the newest K/V's too)."""
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


def _flat(x, rows: int):
    """x [N, R, Dh] as [N * R, Dh] rows, zero-padded to ``rows``: blocks read 8-aligned runs of
    it by TMA, whose tiled boxes need the array's rows a multiple of 8 and in bounds (a copy only
    where N * R is not; Ouro's 16 heads never pad)."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if rows <= flat.shape[0] else jnp.pad(flat, ((0, rows - flat.shape[0]), (0, 0)))


@functools.partial(jax.jit, static_argnames=("scale", "pages_per_block", "num_splits", "max_concurrent_steps",
                                             "interpret", "return_partials"))
def paged_attention_mosaic(q, k_pages, v_pages, block_tables, row_tables, lengths, *, layer=None,
                           scale: float | None = None, pages_per_block: int | None = None,
                           num_splits: int | None = None, max_concurrent_steps: int | None = None, interpret=False,
                           return_partials: bool = False, new_kv=None):
    """The kernel; callers go through ``kernels.paged_attention`` (backend="mosaic").

    q [N, H, Dh]; k_pages, v_pages: one layer's [Hkv, P, S, Dh] pool or the stacked [L, Hkv, P,
    S, Dh] pool with ``layer`` (int32, may be traced). new_kv = (k_new, v_new [N, Hkv, Dh],
    write_page [M, N], write_offset [N]): each row's key at position lengths - 1 is k_new / v_new
    (the pool is read below it), stored on every write plane; returns (out, k_pages, v_pages),
    the pools updated in place (donate them). return_partials (num_splits > 1): the raw (o [S, N,
    H, Dh], lse [S, N, H]) float32. max_concurrent_steps: K/V slots (None: ``mosaic_launch``'s).
    interpret: True or an ``InterpretGPUParams`` runs Mosaic GPU's interpreter (CPU)."""
    unstacked = k_pages.ndim == 4
    if unstacked:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    (n, heads, head_dim), (num_kv, page_size) = q.shape, (k_pages.shape[1], k_pages.shape[3])
    group, fused = heads // num_kv, new_kv is not None
    launch = mosaic_launch(q, k_pages, pages_per_block=pages_per_block, max_concurrent_steps=max_concurrent_steps,
                           fused=fused)
    if launch.unsupported:
        raise ValueError(f"paged_attention_mosaic: {launch.unsupported}")
    ppb, depth, columns = launch.pages_per_block, launch.depth, query_columns(heads, group)
    splits = num_splits or default_num_splits(n, num_kv, block_tables.shape[1], ppb, page_size)
    last_run = ((n - 1) * heads + (num_kv - 1) * group) // 8 * 8      # the last group's 8-aligned run
    args = [jnp.asarray(layer, jnp.int32).reshape(1), lengths, row_tables, block_tables,
            _flat(q, last_run + columns)]
    if fused:
        k_new, v_new, write_page, write_offset = new_kv
        k_ref, v_ref = jax.new_ref(k_pages), jax.new_ref(v_pages)
        new_rows = -(-n * num_kv // 8) * 8     # tiled TMA boxes need a multiple of 8 rows
        args += [k_ref, v_ref, _flat(k_new, new_rows), _flat(v_new, new_rows), write_page.reshape(-1, n),
                 write_offset]
    else:
        args += [k_pages, v_pages]
    outs = plgpu.kernel(
        functools.partial(_kernel, heads=heads, group=group, page_size=page_size, pages_per_block=ppb, depth=depth,
                          splits=splits, fused=fused, scale=head_dim ** -0.5 if scale is None else float(scale)),
        out_type=[jax.ShapeDtypeStruct((n * heads, head_dim), q.dtype)] if splits == 1 else
        [jax.ShapeDtypeStruct((splits, n * heads, head_dim), jnp.float32),
         jax.ShapeDtypeStruct((splits, n * heads), jnp.float32)],
        grid=(n, num_kv, splits), grid_names=("row", "kvh", "split"),
        kernel_name=f"rlt_paged_attention_mgpu{'_write' if fused else ''}_g{group}_ppb{ppb}_s{splits}",
        **launch_settings(interpret),
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

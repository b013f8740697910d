"""Depth-aware paged attention decode: a Pallas kernel for the Triton GPU backend.

Same layout and semantics as `kernels.paged_attention_ref` (read its docstring):
  q [N, H, Dh], k_pages/v_pages [Hkv, num_pages, page_size, Dh],
  block_tables [num_tables, pages_per_table] int32, row_tables [N] int32, lengths [N] int32.

Grid (row, kv head, split). One program owns the G = H // Hkv query heads that
share one KV head, for one row, over one contiguous range of that row's pages
(flash-decoding split-K). It loops over blocks of `pages_per_block` pages: the
page ids come from the row's block table (row_tables[row]) as one small vector
load, K and V for the block are gathered as [pages_per_block * page_size, Dh],
and an online softmax in float32 accumulates in float32. Splits divide the row's
*own* page count (cdiv(lengths[row], page_size)), not the table's capacity, so
ragged rows stay balanced and a split with nothing to do exits at once.

Scores: G == 1 (MHA, e.g. Ouro) multiplies and sums elementwise in float32 (no
tensor core shape constraints, no 16x padding); G >= 2 uses `plgpu.dot` with the
head group padded (by masked loads and stores, no XLA copies) to at least 16
rows, the tensor-core minimum.

Fused write (``paged_attention_write``): q_ref is q | k | v [N, H + 2 Hkv, Dh]; split 0
stores the row's new K/V; with RoPE, q and the new key are rotated in registers at full
width (each column's rotate-half partner is a gather load), so the pool is still read in
full-width blocks.

num_splits == 1 writes the final [N, H, Dh] output in q's dtype directly;
num_splits > 1 writes per-split normalized outputs and log-sum-exps (float32)
that `kernels.split_merge.combine_splits` merges in XLA.

Addressing: K/V are indexed through the block dimension (BlockSpec on the head
axis, an index vector on the page axis); the Pallas Triton lowering multiplies
indices by strides in int64 whenever the pool exceeds 2**32 bytes, so pools
larger than 2**31 elements are addressed correctly. Nothing here computes
page * page_size * head_dim in int32.

Page ids past the row's needed pages are replaced by page 0 before the gather
(masked loads), so garbage/-1 entries beyond a row's length are never
dereferenced. Entries within the length must be valid page ids.

head_dim need not be a power of two: it is processed as power-of-two column chunks
(96 = 64 + 32; any multiple of 16), each loaded, dotted and stored separately.

Triton constraints respected: every block shape is a power of two (page_size,
pages_per_block, head-dim chunks, padded group); dot operands are >= 16 in each dim
(page_size * pages_per_block >= 16 is enforced); no dynamic shapes (dynamic
loop bounds only). float32 dots run at IEEE precision (Triton's default is TF32).

Defaults (``kernels.paged_attention_launch``, tuned on H200): 64-key blocks, 4 warps, 2 stages,
about one split per 512 keys of table capacity, raised until the grid has >= 1024
programs; the fused decode kernel at 32+ rows (G == 1, 128-wide heads, up to 4 write planes) with
tables of up to 1,024 keys takes 32-key blocks, 3 stages and 2 splits, with one warp a
program from 64 rows.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from rltjax.kernels.paged_attention_launch import resolve_launch
from rltjax.kernels.split_merge import combine_splits, log_sum_exp, split_range
from rltjax.kernels.triton_common import cdiv, head_dim_chunks, kernel_rope_supported, next_pow2, stacked_pool

NEG_INF = float("-inf")


def _rope_tables(cos_ref, sin_ref, row, head_dim: int):
    """Rotate-half RoPE at full width: x_rot = x * cos + x[partner] * signed_sin, with
    partner(i) = i +- Dh/2 (a gather load) and the sine negated on the first half: the same
    float32 terms as ``rope_rotate_half_ref`` (lo cos - hi sin, hi cos + lo sin), while K/V
    stay one full-width block. -> (partner [Dh] int32, cos, signed_sin [Dh] float32)."""
    col = jax.lax.broadcasted_iota(jnp.int32, (head_dim,), 0)
    half = head_dim // 2
    first = col < half
    angle = jnp.where(first, col, col - half)
    sin = plgpu.load(sin_ref.at[row, angle])
    return jnp.where(first, col + half, angle), plgpu.load(cos_ref.at[row, angle]), jnp.where(first, -sin, sin)


def _rotate(x, x_partner, cos, signed_sin):
    return (x.astype(jnp.float32) * cos + x_partner.astype(jnp.float32) * signed_sin).astype(x.dtype)


def _kernel(layer_ref, lengths_ref, row_tables_ref, block_tables_ref, q_ref, k_ref, v_ref, *refs,
            group: int, group_pad: int, page_size: int, pages_per_block: int,
            pages_per_table: int, num_splits: int, scale: float, use_dot: bool, fused_write: bool,
            rope: bool):
    row = pl.program_id(0)
    kvh = pl.program_id(1)
    split = pl.program_id(2)
    layer = layer_ref[0]
    head_dim = q_ref.shape[-1]
    chunks = head_dim_chunks(head_dim)          # one chunk when RoPE runs here (Dh a power of two)
    block_k = pages_per_block * page_size

    length = jnp.clip(lengths_ref[row], 0, pages_per_table * page_size)
    if fused_write:
        # q_ref is q | k | v [N, H + 2 Hkv, Dh]. The row's newest key (position length - 1)
        # is the K/V it writes in this call: the pool is read below it, and split 0 folds
        # the new key in from registers (and stores it), so no program reads a slot another
        # program is writing.
        num_kv = k_ref.shape[1]
        num_heads = q_ref.shape[1] - 2 * num_kv
        if rope:
            cos_ref, sin_ref, *refs = refs
            partner, cos, signed_sin = _rope_tables(cos_ref, sin_ref, row, head_dim)
        write_page_ref, write_offset_ref, *out_refs = refs
        has_new = length > 0
        new_k = [plgpu.load(q_ref.at[row, num_heads + kvh, pl.ds(off, w)]) for off, w in chunks]  # [w] each
        new_v = [plgpu.load(q_ref.at[row, num_heads + num_kv + kvh, pl.ds(off, w)]) for off, w in chunks]
        if rope:
            new_k = [_rotate(new_k[0], plgpu.load(q_ref.at[row, num_heads + kvh, partner]), cos, signed_sin)]
        k_out_ref, v_out_ref = out_refs[-2:]
        out_refs = out_refs[:-2]
        offset = write_offset_ref[row]
        # Every write plane's page in one vector load and each chunk in one scatter store:
        # a loop over the planes would wait on a page load before each store (Ouro: 4
        # dependent loads ahead of the attention; Huginn: up to its cache's loops). Page 0
        # (scratch: padded rows, dropped writes, a row's shallower planes) and the planes'
        # power-of-two padding (loaded as page 0) are masked off.
        num_planes = write_page_ref.shape[0]
        plane = jax.lax.broadcasted_iota(jnp.int32, (next_pow2(num_planes),), 0)

        @pl.when(split == 0)
        def _store():
            pages = plgpu.load(write_page_ref.at[jnp.minimum(plane, num_planes - 1), row],  # clamped:
                               mask=plane < num_planes, other=0)      # [Mp]; interpret mode's gather
            keep = (pages != 0)[:, None]
            for (off, w), kc, vc in zip(chunks, new_k, new_v):
                cols = off + jax.lax.broadcasted_iota(jnp.int32, (1, w), 1)     # array indices only:
                for out_ref, new in ((k_out_ref, kc), (v_out_ref, vc)):       # interpret mode's scatter
                    plgpu.store(out_ref.at[layer, kvh, pages[:, None], offset, cols],
                                jnp.broadcast_to(new[None, :], (plane.shape[0], w)), mask=keep)

        length = jnp.maximum(length - 1, 0)
    else:
        out_refs = refs
    table = row_tables_ref[row]
    n_pages = cdiv(length, page_size)
    start, stop = split_range(cdiv(n_pages, pages_per_block), split, num_splits)

    # float32 inputs: IEEE products (Triton's default for f32 tl.dot is TF32, ~1e-3 error).
    dot = functools.partial(plgpu.dot, precision=jax.lax.Precision.HIGHEST
                            if q_ref.dtype == jnp.float32 else None)
    head_ok = jax.lax.broadcasted_iota(jnp.int32, (group_pad,), 0) < group
    heads = pl.ds(kvh * group, group_pad)
    qs = [plgpu.load(q_ref.at[row, heads, pl.ds(off, width)], mask=head_ok[:, None], other=0)
          for off, width in chunks]                                      # [Gp, w] each
    if rope:
        head_ids = kvh * group + jax.lax.broadcasted_iota(jnp.int32, (group_pad, 1), 0)
        q_partner = plgpu.load(q_ref.at[row, head_ids, partner[None, :]], mask=head_ok[:, None], other=0)
        qs = [_rotate(qs[0], q_partner, cos[None, :], signed_sin[None, :])]
    qs = [qc if use_dot else qc.astype(jnp.float32) * scale for qc in qs]

    def body(b, carry):
        os, m, l = carry
        slot = b * pages_per_block + jax.lax.broadcasted_iota(jnp.int32, (pages_per_block,), 0)
        ids = plgpu.load(block_tables_ref.at[table, pl.ds(b * pages_per_block, pages_per_block)],
                         mask=slot < n_pages, other=0)                   # [ppb]; page 0 past the length
        tok = b * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        visible = tok < length
        ks = [k_ref[layer, kvh, ids, :, pl.ds(off, w)].reshape(block_k, w) for off, w in chunks]
        vs = [v_ref[layer, kvh, ids, :, pl.ds(off, w)].reshape(block_k, w) for off, w in chunks]
        if use_dot:
            s = sum(dot(qc, kc, trans_b=True) for qc, kc in zip(qs, ks)) * scale  # [Gp, bk]
            s = jnp.where(visible[None, :], s, NEG_INF)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[:, None])
            l = l * alpha + jnp.sum(p, axis=1)
            pv = p.astype(vs[0].dtype)
            os = [o * alpha[:, None] + dot(pv, vc) for o, vc in zip(os, vs)]
        else:                                                            # G == 1: [bk] scores
            s = sum(jnp.sum(qc * kc.astype(jnp.float32), axis=1) for qc, kc in zip(qs, ks))
            s = jnp.where(visible, s, NEG_INF)
            m_new = jnp.maximum(m, jnp.max(s))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new)
            l = l * alpha + jnp.sum(p)
            os = [o * alpha + jnp.sum(p[:, None] * vc.astype(jnp.float32), axis=0)
                  for o, vc in zip(os, vs)]
        return os, m_new, l

    # Every block in [start, stop) holds >= 1 visible key, so m is finite after
    # the first iteration and exp(-inf - m) = 0: masking makes no NaNs.
    shape = (group_pad,) if use_dot else ()
    init = ([jnp.zeros(shape + (w,), jnp.float32) for _, w in chunks],
            jnp.full(shape, NEG_INF, jnp.float32), jnp.zeros(shape, jnp.float32))
    if fused_write:      # split 0 starts from the new key: score s, weight 1, value v
        own = (split == 0) & has_new
        if use_dot:
            s_new = sum(jnp.sum(qc.astype(jnp.float32) * kc.astype(jnp.float32)[None, :], axis=1)
                        for qc, kc in zip(qs, new_k)) * scale                   # [Gp]
            values = [jnp.broadcast_to(vc.astype(jnp.float32)[None, :], shape + vc.shape) for vc in new_v]
        else:
            s_new = sum(jnp.sum(qc * kc.astype(jnp.float32)) for qc, kc in zip(qs, new_k))
            values = [vc.astype(jnp.float32) for vc in new_v]
        init = ([jnp.where(own, vc, o) for vc, o in zip(values, init[0])],
                jnp.where(own, jnp.broadcast_to(s_new, shape), init[1]),
                jnp.where(own, jnp.ones(shape, jnp.float32), init[2]))
    os, m, l = jax.lax.fori_loop(start, stop, body, init)

    has = l > 0
    inv = 1.0 / jnp.where(has, l, 1.0)
    lse = log_sum_exp(m, l)
    if use_dot:
        os = [o * inv[:, None] for o in os]
    else:
        os = [(o * inv)[None, :] for o in os]
        lse = jnp.broadcast_to(lse, (1,))
    mask = head_ok[:, None]
    if num_splits == 1:
        (o_ref,) = out_refs
        for (off, w), o in zip(chunks, os):
            plgpu.store(o_ref.at[row, heads, pl.ds(off, w)], o.astype(o_ref.dtype), mask=mask)
    else:
        o_ref, lse_ref = out_refs
        for (off, w), o in zip(chunks, os):
            plgpu.store(o_ref.at[split, row, heads, pl.ds(off, w)], o, mask=mask)
        plgpu.store(lse_ref.at[split, row, heads], lse, mask=head_ok)


@functools.partial(jax.jit, static_argnames=(
    "scale", "pages_per_block", "num_splits", "num_warps", "num_stages", "use_dot",
    "interpret", "return_partials"))
def paged_attention_pallas(q, k_pages, v_pages, block_tables, row_tables, lengths, *,
                           layer=None, scale: float | None = None, pages_per_block: int | None = None,
                           num_splits: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, use_dot: bool | None = None,
                           interpret: bool = False, return_partials: bool = False, new_kv=None):
    """The kernel; callers should go through `kernels.paged_attention.paged_attention`
    (or ``paged_attention_write`` for ``new_kv``).

    With return_partials (and num_splits > 1) returns the raw (o [S, N, H, Dh] f32,
    lse [S, N, H] f32) instead of the combined output. k_pages/v_pages may be one
    layer's [Hkv, P, S, Dh] pool or the stacked [L, Hkv, P, S, Dh] pool with ``layer``
    (a traced int32 scalar): the kernel then reads that layer in place, so a layer
    scan passes the whole pool without an XLA slice copy.

    new_kv = (write_page [M, N], write_offset [N], rope: None or (cos, sin) [N, Dh/2] f32):
    q is then q | k_new | v_new [N, H + 2 Hkv, Dh] in the pool's dtype; q and k_new are
    rotated (rotate-half) when rope is given; each row's new K/V is stored at every
    (write_page[m], write_offset) with a page other than 0 and is its key at position
    lengths - 1; returns (out, k_pages, v_pages), the pools updated in place (aliased:
    donate them).
    """
    unstacked = k_pages.ndim == 4
    k_pages, v_pages, layer = stacked_pool(k_pages, v_pages, layer)
    n, num_heads, head_dim = q.shape
    _, num_kv, _, page_size, _ = k_pages.shape
    rope = new_kv is not None and new_kv[2] is not None
    if new_kv is not None:
        num_heads -= 2 * num_kv                  # q is q | k_new | v_new
    if rope and not kernel_rope_supported(head_dim):
        raise ValueError(f"in-kernel RoPE needs a power-of-two head_dim >= 32, got {head_dim}")
    pages_per_table = block_tables.shape[1]
    group = num_heads // num_kv
    if use_dot is None:
        use_dot = group > 1
    if not use_dot and group != 1:
        raise ValueError("the elementwise path needs H == Hkv (use_dot=True for GQA)")
    group_pad = max(16, next_pow2(group)) if use_dot else 1
    pages_per_block, num_splits, num_warps, num_stages = resolve_launch(
        n, num_kv, page_size, pages_per_table, head_dim, elementwise=not use_dot,
        write_planes=new_kv[0].size // n if new_kv is not None else 0, pages_per_block=pages_per_block,
        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)
    scale = head_dim ** -0.5 if scale is None else float(scale)

    kernel = functools.partial(
        _kernel, group=group, group_pad=group_pad, page_size=page_size,
        pages_per_block=pages_per_block, pages_per_table=pages_per_table,
        num_splits=num_splits, scale=scale, use_dot=use_dot, fused_write=new_kv is not None,
        rope=rope)
    whole = lambda shape: pl.BlockSpec(shape, lambda r, h, s: (0,) * len(shape))
    pool = whole(k_pages.shape)     # indexed in the kernel by (layer, kv head, page ids)
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((n, num_heads, head_dim), q.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((num_splits, n, num_heads, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, n, num_heads), jnp.float32)]
    args = [layer, lengths, row_tables, block_tables, q, k_pages, v_pages]
    aliases = {}
    if new_kv is not None:
        write_page, write_offset, cos_sin = new_kv
        args += [*(cos_sin or ()), write_page.reshape(-1, n), write_offset]
        aliases = {5: len(out_shape), 6: len(out_shape) + 1}     # the pools, updated in place
        out_shape += [jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype)] * 2
    outs = pl.pallas_call(
        kernel,
        grid=(n, num_kv, num_splits),
        in_specs=[whole(a.shape) for a in args[:5]] + [pool, pool] + [whole(a.shape) for a in args[7:]],
        out_specs=[whole(s.shape) for s in out_shape],
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"rlt_paged_attention{'_write' if new_kv is not None else ''}{'_rope' if rope else ''}"
             f"_g{group}_ppb{pages_per_block}"
             f"_s{num_splits}",
    )(*args)
    if new_kv is not None:
        outs, pools = outs[:-2], tuple(p[0] if unstacked else p for p in outs[-2:])
    if num_splits == 1:
        out = outs[0]
    elif return_partials:
        out = tuple(outs)
    else:
        out = combine_splits(*outs, q.dtype)
    return out if new_kv is None else (out, *pools)

"""Paged attention for prefill chunks: the validated wrapper ``paged_prefill_attention``
and its flash-style Pallas kernel (Triton backend); the reference is ``paged_attention_ref``.

Same layout and per-row semantics as `kernels.paged_attention_ref`, plus one
precondition on how rows are laid out (the engine's prefill batches keep it):

  query blocks:  rows are taken in aligned blocks of ``block_q`` (row i is in
                 block i // block_q); every row of a block with length > 0 reads
                 the same block table. Rows with length 0 (padding) may sit anywhere.

A prefill chunk is consecutive positions of one sequence at one plane, so when
each chunk starts at a multiple of ``block_q`` all its blocks qualify. The
per-row decode kernel re-reads a row's whole prefix for every row (quadratic
traffic in the chunk length); here one program reads each KV block once for its
``program_rows`` rows of a chunk and multiplies [program_rows, Dh] x [Dh, block_k] on
tensor cores.

Grid (program block, query head, key split). A program takes ``program_rows`` rows (a
power-of-two multiple of ``block_q``; by default 64, over the engine's 32-row blocks: 1.2-2.8x
faster than 32-row programs on an H200 at engine-shaped prefill batches:
scripts/bench_prefill.py), so it holds up to program_rows / block_q aligned blocks and as many
tables. For each block whose table no earlier block of the program has, it loops over that
table's key blocks up to its longest row (online softmax in float32, per-row causal mask
``key < length``, rows of other tables masked out); blocks of one chunk share a table and cost
one loop. It writes [program_rows, Dh]. With key_splits > 1 (a launch option, default 1) each
program takes its share of every table's key blocks and writes a normalized partial with its
log-sum-exp, which ``split_merge.combine_splits`` merges in XLA. A row whose table is none of
its program's blocks' tables gets NaN: a broken layout is loud, never silently wrong. Rows with
length 0 get zeros.

Addressing and head_dim chunking as in `kernels.paged_attention_pallas` (int64 strides for
pools beyond 2**31 elements; page ids past the needed pages replaced by page 0).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from rltjax.kernels.paged_attention import fail, resolve_impl, validate
from rltjax.kernels.paged_attention_ref import paged_attention_ref
from rltjax.kernels.split_merge import combine_splits, log_sum_exp, split_range
from rltjax.kernels.triton_common import cdiv, head_dim_chunks, is_pow2, stacked_pool

# The aligned query blocks (rows of one block read one table); the engine aligns chunks to
# it. Programs take PROGRAM_ROWS = 64 rows, so two blocks of one chunk share a program, while
# short prompts pad only to 32 rows.
DEFAULT_BLOCK_Q = 32
NEG_INF = float("-inf")
TARGET_BLOCK_K = 64          # keys per inner iteration
PROGRAM_ROWS = 64            # query rows a program multiplies at once (at least block_q)


def _kernel(layer_ref, lengths_ref, row_tables_ref, block_tables_ref, q_ref, k_ref, v_ref, *out_refs,
            block_q: int, program_rows: int, group: int, page_size: int, pages_per_block: int,
            pages_per_table: int, key_splits: int, scale: float):
    pb = pl.program_id(0)
    head = pl.program_id(1)
    split = pl.program_id(2)
    kvh = head // group
    layer = layer_ref[0]
    chunks = head_dim_chunks(q_ref.shape[-1])
    block_k = pages_per_block * page_size
    rows = pl.ds(pb * program_rows, program_rows)

    lengths = jnp.clip(lengths_ref[rows], 0, pages_per_table * page_size)       # [R]
    tables = row_tables_ref[rows]                                                # [R]
    live = lengths > 0
    row = jax.lax.broadcasted_iota(jnp.int32, (program_rows,), 0)

    dot = functools.partial(plgpu.dot, precision=jax.lax.Precision.HIGHEST
                            if q_ref.dtype == jnp.float32 else None)
    qs = [q_ref[rows, head, pl.ds(off, w)] for off, w in chunks]                # [R, w]

    def body(b, carry, table, mine, n_pages):
        os, m, l = carry
        slot = b * pages_per_block + jax.lax.broadcasted_iota(jnp.int32, (pages_per_block,), 0)
        ids = plgpu.load(block_tables_ref.at[table, pl.ds(b * pages_per_block, pages_per_block)],
                         mask=slot < n_pages, other=0)
        tok = b * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        visible = (tok[None, :] < lengths[:, None]) & mine[:, None]             # [R, bk]
        ks = [k_ref[layer, kvh, ids, :, pl.ds(off, w)].reshape(block_k, w) for off, w in chunks]
        vs = [v_ref[layer, kvh, ids, :, pl.ds(off, w)].reshape(block_k, w) for off, w in chunks]
        s = sum(dot(qc, kc, trans_b=True) for qc, kc in zip(qs, ks)) * scale    # [R, bk] f32
        s = jnp.where(visible, s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        # A row can see nothing in this block (shorter than its neighbours, or another table's
        # row): keep it where it is without NaNs by exponentiating against a finite stand-in.
        m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        pv = p.astype(vs[0].dtype)
        os = [o * alpha[:, None] + dot(pv, vc) for o, vc in zip(os, vs)]
        return os, m_new, l

    carry = ([jnp.zeros((program_rows, w), jnp.float32) for _, w in chunks],
             jnp.full((program_rows,), NEG_INF, jnp.float32), jnp.zeros((program_rows,), jnp.float32))
    ok = ~live
    seen = []                        # (has a live row, table) of the program's earlier blocks
    for blk in range(program_rows // block_q):
        in_blk = (row >= blk * block_q) & (row < (blk + 1) * block_q) & live
        # the table of the block's first live row (every live row's, under the precondition)
        first = jnp.min(jnp.where(in_blk, row, program_rows))
        table = jnp.sum(jnp.where(row == first, tables, 0))
        has = first < program_rows
        new = has
        for had, t in seen:
            new = new & ~(had & (t == table))
        mine = live & (tables == table) & new
        n_pages = cdiv(jnp.max(jnp.where(mine, lengths, 0)), page_size)
        start, stop = split_range(cdiv(n_pages, pages_per_block), split, key_splits)
        carry = jax.lax.fori_loop(start, stop, functools.partial(body, table=table, mine=mine, n_pages=n_pages),
                                  carry)
        ok = ok | (live & has & (tables == table))
        seen.append((has, table))
    _write_out(out_refs, carry, ok, chunks, rows, head, split)


def _write_out(out_refs, carry, ok, chunks, rows, head, split):
    """[program_rows, Dh] normalized (NaN for a row no block of the program serves); with key
    splits, the split's partial and its log-sum-exp, merged by split_merge.combine_splits."""
    os, m, l = carry
    inv = 1.0 / jnp.where(l > 0, l, 1.0)
    os = [jnp.where(ok[:, None], o * inv[:, None], jnp.nan) for o in os]
    if len(out_refs) == 1:
        (o_ref,) = out_refs
        for (off, w), o in zip(chunks, os):
            o_ref[rows, head, pl.ds(off, w)] = o.astype(o_ref.dtype)
    else:
        o_ref, lse_ref = out_refs
        for (off, w), o in zip(chunks, os):
            o_ref[split, rows, head, pl.ds(off, w)] = o
        lse_ref[split, rows, head] = log_sum_exp(m, l)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "program_rows", "pages_per_block",
                                             "num_warps", "num_stages", "key_splits", "return_partials",
                                             "interpret"))
def paged_prefill_attention_pallas(q, k_pages, v_pages, block_tables, row_tables, lengths, *, layer=None,
                                   scale: float | None = None, block_q: int = DEFAULT_BLOCK_Q,
                                   program_rows: int | None = None, pages_per_block: int | None = None,
                                   num_warps: int = 4, num_stages: int | None = None, key_splits: int = 1,
                                   return_partials: bool = False, interpret: bool = False):
    """The kernel; callers go through ``paged_prefill_attention``.
    block_q: the layout's aligned blocks (the precondition); program_rows: the rows a program
    takes, a multiple of block_q (None: max(block_q, PROGRAM_ROWS)). N need not be a multiple
    of either (rows are padded with length 0 here). key_splits: programs a (row block, head)'s
    keys are split over (flash-decoding's split-K: more programs where a few chunks attend over
    long prefixes), their partials merged in XLA (return_partials: the [S, N, H, Dh] normalized
    partials and [S, N, H] log-sum-exps instead)."""
    k_pages, v_pages, layer = stacked_pool(k_pages, v_pages, layer)
    n, num_heads, head_dim = q.shape
    _, num_kv, _, page_size, _ = k_pages.shape
    pages_per_table = block_tables.shape[1]
    if pages_per_block is None:
        pages_per_block = max(1, TARGET_BLOCK_K // page_size, 16 // page_size)
    if num_stages is None:
        num_stages = 3
    program_rows = max(block_q, PROGRAM_ROWS) if program_rows is None else program_rows
    if pages_per_block & (pages_per_block - 1) or pages_per_block * page_size < 16:
        raise ValueError(f"pages_per_block must be a power of two with pages_per_block * page_size >= 16, "
                         f"got {pages_per_block}")
    if block_q < 16 or block_q & (block_q - 1):
        raise ValueError(f"block_q must be a power of two >= 16 (tensor-core tiles), got {block_q}")
    if key_splits < 1:
        raise ValueError(f"key_splits must be >= 1, got {key_splits}")
    if program_rows < block_q or not is_pow2(program_rows):
        raise ValueError(f"program_rows must be a power of two >= block_q={block_q} (so a multiple of it), "
                         f"got {program_rows}")
    pad = -n % program_rows
    if pad:
        q = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
        row_tables = jnp.pad(row_tables, (0, pad))
        lengths = jnp.pad(lengths, (0, pad))
    scale = head_dim ** -0.5 if scale is None else float(scale)
    kernel = functools.partial(_kernel, block_q=block_q, program_rows=program_rows, group=num_heads // num_kv,
                               page_size=page_size, pages_per_block=pages_per_block, pages_per_table=pages_per_table,
                               key_splits=key_splits, scale=scale)
    whole = lambda shape: pl.BlockSpec(shape, lambda *program: (0,) * len(shape))
    if key_splits == 1:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        out_shape = (jax.ShapeDtypeStruct((key_splits, *q.shape), jnp.float32),
                     jax.ShapeDtypeStruct((key_splits, *q.shape[:2]), jnp.float32))
    out = pl.pallas_call(
        kernel,
        grid=((n + pad) // program_rows, num_heads, key_splits),
        in_specs=[whole((1,)), whole(lengths.shape), whole(row_tables.shape), whole(block_tables.shape),
                  whole(q.shape), whole(k_pages.shape), whole(k_pages.shape)],
        out_specs=jax.tree.map(lambda o: whole(o.shape), out_shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"rlt_paged_prefill_rows{program_rows}_bq{block_q}_ppb{pages_per_block}"
             + (f"_split{key_splits}" if key_splits > 1 else ""),
    )(layer, lengths, row_tables, block_tables, q, k_pages, v_pages)
    if key_splits == 1:
        return out[:n]
    return tuple(x[:, :n] for x in out) if return_partials else combine_splits(*out, q.dtype)[:n]


def paged_prefill_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                            block_tables: jax.Array, row_tables: jax.Array, lengths: jax.Array, *,
                            layer: jax.Array | int | None = None, impl: str = "auto",
                            interpret: bool = False, scale: float | None = None,
                            block_q: int = DEFAULT_BLOCK_Q, program_rows: int | None = None) -> jax.Array:
    """``paged_attention`` for prefill chunks: same arguments and result, one more
    precondition for the kernel (``paged_prefill_attention_pallas``): in every aligned block of
    ``block_q`` rows, the rows with length > 0 read one block table. The XLA path takes
    any layout. ``program_rows``: the kernel's rows a program (None: its default). A Mosaic
    GPU or jax-triton port replaces the "pallas" branch only.
    """
    validate(q, k_pages, v_pages, block_tables, row_tables, lengths, layer, impl)
    if block_q < 16 or block_q & (block_q - 1):
        fail("block_q", f"expected a power of two >= 16, got {block_q}")
    impl = resolve_impl(impl, q, k_pages)
    if impl == "xla":
        return paged_attention_ref(q, k_pages, v_pages, block_tables, row_tables, lengths,
                                   layer=layer, scale=scale)
    return paged_prefill_attention_pallas(q, k_pages, v_pages, block_tables, row_tables, lengths,
                                          layer=layer, scale=scale, block_q=block_q, program_rows=program_rows,
                                          interpret=interpret)

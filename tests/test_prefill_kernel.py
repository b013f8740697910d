"""The flash-style prefill kernel (interpret mode) equals the XLA reference on engine-shaped
prefill batches: chunks of consecutive positions, each starting at a block_q-aligned row,
padding rows (length 0) in between; a broken layout is loud (NaN), never silently wrong."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from rltjax.kernels.prefill_attention import paged_prefill_attention
from rltjax.kernels.paged_attention_ref import paged_attention_ref

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}
BLOCK_Q = 16
N_ROWS, N_TABLES, PAGES_PER_TABLE = 64, 4, 8        # fixed so interpret-mode compiles are reused


def prefill_batch(rng, chunks, *, num_kv, group, page_size, head_dim, dtype, block_q=BLOCK_Q):
    """chunks: [(table, start, n)]; each starts at the next block_q-aligned row."""
    num_pages = PAGES_PER_TABLE * N_TABLES + 1
    shape = (num_kv, num_pages, page_size, head_dim)
    k = jnp.asarray(rng.standard_normal(shape), dtype)
    v = jnp.asarray(rng.standard_normal(shape), dtype)
    tables = np.stack([1 + rng.permutation(num_pages - 1)[:PAGES_PER_TABLE] for _ in range(N_TABLES)])
    row_tables, lengths = np.zeros(N_ROWS, np.int32), np.zeros(N_ROWS, np.int32)
    row = 0
    for table, start, n in chunks:
        row_tables[row:row + n] = table
        lengths[row:row + n] = np.arange(start, start + n) + 1
        row = -(-(row + n) // block_q) * block_q
    q = jnp.asarray(rng.standard_normal((N_ROWS, num_kv * group, head_dim)), dtype)
    return (q, k, v, jnp.asarray(tables, jnp.int32), jnp.asarray(row_tables), jnp.asarray(lengths))


@st.composite
def chunk_lists(draw, page_size, block_q):
    cap = PAGES_PER_TABLE * page_size
    chunks, rows = [], 0
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.integers(1, 24))
        if rows + n > N_ROWS:
            break
        start = draw(st.integers(0, cap - n))
        chunks.append((draw(st.integers(0, N_TABLES - 1)), start, n))
        rows = -(-(rows + n) // block_q) * block_q
    return chunks


@settings(max_examples=9, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), seed=st.integers(0, 2**31 - 1), num_kv=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 2, 4]), page_size=st.sampled_from([8, 16]),
       head_dim=st.sampled_from([64, 96]), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
       block_q=st.sampled_from([16, 32]), blocks_a_program=st.sampled_from([None, 1]))
def test_prefill_kernel_matches_reference(data, seed, num_kv, group, page_size, head_dim, dtype, block_q,
                                          blocks_a_program):
    """blocks_a_program None: the default 64-row programs, which hold 2-4 aligned blocks here
    and so up to 4 chunks' tables (each looped over once); 1: one block a program."""
    chunks = data.draw(chunk_lists(page_size, block_q))
    case = prefill_batch(np.random.default_rng(seed), chunks, num_kv=num_kv, group=group,
                         page_size=page_size, head_dim=head_dim, dtype=dtype, block_q=block_q)
    program_rows = None if blocks_a_program is None else block_q * blocks_a_program
    out = paged_prefill_attention(*case, impl="pallas", interpret=True, block_q=block_q, program_rows=program_rows)
    ref = paged_attention_ref(*case)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=TOL[dtype], rtol=TOL[dtype])
    assert not np.any(np.asarray(out)[np.asarray(case[5]) == 0])     # padding rows are zeros


def test_stacked_pool_and_unaligned_row_count():
    """The stacked [L, ...] pool read at a traced layer; N not a multiple of block_q."""
    rng = np.random.default_rng(3)
    q, k, v, bt, rt, ln = prefill_batch(rng, [(2, 5, 20), (1, 0, 9)], num_kv=2, group=1, page_size=8,
                                        head_dim=64, dtype=jnp.float32)
    k5, v5 = jnp.stack([k * 0.5, k]), jnp.stack([v * 0.5, v])
    n = 41
    out = paged_prefill_attention(q[:n], k5, v5, bt, rt[:n], ln[:n], layer=jnp.int32(1),
                                  impl="pallas", interpret=True, block_q=BLOCK_Q)
    ref = paged_attention_ref(q[:n], k, v, bt, rt[:n], ln[:n])
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


def test_broken_layout_is_nan_not_wrong():
    """Two live rows of one query block reading different tables: the kernel cannot serve
    the second, so it returns NaN for it (the XLA path would be right; the engine never
    builds such a batch)."""
    rng = np.random.default_rng(4)
    q, k, v, bt, rt, ln = prefill_batch(rng, [(0, 0, 8)], num_kv=1, group=1, page_size=8,
                                        head_dim=64, dtype=jnp.float32)
    rt = rt.at[8].set(3)
    ln = ln.at[8].set(4)
    out = np.asarray(paged_prefill_attention(q, k, v, bt, rt, ln, impl="pallas", interpret=True, block_q=BLOCK_Q))
    assert np.all(np.isnan(out[8]))
    ref = np.asarray(paged_attention_ref(q, k, v, bt, rt, ln))
    np.testing.assert_allclose(out[:8], ref[:8], atol=2e-5, rtol=2e-5)


def test_a_row_may_read_another_block_table_of_its_program():
    """A program loops over each of its blocks' tables for every row of that table, so a row
    whose table is a later block's (in the same 64-row program) is served, not NaN; one
    whose table no block of its program has is NaN."""
    rng = np.random.default_rng(6)
    q, k, v, bt, rt, ln = prefill_batch(rng, [(0, 0, 8), (2, 30, 10)], num_kv=1, group=2, page_size=8,
                                        head_dim=64, dtype=jnp.float32)
    rt, ln = rt.at[9].set(2).at[10].set(3), ln.at[9].set(21).at[10].set(5)   # block 0: tables 0, 2, 3
    out = np.asarray(paged_prefill_attention(q, k, v, bt, rt, ln, impl="pallas", interpret=True, block_q=BLOCK_Q))
    ref = np.asarray(paged_attention_ref(q, k, v, bt, rt, ln))
    served = np.asarray(ln) > 0
    served[10] = False
    np.testing.assert_allclose(out[served], ref[served], atol=2e-5, rtol=2e-5)
    assert np.all(np.isnan(out[10]))


@pytest.mark.parametrize("name, chunks, program_rows", [
    # (table, start, n) per chunk, each from the next 16-row block; programs of 64 rows
    ("tables A, B, A, B in one program", [(1, 3, 16), (2, 40, 16), (1, 19, 16), (2, 56, 5)], 64),
    ("an empty block, then table 0", [(0, 0, 0), (0, 10, 12)], 64),
    ("one program of padding only", [(3, 0, 9)], 32),
    ("128-row programs over a padded tail", [(0, 0, 16), (1, 7, 16), (0, 16, 16), (3, 2, 7)], 128),
])
def test_fixed_layouts_of_several_blocks_a_program(name, chunks, program_rows):
    """Layouts hypothesis reaches only by chance: a table met again after another one, a
    block with no live row before one of table 0 (the stand-in table of an empty block), a
    program with no live row, programs wider than the batch."""
    rng = np.random.default_rng(8)
    q, k, v, bt, rt, ln = prefill_batch(rng, [c for c in chunks if c[2]], num_kv=2, group=2, page_size=8,
                                        head_dim=64, dtype=jnp.float32)
    if name == "an empty block, then table 0":
        rt, ln = jnp.roll(rt, BLOCK_Q), jnp.roll(ln, BLOCK_Q)       # block 0 left empty
    out = np.asarray(paged_prefill_attention(q, k, v, bt, rt, ln, impl="pallas", interpret=True, block_q=BLOCK_Q,
                                             program_rows=program_rows))
    ref = np.asarray(paged_attention_ref(q, k, v, bt, rt, ln))
    assert not np.any(np.isnan(out))
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
    assert not np.any(out[np.asarray(ln) == 0])


@pytest.mark.parametrize("key_splits", [2, 3, 5])
@pytest.mark.parametrize("chunks", [
    [(1, 3, 16), (2, 40, 16), (1, 19, 16), (2, 56, 5)],      # tables met twice in one program
    [(0, 50, 14), (3, 0, 9)],                               # a long prefix and a fresh prompt
])
def test_key_splits_match_reference(chunks, key_splits):
    """Each split takes its share of a table's key blocks (16-key blocks here: up to 4 a table,
    so some splits of a short row have none); the merged partials equal the reference, padding
    rows stay zeros and a row no block of its program serves stays NaN."""
    from rltjax.kernels.prefill_attention import paged_prefill_attention_pallas
    rng = np.random.default_rng(11)
    q, k, v, bt, rt, ln = prefill_batch(rng, chunks, num_kv=2, group=2, page_size=8, head_dim=64,
                                        dtype=jnp.float32)
    live_rows = np.flatnonzero(np.asarray(ln))
    broken = int(live_rows[1])      # the first chunk's second row: a table no chunk has, not served
    rt, ln = rt.at[broken].set(min(set(range(4)) - {c[0] for c in chunks})), ln.at[broken].set(7)
    out = np.asarray(paged_prefill_attention_pallas(q, k, v, bt, rt, ln, block_q=BLOCK_Q, pages_per_block=2,
                                                    key_splits=key_splits, interpret=True))
    one = np.asarray(paged_prefill_attention_pallas(q, k, v, bt, rt, ln, block_q=BLOCK_Q, pages_per_block=2,
                                                    interpret=True))
    ref = np.asarray(paged_attention_ref(q, k, v, bt, rt, ln))
    served = np.asarray(ln) > 0
    served[broken] = False
    np.testing.assert_allclose(out[served], ref[served], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(out[served], one[served], atol=2e-5, rtol=2e-5)
    assert np.all(np.isnan(out[broken])) and np.all(np.isnan(one[broken]))
    assert not np.any(out[np.asarray(ln) == 0])


def test_each_key_split_takes_its_own_blocks():
    """The partials themselves: one chunk (rows at lengths 41..56: 7 pages of 8, so 4 blocks of 16
    keys) over 3 splits of 2, 2 and 0 blocks. Each split's log-sum-exp and partial equal numpy's
    softmax over that split's keys alone, and the empty split has none (-inf)."""
    from rltjax.kernels.prefill_attention import paged_prefill_attention_pallas
    rng = np.random.default_rng(12)
    q, k, v, bt, rt, ln = prefill_batch(rng, [(1, 40, 16)], num_kv=1, group=1, page_size=8, head_dim=64,
                                        dtype=jnp.float32)
    o, lse = paged_prefill_attention_pallas(q, k, v, bt, rt, ln, block_q=BLOCK_Q, pages_per_block=2, key_splits=3,
                                            return_partials=True, interpret=True)
    keys = np.asarray(k)[0][np.asarray(bt)[1]].reshape(-1, 64)            # table 1's keys in order
    values = np.asarray(v)[0][np.asarray(bt)[1]].reshape(-1, 64)
    for r in range(16):
        length = int(ln[r])
        scores = keys[:length] @ np.asarray(q)[r, 0] / 8.0
        for split, (lo, hi) in enumerate([(0, 32), (32, 64), (64, 64)]):
            s = scores[lo:min(hi, length)]
            if s.size == 0:
                assert lse[split, r, 0] == -np.inf and not np.any(np.asarray(o)[split, r, 0])
                continue
            np.testing.assert_allclose(lse[split, r, 0], np.logaddexp.reduce(s), rtol=1e-5)
            p = np.exp(s - np.logaddexp.reduce(s))
            np.testing.assert_allclose(o[split, r, 0], p @ values[lo:lo + s.size], atol=2e-5, rtol=2e-5)


def test_block_q_validation():
    rng = np.random.default_rng(5)
    case = prefill_batch(rng, [(0, 0, 4)], num_kv=1, group=1, page_size=8, head_dim=64, dtype=jnp.float32)
    with pytest.raises(ValueError, match="block_q"):
        paged_prefill_attention(*case, impl="pallas", interpret=True, block_q=24)
    for program_rows in (48, 96, 16, 0):       # not a multiple, not a power of two, < block_q, zero
        with pytest.raises(ValueError, match="program_rows"):
            paged_prefill_attention(*case, impl="pallas", interpret=True, block_q=32, program_rows=program_rows)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,block_q,program_rows,key_splits", [
    (jnp.bfloat16, 16, None, 1), (jnp.bfloat16, 32, None, 1), (jnp.bfloat16, 32, 32, 1), (jnp.bfloat16, 32, 128, 1),
    (jnp.bfloat16, 64, None, 1), (jnp.float16, 32, None, 1), (jnp.float32, 32, None, 1),
    (jnp.bfloat16, 32, None, 4), (jnp.float32, 32, 128, 3)])
def test_prefill_kernel_compiled_on_gpu(dtype, block_q, program_rows, key_splits):
    """Compiled (not interpreted) on the GPU at Ouro-like head sizes, GQA 2, page 16; the
    default 64-row programs hold two or four blocks (block_q 32 / 16), some of two chunks;
    key splits merged."""
    from rltjax.kernels.prefill_attention import paged_prefill_attention_pallas
    rng = np.random.default_rng(7)
    num_pages = 200
    k = jnp.asarray(rng.standard_normal((4, num_pages, 16, 128)), dtype)
    v = jnp.asarray(rng.standard_normal((4, num_pages, 16, 128)), dtype)
    tables = jnp.asarray(np.stack([1 + rng.permutation(num_pages - 1)[:48] for _ in range(3)]), jnp.int32)
    row_tables, lengths = [], []
    for table, start, n in [(0, 0, 100), (2, 500, 64), (1, 700, 3)]:
        pad = -len(row_tables) % block_q
        row_tables += [0] * pad + [table] * n
        lengths += [0] * pad + list(range(start + 1, start + n + 1))
    q = jnp.asarray(rng.standard_normal((len(lengths), 8, 128)), dtype)
    case = (q, k, v, tables, jnp.asarray(row_tables, jnp.int32), jnp.asarray(lengths, jnp.int32))
    out = paged_prefill_attention_pallas(*case, block_q=block_q, program_rows=program_rows, key_splits=key_splits)
    with jax.default_matmul_precision("highest"):     # XLA's GPU default for float32 is TF32
        ref = paged_attention_ref(*case)
    tol = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3}.get(dtype, 1e-4)   # f32: as the decode kernel GPU test
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)

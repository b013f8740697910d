"""The depth-aware read rule on hand-built values: writes per loop plus copy-on-exit leave each
plane reading min(d, e) (last_exited) or e (shared); copy batches and their padding."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from rltjax.cache.kv_update import copy_slots, exit_copy_slots, pack_copies, write_kv
from rltjax.cache.paged_kv import PagedKV, PagedKVBackend, PagedMeta

L, HKV, DH = 2, 2, 4


@functools.partial(jax.jit, donate_argnums=(0,))
def write_rows(kv, vals, page, offset):
    """vals [L, N]: each row writes K = vals, V = -vals (broadcast over heads and Dh) at every layer."""
    for layer in range(L):
        k = jnp.broadcast_to(vals[layer][:, None, None], (vals.shape[1], HKV, DH))
        kv = write_kv(kv, jnp.int32(layer), k, -k, page, offset)
    return kv


def value(layer, seq, depth, pos):
    return 1000 * layer + 100 * seq + 10 * depth + pos + 1.0


def simulate(exits, R, page_size, kv_layout, seed):
    """Run every token's loops (rows of all sequences batched per loop, padded), copy-on-exit per step."""
    num_seqs, T = len(exits), len(exits[0])
    planes = R if kv_layout == "last_exited" else 1
    ppt = -(-T // page_size)
    perm = np.random.default_rng(seed).permutation(np.arange(1, 1 + num_seqs * planes * ppt))
    tables = perm.reshape(-1, ppt).astype(np.int32)
    table_of_plane = np.arange(num_seqs * planes).reshape(num_seqs, planes)
    shape = (L, HKV, 1 + tables.size, page_size, DH)
    kv = PagedKV(jnp.full(shape, -7.0), jnp.full(shape, -7.0))
    for pos in range(T):
        for r in range(1, R + 1):
            vals, pages, offs = np.zeros((L, num_seqs), np.float32), np.zeros(num_seqs, np.int32), \
                np.zeros(num_seqs, np.int32)
            for s in range(num_seqs):
                if r <= exits[s][pos]:   # else: a padded row (page 0)
                    t = table_of_plane[s, r - 1 if kv_layout == "last_exited" else 0]
                    vals[:, s] = [value(layer, s, r, pos) for layer in range(L)]
                    pages[s], offs[s] = tables[t, pos // page_size], pos % page_size
            kv = write_rows(kv, jnp.asarray(vals), jnp.asarray(pages), jnp.asarray(offs))
        if kv_layout == "last_exited":  # all exits of this step in one copy batch
            copies = [exit_copy_slots(tables, table_of_plane, s, pos, exits[s][pos], R, page_size)
                      for s in range(num_seqs)]
            kv = copy_slots(kv, *pack_copies(copies, num_seqs * (R - 1)))
    return kv, tables, table_of_plane


def check_read_rule(kv, tables, table_of_plane, exits, R, page_size, kv_layout):
    k, v = np.asarray(kv.k), np.asarray(kv.v)
    for s, seq_exits in enumerate(exits):
        for d in range(1, R + 1):
            t = table_of_plane[s, d - 1 if kv_layout == "last_exited" else 0]
            for pos, e in enumerate(seq_exits):
                read = min(d, e) if kv_layout == "last_exited" else e
                page, off = tables[t, pos // page_size], pos % page_size
                for layer in range(L):
                    assert np.all(k[layer, :, page, off] == value(layer, s, read, pos)), (s, d, pos)
                    assert np.all(v[layer, :, page, off] == -value(layer, s, read, pos))


@pytest.mark.parametrize("kv_layout", ["last_exited", "shared"])
def test_read_rule_hand_built(kv_layout):
    exits, R, ps = [[4, 2, 3]], 4, 2
    kv, tables, top = simulate(exits, R, ps, kv_layout, seed=0)
    check_read_rule(kv, tables, top, exits, R, ps, kv_layout)
    # Through attention: q = 0 gives uniform weights, so a query at plane d and position p returns
    # -(mean of the values it reads at positions 0..p).
    backend = PagedKVBackend()
    for d in range(1, R + 1):
        t = top[0, d - 1 if kv_layout == "last_exited" else 0]
        meta = PagedMeta(positions=jnp.arange(3, dtype=jnp.int32), write_page=jnp.zeros(3, jnp.int32),
                         write_offset=jnp.zeros(3, jnp.int32), row_tables=jnp.full(3, t, jnp.int32),
                         lengths=jnp.arange(1, 4, dtype=jnp.int32), block_tables=jnp.asarray(tables))
        out = np.asarray(backend.attend(kv, jnp.int32(1), jnp.zeros((3, 2 * HKV, DH)), meta))
        reads = [min(d, e) if kv_layout == "last_exited" else e for e in exits[0]]
        want = [-np.mean([value(1, 0, reads[j], j) for j in range(p + 1)]) for p in range(3)]
        np.testing.assert_allclose(out, np.broadcast_to(np.array(want)[:, None, None], out.shape), rtol=1e-6)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), R=st.integers(2, 5), T=st.integers(1, 10), page_size=st.sampled_from([1, 2, 4]),
       kv_layout=st.sampled_from(["last_exited", "shared"]), seed=st.integers(0, 1000))
def test_random_exit_patterns_follow_read_rule(data, R, T, page_size, kv_layout, seed):
    exits = data.draw(st.lists(st.lists(st.integers(1, R), min_size=T, max_size=T), min_size=1, max_size=3))
    kv, tables, top = simulate(exits, R, page_size, kv_layout, seed)
    check_read_rule(kv, tables, top, exits, R, page_size, kv_layout)


def test_exit_copy_slots_lists_planes_below_and_above():
    tables = np.array([[5, 6], [7, 8], [9, 10]], np.int32)      # planes 0..2 of one sequence
    src_p, src_o, dst_p, dst_o = exit_copy_slots(tables, lambda s, p: p, 0, 3, 1, 3, 2)
    assert src_p.tolist() == [6, 6] and src_o.tolist() == [1, 1]
    assert dst_p.tolist() == [8, 10] and dst_o.tolist() == [1, 1]
    assert all(len(a) == 0 for a in exit_copy_slots(tables, np.array([[0, 1, 2]]), 0, 3, 3, 3, 2))
    with pytest.raises(ValueError):
        exit_copy_slots(tables, lambda s, p: p, 0, 0, 4, 3, 2)
    with pytest.raises(ValueError, match="exceed"):
        pack_copies([exit_copy_slots(tables, lambda s, p: p, 0, 0, 1, 3, 2)], 1)



def test_copies_land_beside_dropped_padding():
    """Entries with destination page 0 (padding) are dropped, not written, even with a live
    source; the real copies still land, also one that reads out of page 0, and no other slot
    (page 0 included) changes."""
    rng = np.random.default_rng(3)
    shape = (2, 2, 4, 4, 8)                                   # [L, Hkv, P, S, Dh]
    kv = PagedKV(k=jnp.asarray(rng.standard_normal(shape), jnp.float32),
                 v=jnp.asarray(rng.standard_normal(shape), jnp.float32))
    before = jax.tree.map(np.asarray, kv)
    src_p, src_o = np.array([0, 2, 0, 2], np.int32), np.array([3, 1, 0, 1], np.int32)
    dst_p, dst_o = np.array([3, 1, 0, 0], np.int32), np.array([0, 2, 0, 3], np.int32)
    out = jax.tree.map(np.asarray, copy_slots(kv, *map(jnp.asarray, (src_p, src_o, dst_p, dst_o))))
    for name in ("k", "v"):
        b, o = getattr(before, name), getattr(out, name)
        np.testing.assert_array_equal(o[:, :, 3, 0], b[:, :, 0, 3])   # copied out of page 0
        np.testing.assert_array_equal(o[:, :, 1, 2], b[:, :, 2, 1])
        expect = b.copy()
        expect[:, :, 3, 0], expect[:, :, 1, 2] = b[:, :, 0, 3], b[:, :, 2, 1]
        np.testing.assert_array_equal(o, expect)                      # nothing else changed, page 0 too

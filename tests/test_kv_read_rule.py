"""The depth-aware read rule on hand-built values: writes per loop, each written through to the
deeper planes, leave each plane reading min(d, e) (last_exited) or e (shared); the device's
write-through pages equal the host's."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from rltjax.cache.kv_update import write_kv, write_plane_mask, write_through_pages
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
    """Run every token's loops (rows of all sequences batched per loop, padded); each row writes
    its plane and, written through, the deeper ones (``write_plane_mask``). No copy on exit."""
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
            vals, pages, offs = np.zeros((L, num_seqs), np.float32), np.zeros((planes, num_seqs), np.int32), \
                np.zeros(num_seqs, np.int32)
            for s in range(num_seqs):
                if r <= exits[s][pos]:   # else: a padded row (page 0)
                    vals[:, s] = [value(layer, s, r, pos) for layer in range(L)]
                    mask = write_plane_mask(np.array([r - 1 if kv_layout == "last_exited" else 0]), np.array([R]),
                                            planes)[:, 0]
                    for p in np.flatnonzero(mask):
                        pages[p, s] = tables[table_of_plane[s, p], pos // page_size]
                    offs[s] = pos % page_size
            kv = write_rows(kv, jnp.asarray(vals), jnp.asarray(pages), jnp.asarray(offs))
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


def test_write_planes_below_the_cap():
    mask = write_plane_mask(np.array([1, 1, 3, 0]), np.array([4, 2, 4, 7]), 4)
    assert [np.flatnonzero(mask[:, i]).tolist() for i in range(4)] == [
        [1, 2, 3],          # its own plane and the deeper ones
        [1],                # max_loops 2: planes past it are never read
        [3],                # the last loop: its own plane only
        [0, 1, 2, 3]]       # a cap above the engine's planes: all of them
    assert write_plane_mask(np.array([0]), np.array([7]), 1).tolist() == [[True]]    # shared: one plane


@settings(max_examples=30, deadline=None)
@given(data=st.data(), num_planes=st.integers(1, 5), page_size=st.sampled_from([1, 2, 4]))
def test_device_write_through_pages_equal_the_host_rule(data, num_planes, page_size):
    """``write_through_pages`` (decode windows) == the rule row by row: the row's plane up to
    min(planes, max_loops), active rows only (the step path's mask is the same function)."""
    b = data.draw(st.integers(1, 6))
    ppt = 4
    block_tables = np.arange(1, 1 + b * num_planes * ppt, dtype=np.int32).reshape(b * num_planes, ppt)
    plane_tables = np.arange(b * num_planes, dtype=np.int32).reshape(b, num_planes)
    max_loops = np.array(data.draw(st.lists(st.integers(1, 6), min_size=b, max_size=b)), np.int32)
    plane = np.array([data.draw(st.integers(0, max(0, min(num_planes, m) - 1))) for m in max_loops], np.int32)
    positions = np.array(data.draw(st.lists(st.integers(0, ppt * page_size - 1), min_size=b, max_size=b)), np.int32)
    active = np.array(data.draw(st.lists(st.booleans(), min_size=b, max_size=b)))
    got = np.asarray(write_through_pages(jnp.asarray(plane_tables), jnp.asarray(plane), jnp.asarray(max_loops),
                                         jnp.asarray(positions), jnp.asarray(active), jnp.asarray(block_tables),
                                         page_size))
    want = np.zeros((num_planes, b), np.int32)
    for i in np.flatnonzero(active):
        for p in range(int(plane[i]), min(num_planes, int(max_loops[i]))):
            want[p, i] = block_tables[plane_tables[i, p], positions[i] // page_size]
    np.testing.assert_array_equal(got, want)

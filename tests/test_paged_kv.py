"""Paged KV (rltjax.cache): the model on paged planes equals the dense oracle; the read rule; padding; sizing."""
from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from checkpoints.loader import load_checkpoint
from conftest import reference_model, reference_npz
from rltjax.cache.kv_update import copy_slots, exit_copy_slots, pack_copies, write_kv
from rltjax.cache.paged_kv import PagedKV, PagedKVBackend, PagedMeta
from rltjax.cache.sizing import (KVSizingError, allocate_paged_kv, bytes_per_page,
                                 kv_bytes_per_token_per_plane, num_pages_for_memory)
from rltjax.models.base import get_model
from rltjax.reference.exits import TokenExit
from rltjax.sampling_params import SamplingParams

FIXTURES = Path(__file__).parent / "fixtures"
PROMPT = [int(t) for t in reference_npz("ouro-tiny")["p1_input_ids"]]
PAD_ROW = dict(positions=0, write_page=0, write_offset=0, row_tables=0, lengths=0)


@functools.cache
def checkpoint(name="ouro-tiny"):
    return load_checkpoint(FIXTURES / name, dtype="float32")


@functools.cache
def jitted_model(name):
    model = get_model(checkpoint(name).cfg)
    backend = PagedKVBackend()
    loop = jax.jit(lambda p, s, kv, meta: model.loop(p, s, None, kv, meta, backend), donate_argnums=(2,))
    return model, loop, jax.jit(model.head)


class PagedRunner:
    """Test-local driver: sequences on one page pool, a block table per (sequence, plane), pages shuffled."""

    def __init__(self, name, kv_layout, num_seqs, capacity, page_size, seed=0):
        self.params = checkpoint(name).params
        self.model, self._loop, self._head = jitted_model(name)
        self.cfg, self.layout, self.ps = self.model.cfg, kv_layout, page_size
        self.R = self.cfg.num_loops
        planes = self.R if kv_layout == "last_exited" else 1
        ppt = -(-capacity // page_size)
        num_pages = 1 + num_seqs * planes * ppt + 3                     # + spare pages never used
        perm = np.random.default_rng(seed).permutation(np.arange(1, num_pages))
        self.tables = perm[:num_seqs * planes * ppt].reshape(-1, ppt).astype(np.int32)
        self.table_of_plane = np.arange(num_seqs * planes).reshape(num_seqs, planes)
        self.kv = allocate_paged_kv(self.cfg, num_pages, page_size, jnp.float32)

    def row(self, seq, pos, depth):
        t = int(self.table_of_plane[seq, depth - 1 if self.layout == "last_exited" else 0])
        return dict(positions=pos, write_page=self.tables[t, pos // self.ps], write_offset=pos % self.ps,
                    row_tables=t, lengths=pos + 1)

    def loop(self, state, rows):
        meta = PagedMeta(**{k: jnp.int32([r[k] for r in rows]) for k in PAD_ROW},
                         block_tables=jnp.asarray(self.tables))
        state, self.kv, gate = self._loop(self.params, state, self.kv, meta)
        return state, gate

    def embed(self, tokens):
        return self.model.embed(self.params, jnp.int32(tokens))[0]

    def head(self, state):
        return np.asarray(self._head(self.params, state))

    def exit(self, seqs_positions_depths):
        """Copy-on-exit for tokens that exited early, batched into one copy_slots call."""
        if self.layout != "last_exited":
            return
        copies = [exit_copy_slots(self.tables, self.table_of_plane, s, p, d, self.R, self.ps)
                  for s, p, d in seqs_positions_depths if d < self.R]
        if copies:
            self.kv = copy_slots(self.kv, *pack_copies(copies, 2 * self.R))


def token_schedule(out, R):
    """(token, position, depth) of every token that runs loops, teacher-forced from the oracle."""
    tokens = out.prompt_token_ids + out.token_ids[:-1]
    depths = [R] * len(out.prompt_token_ids) + out.exit_depths[1:]
    return list(zip(tokens, range(len(tokens)), depths))


def reference_output(name, kv_layout, q, prompt, seed=7, max_tokens=12):
    rm = reference_model(name, kv_layout=kv_layout, exit_mode="ouro")
    sp = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, exit_threshold=q, ignore_eos=True)
    return rm.generate(prompt, sp, record_logits=True), sp


@pytest.mark.parametrize("name,kv_layout,q,page_size", [
    ("ouro-tiny", "last_exited", 0.3, 4), ("ouro-tiny", "last_exited", 0.9, 8),
    ("ouro-tiny", "shared", 0.3, 4), ("ouro-tiny", "shared", 0.9, 8),
    ("ouro-tiny-gqa", "last_exited", 0.3, 4)])
def test_single_request_matches_dense_reference(name, kv_layout, q, page_size):
    out, sp = reference_output(name, kv_layout, q, PROMPT[:9])
    runner = PagedRunner(name, kv_layout, num_seqs=1, capacity=24, page_size=page_size, seed=1)
    R, S = runner.R, len(out.prompt_token_ids)
    logits = []
    for token, pos, depth in token_schedule(out, R):
        state, rule = runner.embed([token]), TokenExit("ouro", min_loops=1, max_loops=R, threshold=q)
        for r in range(1, depth + 1):
            state, gate = runner.loop(state, [runner.row(0, pos, r)])
            hazard = float(jax.nn.sigmoid(gate[0]))
            cdf = 1 - rule.remaining * (1 - hazard)
            exits = rule.after_loop(r, hazard)
            if pos >= S and abs(cdf - q) > 1e-4:   # the paged hazards give the oracle's depth
                assert exits == (r == depth), (pos, r, depth)
        runner.exit([(0, pos, depth)])
        if pos >= S - 1:
            logits.append(runner.head(state)[0])
    np.testing.assert_allclose(np.stack(logits), np.stack(out.logits), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kv_layout", ["last_exited", "shared"])
def test_concurrent_requests_in_mixed_batches_match_reference(kv_layout):
    """Two requests share every loop() call: prefill chunks (last_exited), decode rows at different
    planes, padded rows; each request's logits equal its own dense run."""
    outs = [reference_output("ouro-tiny", kv_layout, 0.3, p, seed=s)[0]
            for p, s in ((PROMPT[:9], 7), (PROMPT[4:11], 3))]
    runner = PagedRunner("ouro-tiny", kv_layout, num_seqs=2, capacity=24, page_size=4, seed=2)
    R, N = runner.R, 8
    chunk = 3 if kv_layout == "last_exited" else 1     # shared prefill is position-sequential
    jobs = [token_schedule(o, R) for o in outs]
    cur = [None, None]          # per sequence: (jobs in flight, loop done, state)
    nxt, logits, start = [0, 0], [[], []], [0, 2]       # request 1 arrives 2 passes later
    mixed_planes = False
    for step in range(500):
        rows, owners = [], []
        for s in range(2):
            if step < start[s] or (cur[s] is None and nxt[s] == len(jobs[s])):
                continue
            if cur[s] is None:  # next job: a prompt chunk (same depth R) or one decode token
                S = len(outs[s].prompt_token_ids)
                take = min(chunk, S - nxt[s]) if nxt[s] < S else 1
                js = jobs[s][nxt[s]:nxt[s] + take]
                cur[s] = (js, 0, runner.embed([t for t, _, _ in js]))
            js, done, _ = cur[s]
            rows += [runner.row(s, p, done + 1) for _, p, _ in js]
            owners.append(s)
        if not rows:
            break
        mixed_planes |= len({cur[s][1] for s in owners}) > 1
        rows += [dict(PAD_ROW, write_offset=i % 4) for i in range(N - len(rows))]
        state_in = jnp.concatenate([cur[s][2] for s in owners] + [jnp.zeros((N - sum(
            len(cur[s][0]) for s in owners), runner.cfg.hidden_size))])
        state, _ = runner.loop(state_in, rows)
        i = 0
        for s in owners:
            js, done, _ = cur[s]
            st_s, i = state[i:i + len(js)], i + len(js)
            cur[s] = (js, done + 1, st_s)
            if done + 1 == js[0][2]:            # every job in flight shares its depth
                runner.exit([(s, p, d) for _, p, d in js])
                if js[-1][1] >= len(outs[s].prompt_token_ids) - 1:
                    logits[s].append(runner.head(st_s[-1:])[0])
                nxt[s] += len(js)
                cur[s] = None
    for s in range(2):
        np.testing.assert_allclose(np.stack(logits[s]), np.stack(outs[s].logits), rtol=1e-4, atol=1e-5)
    assert mixed_planes, "the schedule must put rows at different loops in one call"


@pytest.mark.parametrize("kv_layout", ["last_exited", "shared"])
def test_one_mixed_call_equals_single_row_calls(kv_layout):
    runner = PagedRunner("ouro-tiny", kv_layout, num_seqs=3, capacity=16, page_size=4, seed=3)
    hist = np.random.default_rng(0)
    for s, n in ((0, 6), (1, 3)):                   # some history at every plane
        for pos in range(n):
            state = runner.embed([PROMPT[pos + s]])
            for r in range(1, runner.R + 1):
                state, _ = runner.loop(state, [runner.row(s, pos, r)])
    chunk = [runner.row(2, p, 2) for p in range(6)] if kv_layout == "last_exited" else [runner.row(2, 0, 1)]
    real = [runner.row(0, 6, 3), runner.row(1, 3, 1)] + chunk
    rows = real[:1] + [dict(PAD_ROW, write_offset=1)] + real[1:] + [PAD_ROW, dict(PAD_ROW, write_offset=3)]
    states = jnp.asarray(hist.standard_normal((len(rows), runner.cfg.hidden_size)), jnp.float32)
    start = jax.tree.map(jnp.copy, runner.kv)
    batched, gate_b = runner.loop(states, rows)
    kv_b, runner.kv = runner.kv, start
    for i, r in enumerate(rows):
        if r["lengths"]:
            single, gate_s = runner.loop(states[i:i + 1], [r])
            np.testing.assert_allclose(batched[i], single[0], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(gate_b[i], gate_s[0], rtol=1e-5, atol=1e-5)
    assert np.all(np.isfinite(np.asarray(batched)))
    np.testing.assert_allclose(kv_b.k[:, :, 1:], runner.kv.k[:, :, 1:], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kv_b.v[:, :, 1:], runner.kv.v[:, :, 1:], rtol=1e-5, atol=1e-6)


# ---- the read rule on hand-built values -----------------------------------------------------------

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


# ---- padding ----------------------------------------------------------------------------------------

def test_padded_rows_only_touch_page_zero():
    runner = PagedRunner("ouro-tiny", "last_exited", num_seqs=2, capacity=8, page_size=4, seed=4)
    rng = np.random.default_rng(1)
    rand = lambda: jnp.asarray(rng.standard_normal(runner.kv.k.shape), jnp.float32)  # noqa: E731
    runner.kv = PagedKV(rand(), rand())
    before = jax.tree.map(np.asarray, runner.kv)
    real = runner.row(1, 5, 2)
    rows = [dict(PAD_ROW, write_offset=2), PAD_ROW, real, dict(PAD_ROW, write_offset=3)]
    runner.loop(jnp.asarray(rng.standard_normal((4, runner.cfg.hidden_size)), jnp.float32), rows)
    runner.kv = copy_slots(runner.kv, *pack_copies([], 4))               # an all-padding copy batch
    for old, new in ((before.k, runner.kv.k), (before.v, runner.kv.v)):
        changed = np.any(np.asarray(new) != old, axis=(0, 1, 4))         # [num_pages, page_size]
        changed[0] = False
        assert changed[real["write_page"], real["write_offset"]]
        changed[real["write_page"], real["write_offset"]] = False
        assert not changed.any(), np.argwhere(changed)


# ---- sizing -----------------------------------------------------------------------------------------

class FakeDevice:
    platform = "gpu"

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_sizing():
    cfg = checkpoint().cfg                                  # L=2, Hkv=4, Dh=16
    assert kv_bytes_per_token_per_plane(cfg, jnp.float32) == 2 * 4 * 16 * 2 * 4
    assert kv_bytes_per_token_per_plane(cfg, jnp.bfloat16) == 2 * 4 * 16 * 2 * 2
    assert bytes_per_page(cfg, 16, jnp.bfloat16) == 16 * 512
    dev = FakeDevice({"bytes_limit": 10_000_000, "bytes_in_use": 2_000_000})
    assert num_pages_for_memory(cfg, 16, jnp.bfloat16, 0.5, dev) == 4_000_000 // (16 * 512)
    with pytest.raises(KVSizingError, match="num_pages"):
        num_pages_for_memory(cfg, 16, jnp.bfloat16, 0.9, FakeDevice(None))
    with pytest.raises(KVSizingError, match="at least 2"):
        num_pages_for_memory(cfg, 16, jnp.bfloat16, 0.9, FakeDevice({"bytes_limit": 10, "bytes_in_use": 0}))
    kv = allocate_paged_kv(cfg, 5, 8, jnp.bfloat16)
    assert kv.k.shape == kv.v.shape == (2, 4, 5, 8, 16) and kv.k.dtype == jnp.bfloat16
    assert not np.asarray(kv.k, np.float32).any()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU reports no memory statistics")
def test_sizing_on_cpu_asks_for_explicit_num_pages():
    with pytest.raises(KVSizingError, match="explicit num_pages"):
        num_pages_for_memory(checkpoint().cfg, 16, jnp.float32, 0.9)


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

"""Paged KV (rltjax.cache): the model on paged planes, each row's K/V written through to its
deeper planes, equals the dense oracle, and padded rows touch no page. The read rule on hand-built values is in
test_kv_read_rule.py, pool sizing in test_kv_sizing.py."""
from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rltjax.checkpoints.loader import load_checkpoint
from conftest import reference_model, reference_npz
from rltjax.cache.kv_update import write_plane_mask
from rltjax.cache.paged_kv import PagedKV, PagedKVBackend, PagedMeta
from rltjax.cache.sizing import allocate_paged_kv
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
        self.planes = planes = self.R if kv_layout == "last_exited" else 1
        ppt = -(-capacity // page_size)
        num_pages = 1 + num_seqs * planes * ppt + 3                     # + spare pages never used
        perm = np.random.default_rng(seed).permutation(np.arange(1, num_pages))
        self.tables = perm[:num_seqs * planes * ppt].reshape(-1, ppt).astype(np.int32)
        self.table_of_plane = np.arange(num_seqs * planes).reshape(num_seqs, planes)
        self.kv = allocate_paged_kv(self.cfg, num_pages, page_size, jnp.float32)

    def row(self, seq, pos, depth):
        """A row at loop ``depth``: reads its plane, writes it and (last_exited) the deeper ones."""
        plane = depth - 1 if self.layout == "last_exited" else 0
        pages = np.zeros(self.planes, np.int32)
        for p in np.flatnonzero(write_plane_mask(np.array([plane]), np.array([self.R]), self.planes)[:, 0]):
            pages[p] = self.tables[self.table_of_plane[seq, p], pos // self.ps]
        t = int(self.table_of_plane[seq, plane])
        return dict(positions=pos, write_page=pages, write_offset=pos % self.ps, row_tables=t, lengths=pos + 1)

    def loop(self, state, rows):
        fields = {k: jnp.int32([r[k] for r in rows]) for k in PAD_ROW if k != "write_page"}
        write_page = np.stack([np.broadcast_to(r["write_page"], (self.planes,)) for r in rows], axis=1)  # [P, N]
        meta = PagedMeta(**fields, write_page=jnp.int32(write_page), block_tables=jnp.asarray(self.tables))
        state, self.kv, gate = self._loop(self.params, state, self.kv, meta)
        return state, gate

    def embed(self, tokens):
        return self.model.embed(self.params, jnp.int32(tokens))[0]

    def head(self, state):
        return np.asarray(self._head(self.params, state))


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


# ---- padding ----------------------------------------------------------------------------------------

def test_padded_rows_touch_no_page():
    """Padded rows (write page 0) write nothing, not even the scratch page, and a real row
    writes its own plane and the deeper ones: every write that lands has its own slot (the
    scatters may then skip atomics)."""
    runner = PagedRunner("ouro-tiny", "last_exited", num_seqs=2, capacity=8, page_size=4, seed=4)
    rng = np.random.default_rng(1)
    rand = lambda: jnp.asarray(rng.standard_normal(runner.kv.k.shape), jnp.float32)  # noqa: E731
    runner.kv = PagedKV(rand(), rand())
    before = jax.tree.map(np.asarray, runner.kv)
    real = runner.row(1, 5, 2)
    rows = [dict(PAD_ROW, write_offset=2), PAD_ROW, real, dict(PAD_ROW, write_offset=3)]
    runner.loop(jnp.asarray(rng.standard_normal((4, runner.cfg.hidden_size)), jnp.float32), rows)
    written = [int(p) for p in real["write_page"] if p]
    assert len(written) == runner.R - 1                                   # depth 2: planes 1..R-1
    for old, new in ((before.k, runner.kv.k), (before.v, runner.kv.v)):
        changed = np.any(np.asarray(new) != old, axis=(0, 1, 4))         # [num_pages, page_size]
        assert changed[written, real["write_offset"]].all()
        changed[written, real["write_offset"]] = False
        assert not changed.any(), np.argwhere(changed)

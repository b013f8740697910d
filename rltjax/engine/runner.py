"""Device side of the engine: jitted pure functions over padded power-of-two shapes.

Device state is the paged KV pool and a per-slot state buffer ``[max_num_seqs + 1,
D]`` (the last row is the target of padded rows); both are donated to every
call that updates them, so XLA updates them in place. Row counts and token
counts are padded to powers of two, so a handful of executables serve every
batch; ``warm_up`` compiles all of them at start-up (XLA's persistent cache makes
later start-ups fast) and the engine never compiles in steady state.
"""
from __future__ import annotations

import functools
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rltjax.cache.kv_update import copy_slots
from rltjax.cache.paged_kv import PagedKV, PagedKVBackend, PagedMeta
from rltjax.sampling import sample_tokens, token_logprobs

NUM_TOP_LOGPROBS = 20


def bucket(n: int) -> int:
    """Smallest power of two >= n."""
    return 1 << max(0, (n - 1).bit_length())


def buckets_up_to(limit: int) -> list[int]:
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    return out + [bucket(limit)]


@functools.partial(jax.jit, static_argnames=("model", "backend", "num_loops"),
                   donate_argnames=("kv", "slot_state"))
def prefill_step(params, kv: PagedKV, slot_state, tokens, positions, write_page, write_offset,
                 row_tables, lengths, block_tables, out_slots, *, model, backend, num_loops: int):
    """Prompt tokens [T] run all R loops; per loop d they write plane d (write_page[d],
    row_tables[d]: [R, T]). A prompt's last token leaves its state in its slot."""
    x = model.embed(params, tokens)[0]                                   # [T, D]
    for d in range(num_loops):
        meta = PagedMeta(positions, write_page[d], write_offset, row_tables[d], lengths, block_tables)
        x, kv, _ = model.loop(params, x, None, kv, meta, backend)
    return kv, slot_state.at[out_slots].set(x)


@functools.partial(jax.jit, static_argnames=("model", "backend"), donate_argnames=("kv", "slot_state"))
def loop_step(params, kv: PagedKV, slot_state, lookahead_w, slots, tokens, starting, positions,
              write_page, write_offset, row_tables, lengths, block_tables, *, model, backend):
    """One loop pass over B rows, each at its own depth. Rows starting a token embed
    it; others continue from their slot state. Returns hazards and lookahead scores."""
    x = jnp.where(starting[:, None], model.embed(params, tokens)[0], slot_state[slots])
    meta = PagedMeta(positions, write_page, write_offset, row_tables, lengths, block_tables)
    x, kv, gate_logit = model.loop(params, x, None, kv, meta, backend)
    hazard = jax.nn.sigmoid(gate_logit)
    score = jax.nn.sigmoid(x.astype(jnp.float32) @ lookahead_w)
    return kv, slot_state.at[slots].set(x), hazard, score


@functools.partial(jax.jit, static_argnames=("model", "num_top"))
def head_step(params, slot_state, slots, temperature, top_k, top_p, seed_hi, seed_lo, output_index,
              *, model, num_top: int):
    """Heads of B rows: logits, a sampled token per row, and its logprobs."""
    logits = model.head(params, slot_state[slots])                       # [B, V] f32
    tokens = sample_tokens(logits, temperature, top_k, top_p, seed_hi, seed_lo, output_index)
    chosen, top_ids, top_lp = token_logprobs(logits, tokens, num_top)
    return tokens, chosen, top_ids, top_lp


class ModelRunner:
    def __init__(self, model, params, kv: PagedKV, *, max_num_seqs: int, max_num_batched_tokens: int,
                 attn_impl: str, lookahead_w: np.ndarray, max_copies: int):
        self.model = model
        self.params = params
        self.kv = kv
        self.cfg = model.cfg
        self.backend = PagedKVBackend(attn_impl=attn_impl)
        self.max_num_seqs = max_num_seqs
        self.dummy_slot = max_num_seqs
        self.slot_state = jnp.zeros((max_num_seqs + 1, self.cfg.hidden_size), params.embed.dtype)
        self.lookahead_w = jnp.asarray(lookahead_w, jnp.float32)
        self.num_top = min(NUM_TOP_LOGPROBS, self.cfg.vocab_size)
        self.row_buckets = buckets_up_to(max_num_seqs)
        self.token_buckets = buckets_up_to(max_num_batched_tokens)
        self.copy_buckets = buckets_up_to(max(1, max_copies))

    # -- calls (numpy in, numpy out) ------------------------------------------------
    def prefill(self, tokens, positions, write_page, write_offset, row_tables, out_slots, block_tables):
        t = bucket(len(tokens))
        pad = t - len(tokens)
        lengths = np.pad(positions + 1, (0, pad))
        self.kv, self.slot_state = prefill_step(
            self.params, self.kv, self.slot_state, np.pad(tokens, (0, pad)), np.pad(positions, (0, pad)),
            np.pad(write_page, ((0, 0), (0, pad))), np.pad(write_offset, (0, pad)),
            np.pad(row_tables, ((0, 0), (0, pad))), lengths.astype(np.int32), block_tables,
            np.pad(out_slots, (0, pad), constant_values=self.dummy_slot),
            model=self.model, backend=self.backend, num_loops=self.cfg.num_loops)

    def loop(self, slots, tokens, starting, positions, write_page, write_offset, row_tables, block_tables):
        b = bucket(len(slots))
        pad = b - len(slots)
        self.kv, self.slot_state, hazard, score = loop_step(
            self.params, self.kv, self.slot_state, self.lookahead_w,
            np.pad(slots, (0, pad), constant_values=self.dummy_slot), np.pad(tokens, (0, pad)),
            np.pad(starting, (0, pad)), np.pad(positions, (0, pad)), np.pad(write_page, (0, pad)),
            np.pad(write_offset, (0, pad)), np.pad(row_tables, (0, pad)),
            np.pad(positions + 1, (0, pad)).astype(np.int32), block_tables,
            model=self.model, backend=self.backend)
        n = len(slots)
        return np.asarray(hazard)[:n], np.asarray(score)[:n]

    def head(self, slots, temperature, top_k, top_p, seed_hi, seed_lo, output_index):
        b = bucket(len(slots))
        pad = b - len(slots)
        out = head_step(self.params, self.slot_state, np.pad(slots, (0, pad), constant_values=self.dummy_slot),
                        np.pad(temperature, (0, pad)), np.pad(top_k, (0, pad)),
                        np.pad(top_p, (0, pad), constant_values=1.0), np.pad(seed_hi, (0, pad)),
                        np.pad(seed_lo, (0, pad)), np.pad(output_index, (0, pad)),
                        model=self.model, num_top=self.num_top)
        n = len(slots)
        return tuple(np.asarray(x)[:n] for x in out)

    def copy(self, src_page, src_offset, dst_page, dst_offset):
        m = bucket(len(src_page))
        pad = m - len(src_page)
        self.kv = copy_slots(self.kv, *(np.pad(a, (0, pad)).astype(np.int32)
                                        for a in (src_page, src_offset, dst_page, dst_offset)))

    # -- start-up ----------------------------------------------------------------------
    def warm_up(self, block_tables: np.ndarray, show_progress: bool = True) -> float:
        """Compile every bucket now (all-padding inputs touch only the scratch page)."""
        t0 = time.perf_counter()
        jobs = ([("prefill", t) for t in self.token_buckets] + [("loop", b) for b in self.row_buckets]
                + [("head", b) for b in self.row_buckets] + [("copy", m) for m in self.copy_buckets])
        zeros = lambda n: np.zeros(n, np.int32)
        for i, (kind, n) in enumerate(jobs):
            if show_progress:
                print(f"\r[rltjax] compiling {kind} x{n} ({i + 1}/{len(jobs)})", end="", file=sys.stderr,
                      flush=True)
            if kind == "prefill":
                R = self.cfg.num_loops
                self.prefill(zeros(n), zeros(n), np.zeros((R, n), np.int32), zeros(n),
                             np.zeros((R, n), np.int32), np.full(n, self.dummy_slot, np.int32), block_tables)
            elif kind == "loop":
                self._warm_loop(n, block_tables)
            elif kind == "head":
                self.head(np.full(n, self.dummy_slot, np.int32), np.zeros(n, np.float32), zeros(n),
                          np.ones(n, np.float32), np.zeros(n, np.uint32), np.zeros(n, np.uint32), zeros(n))
            else:
                self.copy(zeros(n), zeros(n), zeros(n), zeros(n))
        jax.block_until_ready(self.kv)
        elapsed = time.perf_counter() - t0
        if show_progress:
            print(f"\r[rltjax] compiled {len(jobs)} executables in {elapsed:.1f}s", file=sys.stderr)
        return elapsed

    def _warm_loop(self, n: int, block_tables: np.ndarray) -> None:
        slots = np.full(n, self.dummy_slot, np.int32)
        z = np.zeros(n, np.int32)
        self.loop(slots, z, np.zeros(n, bool), z - 1, z, z, z, block_tables)

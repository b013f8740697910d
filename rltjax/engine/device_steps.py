"""The engine's jitted device steps: pure functions over padded power-of-two shapes.

``prefill_step`` (prompt chunks, all R loops), ``embed_step`` (boundary models'
prelude), ``loop_step`` (one loop pass over rows at mixed depths) and ``head_step``
(heads, sampling, logprobs), each taking its typed batch (``engine.batches``). Device
state (the paged KV pool, the per-slot state buffer ``[max_num_seqs + 1, D]`` whose last
row padded rows name, their writes dropped by ``slot_buffers``, and for boundary models
the boundary pool and per-slot ``inject``) is donated to every call that updates it, so
XLA updates it in place. ``engine.runner.ModelRunner`` calls these through
``DeviceSteps`` (these and the decode window of ``window.program``, rebuilt with the
engine's XLA options).
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from rltjax.cache.paged_kv import PagedKV, PagedMeta
from rltjax.engine.batches import EmbedBatch, HeadBatch, LoopBatch, PrefillBatch
from rltjax.engine.slot_buffers import set_slots
from rltjax.engine.window.program import decode_window
from rltjax.jit_options import check_options, engine_jit, with_options
from rltjax.sampling import sample_tokens, token_logprobs


def _embed(model, backend, params, tokens, bkv, bmeta, seeds):
    """The prelude -> (state, inject, bkv). This and ``_head`` are the one place that tells
    plain models (embed/head read no KV: bkv is None and stays None) from models with
    boundary stages (Huginn: the prelude/coda read and write the boundary pool ``bkv``)."""
    if bkv is None:
        state, inject = model.embed(params, tokens)
        return state, inject, None
    return model.embed(params, tokens, bkv, bmeta, backend, seeds=seeds)


def _head(model, backend, params, state, bkv, bmeta):
    """The coda -> (logits [N, V] f32, bkv). A plain model's lm_head product goes through
    ``backend.head_matmul`` (the decode windows' heads do too: the same path, the same logits)."""
    if bkv is None:
        return model.head(params, state, project=backend.head_matmul), None
    return model.head(params, state, bkv, bmeta, backend)


@engine_jit(static_argnames=("model", "backend", "num_loops", "num_top"), donate_argnames=("kv", "slot_state", "bkv"))
def prefill_step(params, kv: PagedKV, slot_state, bkv, batch: PrefillBatch, *, model, backend, num_loops: int,
                 num_top: int = 0):
    """Prompt tokens [T] run all R loops; per loop d they write plane d (write_page[d],
    row_tables[d]: [R, T]). When the engine keeps planes beyond R (a loop cap above R),
    write_page is [cap, T] and the last loop also writes planes R..cap-1: a deeper query
    reads a prompt token at its exit depth R. ``params``: layer stacks split
    (``split_layer_stacks``). A prompt's last token leaves its state in
    its slot. Boundary models: the prelude writes every row's boundary KV, and so does
    the coda (later codas attend to it; its logits are unused, so XLA drops the lm_head).
    With ``batch.targets`` (prompt logprobs) the head runs on every token's depth-R state and
    the step also returns each token's (chosen, top ids, top logprobs) for its target."""
    b = batch
    bmeta, seeds = (None, None) if b.boundary is None else (b.boundary.meta, b.boundary.seeds)
    x, inject, bkv = _embed(model, backend, params, b.tokens, bkv, bmeta, seeds)   # [T, D]

    def one_loop(d, x, kv, pages):
        meta = PagedMeta(b.positions, pages, b.write_offset, b.row_tables[d], b.lengths, b.block_tables)
        x, kv, _ = model.loop(params, x, inject, kv, meta, backend)
        return x, kv

    # Rolled over loops (Huginn runs 32 here), layers one after another on their own arrays
    # (``params`` holds ``SplitLayers``): inside the loop a slice of a stacked weight would be
    # copied before every matmul.
    x, kv = jax.lax.fori_loop(0, num_loops - 1, lambda d, c: one_loop(d, *c, b.write_page[d]), (x, kv))
    last = num_loops - 1
    x, kv = one_loop(last, x, kv, b.write_page[last:] if b.write_page.shape[0] > num_loops else b.write_page[last])
    scores = None
    if bkv is not None:              # the coda writes boundary KV for every row: it runs on all at once
        logits, bkv = _head(model, backend, params, x, bkv, bmeta)
        if b.targets is not None:
            scores = token_logprobs(logits, b.targets, num_top)
    elif b.targets is not None:
        scores = _scores_by_slices(model, backend, params, x, b.targets, num_top)
    return kv, set_slots(slot_state, b.out_slots, x), bkv, scores


SCORE_ROWS = 256     # prompt logprobs' head in slices of rows: [256, V] float32 logits at a time, not [T, V]


def _scores_by_slices(model, backend, params, x, targets, num_top: int):
    """Prompt logprobs of a plain model's rows, the head and log-softmax run a slice at a time
    (a long chunk's [T, V] logits would otherwise be live at once beside the KV pool)."""
    t = x.shape[0]
    rows = math.gcd(t, SCORE_ROWS)   # slices that divide t (token buckets are powers of two)

    def one(slice_):
        xs, ts = slice_
        return token_logprobs(_head(model, backend, params, xs, None, None)[0], ts, num_top)
    chosen, top_ids, top_lp = jax.lax.map(one, (x.reshape(t // rows, rows, -1), targets.reshape(t // rows, rows)))
    return chosen.reshape(t), top_ids.reshape(t, -1), top_lp.reshape(t, -1)


@engine_jit(static_argnames=("model", "backend"), donate_argnames=("bkv", "slot_state", "slot_inject"))
def embed_step(params, bkv: PagedKV, slot_state, slot_inject, batch: EmbedBatch, *, model, backend):
    """Boundary models: the prelude of B tokens starting their loops; writes their boundary
    KV and puts s_0 and e (the per-loop ``inject``) in their slots."""
    boundary = batch.boundary
    state, inject, bkv = _embed(model, backend, params, batch.tokens, bkv, boundary.meta, boundary.seeds)
    return bkv, set_slots(slot_state, batch.slots, state), set_slots(slot_inject, batch.slots, inject)


@engine_jit(static_argnames=("model", "backend", "raw_signal"), donate_argnames=("kv", "slot_state"))
def loop_step(params, kv: PagedKV, slot_state, slot_inject, lookahead_w, batch: LoopBatch, *, model, backend,
              raw_signal: bool):
    """One loop pass over B rows, each at its own depth. Plain models: rows starting a
    token embed it here; others continue from their slot state. Boundary models: every
    row reads its slot's state and inject (``embed_step`` ran for starting rows).
    Returns (hazard, lookahead score), or (the loop's raw signal,) when ``raw_signal``."""
    b = batch
    if slot_inject is None:
        x = jnp.where(b.starting[:, None], model.embed(params, b.tokens)[0], slot_state[b.slots])
        inject = None
    else:
        x, inject = slot_state[b.slots], slot_inject[b.slots]
    meta = PagedMeta(b.positions, b.write_page, b.write_offset, b.row_tables, b.lengths, b.block_tables)
    x, kv, signal = model.loop(params, x, inject, kv, meta, backend)
    if raw_signal:
        signals = (signal,)
    else:
        signals = (jax.nn.sigmoid(signal), jax.nn.sigmoid(x.astype(jnp.float32) @ lookahead_w))
    return kv, set_slots(slot_state, b.slots, x), signals


@engine_jit(static_argnames=("model", "backend", "num_top"), donate_argnames=("bkv", "slot_tokens"))
def head_step(params, slot_state, slot_tokens, bkv, batch: HeadBatch, *, model, backend, num_top: int):
    """Heads of B rows: logits, a sampled token per row, and its logprobs (boundary models:
    the coda also writes each row's boundary KV). Each token is also left in its row's slot of
    ``slot_tokens`` [max_num_seqs + 1], where a decode window launched before the host reads
    this head picks it up."""
    b = batch
    logits, bkv = _head(model, backend, params, slot_state[b.slots], bkv, b.boundary_meta)   # [B, V] f32
    logits = jax.lax.optimization_barrier(logits)    # one lm_head GEMM, not one per consumer
    tokens = sample_tokens(logits, b.temperature, b.top_k, b.top_p, b.seed_hi, b.seed_lo, b.output_index)
    chosen, top_ids, top_lp = token_logprobs(logits, tokens, num_top)
    return (tokens, chosen, top_ids, top_lp), set_slots(slot_tokens, b.slots, tokens), bkv


@engine_jit()
def merge_rows(after, host, replace):
    """Window rows for a continued window: the device rows ``after`` [B] (a window's rows
    after it), with the rows where ``replace`` [B] bool is set taken from ``host`` (rows the
    host built: freshly admitted requests, idle rows in place of finished ones)."""
    return jax.tree.map(lambda d, h: jnp.where(replace.reshape((-1,) + (1,) * (d.ndim - 1)), h, d), after, host)


class DeviceSteps(NamedTuple):
    """The jitted device steps of one engine (compiled with its XLA options)."""
    prefill: Callable
    embed: Callable
    loop: Callable
    head: Callable
    window: Callable
    merge_rows: Callable

    @classmethod
    def build(cls, xla_options: tuple = ()) -> "DeviceSteps":
        check_options(xla_options)
        return cls(*(with_options(step, xla_options)
                     for step in (prefill_step, embed_step, loop_step, head_step, decode_window, merge_rows)))

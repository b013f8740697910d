"""The engine's jitted device steps: pure functions over padded power-of-two shapes.

``prefill_step`` (prompt chunks, all R loops), ``embed_step`` (boundary models'
prelude), ``loop_step`` (one loop pass over rows at mixed depths) and ``head_step``
(heads, sampling, logprobs). Device state (the paged KV pool, the per-slot state
buffer ``[max_num_seqs + 1, D]`` whose last row padded rows name, their writes dropped
by ``slot_buffers``, and for boundary models the boundary pool and per-slot ``inject``)
is donated to every call
that updates it, so XLA updates it in place. ``rltjax.engine.runner.ModelRunner``
pads host batches and calls these through ``DeviceSteps`` (these and the decode
window, rebuilt with the engine's XLA options); decode windows live in
``decode_window``.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from rltjax.cache.paged_kv import PagedKV, PagedMeta
from rltjax.engine.decode_window import decode_window
from rltjax.engine.slot_buffers import set_slots
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


@engine_jit(static_argnames=("model", "backend", "num_loops"),
                   donate_argnames=("kv", "slot_state", "bkv"))
def prefill_step(params, kv: PagedKV, slot_state, tokens, positions, write_page, write_offset,
                 row_tables, lengths, block_tables, out_slots, bkv, bmeta, seeds, *, model, backend,
                 num_loops: int):
    """Prompt tokens [T] run all R loops; per loop d they write plane d (write_page[d],
    row_tables[d]: [R, T]). When the engine keeps planes beyond R (a loop cap above R),
    write_page is [cap, T] and the last loop also writes planes R..cap-1: a deeper query
    reads a prompt token at its exit depth R. ``params``: layer stacks split
    (``split_layer_stacks``). A prompt's last token leaves its state in
    its slot. Boundary models: the prelude writes every row's boundary KV, and so does
    the coda (later codas attend to it; its logits are unused, so XLA drops the lm_head)."""
    x, inject, bkv = _embed(model, backend, params, tokens, bkv, bmeta, seeds)   # [T, D]

    def one_loop(d, x, kv, pages):
        meta = PagedMeta(positions, pages, write_offset, row_tables[d], lengths, block_tables)
        x, kv, _ = model.loop(params, x, inject, kv, meta, backend)
        return x, kv

    # Rolled over loops (Huginn runs 32 here), layers one after another on their own arrays
    # (``params`` holds ``SplitLayers``): inside the loop a slice of a stacked weight would be
    # copied before every matmul.
    x, kv = jax.lax.fori_loop(0, num_loops - 1, lambda d, c: one_loop(d, *c, write_page[d]), (x, kv))
    last = num_loops - 1
    x, kv = one_loop(last, x, kv, write_page[last:] if write_page.shape[0] > num_loops else write_page[last])
    if bkv is not None:
        _, bkv = _head(model, backend, params, x, bkv, bmeta)
    return kv, set_slots(slot_state, out_slots, x), bkv


@engine_jit(static_argnames=("model", "backend"),
                   donate_argnames=("bkv", "slot_state", "slot_inject"))
def embed_step(params, bkv: PagedKV, slot_state, slot_inject, slots, tokens, seeds, bmeta, *, model, backend):
    """Boundary models: the prelude of B tokens starting their loops; writes their boundary
    KV and puts s_0 and e (the per-loop ``inject``) in their slots."""
    state, inject, bkv = _embed(model, backend, params, tokens, bkv, bmeta, seeds)
    return bkv, set_slots(slot_state, slots, state), set_slots(slot_inject, slots, inject)


@engine_jit(static_argnames=("model", "backend", "raw_signal"),
                   donate_argnames=("kv", "slot_state"))
def loop_step(params, kv: PagedKV, slot_state, lookahead_w, slots, tokens, starting, positions,
              write_page, write_offset, row_tables, lengths, block_tables, slot_inject, *, model, backend,
              raw_signal: bool):
    """One loop pass over B rows, each at its own depth. Plain models: rows starting a
    token embed it here; others continue from their slot state. Boundary models: every
    row reads its slot's state and inject (``embed_step`` ran for starting rows).
    Returns (hazard, lookahead score), or (the loop's raw signal,) when ``raw_signal``."""
    if slot_inject is None:
        x = jnp.where(starting[:, None], model.embed(params, tokens)[0], slot_state[slots])
        inject = None
    else:
        x, inject = slot_state[slots], slot_inject[slots]
    meta = PagedMeta(positions, write_page, write_offset, row_tables, lengths, block_tables)
    x, kv, signal = model.loop(params, x, inject, kv, meta, backend)
    if raw_signal:
        signals = (signal,)
    else:
        signals = (jax.nn.sigmoid(signal), jax.nn.sigmoid(x.astype(jnp.float32) @ lookahead_w))
    return kv, set_slots(slot_state, slots, x), signals


@engine_jit(static_argnames=("model", "backend", "num_top"), donate_argnames=("bkv", "slot_tokens"))
def head_step(params, slot_state, slot_tokens, slots, temperature, top_k, top_p, seed_hi, seed_lo, output_index,
              bkv, bmeta, *, model, backend, num_top: int):
    """Heads of B rows: logits, a sampled token per row, and its logprobs (boundary models:
    the coda also writes each row's boundary KV). Each token is also left in its row's slot of
    ``slot_tokens`` [max_num_seqs + 1], where a decode window launched before the host reads
    this head picks it up."""
    logits, bkv = _head(model, backend, params, slot_state[slots], bkv, bmeta)   # [B, V] f32
    logits = jax.lax.optimization_barrier(logits)    # one lm_head GEMM, not one per consumer
    tokens = sample_tokens(logits, temperature, top_k, top_p, seed_hi, seed_lo, output_index)
    chosen, top_ids, top_lp = token_logprobs(logits, tokens, num_top)
    return (tokens, chosen, top_ids, top_lp), set_slots(slot_tokens, slots, tokens), bkv


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

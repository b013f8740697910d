"""Mixed prefill (device side): whole prompts run their R loops in a decode window's first R passes,
batched with the rows decoding there (``cache.mixed_kv``: one GEMM over both, attention
split between the decode and the prefill kernels), instead of a prefill step of their own.
A prefill step reads the weights R times for its prompts alone; riding the window, they
cost what their extra rows add to passes that run anyway. The rows of their requests wait,
inactive, until the prompts' first heads (after pass R - 1) sample their first tokens.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rltjax.engine.slot_buffers import set_slots
from rltjax.engine.window.state import WindowPrompt, ends_request, sample_rows


def prompt_passes(carry, one_pass, prompt: WindowPrompt, model, weights, backend, *, dummy_slot, sampler,
                  num_top):
    """The prompts' R loops, each riding one pass of the rows (loop d writes plane d; the
    last one also the planes past R, as ``prefill_step``), then their first heads: each
    waiting row samples output 0 (depth R) from its prompt's last state and starts decoding
    it, unless that token already ends the request. ``backend``: the decode rows', whose
    ``head_matmul`` takes the lm_head product as every other head does."""
    num_loops = prompt.row_tables.shape[0]
    px = model.embed(weights, prompt.tokens)[0]                                     # [T, D]
    mixed = lambda d, pages, c: one_pass(c[0], (c[1], pages, prompt.row_tables[d]))   # noqa: E731
    carry, px = jax.lax.fori_loop(0, num_loops - 1, lambda d, c: mixed(d, prompt.write_page[d], c), (carry, px))
    last = num_loops - 1
    pages = prompt.write_page[last:] if prompt.write_page.shape[0] > num_loops else prompt.write_page[last]
    carry, px = mixed(last, pages, (carry, px))
    kv, slot_state, bkv, slot_inject, rows, out, standby = carry
    slot_state = set_slots(slot_state, prompt.out_slots, px)
    new = prompt.rows
    slots = jnp.where(new, rows.slots, dummy_slot)
    # output 0: the host built these rows as after their first token (num_out 1)
    logits = model.head(weights, slot_state[slots], project=backend.head_matmul)  # the windows' head path
    tok, chosen, top_ids, top_lp = sample_rows(logits, rows, rows.num_out - 1, sampler=sampler, num_top=num_top)
    at = jnp.where(new, 0, out.tokens.shape[1])                                     # out of range: dropped
    out = out.put(at, tok, num_loops, chosen, top_ids, top_lp, new)
    rows = dataclasses.replace(rows, tokens=jnp.where(new, tok, rows.tokens),
                               active=rows.active | (new & ~ends_request(rows, tok, rows.num_out)))
    return kv, slot_state, bkv, slot_inject, rows, out, standby

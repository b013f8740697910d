"""Self-speculative rounds on the device: a decode window whose passes are rounds.

A token's first d loops are the same computation in a draft and at full depth (DESIGN
section 5), so a round of a row at position s with up to K drafts runs:

- draft: position s, then the drafts at s + 1 .. s + K, one after another, each through loops
  1..d (writing its K/V at those planes, as plain decoding does) and, for the first K, the head
  on its depth-d state, which samples the next draft (``spec_accept.draft_tokens``);
- verify: the K + 1 shallow states stacked as one batch of (K + 1) x B rows through loops
  d + 1..D, then the head on every one of them: the target's logits at each position;
- accept (``spec_accept.accept``): the kept drafts and the target's own next token, cut at a
  stop id or max_tokens; the row's next round starts from its newest token.

Each row's own depth is its max_loops (at most the engine's target depth D): a loop the row
does not run is masked, so a request asking for fewer loops than d simply drafts at its own
full depth. A row that drafts nothing (``num_speculative_tokens`` 0, or one token left to make)
decodes plainly, with plain decoding's sampling key. Every position writes its own K/V plane
of each loop and writes through to the deeper ones (``cache.kv_update``), the layout plain
decoding leaves; a rejected position's pages hold K/V that the next round overwrites before
any query reads it (queries read positions < their own, and the round's next token sits at
the first rejected position). Rows are the window's ``WindowRows``; outputs go to its
``WindowOutputs`` columns, with each token's exit depth its max_loops.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rltjax.engine.window import spec_accept
from rltjax.engine.window.state import ends_request, pass_meta
from rltjax.sampling import token_logprobs


def rounds(ctx, carry):
    """The window's rounds over ``carry`` (``program.decode_window``'s): a fixed count, or
    (early stop) until no row is active."""
    spec = ctx.spec
    n = spec.speculative.rounds
    one = lambda c: _round(ctx, c)                  # noqa: E731
    if spec.fixed_trip:
        return jax.lax.fori_loop(0, n, lambda _, c: one(c), carry)
    return jax.lax.while_loop(lambda c: (c[5].passes < n) & jnp.any(c[4].active), one, carry)


def _loop(ctx, weights, kv, x, plane: int | jax.Array, run, pos, tables, max_loops, backend):
    """Loop ``plane + 1`` for the rows where ``run`` is set (the others keep x; their writes
    go to the scratch page) -> (x, kv)."""
    planes = jnp.full(pos.shape, plane, jnp.int32)
    meta = pass_meta(tables, planes, max_loops, pos, run, ctx.inputs.block_tables, kv.page_size)
    new, kv, _ = ctx.spec.model.loop(weights, x, None, kv, meta, backend)
    return jnp.where(run[:, None], new, x), kv


def _draft(ctx, weights, rows, kv, x, p, first, run):
    """Position s + p's draft loops 1..d (from loop ``first`` + 1: a row mid-token at s)."""
    d = ctx.spec.speculative.draft_loops

    def body(i, c):
        x, kv = c
        go = run & (i >= first) & (i < rows.max_loops)
        return _loop(ctx, weights, kv, x, i, go, rows.positions + p, rows.tables, rows.max_loops, ctx.spec.backend)
    return jax.lax.fori_loop(0, d, body, (x, kv))


def _round(ctx, carry):
    spec, sp = ctx.spec, ctx.spec.speculative
    kv, slot_state, bkv, slot_inject, rows, out, standby = carry
    weights, _ = jax.lax.optimization_barrier((ctx.weights, out.passes))
    b, k, d, depth = rows.slots.shape[0], sp.num_tokens, sp.draft_loops, sp.target_loops
    act = rows.active
    left = jnp.maximum(rows.max_tokens - rows.num_out, 0)
    drafts_made = jnp.where(act, jnp.clip(jnp.minimum(rows.spec_tokens, left - 1), 0, k), 0)   # [B]
    # position s: from the slot's state where a row is mid-token, else its token's embedding
    embed = lambda t: spec.model.embed(weights, t)[0]          # noqa: E731
    start = jnp.where(act, rows.loops_done, 0)
    x0 = jnp.where((start > 0)[:, None], slot_state[jnp.where(act, rows.slots, spec.dummy_slot)],
                   embed(jnp.where(act, rows.tokens, 0)))
    states = jnp.zeros((b, k + 1) + x0.shape[1:], x0.dtype)
    drafts = jnp.zeros((b, k), jnp.int32)
    q = None if spec.sampler == "greedy" else jnp.zeros((b, k, spec.model.cfg.vocab_size), jnp.float32)

    def draft_one(p, c):
        x, kv, states, drafts, q = c
        run = act & (p <= drafts_made)
        x, kv = _draft(ctx, weights, rows, kv, x, p, jnp.where(p == 0, start, 0), run)
        states = jax.lax.dynamic_update_index_in_dim(states, x, p, axis=1)
        logits = spec.model.head(weights, x, project=spec.backend.head_matmul)
        tok = spec_accept.draft_tokens(logits, rows, rows.num_out + p, spec.sampler)
        drafts = jax.lax.dynamic_update_index_in_dim(drafts, tok, p, axis=1)
        if q is not None:
            q = jax.lax.dynamic_update_index_in_dim(q, spec_accept.probs(logits, rows, spec.sampler), p, axis=1)
        return embed(jnp.where(act, tok, 0)), kv, states, drafts, q

    x, kv, states, drafts, q = jax.lax.fori_loop(0, k, draft_one, (x0, kv, states, drafts, q))
    x, kv = _draft(ctx, weights, rows, kv, x, k, jnp.zeros_like(start), act & (k <= drafts_made))   # k >= 1
    states = states.at[:, k].set(x)
    target, kv = _verify(ctx, weights, rows, kv, states, drafts_made, start, d, depth)
    tokens, accepted = spec_accept.accept(target, drafts, q, drafts_made, rows, rows.num_out, spec.sampler)
    made, stopped = _cut(rows, tokens, accepted + 1)
    made = jnp.where(act, made, 0)
    out = _put(ctx, rows, out, target, tokens, made, drafts_made, accepted)
    last = jnp.take_along_axis(tokens, jnp.maximum(made - 1, 0)[:, None], axis=1)[:, 0]
    moved = made > 0
    rows = dataclasses.replace(
        rows, tokens=jnp.where(moved, last, rows.tokens), positions=rows.positions + made,
        loops_done=jnp.where(moved, 0, rows.loops_done), num_out=rows.num_out + made, active=act & ~stopped)
    return kv, slot_state, bkv, slot_inject, rows, out, standby


def _verify(ctx, weights, rows, kv, states, drafts_made, start, d: int, depth: int):
    """Loops d + 1..D over the K + 1 positions of every row as one batch, then their heads ->
    (target logits [B, K + 1, V] f32, kv). Several rows share a request here, so the write and
    the attention are separate kernels (``decode_rows`` off)."""
    spec = ctx.spec
    b, k1 = states.shape[:2]
    col = jnp.arange(k1)[None, :]
    run = (rows.active[:, None] & (col <= drafts_made[:, None])).reshape(-1)
    first = jnp.where(col == 0, jnp.maximum(start[:, None], d), d).reshape(-1)
    pos = (rows.positions[:, None] + col).reshape(-1)
    rep = lambda a: jnp.repeat(a, k1, axis=0)           # noqa: E731
    tables, max_loops = rep(rows.tables), rep(rows.max_loops)
    backend = dataclasses.replace(spec.backend, decode_rows=False)
    x = states.reshape((b * k1,) + states.shape[2:])

    def body(v, c):
        x, kv = c
        return _loop(ctx, weights, kv, x, v, run & (v >= first) & (v < max_loops), pos, tables, max_loops, backend)
    x, kv = jax.lax.fori_loop(d, depth, body, (x, kv))
    logits = spec.model.head(weights, x, project=spec.backend.head_matmul)
    return logits.reshape(b, k1, -1), kv


def _cut(rows, tokens, made):
    """The round's tokens cut at the first that ends its request -> (made [B], stopped [B])."""
    made_cut, stopped = made, jnp.zeros_like(rows.active)
    for j in range(tokens.shape[1] - 1, -1, -1):       # the earliest stop wins: scan from the back
        ends = (j < made) & ends_request(rows, tokens[:, j], rows.num_out + j + 1)
        made_cut = jnp.where(ends, j + 1, made_cut)
        stopped = stopped | ends
    return made_cut, stopped


def _put(ctx, rows, out, target, tokens, made, drafts_made, accepted):
    """The round's tokens into the window's columns (with logprobs under "truncate"), and its
    draft counts."""
    spec = ctx.spec
    b, k1 = tokens.shape
    num_top = spec.num_top
    if spec.sampler == "truncate":
        chosen, top_ids, top_lp = token_logprobs(target.reshape(b * k1, -1), tokens.reshape(-1), num_top)
        chosen, top_ids, top_lp = chosen.reshape(b, k1), top_ids.reshape(b, k1, -1), top_lp.reshape(b, k1, -1)
    else:
        chosen, top_ids, top_lp = (jnp.zeros((b, k1), jnp.float32), jnp.zeros((b, k1, num_top), jnp.int32),
                                   jnp.zeros((b, k1, num_top), jnp.float32))
    base = out.count
    for j in range(k1):
        keep = j < made
        at = jnp.where(keep, base + j, spec.num_passes)             # out of range: dropped
        out = out.put(at, tokens[:, j], rows.max_loops, chosen[:, j], top_ids[:, j], top_lp[:, j], keep)
    counted = made > 0
    kept = (jnp.arange(k1 - 1)[None, :] < accepted[:, None]) & counted[:, None]     # [B, K] by position
    return dataclasses.replace(out, passes=out.passes + jnp.any(counted),
                               drafted=out.drafted + jnp.where(counted, drafts_made, 0),
                               accepted=out.accepted + kept.astype(jnp.int32))

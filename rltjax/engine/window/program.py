"""Decode windows on the device: one jitted program runs up to K loop passes.

DESIGN section 4: a loop pass costs under a millisecond, so the host must not sit between
passes. A window takes every decoding row (a request whose newest token is looping) and, on
the device, per pass: runs one loop pass for the active rows, applies the exit rule (the
host's own ``EXIT_RULES`` functions, on jax arrays), writes each row's K/V through to its
deeper planes too (so an exiting token's KV is already where ``last_exited`` reads it, with
no copy-on-exit), runs the head where a row exited (sampling with the batch-invariant
per-request keys, logprobs), checks EOS / stop token ids / max_tokens, and feeds the sampled
token back as the row's next looping token.

The trip: early stop (a ``while_loop`` that ends after K passes or when no row is active,
the head and Huginn's prelude under a ``lax.cond``; XLA's GPU runtime reads each of those
predicates back to the host, so the GPU drains and waits for the host twice a pass) or fixed
(exactly K passes, a known trip count: no predicate read, so launching it does not block the
host; the head runs every pass and keeps what exiting rows need; on the kernel path the
lm_head product is skipped on a device flag where no row exits). The outputs are the same.
The head's sampler and top-logprob count are static: the host picks the cheapest variant
exact for the window's requests (``sampling.window_sampler``).

A request whose first head was queued just before the window (``rows.first``) starts from
the token that head left in ``slot_tokens``. With a ``prompt`` (mixed prefill), admitted
prompts run their R loops in the window's first R passes, batched with the rows
(``mixed_prefill``). Standby entries (``standby``) wait on the device for rows that free up.
Models with boundary stages (Huginn) carry their boundary pool through the loop. The host
side builds the rows (``window.rows``), plans (``window.planner``) and launches
(``window.launch``) windows and reads them one window late.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from rltjax.cache.mixed_kv import MixedKVBackend, MixedMeta
from rltjax.cache.paged_kv import PagedKV, PagedMeta
from rltjax.engine.exit_policy import EXIT_RULES, TRIGGER_MODES
from rltjax.engine.slot_buffers import set_slots
from rltjax.engine.window import speculative
from rltjax.engine.window.mixed_prefill import prompt_passes
from rltjax.engine.window.standby import owned, start_standby, take_standby
from rltjax.engine.window.state import (WindowOutputs, WindowPrompt, WindowRows, ends_request, pass_meta,
                                        sample_rows)
from rltjax.jit_options import engine_jit
from rltjax.models.layers import split_layer_stacks


@dataclasses.dataclass(frozen=True)
class WindowSpec:
    """A window program's static settings (one executable per spec and row bucket)."""
    model: object
    backend: object                 # the decode rows' KV backend
    prefill_backend: object         # a prompt's (mixed prefill)
    num_passes: int                 # K
    mode: str                       # the exit mode
    layered: bool                   # last_exited (a row reads and writes its depth's plane)
    dummy_slot: int
    fixed_trip: bool
    sampler: str                    # the head's static sampler
    num_top: int                    # top logprobs ("truncate" only; else 0)
    swap_every_pass: bool           # standby entries may take rows at every pass
    speculative: object = None      # window_settings.SpecSettings: rounds instead of passes (``window.speculative``)


@struct.dataclass
class WindowState:
    """The device state a window updates in place (donated)."""
    kv: PagedKV
    slot_state: jax.Array           # [S + 1, D]
    bkv: PagedKV | None             # boundary pool (models with boundary stages)
    slot_inject: jax.Array | None   # [S + 1, D] the prelude output each loop reads (boundary models)


@struct.dataclass
class WindowInputs:
    rows: WindowRows
    block_tables: jax.Array         # [num_tables, pages_per_table] int32
    lookahead_w: jax.Array          # [D] f32 the random lookahead head
    boundary_tables: jax.Array | None
    slot_tokens: jax.Array          # [S + 1] int32 each slot's token from the last head step
    owners: jax.Array               # [S + 1] int32 each slot's request tag (-1: free)
    prompt: WindowPrompt | None = None
    standby: WindowRows | None = None


@dataclasses.dataclass(frozen=True)
class _Pass:
    """What every pass of one window reads besides its carry."""
    spec: WindowSpec
    inputs: WindowInputs
    weights: object                 # per-layer weights (``split_layer_stacks``)
    first_out: jax.Array            # [B] each row's first output index in this window
    swap_in_passes: bool
    triggers: bool                  # the exit mode can set ``triggered``


@engine_jit(static_argnames=("spec",), donate_argnames=("state",))
def decode_window(params, state: WindowState, inputs: WindowInputs, *, spec: WindowSpec):
    """Up to K loop passes (exactly K with a fixed trip) over ``inputs.rows`` -> (state, rows
    after, WindowOutputs, standby entries after). ``params`` may hold its layer stacks split
    already (the runner keeps such a copy), else they are split here once per window. Rows
    and standby entries whose request no longer holds its slot (``owners``) stop here."""
    rows, standby, prompt = inputs.rows, inputs.standby, inputs.prompt
    if standby is not None and prompt is not None:
        raise ValueError("decode_window: standby entries and a prompt cannot share a window (this is a bug)")
    rows = dataclasses.replace(rows, active=rows.active & owned(rows, inputs.owners))
    # Modes that never trigger keep every row's flag false from here, not rewritten each pass
    # (a constant carried through the loop is a kernel of its own every pass).
    triggers = spec.mode in TRIGGER_MODES
    if not triggers:
        rows = dataclasses.replace(rows, triggered=jnp.zeros_like(rows.triggered))
    if standby is not None:
        standby = start_standby(standby, inputs.owners, inputs.slot_tokens)
    # A request's first token comes from the head step queued just before this window: it
    # starts looping here, unless it already ends the request (the host's stop checks agree).
    tokens = jnp.where(rows.first, inputs.slot_tokens[rows.slots], rows.tokens)
    ends = ends_request(rows, tokens, rows.num_out)
    rows = dataclasses.replace(rows, tokens=tokens, active=rows.active & ~(rows.first & ends),
                               first=jnp.zeros_like(rows.first))
    b, k_max = rows.slots.shape[0], spec.num_passes
    first_out = rows.num_out if prompt is None else rows.num_out - prompt.rows   # a prompt's row: its first token too
    out = _empty_outputs(b, k_max, spec.num_top, spec.speculative.num_tokens if spec.speculative else 0)
    ctx = _Pass(spec, inputs, split_layer_stacks(params),      # a no-op when the caller split them already
                first_out, standby is not None and spec.swap_every_pass, triggers)
    one_pass = functools.partial(_one_pass, ctx)
    if standby is not None and not spec.swap_every_pass:
        rows, standby, out = take_standby(rows, standby, out)
    carry = (state.kv, state.slot_state, state.bkv, state.slot_inject, rows, out, standby)
    if prompt is not None:
        carry = prompt_passes(carry, one_pass, prompt, spec.model, ctx.weights, spec.backend,
                              dummy_slot=spec.dummy_slot, sampler=spec.sampler, num_top=spec.num_top)
    if spec.speculative is not None:
        carry = speculative.rounds(ctx, carry)
    elif spec.fixed_trip:
        plain = k_max - (0 if prompt is None else prompt.row_tables.shape[0])
        carry = jax.lax.fori_loop(0, plain, lambda _, c: one_pass(c), carry)
    else:
        carry = jax.lax.while_loop(functools.partial(_more, k_max, ctx.swap_in_passes), one_pass, carry)
    kv, slot_state, bkv, slot_inject, rows, out, standby = carry
    return WindowState(kv, slot_state, bkv, slot_inject), rows, out, standby


def _empty_outputs(b: int, k_max: int, num_top: int, spec_tokens: int) -> WindowOutputs:
    return WindowOutputs(tokens=jnp.zeros((b, k_max), jnp.int32), depths=jnp.zeros((b, k_max), jnp.int32),
                         chosen=jnp.zeros((b, k_max), jnp.float32),
                         top_ids=jnp.zeros((b, k_max, num_top), jnp.int32),
                         top_lp=jnp.zeros((b, k_max, num_top), jnp.float32),
                         count=jnp.zeros((b,), jnp.int32), passes=jnp.zeros((), jnp.int32),
                         swap_col=jnp.full((b,), -1, jnp.int32), swap_tag=jnp.full((b,), -1, jnp.int32),
                         drafted=jnp.zeros((b,), jnp.int32), accepted=jnp.zeros((b, spec_tokens), jnp.int32))


def _more(k_max: int, swap_in_passes: bool, carry):
    """Early stop: another pass while passes remain and a row is active (or a free row can
    still take a waiting standby entry)."""
    rows, out, standby = carry[4:]
    more = jnp.any(rows.active)
    if swap_in_passes:
        more |= jnp.any(~rows.active & (out.swap_col < 0)) & jnp.any(standby.active)
    return (out.passes < k_max) & more


def _one_pass(ctx: _Pass, carry, mixed=None):
    """One pass over the rows; mixed = (prompt state [T, D], pages, tables) of a prompt loop
    riding along -> (carry, its new state) instead of the carry."""
    spec, inputs = ctx.spec, ctx.inputs
    kv, slot_state, bkv, slot_inject, rows, out, standby = carry
    if ctx.swap_in_passes:
        rows, standby, out = take_standby(rows, standby, out)
    # The weights are loop-invariant, so XLA would hoist each layer's weight slices out of the
    # loop as materialised copies (re-copied every pass under memory pressure), and slices left
    # inside the loop are copied before each matmul: either way ~1.2 ms of copies per Ouro-1.4B
    # pass on an H200. So the loop reads per-layer arrays (``split_layer_stacks``), through a
    # barrier shared with the pass counter so XLA keeps them as they are.
    weights, _ = jax.lax.optimization_barrier((ctx.weights, out.passes))
    act = rows.active
    plane = rows.loops_done if spec.layered else jnp.zeros_like(rows.loops_done)
    meta = pass_meta(rows.tables, plane, rows.max_loops, rows.positions, act, inputs.block_tables, kv.page_size)
    pos = meta.positions
    slots = jnp.where(act, rows.slots, spec.dummy_slot)
    x, inject, bkv, slot_inject = _enter(ctx, weights, rows, act, pos, slots, slot_state, bkv, slot_inject)
    if mixed is None:
        x, kv, signal = spec.model.loop(weights, x, inject, kv, meta, spec.backend)
    else:
        px, pages, tables = mixed
        prompt = inputs.prompt
        pmeta = PagedMeta(prompt.positions, pages, prompt.write_offset, tables, prompt.positions + 1,
                          inputs.block_tables)
        b = rows.slots.shape[0]
        both, kv, signal = spec.model.loop(weights, jnp.concatenate([x, px]), None, kv, MixedMeta(meta, pmeta),
                                           MixedKVBackend(spec.backend, spec.prefill_backend, b))
        x, px, signal = both[:b], both[b:], jax.tree.map(lambda a: a[:b], signal)
    slot_state = set_slots(slot_state, slots, x)
    r, exit_now, trigger, remaining = _exits(ctx, rows, x, signal)
    exit_now = exit_now & act
    tok, chosen, top_ids, top_lp, bkv = _heads(ctx, weights, rows, x, pos, exit_now, bkv)
    # k_max: out of range, dropped; with standby a row's columns continue across a swap
    k = jnp.where(exit_now, rows.num_out - ctx.first_out if standby is None else out.count, spec.num_passes)
    out = dataclasses.replace(out.put(k, tok, r, chosen, top_ids, top_lp, exit_now),
                              passes=out.passes + (jnp.any(act) | (mixed is not None)))
    num_out = rows.num_out + exit_now
    stops = ends_request(rows, tok, num_out)
    rows = dataclasses.replace(
        rows, tokens=jnp.where(exit_now, tok, rows.tokens), positions=rows.positions + exit_now,
        loops_done=jnp.where(exit_now, 0, jnp.where(act, r, rows.loops_done)),
        remaining=jnp.where(exit_now, jnp.float32(1.0), jnp.where(act, remaining, rows.remaining)),
        triggered=jnp.where(act & ~exit_now, trigger, False) if ctx.triggers else rows.triggered,
        active=act & ~(exit_now & stops),
        num_out=num_out)
    carry = kv, slot_state, bkv, slot_inject, rows, out, standby
    return carry if mixed is None else (carry, px)


def _boundary_meta(ctx: _Pass, rows, pos, mask, page_size: int) -> PagedMeta:
    """Boundary-pool meta of the masked rows at their position (others: scratch, length 0)."""
    tables = ctx.inputs.boundary_tables
    page = tables[rows.btables, jnp.maximum(pos, 0) // page_size]
    return PagedMeta(pos, jnp.where(mask, page, 0), jnp.where(mask, pos % page_size, 0),
                     jnp.where(mask, rows.btables, 0), jnp.where(mask, pos + 1, 0), tables)


def _enter(ctx: _Pass, weights, rows, act, pos, slots, slot_state, bkv, slot_inject):
    """Each row's input to this pass -> (x, inject, bkv, slot_inject): a row starting a token
    embeds it (boundary models: the prelude, writing its boundary KV), the others continue
    from their slot's state."""
    spec = ctx.spec
    tokens = jnp.where(act, rows.tokens, 0)
    if bkv is None:
        # inactive rows re-embed token 0 (their KV and slot writes are dropped)
        starting = (rows.loops_done == 0) | ~act
        x = jnp.where(starting[:, None], spec.model.embed(weights, tokens)[0], slot_state[slots])
        return x, None, bkv, slot_inject
    starting = (rows.loops_done == 0) & act

    def prelude(bkv):
        seeds = jnp.stack([rows.seed_hi, rows.seed_lo], axis=1)     # a row's request may change
        meta = _boundary_meta(ctx, rows, pos, starting, bkv.page_size)
        return spec.model.embed(weights, tokens, bkv, meta, spec.backend, seeds=seeds)

    zeros = jnp.zeros_like(slot_state[slots])
    s0, e, bkv = (prelude(bkv) if spec.fixed_trip else
                  jax.lax.cond(jnp.any(starting), prelude, lambda bkv: (zeros, zeros, bkv), bkv))
    x = jnp.where(starting[:, None], s0, slot_state[slots])
    inject = jnp.where(starting[:, None], e, slot_inject[slots])
    return x, inject, bkv, set_slots(slot_inject, slots, inject)


def _exits(ctx: _Pass, rows, x, signal):
    """The exit rule after this pass -> (r, exit_now, trigger, remaining)."""
    r = rows.loops_done + 1
    if ctx.spec.mode == "trace":
        # the whole recorded trace rides along, so a continued window needs no host
        width = rows.trace.shape[1]
        recorded = jnp.take_along_axis(rows.trace, jnp.minimum(rows.num_out, width - 1)[:, None], axis=1)[:, 0]
        depth_now = jnp.where(rows.num_out < width, recorded, rows.max_loops)
        return r, r >= depth_now, rows.triggered, rows.remaining
    cumulative, rule = EXIT_RULES[ctx.spec.mode]
    hazard = jax.nn.sigmoid(signal)
    score = jax.nn.sigmoid(x.astype(jnp.float32) @ ctx.inputs.lookahead_w)
    remaining = (rows.remaining * (1.0 - hazard)).astype(jnp.float32) if cumulative else rows.remaining
    exit_now, trigger = rule(r, rows.min_loops, rows.max_loops, rows.threshold,
                             (1.0 - remaining).astype(jnp.float32), score, signal, rows.triggered)
    return r, exit_now, trigger, remaining


def _heads(ctx: _Pass, weights, rows, x, pos, exit_now, bkv):
    """The exiting rows' heads -> (token, logprob, top ids, top logprobs, bkv). The head reads
    x, not slot_state[slots] (a gather, a kernel a pass): the same rows for every row that
    keeps its head (active rows hold distinct slots). Fixed trip: every row's head, kept where
    a row exits (sampling keys are per request and output index, so the kept tokens are those
    a head over the exiting rows makes)."""
    spec, b, num_top = ctx.spec, rows.slots.shape[0], ctx.spec.num_top
    any_exit = jnp.any(exit_now)

    def head(bkv):
        if bkv is None:
            # fixed trip: on a pass where no row exits the head's kernel skips the lm_head
            project = functools.partial(spec.backend.head_matmul, needed=any_exit)
            logits = spec.model.head(weights, x, project=project)  # [B, V] f32
        else:    # the coda writes the exiting rows' boundary KV
            meta = _boundary_meta(ctx, rows, pos, exit_now, bkv.page_size)
            logits, bkv = spec.model.head(weights, x, bkv, meta, spec.backend)
        return sample_rows(logits, rows, rows.num_out, sampler=spec.sampler, num_top=num_top) + (bkv,)

    def no_head(bkv):
        return (jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.float32),
                jnp.zeros((b, num_top), jnp.int32), jnp.zeros((b, num_top), jnp.float32), bkv)

    return head(bkv) if spec.fixed_trip else jax.lax.cond(any_exit, head, no_head, bkv)

"""Device-side decode windows: one jitted ``while_loop`` runs up to K loop passes.

DESIGN section 4: a loop pass costs under a millisecond, so the host must not sit
between passes. A window takes every decoding row (a request whose newest token
is looping) and, on the device, per pass: runs one loop pass for the active rows,
applies the exit rule (the host's own ``EXIT_RULES`` functions, on jax arrays),
writes each row's K/V through to its deeper planes too (so an exiting token's KV is
already where ``last_exited`` reads it, with no copy-on-exit), runs the
head when any row exited (sampling with the batch-invariant per-request keys,
logprobs), checks EOS / stop token ids / max_tokens, and feeds the sampled token
back as the row's next looping token. With ``fixed_trip=False`` it stops after K passes or
when no row is active, and runs the head (and Huginn's prelude) under a ``lax.cond``; XLA's
GPU runtime reads each of those predicates back to the host, so the GPU drains and waits
for the host twice a pass. ``fixed_trip=True`` runs exactly K passes (a known trip count:
no predicate read, so launching it does not block the host) and computes the head every
pass, keeping what exiting rows need; the outputs are the same. (On the kernel path,
``PagedKVBackend.head_matmul``, the lm_head product is skipped on a device flag where no
row exits: zeros, which nothing keeps.) The head's sampler and
top-logprob count are static: the host picks the cheapest variant exact for the window's
requests (``sampling.sampler_for``), so an all-greedy window without logprobs runs an
argmax, not a vocabulary sort. The host (``window_driver``) packs the rows and reads the
outputs ([B, K] tokens, depths, logprobs) one window late: the next window is launched
from the device's row state before the host reads the last one, also when requests are
admitted into it (``window_driver``). It replays them through its
own stop checks (stop strings are host-only: tokens a row made past one are
dropped) and syncs each request's state, so a step-by-step step can follow a
window at any point and the outputs are those of the step-by-step engine. A request
whose first head was queued just before the window (``rows.first``) starts from the
token that head left in ``slot_tokens``, which the host reads after the launch. With a
``prompt`` (``mixed_prefill``), admitted prompts run their R loops in the window's first R
passes, batched with the rows, and their first heads sample the first tokens on the device.

Pages are reserved for a request's lifetime at admission, so the device finds
every write slot in the block tables itself. Models with boundary stages (Huginn)
carry their boundary pool through the loop: the prelude runs (under a cond) when
a row starts a token, the coda in the head. no_refill cohorts and
min_coda_batch_size > 1 do not run in windows.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from rltjax.cache.kv_update import write_through_pages
from rltjax.cache.mixed_kv import MixedKVBackend, MixedMeta
from rltjax.cache.paged_kv import PagedKV, PagedMeta
from rltjax.engine.exit_policy import EXIT_RULES, TRIGGER_MODES
from rltjax.engine.mixed_prefill import WindowPrompt, prompt_passes
from rltjax.engine.slot_buffers import set_slots
from rltjax.engine.standby import owned, start_standby, take_standby
from rltjax.engine.window_state import WindowOutputs, WindowRows, ends_request, sample_rows
from rltjax.jit_options import engine_jit
from rltjax.models.layers import split_layer_stacks

@engine_jit(static_argnames=("model", "backend", "num_passes", "mode", "num_top", "layered",
                                             "dummy_slot", "fixed_trip", "sampler", "prefill_backend",
                                             "swap_every_pass"),
                   donate_argnames=("kv", "slot_state", "bkv", "slot_inject"))
def decode_window(params, kv: PagedKV, slot_state, rows: WindowRows, block_tables, lookahead_w, bkv, slot_inject,
                  boundary_tables, slot_tokens, prompt: WindowPrompt | None = None,
                  standby: WindowRows | None = None, owners=None, *, model, backend,
                  num_passes: int, mode: str, num_top: int, layered: bool, dummy_slot: int,
                  fixed_trip: bool = False, sampler: str = "truncate", prefill_backend=None,
                  swap_every_pass: bool = True):
    """Up to ``num_passes`` loop passes (exactly that many when ``fixed_trip``) over the rows
    -> (kv, slot_state, bkv, slot_inject, rows, WindowOutputs, standby). Models with boundary stages
    (Huginn) pass their boundary pool ``bkv``, the per-slot ``slot_inject`` and the boundary
    block tables: a row starting a token runs the prelude (writing its boundary KV) and an
    exiting row's head runs the coda; others pass None. ``params`` may hold its layer stacks
    already split (``split_layer_stacks``; the runner keeps such a copy), else they are split
    here once per window. sampler / num_top: the head's static sampling variant and top
    logprob count (``sample_tokens``). slot_tokens: [max_num_seqs + 1] int32, each slot's
    token from the last head step (``rows.first`` rows start from it; the host has not
    read it yet). prompt: whole prompts run in the first R passes with the rows (one GEMM
    over both, attention through ``prefill_backend`` for them), then their first heads;
    fixed trip, plain models only. The window still runs ``num_passes`` passes in all.
    owners: [num_slots + 1] int32 each slot's request tag (``standby``): rows and entries
    whose request no longer holds its slot stop here. standby: entries (``standby``) that
    free rows take at the start of each pass (``swap_every_pass``), else only at the window's
    start (when the rows have room for every request, no entry waits past it); not with a prompt."""
    b, k_max = rows.slots.shape[0], num_passes
    if standby is not None and (prompt is not None or owners is None):
        raise ValueError("decode_window: standby entries need owners and no prompt (this is a bug)")
    if owners is not None:
        rows = dataclasses.replace(rows, active=rows.active & owned(rows, owners))
    # Modes that never trigger keep every row's flag false from here, not rewritten each pass
    # (a constant carried through the loop is a kernel of its own every pass).
    triggers = mode in TRIGGER_MODES
    if not triggers:
        rows = dataclasses.replace(rows, triggered=jnp.zeros_like(rows.triggered))
    if standby is not None:
        standby = start_standby(standby, owners, slot_tokens)
    swap_in_passes = standby is not None and swap_every_pass
    # A request's first token comes from the head step queued just before this window: it
    # starts looping here, unless it already ends the request (the host's stop checks agree).
    tokens = jnp.where(rows.first, slot_tokens[rows.slots], rows.tokens)
    ends = ends_request(rows, tokens, rows.num_out)
    rows = dataclasses.replace(rows, tokens=tokens, active=rows.active & ~(rows.first & ends),
                               first=jnp.zeros_like(rows.first))
    page_size = kv.page_size
    first_out = rows.num_out if prompt is None else rows.num_out - prompt.rows   # a prompt's row: its first token too
    out = WindowOutputs(tokens=jnp.zeros((b, k_max), jnp.int32), depths=jnp.zeros((b, k_max), jnp.int32),
                        chosen=jnp.zeros((b, k_max), jnp.float32),
                        top_ids=jnp.zeros((b, k_max, num_top), jnp.int32),
                        top_lp=jnp.zeros((b, k_max, num_top), jnp.float32),
                        count=jnp.zeros((b,), jnp.int32), passes=jnp.zeros((), jnp.int32),
                        swap_col=jnp.full((b,), -1, jnp.int32), swap_tag=jnp.full((b,), -1, jnp.int32))

    layer_weights = split_layer_stacks(params)       # no-op when the caller split them already

    def boundary_meta(rows, pos, mask):
        """Boundary-pool meta of the masked rows at their position (others: scratch, length 0)."""
        page = boundary_tables[rows.btables, jnp.maximum(pos, 0) // page_size]
        return PagedMeta(pos, jnp.where(mask, page, 0), jnp.where(mask, pos % page_size, 0),
                         jnp.where(mask, rows.btables, 0), jnp.where(mask, pos + 1, 0), boundary_tables)

    def one_pass(carry, mixed=None):
        """One pass over the rows; mixed = (prompt state [T, D], pages, tables) of a prompt
        loop riding along -> (carry, its new state) instead of the carry."""
        kv, slot_state, bkv, slot_inject, rows, out, standby = carry
        if swap_in_passes:
            rows, standby, out = take_standby(rows, standby, out)
        # The weights are loop-invariant, so XLA would hoist each layer's weight slices out
        # of the loop as materialised copies (re-copied every pass under memory pressure), and
        # slices left inside the loop are copied before each matmul: either way ~1.2 ms of
        # copies per Ouro-1.4B pass on an H200. So the loop reads per-layer arrays
        # (``split_layer_stacks``), through a barrier shared with the pass counter so XLA
        # keeps them as they are.
        weights, _ = jax.lax.optimization_barrier((layer_weights, out.passes))
        act = rows.active
        plane = rows.loops_done if layered else jnp.zeros_like(rows.loops_done)
        table = jnp.where(act, jnp.take_along_axis(rows.tables, plane[:, None], axis=1)[:, 0], 0)
        pos = jnp.where(act, rows.positions, -1)
        # written through to the deeper planes: an exit needs no copy (``kv_update``)
        write_page = write_through_pages(rows.tables, plane, rows.max_loops, pos, act, block_tables, page_size)
        slots = jnp.where(act, rows.slots, dummy_slot)
        tokens = jnp.where(act, rows.tokens, 0)
        if bkv is None:
            # inactive rows re-embed token 0 (their KV and slot writes are dropped)
            starting = (rows.loops_done == 0) | ~act
            x, inject = jnp.where(starting[:, None], model.embed(weights, tokens)[0], slot_state[slots]), None
        else:
            starting = (rows.loops_done == 0) & act

            def prelude(bkv):
                seeds = jnp.stack([rows.seed_hi, rows.seed_lo], axis=1)     # a row's request may change
                return model.embed(weights, tokens, bkv, boundary_meta(rows, pos, starting), backend, seeds=seeds)

            zeros = jnp.zeros_like(slot_state[slots])
            s0, e, bkv = (prelude(bkv) if fixed_trip else
                          jax.lax.cond(jnp.any(starting), prelude, lambda bkv: (zeros, zeros, bkv), bkv))
            x = jnp.where(starting[:, None], s0, slot_state[slots])
            inject = jnp.where(starting[:, None], e, slot_inject[slots])
            slot_inject = set_slots(slot_inject, slots, inject)
        meta = PagedMeta(pos, write_page, jnp.where(act, pos % page_size, 0), table, pos + 1, block_tables)
        if mixed is None:
            x, kv, signal = model.loop(weights, x, inject, kv, meta, backend)
        else:
            px, pages, tables = mixed
            pmeta = PagedMeta(prompt.positions, pages, prompt.write_offset, tables, prompt.positions + 1, block_tables)
            both, kv, signal = model.loop(weights, jnp.concatenate([x, px]), None, kv, MixedMeta(meta, pmeta),
                                          MixedKVBackend(backend, prefill_backend, b))
            x, px, signal = both[:b], both[b:], jax.tree.map(lambda a: a[:b], signal)
        slot_state = set_slots(slot_state, slots, x)

        r = rows.loops_done + 1
        if mode == "trace":
            # the whole recorded trace rides along, so a continued window needs no host
            width = rows.trace.shape[1]
            recorded = jnp.take_along_axis(rows.trace, jnp.minimum(rows.num_out, width - 1)[:, None], axis=1)[:, 0]
            depth_now = jnp.where(rows.num_out < width, recorded, rows.max_loops)
            exit_now, trigger, remaining = r >= depth_now, rows.triggered, rows.remaining
        else:
            cumulative, rule = EXIT_RULES[mode]
            hazard = jax.nn.sigmoid(signal)
            score = jax.nn.sigmoid(x.astype(jnp.float32) @ lookahead_w)
            remaining = (rows.remaining * (1.0 - hazard)).astype(jnp.float32) if cumulative else rows.remaining
            exit_now, trigger = rule(r, rows.min_loops, rows.max_loops, rows.threshold,
                                     (1.0 - remaining).astype(jnp.float32), score, signal, rows.triggered)
        exit_now = exit_now & act
        any_exit = jnp.any(exit_now)

        # The head reads x, not slot_state[slots] (a gather, a kernel a pass): the same rows
        # for every row that keeps its head (active rows hold distinct slots).
        def head(bkv):
            if bkv is None:
                # fixed trip: on a pass where no row exits the head's kernel skips the lm_head
                project = functools.partial(backend.head_matmul, needed=any_exit)
                logits = model.head(weights, x, project=project)  # [B, V] f32
            else:    # the coda writes the exiting rows' boundary KV
                logits, bkv = model.head(weights, x, bkv, boundary_meta(rows, pos, exit_now), backend)
            return sample_rows(logits, rows, rows.num_out, sampler=sampler, num_top=num_top) + (bkv,)

        def no_head(bkv):
            return (jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.float32),
                    jnp.zeros((b, num_top), jnp.int32), jnp.zeros((b, num_top), jnp.float32), bkv)

        # fixed_trip: every row's head, kept where a row exits (sampling keys are per request
        # and output index, so the kept tokens are those a head over the exiting rows makes)
        tok, chosen, top_ids, top_lp, bkv = (head(bkv) if fixed_trip else
                                             jax.lax.cond(any_exit, head, no_head, bkv))
        # k_max: out of range, dropped; with standby a row's columns continue across a swap
        k = jnp.where(exit_now, rows.num_out - first_out if standby is None else out.count, k_max)
        out = dataclasses.replace(out.put(k, tok, r, chosen, top_ids, top_lp, exit_now),
                                  passes=out.passes + (jnp.any(act) | (mixed is not None)))
        num_out = rows.num_out + exit_now
        stops = ends_request(rows, tok, num_out)
        rows = dataclasses.replace(
            rows, tokens=jnp.where(exit_now, tok, rows.tokens), positions=rows.positions + exit_now,
            loops_done=jnp.where(exit_now, 0, jnp.where(act, r, rows.loops_done)),
            remaining=jnp.where(exit_now, jnp.float32(1.0), jnp.where(act, remaining, rows.remaining)),
            triggered=jnp.where(act & ~exit_now, trigger, False) if triggers else rows.triggered,
            active=act & ~(exit_now & stops),
            num_out=num_out)
        carry = kv, slot_state, bkv, slot_inject, rows, out, standby
        return carry if mixed is None else (carry, px)

    if standby is not None and not swap_every_pass:
        rows, standby, out = take_standby(rows, standby, out)
    carry = (kv, slot_state, bkv, slot_inject, rows, out, standby)
    if prompt is not None:
        carry = prompt_passes(carry, one_pass, prompt, model, layer_weights, backend, dummy_slot=dummy_slot,
                               sampler=sampler, num_top=num_top)
    if fixed_trip:
        plain = k_max - (0 if prompt is None else prompt.row_tables.shape[0])
        return jax.lax.fori_loop(0, plain, lambda _, c: one_pass(c), carry)

    def cond(carry):
        rows, out, standby = carry[4:]
        more = jnp.any(rows.active)
        if swap_in_passes:          # a free row that can still take a waiting entry
            more |= jnp.any(~rows.active & (out.swap_col < 0)) & jnp.any(standby.active)
        return (out.passes < k_max) & more

    return jax.lax.while_loop(cond, one_pass, carry)

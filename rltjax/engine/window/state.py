"""A decode window's device-side types: its rows, the prompts riding it (mixed prefill) and
its outputs (``window.program`` runs them; ``window.rows`` builds rows on the host and
``window.planner`` reads the outputs), and the device's stop check and head sampling."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from rltjax.cache.kv_update import write_through_pages
from rltjax.cache.paged_kv import PagedMeta
from rltjax.sampling import sample_tokens, token_logprobs

STOP_ID_WIDTH = 8   # token-stop ids checked on the device per row (more are checked by the host only)


@struct.dataclass
class WindowRows:
    """Per-row state of a window, [B] unless noted (padding rows: inactive, dummy slot)."""
    slots: jax.Array          # int32 slot of the per-slot state buffer
    tokens: jax.Array         # int32 the token now looping
    positions: jax.Array      # int32 its position
    loops_done: jax.Array     # int32 loops it has run
    remaining: jax.Array      # f32 ouro modes: prod of (1 - hazard)
    triggered: jax.Array      # bool delayed modes: exit after the next loop
    active: jax.Array         # bool still generating
    num_out: jax.Array        # int32 output tokens so far (the next one's output index)
    max_tokens: jax.Array     # int32
    min_loops: jax.Array      # int32
    max_loops: jax.Array      # int32
    threshold: jax.Array      # f32 exit_threshold
    temperature: jax.Array    # f32
    top_k: jax.Array          # int32
    top_p: jax.Array          # f32
    seed_hi: jax.Array        # uint32
    seed_lo: jax.Array        # uint32
    tables: jax.Array         # [B, planes] int32 block table of each plane
    btables: jax.Array        # int32 boundary-pool block table (models with boundary KV; else 0)
    stop_ids: jax.Array       # [B, STOP_ID_WIDTH] int32 ids that end the request (-1: none)
    trace: jax.Array          # [B, W] int32 trace mode: recorded exit depth of each output index
    first: jax.Array          # bool its token is the one its first head (queued just before the
                              # window) wrote to ``slot_tokens``; ``tokens`` holds a placeholder
    tag: jax.Array            # int32 the request's arrival index (-1: no request): a row or standby
                              # entry runs only while ``owners[slot]`` names it
    spec_tokens: jax.Array    # int32 drafts a speculative round may make for it (0: none)


@struct.dataclass
class WindowPrompt:
    """Whole prompts that run their R loops in a window's first R passes (mixed prefill):
    the arrays of a prefill batch (``batches.PrefillBatch``), [T] unless noted, and the
    window rows that wait for them."""
    tokens: jax.Array         # int32
    positions: jax.Array      # int32 (-1: alignment or bucket padding)
    write_page: jax.Array     # [P, T] int32 page each token writes, per plane (P = max(R, cap))
    write_offset: jax.Array   # int32
    row_tables: jax.Array     # [R, T] int32 table each token reads at loop d
    out_slots: jax.Array      # int32 a prompt's last token: its request's slot; others the dummy
    rows: jax.Array           # [B] bool rows of these prompts' requests: inactive until their
                              # first head (after pass R - 1) samples the first token


@struct.dataclass
class WindowOutputs:
    tokens: jax.Array         # [B, K] int32
    depths: jax.Array         # [B, K] int32 exit depth of each output
    chosen: jax.Array         # [B, K] f32 logprob of the sampled token
    top_ids: jax.Array        # [B, K, T] int32
    top_lp: jax.Array         # [B, K, T] f32
    count: jax.Array          # [B] int32 outputs made in this window
    passes: jax.Array         # [] int32 loop passes run
    swap_col: jax.Array       # [B] int32 standby windows: the output column where a standby entry
                              # took the row (the columns before it are the previous request's); -1: none
    swap_tag: jax.Array       # [B] int32 the tag of the request that took the row (-1: none)
    drafted: jax.Array        # [B] int32 speculative windows: drafts made
    accepted: jax.Array       # [B, K] int32 speculative windows: drafts kept, by position in their round

    def put(self, at, tokens, depths, chosen, top_ids, top_lp, made) -> "WindowOutputs":
        """Each row's output at column ``at`` [B] (out of range, negative too: dropped); made
        [B] bool counts toward ``count``. A select over the columns, not a scatter: selects fuse
        with their neighbours, where each scatter was a kernel of its own every pass."""
        hit = jnp.arange(self.tokens.shape[1])[None, :] == at[:, None]            # [B, K]

        def col(new, old):      # old [B, K, ...]; new [B, ...] or a scalar
            new = jnp.broadcast_to(jnp.asarray(new, old.dtype), old.shape[:1] + old.shape[2:])
            return jnp.where(hit.reshape(hit.shape + (1,) * (old.ndim - 2)), new[:, None], old)

        return dataclasses.replace(
            self, tokens=col(tokens, self.tokens), depths=col(depths, self.depths),
            chosen=col(chosen, self.chosen), top_ids=col(top_ids, self.top_ids),
            top_lp=col(top_lp, self.top_lp), count=self.count + made)


class RowsRead(NamedTuple):
    """The fields of a window's rows after it that the host reads back (``window.planner``
    takes each request's exit state from them); the rest stays on the device."""
    active: jax.Array
    loops_done: jax.Array
    remaining: jax.Array
    triggered: jax.Array

    @classmethod
    def of(cls, rows: WindowRows) -> "RowsRead":
        return cls(*(getattr(rows, name) for name in cls._fields))


def pass_meta(tables, plane, max_loops, positions, active, block_tables, page_size: int) -> PagedMeta:
    """A loop pass's meta for window rows [B]: an active row at ``positions`` reads its table of
    ``plane`` and writes its K/V there and through to its deeper planes, so an exit needs no
    copy (``cache.kv_update``); an inactive row writes the scratch page and reads nothing.
    tables [B, planes]; plane, max_loops, positions [B] int; active [B] bool."""
    table = jnp.where(active, jnp.take_along_axis(tables, plane[:, None], axis=1)[:, 0], 0)
    pos = jnp.where(active, positions, -1)
    write_page = write_through_pages(tables, plane, max_loops, pos, active, block_tables, page_size)
    return PagedMeta(pos, write_page, jnp.where(active, pos % page_size, 0), table, pos + 1, block_tables)


def ends_request(rows: WindowRows, tokens, num_out):
    """[B] bool: the newest token (of num_out so far) ends its request on the device: a stop
    id (EOS unless ignored, the first STOP_ID_WIDTH token-stop ids) or max_tokens reached."""
    # column by column, elementwise: a reduction over the ids would be a kernel of its own
    stop = num_out >= rows.max_tokens
    for j in range(rows.stop_ids.shape[1]):
        stop = stop | (tokens == rows.stop_ids[:, j])
    return stop


def sample_rows(logits, rows: WindowRows, output_index, *, sampler: str, num_top: int):
    """[B, V] f32 logits -> (token, its logprob, top ids, top logprobs) per row, with each
    row's sampling params and per-request key at ``output_index``. Logprobs only with the
    "truncate" sampler (``sampling.window_sampler`` picks it for any request that asks for
    logprobs); the others give zeros, not the log-softmax's two reductions every pass. The
    logits are materialised once: otherwise XLA may fuse the lm_head GEMM into each consumer
    (sampling's argmax, the log-softmax) and stream the 49k-column weight twice."""
    logits = jax.lax.optimization_barrier(logits)
    tok = sample_tokens(logits, rows.temperature, rows.top_k, rows.top_p, rows.seed_hi, rows.seed_lo,
                        output_index, sampler=sampler)
    if sampler != "truncate":
        b = logits.shape[0]
        return (tok, jnp.zeros((b,), jnp.float32), jnp.zeros((b, num_top), jnp.int32),
                jnp.zeros((b, num_top), jnp.float32))
    return (tok,) + token_logprobs(logits, tok, num_top)

"""Standby entries (device side): requests prefilled ahead of a free decode-window row, swapped in.

A window's host reads its outputs one window late, so a row whose request finishes in
window w could only be refilled by the host at w + 2. Instead the host hands the device
the requests it admits (prefilled, first heads queued) as standby entries, one per slot
(``WindowRows`` of ``[num_slots + 1]``, indexed by slot; ``active``: the entry waits for a
row). At the start of every pass, each row that is free (inactive: finished, idled or
padding) and has not taken one yet in this window takes the oldest waiting entry (by
``tag``, the arrival index). The window's outputs say where (``swap_col``, ``swap_tag``),
and the host splits that row's output columns between the two requests. A row takes at
most one entry a window, so the host's split needs no more than one column a row.

``owners`` [num_slots + 1] int32 names each slot's request (its tag; -1: free) as the host
knows it at launch: a row or entry whose tag differs (aborted, stopped by the host, its
slot given to another request since) stops at the window's start, so nothing runs into
pages or a slot that may now be another request's.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rltjax.engine.window.state import WindowOutputs, WindowRows, ends_request


def owned(rows: WindowRows, owners) -> jax.Array:
    """[B] bool: the rows' requests still hold their slots."""
    return owners[rows.slots] == rows.tag


def start_standby(standby: WindowRows, owners, slot_tokens) -> WindowRows:
    """The entries at a window's start: those whose first head was queued just before it
    take their token from ``slot_tokens`` (and wait no more if it already ends the request,
    as the host's stop checks agree); entries the host finished stop waiting."""
    tokens = jnp.where(standby.first, slot_tokens[standby.slots], standby.tokens)
    ends = ends_request(standby, tokens, standby.num_out)
    active = standby.active & owned(standby, owners) & ~(standby.first & ends)
    return dataclasses.replace(standby, tokens=tokens, active=active, first=jnp.zeros_like(standby.first))


def take_standby(rows: WindowRows, standby: WindowRows, out: WindowOutputs):
    """Free rows take waiting entries, the oldest first -> (rows, standby, out)."""
    free = ~rows.active & (out.swap_col < 0)                                          # [B]
    waiting = standby.active                                                          # [S]
    # the rank of each waiting entry by tag (distinct among waiting entries): no sort
    older = waiting[None, :] & (standby.tag[None, :] < standby.tag[:, None])          # [S, S]
    rank_of_entry = jnp.where(waiting, jnp.sum(older, axis=1), -1)                    # [S]
    rank_of_row = jnp.cumsum(free) - 1                                                # [B]
    take = free & (rank_of_row < jnp.sum(waiting))
    match = (rank_of_entry[None, :] == rank_of_row[:, None]) & take[:, None]          # [B, S]
    src = jnp.argmax(match, axis=1)                                                   # [B]
    picked = jax.tree.map(lambda a: a[src], standby)
    rows = jax.tree.map(lambda r, s: jnp.where(take.reshape((-1,) + (1,) * (r.ndim - 1)), s, r), rows, picked)
    standby = dataclasses.replace(standby, active=waiting & ~jnp.any(match, axis=0))
    out = dataclasses.replace(out, swap_col=jnp.where(take, out.count, out.swap_col),
                              swap_tag=jnp.where(take, picked.tag, out.swap_tag))
    return rows, standby, out

"""Boundary stages (embed / head) of one request in the dense reference.

``PlainStages``: models whose embed and head read no KV (Ouro, Nanbeige).
``BoundaryStages``: models with a prelude/coda that attend (Huginn). They own
the request's boundary KV (one plane, P + K layers; see rltjax.models.base),
draw the initial state from the request seed and position, and run the coda
for every token, prompt tokens included, because later codas attend to it.

``sequence_forward`` is the whole-prompt forward at a fixed depth (all rows in
one batch, causal by length), for teacher-forced checks against upstream.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rltjax.models.base import boundary_kv_layers
from rltjax.reference.dense_kv import DenseKVBackend, DenseMeta, empty_kv
from rltjax.sampling import split_seed


def single_plane_meta(positions: np.ndarray, capacity: int) -> DenseMeta:
    """Rows at ``positions`` [N] writing and reading plane 0, causal."""
    positions = np.asarray(positions, np.int32)
    return DenseMeta(positions=jnp.asarray(positions), write_plane=jnp.zeros_like(jnp.asarray(positions)),
                     read_planes=jnp.zeros((len(positions), capacity), jnp.int32),
                     lengths=jnp.asarray(positions + 1))


class PlainStages:
    prompt_heads = False   # only the last prompt token's head is needed

    def __init__(self, rm):
        self.rm = rm

    def embed(self, token: int, position: int):
        return self.rm._embed(self.rm.params, jnp.int32([token])), None

    def head(self, state, position: int):
        return self.rm._head(self.rm.params, state)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(4,))
def _boundary_embed(model, backend, params, tokens, kv, meta, seeds):
    return model.embed(params, tokens, kv, meta, backend, seeds=seeds)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(4,))
def _boundary_head(model, backend, params, state, kv, meta):
    return model.head(params, state, kv, meta, backend)


class BoundaryFns:
    """The jitted boundary stages of a model with boundary KV (compiled once per model config)."""

    def __init__(self, model, backend):
        self.embed = functools.partial(_boundary_embed, model, backend)
        self.head = functools.partial(_boundary_head, model, backend)


class BoundaryStages:
    prompt_heads = True    # every token's coda writes the boundary KV

    def __init__(self, rm, capacity: int, seed: int):
        cfg = rm.cfg
        self.rm, self.capacity = rm, capacity
        self.kv = empty_kv(boundary_kv_layers(rm.model), 1, capacity, cfg.num_kv_heads, cfg.head_dim,
                           rm.dtype)
        self.seeds = jnp.asarray([split_seed(seed)], jnp.uint32)       # [1, 2] (hi, lo)

    def embed(self, token: int, position: int):
        meta = single_plane_meta([position], self.capacity)
        state, inject, self.kv = self.rm._bfns.embed(self.rm.params, jnp.int32([token]), self.kv, meta,
                                                     self.seeds)
        return state, inject

    def head(self, state, position: int):
        meta = single_plane_meta([position], self.capacity)
        logits, self.kv = self.rm._bfns.head(self.rm.params, state, self.kv, meta)
        return logits


@functools.partial(jax.jit, static_argnums=(0, 3))
def _sequence_forward(model, params, tokens, max_loops: int, num_loops, init_state, use_init, seeds):
    """tokens [T] (padded; rows past the prompt are causal no-ops for it); num_loops traced <= max_loops."""
    cfg, backend = model.cfg, DenseKVBackend()
    n = tokens.shape[0]
    positions = np.arange(n, dtype=np.int32)
    bmeta = single_plane_meta(positions, n)
    kv = empty_kv(cfg.num_layers, max_loops, n, cfg.num_kv_heads, cfg.head_dim, params.embed.dtype)
    bkv = empty_kv(max(boundary_kv_layers(model), 1), 1, n, cfg.num_kv_heads, cfg.head_dim,
                   params.embed.dtype)
    if boundary_kv_layers(model):
        state, inject, bkv = model.embed(params, tokens, bkv, bmeta, backend, seeds=seeds)
        state = jnp.where(use_init, init_state.astype(state.dtype), state)
    else:
        state, inject = model.embed(params, tokens)

    def one_loop(r, carry):                      # every row at depth r + 1, reading plane r
        state, kv, states, signals = carry
        meta = DenseMeta(positions=bmeta.positions, write_plane=jnp.full((n,), r, jnp.int32),
                         read_planes=jnp.full((n, n), r, jnp.int32), lengths=bmeta.lengths)
        state, kv, signal = model.loop(params, state, inject, kv, meta, backend)
        return state, kv, states.at[r].set(state), signals.at[r].set(signal)

    states = jnp.zeros((max_loops,) + state.shape, state.dtype)
    signals = jnp.zeros((max_loops, n), jnp.float32)
    state, kv, states, signals = jax.lax.fori_loop(0, num_loops, one_loop, (state, kv, states, signals))
    if boundary_kv_layers(model):
        logits, _ = model.head(params, state, bkv, bmeta, backend)
    else:
        logits = model.head(params, state)
    return dict(inject=inject, states=states, signals=signals, logits=logits)


def sequence_forward(model, params, tokens, num_loops: int, init_state=None, seed: int = 0) -> dict[str, Any]:
    """All prompt positions in one batch at depth ``num_loops`` (one compile per padded length).

    -> {"inject": [S, D] or None (Huginn: prelude output e), "states": [r, S, D] per loop,
        "signals": [r, S], "logits": [S, V] f32}.
    ``init_state`` [S, D] (boundary models): an explicit s_0 used as given.
    """
    cfg, s = model.cfg, len(tokens)
    n = max(64, 1 << (s - 1).bit_length())
    padded = np.zeros(n, np.int32)
    padded[:s] = np.asarray(tokens, np.int32)
    init = np.zeros((n, cfg.hidden_size), np.float32)
    if init_state is not None:
        init[:s] = np.asarray(init_state, np.float32)
    seeds = jnp.tile(jnp.asarray([split_seed(seed)], jnp.uint32), (n, 1))
    out = _sequence_forward(model, params, jnp.asarray(padded), max(cfg.num_loops, num_loops),
                            jnp.int32(num_loops), jnp.asarray(init), jnp.bool_(init_state is not None), seeds)
    out = {k: (None if v is None else np.asarray(v)) for k, v in out.items()}
    return dict(inject=None if out["inject"] is None else out["inject"][:s],
                states=out["states"][:num_loops, :s], signals=out["signals"][:num_loops, :s],
                logits=out["logits"][:s])

"""The model contract (DESIGN section 1) and the KV backend it calls.

A model is three pure functions over a flat batch of N token rows, each row
carrying its own position and depth in ``meta``:

    embed(params, tokens[N], kv, meta)        -> (state[N, D], inject)
    loop(params, state, inject, kv, meta)     -> (state, kv, signal[N] f32)
    head(params, state[N, D], kv, meta)       -> logits[N, V] f32

``meta`` always has ``positions`` ([N] int32); the rest is the backend's.
Attention never touches a KV layout directly: it goes through a ``KVBackend``
(dense per-request planes for the reference oracle, paged planes for the
engine). Within one layer a row's K/V is written before it attends, so a row
sees itself.
"""
from __future__ import annotations

from typing import Any, Protocol

import jax


class KVBackend(Protocol):
    """Static (hashable) description of how K/V are stored and read.

    ``kv`` and ``meta`` are pytrees owned by the backend; ``layer`` is a traced
    int32 scalar indexing the stacked layer axis.
    """

    def write(self, kv: Any, layer: jax.Array, k: jax.Array, v: jax.Array, meta: Any) -> Any:
        """k, v: [N, Hkv, Dh] -> updated kv."""
        ...

    def attend(self, kv: Any, layer: jax.Array, q: jax.Array, meta: Any) -> jax.Array:
        """q: [N, H, Dh] -> [N, H, Dh], causal within each row's sequence at its plane."""
        ...


IMPLEMENTED = ("ouro",)


def arch_module(arch: str):
    """The module of an architecture: ``hf_tensor_specs``, ``init_params``, the model class."""
    if arch == "ouro":
        from rltjax.models import ouro
        return ouro
    raise NotImplementedError(
        f"architecture {arch!r} parses but is not implemented yet; rltjax currently runs: {IMPLEMENTED}")


def get_model(cfg):
    """The model object (embed / loop / head) for a config."""
    module = arch_module(cfg.arch)
    return module.MODEL_CLASS(cfg)

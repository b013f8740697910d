"""The model contract (DESIGN section 1) and the KV backend it calls.

A model is three pure functions over a flat batch of N token rows, each row
carrying its own position and depth in ``meta``:

    embed(params, tokens[N], kv, meta)        -> (state[N, D], inject)
    loop(params, state, inject, kv, meta, backend) -> (state, kv, signal[N] f32)
    head(params, state[N, D], kv, meta)       -> logits[N, V] f32   (plain models: also project=)

``meta`` always has ``positions`` ([N] int32); the rest is the backend's.

Boundary KV (Huginn): a model whose prelude/coda attend over earlier
positions declares ``boundary_kv_layers`` = P + K > 0. Its boundary stages
then take a second, separate KV pytree (one plane, P + K stacked layers:
prelude block j is layer j, coda block j is layer P + j) through the same
KVBackend, and return it updated:

    embed(params, tokens, bkv, bmeta, backend, ...) -> (state, inject, bkv)
    head(params, state, bkv, bmeta, backend)        -> (logits, bkv)

The backend also applies each layer's projections (``matmul``), so the engine can pick
a decode-shaped kernel while the oracle keeps XLA's dot; a plain model's head takes the
lm_head product the same way, as an optional ``project(state, lm_head)`` (the engine's decode
windows pass one through ``PagedKVBackend.head_matmul``, which skips the product on a pass
where no row exits). The core KV (``loop``) keeps
its own layer indices 0..L-1 and planes. The caller owns both pytrees and passes
single-plane meta for the boundary one.
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

    def write_attend(self, kv: Any, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
                     meta: Any, rope: Any = None) -> tuple[jax.Array, Any]:
        """What a layer calls -> (out, kv): ``rope`` (``models.layers.Rope``, the pass's tables)
        rotates q and k (None: they come rotated), then ``write``, then ``attend``. A backend
        may fuse the three."""
        ...

    def residual_norm(self, x: jax.Array, y: jax.Array, post_weight: jax.Array, next_weight: jax.Array,
                      eps: float) -> tuple[jax.Array, jax.Array]:
        """x, y [N, D] -> (x + rms_norm(y, post_weight), rms_norm(of that, next_weight)): a
        sandwich layer's residual add and the next pre-norm (``kernels.residual_norm``)."""
        ...

    def matmul(self, x: jax.Array, w: jax.Array, layer: jax.Array, partial_sums: bool = False) -> jax.Array:
        """A layer's projection: x [N, K] @ w[layer] of a stacked [L, K, N'] weight -> [N, N'] in
        x's dtype (float32 accumulation). Stacked in, so a kernel can read the layer in place.
        partial_sums: the result goes to ``residual_norm`` as its y, which also takes [S, N, N']
        split-K partial sums; the backend may hand those on unreduced."""
        ...

    def gated_up(self, x: jax.Array, w_gate: jax.Array, w_up: jax.Array, layer: jax.Array) -> jax.Array:
        """A SwiGLU MLP's activation: silu(x @ w_gate[layer]) * (x @ w_up[layer]) [N, F], each
        product rounded to x's dtype (``kernels.skinny_matmul.gated_up_ref``)."""
        ...


IMPLEMENTED = ("ouro", "nanbeige", "huginn")


def arch_module(arch: str):
    """The module of an architecture: ``hf_tensor_specs``, ``init_params``, the model class
    (and optionally ``HF_IGNORED_TENSORS``: checkpoint tensors that are derived buffers)."""
    if arch == "ouro":
        from rltjax.models import ouro
        return ouro
    if arch == "nanbeige":
        from rltjax.models import nanbeige
        return nanbeige
    if arch == "huginn":
        from rltjax.models import huginn
        return huginn
    raise NotImplementedError(
        f"architecture {arch!r} parses but is not implemented yet; rltjax currently runs: {IMPLEMENTED}")


def get_model(cfg):
    """The model object (embed / loop / head) for a config."""
    module = arch_module(cfg.arch)
    return module.MODEL_CLASS(cfg)


def boundary_kv_layers(model) -> int:
    """P + K layers of boundary (prelude/coda) KV; 0 for models whose embed/head read no KV."""
    return int(getattr(model, "boundary_kv_layers", 0))


def loop_limit(model) -> int:
    """The most loops a request may ask for (``SamplingParams.max_loops``).

    R (``cfg.num_loops``) unless the model allows deeper recurrence (Huginn:
    ``max_recurrence``, any r up to it). Prompt tokens always run R loops.
    """
    return max(model.cfg.num_loops, int(getattr(model, "max_recurrence", 0)))


def signal_kind(model) -> str:
    """What ``loop``'s signal is: "gate" (a gate logit), "latent_diff" or "none" (zeros)."""
    return getattr(model, "signal", "gate" if model.cfg.has_exit_gate else "none")

"""Nanbeige4.2 (looped Llama) as pure JAX functions.

One loop = all L Llama pre-norm layers (``over_layers`` of stacked params), then the
shared ``model.norm``. The normed state feeds the next loop and the head.
There is no exit gate: the loop's signal is zero and depth is fixed
(``max_loops`` of the request, default R = ``num_loops``).

Pre-norm layer:  x += attn(input_layernorm(x))
                 x += mlp(post_attention_layernorm(x))
GQA with q width H*Dh != hidden (non-square q/o projections); RoPE rotate-half.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from rltjax.config import ModelConfig
from rltjax.models.base import KVBackend
from rltjax.models.layers import over_layers, project_qkv, projection_source, rms_norm, Rope, swiglu
from rltjax.models.params import TensorSpec, llama_stack_specs


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class NanbeigeLayers:
    attn_norm: jax.Array       # [L, D]
    mlp_norm: jax.Array        # [L, D]
    wq: jax.Array              # [L, D, H*Dh]
    wk: jax.Array              # [L, D, Hkv*Dh]
    wv: jax.Array              # [L, D, Hkv*Dh]
    wo: jax.Array              # [L, H*Dh, D]
    w_gate: jax.Array          # [L, D, F]
    w_up: jax.Array            # [L, D, F]
    w_down: jax.Array          # [L, F, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class NanbeigeParams:
    embed: jax.Array           # [V, D]
    layers: NanbeigeLayers
    norm: jax.Array            # [D]
    lm_head: jax.Array         # [D, V]


def hf_tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    return llama_stack_specs(cfg, {"attn_norm": "input_layernorm.weight",
                                   "mlp_norm": "post_attention_layernorm.weight"})


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.bfloat16) -> NanbeigeParams:
    """Random weights at the config's shape (benchmarks): N(0, initializer_range), unit norms."""
    D, F, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    std = cfg.initializer_range
    keys = iter(jax.random.split(key, 16))

    def normal(shape):
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    layers = NanbeigeLayers(
        attn_norm=jnp.ones((L, D), dtype), mlp_norm=jnp.ones((L, D), dtype),
        wq=normal((L, D, cfg.q_width)), wk=normal((L, D, cfg.kv_width)),
        wv=normal((L, D, cfg.kv_width)), wo=normal((L, cfg.q_width, D)),
        w_gate=normal((L, D, F)), w_up=normal((L, D, F)), w_down=normal((L, F, D)))
    return NanbeigeParams(embed=normal((V, D)), layers=layers, norm=jnp.ones((D,), dtype),
                          lm_head=normal((D, V)))


@dataclasses.dataclass(frozen=True)
class NanbeigeModel:
    cfg: ModelConfig
    signal = "none"            # no exit gate: the loop's signal is always 0

    def embed(self, params: NanbeigeParams, tokens: jax.Array, kv: Any = None, meta: Any = None):
        """tokens [N] -> (state [N, D], inject None). No prelude."""
        return params.embed[tokens], None

    def loop(self, params: NanbeigeParams, state: jax.Array, inject: Any, kv: Any, meta: Any,
             backend: KVBackend):
        """One pass over all layers for N rows, then the shared norm.

        state [N, D] -> (state [N, D], kv, signal [N] f32 zeros).
        """
        cfg = self.cfg
        n = state.shape[0]
        rope = Rope.at(meta.positions, cfg.head_dim, cfg.rope_theta)   # once a pass

        def layer_step(carry, xs):
            x, kv = carry
            layer, p = xs
            lw, index = projection_source(params.layers, p, layer)
            mm = lambda a, w: backend.matmul(a, w, index)               # noqa: E731
            h = rms_norm(x, p.attn_norm, cfg.norm_eps)
            q, k, v = project_qkv(h, lw, mm, cfg)                          # [N, H | Hkv, Dh]
            out, kv = backend.write_attend(kv, layer, q, k, v, meta, rope)         # [N, H, Dh]
            attn = mm(out.reshape(n, cfg.q_width), lw.wo)                     # [N, D]
            x = x + attn
            x = x + swiglu(rms_norm(x, p.mlp_norm, cfg.norm_eps), mm, lw.w_gate, lw.w_up, lw.w_down)
            return (x, kv), None

        # Unrolled for static layer slices of the stacked weights (see ouro.py).
        state, kv = over_layers(layer_step, (state, kv), params.layers)
        state = rms_norm(state, params.norm, cfg.norm_eps)
        return state, kv, jnp.zeros((n,), jnp.float32)

    def head(self, params: NanbeigeParams, state: jax.Array, kv: Any = None, meta: Any = None, project=None):
        """state [N, D] (already normed by the loop) -> logits [N, V] float32. project:
        (state, lm_head) -> their product in state's dtype or float32, the engine's kernel choice (None:
        XLA's dot)."""
        logits = state @ params.lm_head if project is None else project(state, params.lm_head)
        return logits.astype(jnp.float32)


MODEL_CLASS = NanbeigeModel

"""Ouro (1.4B / 2.6B and Thinking variants) as pure JAX functions.

One loop = all L sandwich layers (``over_layers`` of stacked params), then the
shared ``model.norm``. The normed state feeds the next loop, the exit gate
and the head.

Sandwich layer:  x += post_attn_norm(attn(attn_norm(x)))
                 x += post_mlp_norm(mlp(mlp_norm(x)))
Each residual add runs with the pre-norm after it (``KVBackend.residual_norm``): the
attention's with mlp_norm, the MLP's with the next layer's attn_norm (after the last
layer: the shared model.norm, which is then the loop's output).
(HF names: input_layernorm, input_layernorm_2, post_attention_layernorm,
post_attention_layernorm_2.)
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from rltjax.config import ModelConfig
from rltjax.models.base import KVBackend
from rltjax.models.layers import SplitLayers, over_layers, project_qkv, projection_source, rms_norm, Rope
from rltjax.models.params import TensorSpec, llama_stack_specs


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class OuroLayers:
    attn_norm: jax.Array       # [L, D]
    attn_post_norm: jax.Array  # [L, D]
    mlp_norm: jax.Array        # [L, D]
    mlp_post_norm: jax.Array   # [L, D]
    wq: jax.Array              # [L, D, H*Dh]
    wk: jax.Array              # [L, D, Hkv*Dh]
    wv: jax.Array              # [L, D, Hkv*Dh]
    wo: jax.Array              # [L, H*Dh, D]
    w_gate: jax.Array          # [L, D, F]
    w_up: jax.Array            # [L, D, F]
    w_down: jax.Array          # [L, F, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class OuroParams:
    embed: jax.Array           # [V, D]
    layers: OuroLayers
    norm: jax.Array            # [D]
    gate_w: jax.Array          # [D]
    gate_b: jax.Array          # []
    lm_head: jax.Array         # [D, V]


def hf_tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    D = cfg.hidden_size
    return llama_stack_specs(cfg, {
        "attn_norm": "input_layernorm.weight", "attn_post_norm": "input_layernorm_2.weight",
        "mlp_norm": "post_attention_layernorm.weight", "mlp_post_norm": "post_attention_layernorm_2.weight",
    }) + [
        TensorSpec("gate_w", "model.early_exit_gate.weight", (1, D), param_shape=(D,)),
        TensorSpec("gate_b", "model.early_exit_gate.bias", (1,), param_shape=()),
    ]


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.bfloat16) -> OuroParams:
    """Random weights at the config's shape (benchmarks): N(0, initializer_range), unit norms."""
    D, F, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    std = cfg.initializer_range
    keys = iter(jax.random.split(key, 16))

    def normal(shape):
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    def ones(shape):
        return jnp.ones(shape, dtype)

    layers = OuroLayers(
        attn_norm=ones((L, D)), attn_post_norm=ones((L, D)),
        mlp_norm=ones((L, D)), mlp_post_norm=ones((L, D)),
        wq=normal((L, D, cfg.q_width)), wk=normal((L, D, cfg.kv_width)),
        wv=normal((L, D, cfg.kv_width)), wo=normal((L, cfg.q_width, D)),
        w_gate=normal((L, D, F)), w_up=normal((L, D, F)), w_down=normal((L, F, D)))
    return OuroParams(embed=normal((V, D)), layers=layers, norm=ones((D,)),
                      gate_w=normal((D,)), gate_b=jnp.zeros((), dtype), lm_head=normal((D, V)))


@dataclasses.dataclass(frozen=True)
class OuroModel:
    cfg: ModelConfig

    def embed(self, params: OuroParams, tokens: jax.Array, kv: Any = None, meta: Any = None):
        """tokens [N] -> (state [N, D], inject None). Ouro has no prelude."""
        return params.embed[tokens], None

    def loop(self, params: OuroParams, state: jax.Array, inject: Any, kv: Any, meta: Any,
             backend: KVBackend):
        """One pass over all layers for N rows, then the shared norm and the gate.

        state [N, D] -> (state [N, D], kv, gate_logit [N] f32).
        """
        cfg = self.cfg
        n = state.shape[0]
        rope = Rope.at(meta.positions, cfg.head_dim, cfg.rope_theta)   # once a pass

        def layer_step(carry, xs):
            x, h, kv = carry                  # h: this layer's attention pre-norm of x
            layer, p, next_norm = xs          # next_norm: the next pre-norm (the final norm last)
            lw, index = projection_source(params.layers, p, layer)
            mm = lambda a, w: backend.matmul(a, w, index)               # noqa: E731
            q, k, v = project_qkv(h, lw, mm, cfg)                          # [N, H | Hkv, Dh]
            out, kv = backend.write_attend(kv, layer, q, k, v, meta, rope)         # [N, H, Dh]
            # o's (and below down's) output may come as split-K partial sums the norm adds up
            attn = backend.matmul(out.reshape(n, cfg.q_width), lw.wo, index, partial_sums=True)  # [(S,) N, D]
            # x += post_norm(branch), then the next pre-norm: one kernel on the decode path.
            x, h = backend.residual_norm(x, attn, p.attn_post_norm, p.mlp_norm, cfg.norm_eps)
            # SwiGLU
            act = backend.gated_up(h, lw.w_gate, lw.w_up, index)                  # [N, F]
            mlp = backend.matmul(act, lw.w_down, index, partial_sums=True)       # [(S,) N, D]
            x, h = backend.residual_norm(x, mlp, p.mlp_post_norm, next_norm, cfg.norm_eps)
            return (x, h, kv), None

        # Unrolled: static layer slices of the stacked weights. With a rolled scan the
        # per-layer dynamic slices made the projections ~2x slower on an H200
        # (scripts/bench_loop_pass.py).
        layers = params.layers
        if isinstance(layers, SplitLayers):
            first_norm = layers.layers[0].attn_norm
            next_norms = tuple(lp.attn_norm for lp in layers.layers[1:]) + (params.norm,)
        else:
            first_norm = layers.attn_norm[0]
            next_norms = jnp.concatenate([layers.attn_norm[1:], params.norm[None].astype(layers.attn_norm.dtype)])
        h = rms_norm(state, first_norm, cfg.norm_eps)
        _, state, kv = over_layers(layer_step, (state, h, kv), layers, extra=next_norms)
        # state is now the final norm of the last layer's output (its "next pre-norm").
        gate_logit = state.astype(jnp.float32) @ params.gate_w.astype(jnp.float32) \
            + params.gate_b.astype(jnp.float32)
        return state, kv, gate_logit

    def head(self, params: OuroParams, state: jax.Array, kv: Any = None, meta: Any = None, project=None):
        """state [N, D] (already normed by the loop) -> logits [N, V] float32. project:
        (state, lm_head) -> their product in state's dtype or float32, the engine's kernel choice (None:
        XLA's dot)."""
        logits = state @ params.lm_head if project is None else project(state, params.lm_head)
        return logits.astype(jnp.float32)


MODEL_CLASS = OuroModel

"""Huginn-0125 (recurrent-depth "Raven") as pure JAX functions.

    e    = prelude(wte[ids] * sqrt(h))                      embed: boundary KV layers 0..P-1
    s_0  = 0 | explicit | truncnormal (see ``initial_state``)
    s_i  = core(adapter(concat[s_{i-1}, e]))                loop:  core KV layers 0..C-1
    out  = wte^T ln_f(coda(ln_f(s_r)))                      head:  boundary KV layers P..P+K-1

Sandwich block (post-residual norms; HF norm_1..norm_4):
    x = norm_2(attn(norm_1(x)) + x)
    x = norm_4(mlp(norm_3(x)) + x)
Attention: fused Wqkv -> (q, k, v); q += qk_bias[0], k += qk_bias[1] before RoPE on
interleaved pairs (theta = rope_base; the checkpoint's ``freqs_cis`` buffer is ignored).
GatedMLP: fc -> (a, b) halves -> proj(silu(a) * b).

The prelude and coda attend over their own ("boundary") KV: a second KV pytree with
one plane and P + K stacked layers, passed through the same KVBackend (see
rltjax.models.base). The loop signal is the zero-shot relative latent change
||s_r - s_{r-1}|| / ||s_r|| per row (float32).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from rltjax.config import ModelConfig
from rltjax.models.base import KVBackend
from rltjax.models.layers import over_layers, project_qkv, projection_source, rms_norm, Rope, silu_mul
from rltjax.models.params import TensorSpec

HF_IGNORED_TENSORS = ("freqs_cis",)   # RoPE table: recomputed from rope_base


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HuginnBlocks:
    norm_1: jax.Array          # [n, D]
    norm_2: jax.Array          # [n, D]
    norm_3: jax.Array          # [n, D]
    norm_4: jax.Array          # [n, D]
    wqkv: jax.Array            # [n, D, (H + 2 Hkv) Dh]
    qk_bias: jax.Array | None  # [n, 2, H, Dh] (None when cfg.qk_bias is False)
    wo: jax.Array              # [n, H Dh, D]
    w_fc: jax.Array            # [n, D, 2F]
    w_proj: jax.Array          # [n, F, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HuginnParams:
    embed: jax.Array           # [V, D] wte (the head reads it transposed when tied)
    prelude: HuginnBlocks      # n = P
    adapter: jax.Array         # [2D, D]
    core: HuginnBlocks         # n = C
    coda: HuginnBlocks         # n = K
    ln_f: jax.Array            # [D]
    lm_head: jax.Array | None  # [D, V], None when tied


def hf_tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    H, Dh, qkv = cfg.num_heads, cfg.head_dim, cfg.q_width + 2 * cfg.kv_width
    specs = [TensorSpec("embed", "transformer.wte.weight", (V, D))]
    for stack, hf, n in (("prelude", "prelude", cfg.num_prelude_layers),
                         ("core", "core_block", cfg.num_layers), ("coda", "coda", cfg.num_coda_layers)):
        def s(param, name, shape, transpose=False, param_shape=None):
            return TensorSpec(f"{stack}.{param}", f"transformer.{hf}.{{i}}.{name}", shape,
                              num_stacked=n, transpose=transpose, param_shape=param_shape)
        specs += [s(f"norm_{j}", f"norm_{j}.weight", (D,)) for j in (1, 2, 3, 4)]
        specs += [s("wqkv", "attn.Wqkv.weight", (qkv, D), transpose=True),
                  s("wo", "attn.proj.weight", (D, cfg.q_width), transpose=True),
                  s("w_fc", "mlp.fc.weight", (2 * F, D), transpose=True),
                  s("w_proj", "mlp.proj.weight", (D, F), transpose=True)]
        if cfg.qk_bias:
            specs.append(s("qk_bias", "attn.qk_bias", (2, 1, H, Dh), param_shape=(2, H, Dh)))
    specs += [TensorSpec("adapter", "transformer.adapter.weight", (D, 2 * D), transpose=True),
              TensorSpec("ln_f", "transformer.ln_f.weight", (D,))]
    if not cfg.tie_embeddings:
        specs.append(TensorSpec("lm_head", "lm_head.weight", (V, D), transpose=True))
    return specs


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.bfloat16) -> HuginnParams:
    """Random weights at the config's shape (benchmarks): N(0, initializer_range), unit norms."""
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    std = cfg.initializer_range
    keys = iter(jax.random.split(key, 32))

    def normal(shape):
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    def blocks(n):
        ones = jnp.ones((n, D), dtype)
        return HuginnBlocks(
            norm_1=ones, norm_2=ones, norm_3=ones, norm_4=ones,
            wqkv=normal((n, D, cfg.q_width + 2 * cfg.kv_width)),
            qk_bias=jnp.zeros((n, 2, cfg.num_heads, cfg.head_dim), dtype) if cfg.qk_bias else None,
            wo=normal((n, cfg.q_width, D)), w_fc=normal((n, D, 2 * F)), w_proj=normal((n, F, D)))

    return HuginnParams(embed=normal((V, D)), prelude=blocks(cfg.num_prelude_layers),
                        adapter=normal((2 * D, D)), core=blocks(cfg.num_layers),
                        coda=blocks(cfg.num_coda_layers), ln_f=jnp.ones((D,), dtype),
                        lm_head=None if cfg.tie_embeddings else normal((D, V)))


def state_init_key(seed_hi: jax.Array, seed_lo: jax.Array, position: jax.Array) -> jax.Array:
    """Key of one row's initial state: (request seed, position) only, a domain apart from
    sampling's keys (root key(1) here, key(0) there), so batching never changes it."""
    key = jax.random.fold_in(jax.random.key(1), seed_hi)
    return jax.random.fold_in(jax.random.fold_in(key, seed_lo), position)


def _blocks(cfg: ModelConfig, blocks: HuginnBlocks, x, kv, meta, backend: KVBackend, offset: int):
    """Run n stacked sandwich blocks; block j uses KV layer offset + j. x [N, D] -> x, kv."""
    n, eps = x.shape[0], cfg.norm_eps
    rope = Rope.at(meta.positions, cfg.head_dim, cfg.rope_theta, interleaved=True)   # once a pass

    def block_step(carry, xs):
        x, kv = carry
        layer, p = xs
        src, index = projection_source(blocks, p, layer - offset)      # block index into the stack
        mm = lambda a, w: backend.matmul(a, w, index)                   # noqa: E731
        q, k, v = project_qkv(rms_norm(x, p.norm_1, eps), src, mm, cfg)    # [N, H | Hkv, Dh]
        if p.qk_bias is not None:
            q, k = q + p.qk_bias[0], k + p.qk_bias[1]
        out, kv = backend.write_attend(kv, layer, q, k, v, meta, rope)         # [N, H, Dh]
        attn = mm(out.reshape(n, cfg.q_width), src.wo)                     # [N, D]
        x = rms_norm(attn + x, p.norm_2, eps)
        a, b = jnp.split(mm(rms_norm(x, p.norm_3, eps), src.w_fc), 2, axis=-1)  # [N, F] each
        x = rms_norm(mm(silu_mul(a, b), src.w_proj) + x, p.norm_4, eps)
        return (x, kv), None

    return over_layers(block_step, (x, kv), blocks, first_layer=offset)


@dataclasses.dataclass(frozen=True)
class HuginnModel:
    cfg: ModelConfig
    signal = "latent_diff"
    max_recurrence = 128       # a request may ask for any r <= this (prompt tokens run R)

    @property
    def boundary_kv_layers(self) -> int:
        return self.cfg.num_prelude_layers + self.cfg.num_coda_layers

    def initial_state(self, inject: jax.Array, positions: jax.Array, seeds: jax.Array | None):
        """s_0 [N, D]. state_init "zero": zeros (hf_overrides={"state_init": "zero"}).
        "like-init" (upstream default): truncated normal, std sqrt(2/(5h)) clipped at +-3 std,
        times sqrt(h), drawn per row from ``state_init_key(seed_hi, seed_lo, position)``;
        seeds [N, 2] uint32 (hi, lo words of the request seed)."""
        n, d = inject.shape
        if self.cfg.state_init == "zero":
            return jnp.zeros_like(inject)
        if seeds is None:
            raise ValueError("state_init='like-init' needs per-row seeds [N, 2] (or pass init_state)")
        keys = jax.vmap(state_init_key)(seeds[:, 0], seeds[:, 1], positions)
        draw = jax.vmap(lambda k: jax.random.truncated_normal(k, -3.0, 3.0, (d,), jnp.float32))(keys)
        scale = math.sqrt(2.0 / (5.0 * d)) * math.sqrt(d)
        return (draw * scale).astype(inject.dtype)

    def embed(self, params: HuginnParams, tokens: jax.Array, kv: Any, meta: Any, backend: KVBackend,
              seeds: jax.Array | None = None, init_state: jax.Array | None = None):
        """Prelude over boundary KV layers 0..P-1. tokens [N] -> (s_0 [N, D], e [N, D], kv).

        ``init_state`` [N, D], if given, is s_0 as is (no scaling); else ``initial_state``.
        """
        x = params.embed[tokens] * math.sqrt(self.cfg.hidden_size)       # [N, D]
        e, kv = _blocks(self.cfg, params.prelude, x, kv, meta, backend, 0)
        state = self.initial_state(e, meta.positions, seeds) if init_state is None else init_state
        return state.astype(e.dtype), e, kv

    def loop(self, params: HuginnParams, state: jax.Array, inject: jax.Array, kv: Any, meta: Any,
             backend: KVBackend):
        """One recurrence: adapter(concat[s, e]) then the C core blocks (core KV layers 0..C-1).

        state [N, D], inject e [N, D] -> (state [N, D], kv, rel. latent change [N] f32).
        """
        x = jnp.concatenate([state, inject], axis=-1) @ params.adapter   # [N, D]
        x, kv = _blocks(self.cfg, params.core, x, kv, meta, backend, 0)
        new, old = x.astype(jnp.float32), state.astype(jnp.float32)
        diff = jnp.linalg.norm(new - old, axis=-1)
        signal = diff / jnp.maximum(jnp.linalg.norm(new, axis=-1), jnp.finfo(jnp.float32).tiny)
        return x, kv, signal

    def head(self, params: HuginnParams, state: jax.Array, kv: Any, meta: Any, backend: KVBackend):
        """Coda over boundary KV layers P..P+K-1. state [N, D] (raw s_r) -> (logits [N, V] f32, kv)."""
        cfg = self.cfg
        x = rms_norm(state, params.ln_f, cfg.norm_eps)
        x, kv = _blocks(cfg, params.coda, x, kv, meta, backend, cfg.num_prelude_layers)
        x = rms_norm(x, params.ln_f, cfg.norm_eps)
        w = params.embed.T if params.lm_head is None else params.lm_head  # [D, V]
        return (x @ w).astype(jnp.float32), kv


MODEL_CLASS = HuginnModel

"""Numerics shared by the model files: RMSNorm, RoPE, SwiGLU, projections.

Precision rules: norms and RoPE are computed in float32 and cast back to the
activation dtype; matmuls run in the parameter dtype; SwiGLU's silu(gate) * up is computed
in float32 and rounded once (``silu_mul``; upstream's bfloat16 rounds the SiLU too); logits and
exit signals are float32. (In float32 this is the upstream PyTorch code exactly; its bfloat16 RoPE
rounds cos / sin and each term to bfloat16, ours rounds once.)
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp



# The kernels' plain-JAX references (``rltjax.kernels``) compute these same three functions
# for their own oracles; ``tests/test_model_math.py`` holds the two equal bit for bit.
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """[..., D] -> [..., D]; normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


def silu_mul(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up in their dtype, computed in float32 and rounded once on every backend
    (left to XLA, bf16 rounded after each op on a CPU and not inside a GPU fusion); upstream's
    bfloat16 rounds twice (SiLU, then the product): at most one step apart."""
    g32 = gate.astype(jnp.float32)
    return (g32 / (1.0 + jnp.exp(-g32)) * up.astype(jnp.float32)).astype(gate.dtype)


def rope_rotate_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (Llama / Qwen): x [N, H, Dh], cos/sin [N, Dh / 2] float32 -> x's dtype;
    with x = (lo, hi): (lo cos - hi sin, hi cos + lo sin) in float32, cast back once."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    lo, hi = x32[..., :half], x32[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([lo * c - hi * s, hi * c + lo * s], axis=-1).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float) -> jax.Array:
    """[head_dim // 2] float32 inverse frequencies."""
    exponent = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    return 1.0 / (theta ** exponent)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """positions [N] -> (cos, sin) [N, head_dim // 2] float32 of the rotation angles."""
    angles = positions.astype(jnp.float32)[:, None] * rope_inv_freq(head_dim, theta)[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE on interleaved (even, odd) pairs (Huginn). x: [N, H, Dh], cos/sin [N, Dh/2] -> [N, H, Dh]."""
    cos, sin = cos[:, None, :], sin[:, None, :]                          # [N, 1, Dh/2]
    x32 = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    even, odd = x32[..., 0], x32[..., 1]
    out = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Rope:
    """A pass's rotary embedding: the angles' tables at its rows' positions, built once per
    pass (``Rope.at``) and handed by every layer to its KV backend with the un-rotated q and
    k (``KVBackend.write_attend``), which may apply it inside its attention kernel.
    ``interleaved``: (even, odd) pairs (Huginn); else rotate-half (Llama / Qwen)."""
    cos: jax.Array                                                       # [N, Dh/2] float32
    sin: jax.Array                                                       # [N, Dh/2] float32
    interleaved: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @classmethod
    def at(cls, positions: jax.Array, head_dim: int, theta: float, interleaved: bool = False) -> "Rope":
        # Materialised once (a barrier): XLA otherwise recomputed the cos / sin fusion for
        # every layer's attention kernel that reads them (24 extra kernels a pass on an H200).
        cos, sin = jax.lax.optimization_barrier(rope_cos_sin(positions, head_dim, theta))
        return cls(cos, sin, interleaved=interleaved)

    def __call__(self, x: jax.Array) -> jax.Array:
        """[N, H, Dh] -> [N, H, Dh] in x's dtype."""
        return (rope_interleaved if self.interleaved else rope_rotate_half)(x, self.cos, self.sin)


def project_qkv(h: jax.Array, lw, matmul, cfg) -> tuple[jax.Array, jax.Array, jax.Array]:
    """h [N, D] -> q [N, H, Dh], k, v [N, Hkv, Dh]: through the fused q | k | v weight ``wqkv``
    where the layer holds one (``FusedQKVLayer``, Huginn's blocks), else the three projections."""
    n = h.shape[0]
    if getattr(lw, "wqkv", None) is not None:
        q, k, v = jnp.split(matmul(h, lw.wqkv), (cfg.q_width, cfg.q_width + cfg.kv_width), axis=-1)
    else:
        q, k, v = matmul(h, lw.wq), matmul(h, lw.wk), matmul(h, lw.wv)
    return (q.reshape(n, cfg.num_heads, cfg.head_dim), k.reshape(n, cfg.num_kv_heads, cfg.head_dim),
            v.reshape(n, cfg.num_kv_heads, cfg.head_dim))


@jax.tree_util.register_pytree_node_class
class FusedQKVLayer:
    """One layer's params (Ouro, Nanbeige) with q | k | v as one weight ``wqkv``
    [D, (H + 2 Hkv) * Dh]: one GEMM, whose output the decode kernel reads as is. Every other
    field reads through to ``layer`` (whose wq / wk / wv are None). The stacked params keep
    their own dataclasses, so saved checkpoints do not change."""

    def __init__(self, layer, wqkv):
        self.layer, self.wqkv = layer, wqkv

    def __getattr__(self, name):
        return getattr(self.__dict__["layer"], name)

    def tree_flatten(self):
        return (self.layer, self.wqkv), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


def fuse_qkv(layer):
    """A per-layer params tree with wq / wk / wv -> ``FusedQKVLayer``; any other tree as is
    (Huginn's layers hold their own fused wqkv)."""
    if getattr(layer, "wq", None) is None:
        return layer
    wqkv = jnp.concatenate([layer.wq, layer.wk, layer.wv], axis=-1)
    return FusedQKVLayer(dataclasses.replace(layer, wq=None, wk=None, wv=None), wqkv)


def unfuse_qkv(layer, q_width: int, kv_width: int):
    """``fuse_qkv``'s inverse (column slices, copies): the layer's own tree with wq / wk / wv."""
    if not isinstance(layer, FusedQKVLayer):
        return layer
    wq, wk, wv = jnp.split(layer.wqkv, (q_width, q_width + kv_width), axis=-1)
    return dataclasses.replace(layer.layer, wq=wq, wk=wk, wv=wv)


def swiglu(x: jax.Array, matmul, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """[N, D] -> [N, D]; ``matmul(x, w)`` applies one projection (w_gate/w_up [.., D, F],
    w_down [.., F, D]: the backend's matmul picks the layer of stacked weights). x reaches the
    up projection through a barrier, as ``rltjax.kernels.gated_up_ref`` does: XLA:GPU would
    otherwise merge the two dots by concatenating their weights on every call."""
    x_up = jax.lax.optimization_barrier(x)
    return matmul(silu_mul(matmul(x, w_gate), matmul(x_up, w_up)), w_down)


def causal_softmax_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Dense masked attention with float32 softmax.

    q: [N, H, Dh], k/v: [N, T, Hkv, Dh] (keys gathered per query), mask: [N, T] bool.
    Returns [N, H, Dh] in q's dtype. GQA: query head h reads kv head h // (H // Hkv).
    """
    num_heads, num_kv = q.shape[1], k.shape[2]
    group = num_heads // num_kv
    k = jnp.repeat(k, group, axis=2)                                     # [N, T, H, Dh]
    v = jnp.repeat(v, group, axis=2)
    scale = 1.0 / jnp.sqrt(jnp.float32(q.shape[-1]))
    scores = jnp.einsum("nhd,nthd->nht", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    scores = jnp.where(mask[:, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("nht,nthd->nhd", probs, v.astype(jnp.float32))
    return out.astype(q.dtype)


def over_layers(step, carry, layers, *, first_layer: int = 0, extra=None):
    """``step(carry, (layer, layer_params)) -> (carry, None)`` over the layers -> the final carry.
    ``extra``: one more per-layer input, ``step(carry, (layer, layer_params, extra_i))``, in
    the layers' form (a tuple of per-layer arrays for ``SplitLayers``, else stacked).

    ``layers`` is a stacked per-layer params tree (leading axis L): an unrolled ``lax.scan``
    (XLA folds the layer index: static slices read in place, and every layer's matmul fusion
    is the same, so GEMM autotuning runs once per shape; a Python loop with per-layer static
    slices made each layer's fusion distinct and tripled cold compiles on an H200). Or it is
    ``SplitLayers`` (prefill, decode windows): a loop over the per-layer trees through one
    nested jit, ``layer`` a traced int32; ``step`` then reads projections through
    ``projection_source``.
    """
    if isinstance(layers, SplitLayers):
        # One trace serves every layer: the layer's arrays and index are arguments of a nested
        # jit, whose calls XLA inlines (the compiled code is that of a Python loop). Tracing
        # and lowering the 24-layer body once per window variant was most of the start-up
        # warm-up's host time.
        step_once = jax.jit(step)
        for i, layer_params in enumerate(layers.layers):
            xs = (jnp.int32(first_layer + i), layer_params) + (() if extra is None else (extra[i],))
            carry, _ = step_once(carry, xs)
        return carry
    num = jax.tree.leaves(layers)[0].shape[0]
    ids = first_layer + jnp.arange(num, dtype=jnp.int32)
    carry, _ = jax.lax.scan(step, carry, (ids, layers) + (() if extra is None else (extra,)), unroll=True)
    return carry


def projection_source(stack, layer_params, layer):
    """(tree, index) that layer ``layer``'s projections are read from: a stacked tree with the
    layer index (backends read a stack in place, no slice copy), or, when the layers are
    ``SplitLayers``, the layer's own params and no index."""
    if isinstance(stack, SplitLayers):
        return layer_params, None
    return stack, layer


@jax.tree_util.register_pytree_node_class
class SplitLayers:
    """A stack of per-layer params held as L separate per-layer trees (``layers``).

    ``over_layers`` hands each layer its own tree, and model code reads that layer's
    projections from it (``projection_source``) instead of slicing a stack. The engine's
    prefill, loop steps and decode windows run on these: inside a ``while_loop`` (or
    prefill's ``fori_loop`` over loops) XLA:GPU copied every per-layer slice of a stacked
    weight before its matmul, every pass (168 copies, ~1.3 ms per Ouro-1.4B pass on an
    H200), and a single loop step still copied ~0.6 ms of them.
    """

    def __init__(self, layers: tuple):
        self.layers = tuple(layers)

    def tree_flatten(self):
        return (self.layers,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    @classmethod
    def split(cls, stacked) -> "SplitLayers":
        """Per-layer copies, q | k | v fused (``fuse_qkv``) one layer at a time."""
        num = jax.tree.leaves(stacked)[0].shape[0]
        return cls(tuple(fuse_qkv(jax.tree.map(lambda a: a[i], stacked)) for i in range(num)))


def split_layer_stacks(params):
    """``params`` with every stacked-layer field (a nested params dataclass: Ouro's and
    Nanbeige's ``layers``, Huginn's ``prelude`` / ``core`` / ``coda``) as ``SplitLayers``."""
    return dataclasses.replace(params, **{
        f.name: SplitLayers.split(getattr(params, f.name)) for f in dataclasses.fields(params)
        if dataclasses.is_dataclass(getattr(params, f.name))})

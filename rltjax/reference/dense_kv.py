"""Dense per-request KV for the reference oracle: one plane per depth, no paging.

kv.k / kv.v: [L, P, T, Hkv, Dh] where P = R planes (``last_exited``) or 1
(``shared``), T the request's capacity. Each query row names the plane it
writes and, for every key position, the plane it reads (``read_planes``), so
the read rule of a KV layout is spelled out explicitly by the caller instead
of being implied by copies.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rltjax.kernels.residual_norm import residual_norm_ref
from rltjax.kernels.skinny_matmul import gated_up_ref, skinny_matmul_ref
from rltjax.models.layers import causal_softmax_attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DenseKV:
    k: jax.Array  # [L, P, T, Hkv, Dh]
    v: jax.Array  # [L, P, T, Hkv, Dh]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DenseMeta:
    positions: jax.Array    # [N] int32
    write_plane: jax.Array  # [N] int32
    read_planes: jax.Array  # [N, T] int32: the plane each key position is read from
    lengths: jax.Array      # [N] int32: keys 0..length-1 are visible (causal)


def empty_kv(num_layers: int, num_planes: int, capacity: int, num_kv_heads: int,
             head_dim: int, dtype) -> DenseKV:
    shape = (num_layers, num_planes, capacity, num_kv_heads, head_dim)
    return DenseKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


@dataclasses.dataclass(frozen=True)
class DenseKVBackend:
    """KVBackend over DenseKV (see rltjax.models.base)."""

    def write(self, kv: DenseKV, layer, k, v, meta: DenseMeta) -> DenseKV:
        idx = (layer, meta.write_plane, meta.positions)
        return DenseKV(kv.k.at[idx].set(k.astype(kv.k.dtype)), kv.v.at[idx].set(v.astype(kv.v.dtype)))

    def matmul(self, x, w, layer, partial_sums: bool = False):
        return skinny_matmul_ref(x, w, layer)

    def gated_up(self, x, w_gate, w_up, layer):
        return gated_up_ref(x, w_gate, w_up, layer)

    def residual_norm(self, x, y, post_weight, next_weight, eps):
        return residual_norm_ref(x, y, post_weight, next_weight, eps)

    def write_attend(self, kv: DenseKV, layer, q, k, v, meta: DenseMeta, rope=None):
        if rope is not None:
            q, k = rope(q), rope(k)
        kv = self.write(kv, layer, k, v, meta)
        return self.attend(kv, layer, q, meta), kv

    def attend(self, kv: DenseKV, layer, q, meta: DenseMeta):
        capacity = kv.k.shape[2]
        cols = jnp.arange(capacity)[None, :]                          # [1, T]
        keys = kv.k[layer][meta.read_planes, cols]                     # [N, T, Hkv, Dh]
        values = kv.v[layer][meta.read_planes, cols]
        mask = cols < meta.lengths[:, None]                            # [N, T]
        return causal_softmax_attention(q, keys, values, mask)


def read_planes_for(kv_layout: str, depth: int, position: int, exit_depths: np.ndarray,
                    capacity: int) -> np.ndarray:
    """The plane each key position is read from by a query at ``depth`` (1-based).

    last_exited: an earlier token with exit depth e is read at min(depth, e);
    the query reads its own entry at its own depth. shared: one plane.
    """
    if kv_layout == "shared":
        return np.zeros(capacity, np.int32)
    planes = np.minimum(depth, np.maximum(exit_depths[:capacity], 1)) - 1
    planes = planes.astype(np.int32)
    planes[position] = depth - 1
    return planes

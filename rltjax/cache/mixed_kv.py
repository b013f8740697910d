"""One loop pass over decode rows and prompt tokens at once (mixed prefill + decode).

The model code is generic over N rows: a pass over ``[B decode rows; T prompt tokens]``
runs every projection as one GEMM over B + T rows (one read of the weights for both),
and splits only where the two kinds differ: attention. The first B rows go through the
decode backend (each row its request's newest token; on a GPU the fused write + RoPE +
attention kernel), the last T through the prefill backend (chunks of consecutive
positions, causal within themselves; on a GPU the prefill kernel over aligned query
blocks). Their writes touch different requests' pages, so their order does not matter.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rltjax.cache.paged_kv import PagedKV, PagedKVBackend, PagedMeta


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MixedMeta:
    rows: PagedMeta       # [B] decode rows
    prompt: PagedMeta     # [T] prompt tokens (aligned chunks; padding at position -1)

    @property
    def positions(self) -> jax.Array:
        """[B + T] RoPE positions (the model builds one rotary table per pass from them)."""
        return jnp.concatenate([self.rows.positions, self.prompt.positions])


@dataclasses.dataclass(frozen=True)
class MixedKVBackend:
    """KVBackend over PagedKV / MixedMeta: the first ``num_rows`` rows through ``decode``,
    the rest through ``prefill``; projections and norms over all rows at once (XLA's dot
    and fusions: B + T rows are past the decode kernels' sizes)."""
    decode: PagedKVBackend
    prefill: PagedKVBackend
    num_rows: int

    def matmul(self, x, w, layer, partial_sums: bool = False):
        return self.prefill.matmul(x, w, layer, partial_sums)

    def gated_up(self, x, w_gate, w_up, layer):
        return self.prefill.gated_up(x, w_gate, w_up, layer)

    def residual_norm(self, x, y, post_weight, next_weight, eps):
        return self.prefill.residual_norm(x, y, post_weight, next_weight, eps)

    def write_attend(self, kv: PagedKV, layer, q, k, v, meta: MixedMeta, rope=None):
        """-> (out [B + T, H, Dh], kv)."""
        b = self.num_rows
        head = lambda a: a[:b]                  # noqa: E731
        tail = lambda a: a[b:]                  # noqa: E731
        split = (lambda f: None if rope is None else jax.tree.map(f, rope))
        out_rows, kv = self.decode.write_attend(kv, layer, head(q), head(k), head(v), meta.rows, split(head))
        out_prompt, kv = self.prefill.write_attend(kv, layer, tail(q), tail(k), tail(v), meta.prompt, split(tail))
        return jnp.concatenate([out_rows, out_prompt]), kv

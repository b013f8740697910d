"""Where an engine's arrays live: one device, or a tensor-parallel mesh of several.

``ParallelConfig`` says how many devices an engine spans (``tensor_parallel_size``) and
how many engines serve side by side (``data_parallel_size``, ``entrypoints.replicas``).
A ``Placement`` turns an engine's device group into shardings. With one device every array
is committed to it (the programs are exactly those of a one-device engine). With several,
they form a ``Mesh`` with one axis, ``tp``: the weights are laid out Megatron-style (the
column-parallel projections q/k/v, gate/up split by columns, the row-parallel o/down by
rows, the embedding and lm_head by vocabulary), the KV pools by KV heads, and everything
else (slot state, tokens, tables) is replicated. XLA's partitioner (GSPMD) places the
collectives; every value the host reads (hidden state for the exit gate, logits, tokens) is
the full value, so the engine's rules run exactly as on one device. The Pallas attention
kernels, which the partitioner cannot split, run inside ``shard_map`` on each device's heads
(``cache.paged_kv.PagedKVBackend.mesh``).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from rltjax.config_checks import EngineConfigError

# leaf names (the last key of a weight's path) by how Megatron splits them
_COLUMN = {"wq", "wk", "wv", "wqkv", "w_gate", "w_up", "w_fc", "w_gate_up"}
_ROW = {"wo", "w_down", "w_proj"}


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1    # devices one engine spans (its weights and KV split across them)
    data_parallel_size: int = 1      # engines side by side, each on its own devices

    def __post_init__(self):
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise EngineConfigError(f"ParallelConfig.{name}={value!r}: must be an integer >= 1")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    def device_groups(self, devices: Sequence | None = None) -> list[tuple]:
        """The devices of each replica, in order (``jax.devices()`` by default)."""
        devices = list(jax.devices() if devices is None else devices)
        if len(devices) < self.world_size:
            raise EngineConfigError(
                f"tensor_parallel_size={self.tensor_parallel_size} x data_parallel_size={self.data_parallel_size} "
                f"needs {self.world_size} devices; {len(devices)} are visible ({devices[0].platform})")
        tp = self.tensor_parallel_size
        return [tuple(devices[i * tp:(i + 1) * tp]) for i in range(self.data_parallel_size)]


def check_heads(cfg, tp: int) -> None:
    """Tensor parallelism splits attention heads: both head counts must divide by ``tp``."""
    if tp == 1:
        return
    heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
    if heads % tp or kv_heads % tp:
        works = [n for n in range(1, heads + 1) if heads % n == 0 and kv_heads % n == 0]
        raise EngineConfigError(
            f"tensor_parallel_size={tp}: the model's {heads} attention heads and {kv_heads} KV heads do not split "
            f"evenly over {tp} devices; sizes that work: {', '.join(map(str, works))}")


class Placement:
    def __init__(self, devices: Sequence):
        self.devices = tuple(devices)
        self.tp = len(self.devices)
        if self.tp == 1:
            self.mesh = None
            self.replicated = self.kv = SingleDeviceSharding(self.devices[0])
        else:
            self.mesh = Mesh(np.array(self.devices), ("tp",))
            self.replicated = NamedSharding(self.mesh, P())
            self.kv = NamedSharding(self.mesh, P(None, "tp"))     # [L, Hkv, pages, page, Dh]

    @classmethod
    def default(cls) -> "Placement":
        return cls(jax.devices()[:1])

    def put_params(self, params):
        """The weights on this placement (sharded by ``weight_spec`` on a mesh)."""
        if self.mesh is None:
            return jax.device_put(params, self.replicated)
        shardings = jax.tree_util.tree_map_with_path(
            lambda path, leaf: NamedSharding(self.mesh, weight_spec(path, leaf.shape, self.tp)), params)
        return jax.device_put(params, shardings)


def weight_spec(path, shape: tuple, tp: int) -> P:
    """Megatron's split of one weight, by its name; replicated when the dimension does not divide."""
    name = _leaf_name(path)
    ndim = len(shape)
    if name == "embed" and ndim == 2:
        dim = 0
    elif name == "lm_head" and ndim == 2:
        dim = 1
    elif name in _COLUMN or (name is None and ndim >= 2):   # a fused q|k|v matrix has no field name
        dim = ndim - 1
    elif name in _ROW and ndim >= 2:
        dim = ndim - 2
    else:
        return P()
    if shape[dim] % tp:
        return P()
    spec = [None] * ndim
    spec[dim] = "tp"
    return P(*spec)


def _leaf_name(path) -> str | None:
    for key in reversed(path):
        name = getattr(key, "name", None)
        if isinstance(name, str):
            return name
        if not isinstance(key, jax.tree_util.FlattenedIndexKey):
            return None
    return None

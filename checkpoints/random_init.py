"""Random weights at a config's shape, for benchmarks without a download.

``init_params`` runs under ``jax.jit``, so the random draws happen on the
device and the arrays are born there: a multi-GB preset never passes through
host memory and costs one compile plus a few milliseconds of RNG.
"""
from __future__ import annotations

import functools
from typing import Any

import jax

from rltjax.checkpoints.hf import param_template, resolve_dtype
from rltjax.config import ModelConfig
from rltjax.models.base import arch_module


@functools.lru_cache(maxsize=8)
def _jitted_init(cfg: ModelConfig, dtype_name: str):
    module = arch_module(cfg.arch)
    return jax.jit(lambda key: module.init_params(cfg, key, resolve_dtype(dtype_name)))


def random_checkpoint(cfg: ModelConfig, seed: int = 0, dtype: Any = "bfloat16") -> Any:
    """Params pytree drawn from ``init_params`` with ``jax.random.key(seed)``, on the default device."""
    return _jitted_init(cfg, resolve_dtype(dtype).name)(jax.random.key(seed))


def random_checkpoint_shapes(cfg: ModelConfig, dtype: Any = "bfloat16") -> Any:
    """The same pytree as ShapeDtypeStructs (no memory): for sizing and shape checks."""
    return param_template(cfg, dtype)

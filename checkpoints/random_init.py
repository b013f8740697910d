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


def converging(params: Any, scale: float) -> Any:
    """``params`` with every loop's residual branches scaled by ``scale`` (in (0, 1]).

    Random weights make each loop move the state as much as the last, so a token's state
    at depth 2 and depth 4 pick different tokens almost always; a trained looped model's
    loops converge instead. Scaling the looped block's branches (Ouro's post-branch norms,
    which would undo a scaled projection; Nanbeige's and Huginn's core output projections)
    makes later loops move the state less, so shallow and full depth agree more often:
    ``scripts/spec_acceptance.py`` measures how often, per scale. Prelude and coda stay.
    """
    import dataclasses
    if not 0.0 < scale <= 1.0:
        raise ValueError(f"scale={scale}: must be in (0, 1]")
    if hasattr(params, "core"):                                   # Huginn: the recurrent core only
        core = params.core
        return dataclasses.replace(params, core=dataclasses.replace(core, wo=core.wo * scale,
                                                                    w_proj=core.w_proj * scale))
    layers = params.layers
    if hasattr(layers, "attn_post_norm"):                         # Ouro: x + post_norm(branch)
        layers = dataclasses.replace(layers, attn_post_norm=layers.attn_post_norm * scale,
                                     mlp_post_norm=layers.mlp_post_norm * scale)
    else:                                                         # Nanbeige: x + branch
        layers = dataclasses.replace(layers, wo=layers.wo * scale, w_down=layers.w_down * scale)
    return dataclasses.replace(params, layers=layers)

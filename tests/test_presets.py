"""Presets carry the real models' shapes (checked against DESIGN's byte counts)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

from rltjax.checkpoints.random_init import random_checkpoint_shapes
from rltjax.config import ConfigError
from rltjax.presets import PRESETS, preset_config


def nbytes(tree) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_parses(name):
    cfg = preset_config(name)
    assert cfg.num_loops >= 2 and cfg.q_width == cfg.num_heads * cfg.head_dim


def test_ouro_1_4b_sizes_match_the_performance_model():
    cfg = preset_config("ouro-1.4b")
    params = random_checkpoint_shapes(cfg, dtype="bfloat16")
    assert nbytes(params.layers) == pytest.approx(2.47e9, rel=0.01)       # core weights W
    assert nbytes(params.lm_head) == pytest.approx(0.20e9, rel=0.01)
    kv_bytes_per_plane = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    assert kv_bytes_per_plane == 196_608
    assert params.layers.wq.dtype == jnp.bfloat16


def test_ouro_2_6b_has_48_layers_and_exact_parameter_count():
    cfg = preset_config("ouro-2.6b")
    params = random_checkpoint_shapes(cfg, dtype="bfloat16")
    assert cfg.num_layers == 48
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(params)) == 2_667_974_657


def test_other_architectures_shapes():
    nb = preset_config("nanbeige4.2-3b")
    assert (nb.num_layers, nb.num_heads, nb.num_kv_heads, nb.head_dim, nb.hidden_size, nb.num_loops) == \
        (22, 48, 8, 128, 3072, 2)
    hg = preset_config("huginn-0125")
    assert (hg.num_prelude_layers, hg.num_layers, hg.num_coda_layers, hg.num_loops, hg.head_dim) == (2, 4, 2, 32, 96)
    assert hg.tie_embeddings and hg.qk_bias


def test_unknown_preset_lists_choices():
    with pytest.raises(ConfigError, match="ouro-1.4b"):
        preset_config("ouro-9b")

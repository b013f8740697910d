"""Checkpoint loading, conversion and random init (CPU, tiny fixtures)."""
from __future__ import annotations

import dataclasses
import functools
import importlib
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from rltjax.checkpoints import convert as convert_cli
from rltjax.checkpoints.convert import convert_checkpoint
from rltjax.checkpoints.hf import load_hf_params, param_template, save_hf_params
from rltjax.checkpoints.loader import MARKER_FILE, load_checkpoint
from rltjax.checkpoints.orbax_io import restore_params, save_params
from rltjax.checkpoints.random_init import random_checkpoint, random_checkpoint_shapes
from rltjax.checkpoints.safetensors_reader import CheckpointError
from rltjax.config import load_hf_config
from rltjax.models import ouro
from rltjax.models.params import flatten_params

from checkpoint_helpers import FIXTURES, GQA, OURO, Q0, assert_same_tree, copy_fixture, raw_tensors, rewrite


# --- loading HF directories -------------------------------------------------------------

@pytest.mark.parametrize("fixture,dtype", [(OURO, np.float32), (GQA, ml_dtypes.bfloat16)])
def test_load_matches_raw_tensors(fixture, dtype):
    ckpt = load_checkpoint(fixture)
    assert ckpt.dtype == np.dtype(dtype) and ckpt.cfg.arch == "ouro"
    raw, flat = raw_tensors(fixture), flatten_params(ckpt.params)
    used = set()
    for spec in ouro.hf_tensor_specs(ckpt.cfg):
        leaf = np.asarray(flat[spec.param])
        assert leaf.dtype == np.dtype(dtype)
        parts = list(leaf) if spec.num_stacked else [leaf]
        for name, part in zip(spec.hf_names(), parts):
            want = raw[name].T if spec.transpose else raw[name]
            np.testing.assert_array_equal(part, want.reshape(part.shape), err_msg=name)
            used.add(name)
    assert used == set(raw)
    # The layout conventions, spelled out: Linear [out, in] -> [in, out], layers stacked on axis 0.
    p = ckpt.params
    np.testing.assert_array_equal(np.asarray(p.layers.wq[0]), raw[Q0].T)
    np.testing.assert_array_equal(np.asarray(p.lm_head), raw["lm_head.weight"].T)
    np.testing.assert_array_equal(np.asarray(p.gate_b), raw["model.early_exit_gate.bias"][0])
    assert p.layers.wq.shape == (ckpt.cfg.num_layers, ckpt.cfg.hidden_size, ckpt.cfg.q_width)


def test_bf16_checkpoint_loads_as_exact_fp32():
    ckpt = load_checkpoint(GQA, dtype="float32")
    assert ckpt.dtype == np.float32
    raw = raw_tensors(GQA)
    np.testing.assert_array_equal(np.asarray(ckpt.params.embed),
                                  raw["model.embed_tokens.weight"].astype(np.float32))
    np.testing.assert_array_equal(np.asarray(ckpt.params.layers.wk[2]),
                                  raw["model.layers.2.self_attn.k_proj.weight"].astype(np.float32).T)


def test_fp32_checkpoint_loads_as_bf16_rounded():
    params = load_hf_params(OURO, load_hf_config(OURO), jnp.bfloat16)
    raw = raw_tensors(OURO)
    assert params.layers.wq.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(params.layers.wq[1]),
                                  raw["model.layers.1.self_attn.q_proj.weight"].T.astype(ml_dtypes.bfloat16))


def test_ignored_tensors_are_skipped(tmp_path, monkeypatch):
    d = copy_fixture(OURO, tmp_path)
    rewrite(d, lambda t: t.update(freqs_cis=np.zeros((1, 8, 1, 4, 2), np.float32)))
    with pytest.raises(CheckpointError, match="freqs_cis"):
        load_checkpoint(d)
    monkeypatch.setattr(ouro, "HF_IGNORED_TENSORS", ("freqs_cis",), raising=False)
    assert_same_tree(load_checkpoint(d).params, load_checkpoint(OURO).params)


@pytest.mark.parametrize("name", ["huginn-tiny", "nanbeige-tiny"])
def test_other_arches_load_and_round_trip(name, tmp_path):
    """Huginn: tied head (no lm_head tensor), freqs_cis ignored; both re-save to the same tensors."""
    ckpt = load_checkpoint(FIXTURES / name)
    raw = raw_tensors(FIXTURES / name)
    out = save_hf_params(tmp_path / name, ckpt.cfg, ckpt.params, "float32")
    again = raw_tensors(out)
    assert set(raw) - set(again) == ({"freqs_cis"} if name == "huginn-tiny" else set())
    for tensor in again:
        assert raw[tensor].tobytes() == again[tensor].tobytes(), tensor


# --- writing HF, Orbax round trips, conversion -----------------------------------------------

def test_save_hf_sharded_round_trip(tmp_path):
    cfg = load_hf_config(OURO)
    params = load_hf_params(OURO, cfg, jnp.float32)
    out = save_hf_params(tmp_path / "sharded", cfg, params, "float32", max_shard_bytes=200_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    assert not (out / "model.safetensors").exists()
    raw, again = raw_tensors(OURO), raw_tensors(out)
    assert raw.keys() == again.keys()
    for name in raw:
        assert raw[name].tobytes() == again[name].tobytes(), name
    assert_same_tree(load_hf_params(out, cfg, jnp.float32), params)
    # Rewriting as one file replaces the shards instead of leaving an ambiguous directory.
    save_hf_params(out, cfg, params, "bfloat16")
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert raw_tensors(out)[Q0].dtype == ml_dtypes.bfloat16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_orbax_round_trip_is_bit_identical(tmp_path, dtype):
    cfg = load_hf_config(GQA)
    params = random_checkpoint(cfg, seed=3, dtype=dtype)
    save_params(tmp_path, params)
    assert_same_tree(restore_params(tmp_path, param_template(cfg, dtype)), params)
    with pytest.raises(CheckpointError, match="already exists"):
        save_params(tmp_path, params)
    other = dataclasses.replace(cfg, num_kv_heads=4)
    with pytest.raises(CheckpointError, match=r"'layers.wk' has shape \[3, 64, 32\]"):
        restore_params(tmp_path, param_template(other, dtype))


@pytest.mark.parametrize("name", ["ouro-tiny", "nanbeige-tiny"])
def test_saved_params_tree_is_the_checkpoint_tensors(name):
    """The params tree Orbax saves and restores is exactly the checkpoint's tensors: an extra
    field (even one left None, e.g. the engine's fused q | k | v) would change the tree on disk,
    and directories converted before it would no longer load."""
    cfg = load_hf_config(FIXTURES / name)
    template = param_template(cfg, "float32")
    leaves = jax.tree_util.tree_leaves(template, is_leaf=lambda x: x is None)
    assert all(leaf is not None for leaf in leaves)
    module = importlib.import_module(f"rltjax.models.{cfg.arch}")
    assert set(flatten_params(template)) == {spec.param for spec in module.hf_tensor_specs(cfg)}


@pytest.mark.parametrize("fixture", [OURO, GQA])
def test_convert_then_load_equals_hf(tmp_path, fixture):
    hf = load_checkpoint(fixture)
    dst = convert_checkpoint(fixture, tmp_path / "conv", dtype=hf.dtype)
    marker = json.loads((dst / MARKER_FILE).read_text())
    assert marker["format"] == "orbax" and marker["dtype"] == hf.dtype.name
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (dst / name).read_bytes() == (fixture / name).read_bytes()
    conv = load_checkpoint(dst)
    assert conv.cfg == hf.cfg and conv.dtype == hf.dtype and conv.model_dir == dst
    assert_same_tree(conv.params, hf.params)
    # A converted dir loads in another dtype, and converts again (orbax -> orbax).
    assert_same_tree(load_checkpoint(dst, dtype="float32").params, load_checkpoint(fixture, "float32").params)
    again = convert_checkpoint(dst, tmp_path / "again", dtype=hf.dtype)
    assert_same_tree(load_checkpoint(again).params, hf.params)


def test_convert_refuses_non_empty_dst(tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not empty"):
        convert_checkpoint(OURO, dst)
    assert convert_cli.main([str(OURO), str(dst)]) == 2
    assert convert_cli.main([str(OURO), str(dst), "--dtype", "bfloat16", "--overwrite"]) == 0
    assert (dst / "notes.txt").read_text() == "keep me"
    assert load_checkpoint(dst).dtype == jnp.bfloat16
    assert load_checkpoint(OURO).dtype == np.float32
    assert convert_cli.main([str(OURO), str(dst), "--overwrite"]) == 0   # no --dtype: the source's float32
    assert load_checkpoint(dst).dtype == np.float32
    with pytest.raises(CheckpointError, match="source"):
        convert_checkpoint(dst, dst, overwrite=True)


def test_hf_overrides_apply_to_both_layouts(tmp_path):
    dst = convert_checkpoint(OURO, tmp_path / "conv")
    for path in (OURO, dst):
        assert load_checkpoint(path, hf_overrides={"total_ut_steps": 2}).cfg.num_loops == 2


# --- random init -------------------------------------------------------------------------

def test_random_checkpoint_tiny():
    cfg = load_hf_config(OURO)
    params = random_checkpoint(cfg, seed=0, dtype="bfloat16")
    shapes = {n: (l.shape, l.dtype) for n, l in flatten_params(param_template(cfg, jnp.bfloat16)).items()}
    assert {n: (l.shape, l.dtype) for n, l in flatten_params(params).items()} == shapes
    assert all(isinstance(l, jax.Array) for l in jax.tree.leaves(params))
    assert_same_tree(random_checkpoint(cfg, seed=0, dtype="bfloat16"), params)
    assert not np.array_equal(np.asarray(random_checkpoint(cfg, seed=1).embed), np.asarray(params.embed))
    assert random_checkpoint(cfg, dtype=jnp.float32).layers.wq.dtype == jnp.float32


def test_random_checkpoint_big_shapes_only():
    cfg = dataclasses.replace(load_hf_config(OURO), vocab_size=49152, hidden_size=2048,
                              intermediate_size=5632, num_layers=24, num_heads=16, num_kv_heads=16,
                              head_dim=128)
    for shapes in (random_checkpoint_shapes(cfg),
                   jax.eval_shape(functools.partial(random_checkpoint, cfg, 0, "bfloat16"))):
        assert shapes.embed.shape == (49152, 2048) and shapes.lm_head.shape == (2048, 49152)
        assert shapes.layers.wq.shape == (24, 2048, 2048)
        assert shapes.layers.w_down.shape == (24, 5632, 2048)
        assert shapes.gate_b.shape == () and shapes.embed.dtype == jnp.bfloat16
        total = sum(l.size for l in jax.tree.leaves(shapes))
        assert 1.3e9 < total < 1.5e9    # Ouro-1.4B

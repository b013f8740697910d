"""checkpoints.tiny writes a loadable, deterministic HF-layout Ouro directory."""
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from rltjax.checkpoints import tiny
from rltjax.checkpoints.tiny import write_tiny_checkpoint
from rltjax.config import load_hf_config
from rltjax.models.ouro import hf_tensor_specs
from rltjax.tokenizer import Tokenizer

FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "model.safetensors")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ouro")


def test_config_parses(ckpt):
    cfg = load_hf_config(ckpt)
    assert (cfg.arch, cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_loops) == ("ouro", 512, 64, 2, 4)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (4, 4, 16, 160)
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (1, (2,), 0)
    fixture = json.loads((Path(__file__).parent / "fixtures/ouro-tiny/config.json").read_text())
    assert set(json.loads((ckpt / "config.json").read_text())) == set(fixture) - {"auto_map"}


def test_tensors_match_specs(ckpt):
    cfg = load_hf_config(ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    expected = {n: spec.hf_shape for spec in hf_tensor_specs(cfg) for n in spec.hf_names()}
    assert {n: t.shape for n, t in tensors.items()} == expected
    assert all(t.dtype == np.float32 for t in tensors.values())
    assert abs(tensors["model.layers.0.self_attn.q_proj.weight"].std() - 0.02) < 0.002
    norm = tensors["model.norm.weight"]
    assert abs(norm.mean() - 1) < 0.05 and 0.05 < norm.std() < 0.15


def test_deterministic(ckpt, tmp_path):
    again = write_tiny_checkpoint(tmp_path / "again")
    for f in FILES:
        assert (ckpt / f).read_bytes() == (again / f).read_bytes(), f
    other = write_tiny_checkpoint(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (ckpt / "model.safetensors").read_bytes()


def test_tokenizer(ckpt):
    tok = Tokenizer.from_dir(ckpt)
    assert tok.vocab_size == 512
    assert [tok.token_to_id(s) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (1, (2,), 0)
    text = "The baker opened his shutters and the kettle clicked off."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text) / 2  # the merges learned English
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    assert ids[0] == 1 and ids.count(2) == 1


def test_other_shapes_and_dtype(tmp_path):
    d = write_tiny_checkpoint(tmp_path / "gqa", num_layers=3, num_heads=8, num_kv_heads=2,
                              dtype="bfloat16")
    cfg = load_hf_config(d)
    tensors = load_file(str(d / "model.safetensors"))
    assert tensors["model.layers.2.self_attn.k_proj.weight"].shape == (32, 64)
    assert tensors["model.layers.2.self_attn.q_proj.weight"].shape == (128, 64)
    assert str(tensors["lm_head.weight"].dtype) == "bfloat16"
    assert len(tensors) == sum(len(s.hf_names()) for s in hf_tensor_specs(cfg))


def test_unsupported_arch(tmp_path):
    with pytest.raises(NotImplementedError, match="ouro"):
        write_tiny_checkpoint(tmp_path / "x", arch="huginn")


def test_default_demo_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = tiny.default_demo_checkpoint()
    assert path == tmp_path / "rltjax" / "demo-ouro-tiny"
    assert all((path / f).is_file() for f in FILES)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert tiny.default_demo_checkpoint() == path  # cached: not rewritten
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    (path / "tokenizer.json").unlink()  # incomplete -> rewritten
    assert (tiny.default_demo_checkpoint() / "tokenizer.json").is_file()
    assert sorted(p.name for p in (tmp_path / "rltjax").iterdir()) == ["demo-ouro-tiny"]  # no temp dirs left

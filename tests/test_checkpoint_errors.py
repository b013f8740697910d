"""Checkpoint validation: each error names the offending path, tensor or file."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from rltjax.checkpoints.loader import load_checkpoint
from rltjax.checkpoints.safetensors_reader import CheckpointError

from checkpoint_helpers import GQA, OURO, Q0, copy_fixture, rewrite


# --- error paths: each message must name the offending path / tensor / file ---------------

def test_bad_paths(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist") as e:
        load_checkpoint(tmp_path / "nowhere")
    assert "nowhere" in str(e.value)
    with pytest.raises(CheckpointError, match="is a file") as e:
        load_checkpoint(OURO / "model.safetensors")
    assert "model.safetensors" in str(e.value)
    d = copy_fixture(OURO, tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(d)


def test_missing_tensor(tmp_path):
    d = copy_fixture(OURO, tmp_path)
    rewrite(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match="missing 1 tensor") as e:
        load_checkpoint(d)
    assert "model.layers.1.mlp.up_proj.weight" in str(e.value) and "model.safetensors" in str(e.value)


def test_many_missing_tensors_are_truncated(tmp_path):
    d = copy_fixture(OURO, tmp_path)
    rewrite(d, lambda t: [t.pop(k) for k in list(t) if k.startswith("model.layers.")])
    with pytest.raises(CheckpointError, match=r"missing 22 tensor\(s\).*\(12 more\)"):
        load_checkpoint(d)


def test_unexpected_tensor(tmp_path):
    d = copy_fixture(OURO, tmp_path)
    rewrite(d, lambda t: t.update({"model.rotary_emb.inv_freq": np.ones(8, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected 1 tensor\(s\): model.rotary_emb.inv_freq"):
        load_checkpoint(d)


def test_misshaped_tensor(tmp_path):
    d = copy_fixture(OURO, tmp_path)
    rewrite(d, lambda t: t.update({Q0: t[Q0][:, :63]}))
    with pytest.raises(CheckpointError, match=r"shape \[64, 63\].*expects \[64, 64\]") as e:
        load_checkpoint(d)
    assert Q0 in str(e.value) and "model.safetensors" in str(e.value)


def test_int_tensor(tmp_path):
    d = copy_fixture(OURO, tmp_path)
    rewrite(d, lambda t: t.update({"model.norm.weight": np.ones(64, np.int32)}))
    with pytest.raises(CheckpointError, match="I32") as e:
        load_checkpoint(d)
    assert "model.norm.weight" in str(e.value) and "model.safetensors" in str(e.value)


def test_truncated_file(tmp_path):
    d = copy_fixture(OURO, tmp_path)
    path = d / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated") as e:
        load_checkpoint(d)
    assert str(path) in str(e.value)
    path.write_bytes(b"\x10\x00")       # not even a header length
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(d)


def test_corrupt_header(tmp_path):
    d = copy_fixture(OURO, tmp_path)
    path = d / "model.safetensors"
    data = bytearray(OURO.joinpath("model.safetensors").read_bytes())
    data[8] = ord("x")                  # the header's opening brace
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="not valid JSON") as e:
        load_checkpoint(d)
    assert str(path) in str(e.value)
    data[:8] = (10 ** 9).to_bytes(8, "little")   # header length past the end of the file
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="header length") as e:
        load_checkpoint(d)
    assert str(path) in str(e.value)


def test_index_pointing_to_missing_shard(tmp_path):
    d = copy_fixture(GQA, tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"][Q0] = "model-00003-of-00003.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00003-of-00003.safetensors does not exist"):
        load_checkpoint(d)


def test_index_naming_the_wrong_shard(tmp_path):
    d = copy_fixture(GQA, tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = "model.layers.2.mlp.down_proj.weight"
    assert index["weight_map"][name] == "model-00002-of-00002.safetensors"
    index["weight_map"][name] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"not in it: {name}") as e:
        load_checkpoint(d)
    assert "model-00001-of-00002.safetensors" in str(e.value)


def test_index_without_weight_map(tmp_path):
    d = copy_fixture(GQA, tmp_path)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="weight_map"):
        load_checkpoint(d)


def test_pickle_only_dir_is_refused(tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(OURO / "config.json", d)
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match="pickle formats are refused") as e:
        load_checkpoint(d)
    assert "pytorch_model.bin" in str(e.value) and "safetensors" in str(e.value)


def test_unimplemented_arch_is_a_clear_error():
    from rltjax.models.base import arch_module
    with pytest.raises(NotImplementedError, match="mamba"):
        arch_module("mamba")



@pytest.mark.parametrize("value, dtype", [(np.nan, None), (-np.inf, "bfloat16")])
def test_non_finite_weights_are_refused(tmp_path, value, dtype):
    """NaN / Inf weights are refused at load with the tensor named, not served as NaN logits."""
    d = copy_fixture(OURO, tmp_path)

    def poison(t):
        w = np.array(t[Q0], np.float32)
        w[3, 5] = value
        t[Q0] = w
    rewrite(d, poison)
    with pytest.raises(CheckpointError, match=r"NaN or Inf values in 1 tensor\(s\): .*wq") as e:
        load_checkpoint(d, dtype=dtype)
    assert str(d) in str(e.value)

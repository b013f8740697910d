"""Shared helpers for the checkpoint tests: raw tensors, fixture copies, tree equality."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from safetensors import safe_open

from rltjax.checkpoints.safetensors_reader import (index_model_dir, read_tensor, write_safetensors)
from rltjax.models.params import flatten_params


FIXTURES = Path(__file__).parent / "fixtures"
OURO = FIXTURES / "ouro-tiny"          # fp32, one file
GQA = FIXTURES / "ouro-tiny-gqa"       # bf16, two shards + index
Q0 = "model.layers.0.self_attn.q_proj.weight"


def raw_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of a dir via the safetensors library (an independent reader)."""
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="flax") as st:
            out.update({k: np.asarray(st.get_tensor(k)) for k in st.keys()})
    return out


def copy_fixture(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def rewrite(model_dir: Path, edit) -> Path:
    """Rewrite a single-file checkpoint's tensors through ``edit(dict) -> None``."""
    path = model_dir / "model.safetensors"
    tensors = {n: read_tensor(i) for n, i in index_model_dir(model_dir).items()}
    edit(tensors)
    write_safetensors(path, tensors)
    return path


def assert_same_tree(a, b):
    fa, fb = flatten_params(a), flatten_params(b)
    assert fa.keys() == fb.keys()
    for name in fa:
        x, y = np.asarray(fa[name]), np.asarray(fb[name])
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), f"{name} differs"   # bit-identical



"""Hugging Face safetensors <-> rltjax parameter pytrees.

The mapping between the two layouts is declared once per architecture by
``hf_tensor_specs(cfg)`` (see ``rltjax.models.params.TensorSpec``); this
module only walks that declaration. The pytree structure comes from
``jax.eval_shape`` of the model's ``init_params``, so nothing is allocated
twice and the loaded tree is exactly what the model functions expect.

Loading validates the whole directory before reading a byte of weights, then
builds one leaf at a time (stack per-layer tensors, transpose Linear weights
from HF's [out, in] to [in, out]) and sends it to the device, so host memory
peaks at about one leaf rather than one model.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rltjax.checkpoints.safetensors_reader import (INDEX_FILE, SINGLE_FILE, CheckpointError, index_model_dir,
                                            read_tensor, validate, write_safetensors)
from rltjax.config import ModelConfig
from rltjax.models.base import arch_module
from rltjax.models.params import flatten_params, unflatten_params
from rltjax.progress import progress

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(dtype: Any) -> np.dtype:
    """"bfloat16" / jnp.bfloat16 / np.dtype -> np.dtype, restricted to the float types we compute in."""
    try:
        dt = np.dtype(DTYPES[dtype]) if isinstance(dtype, str) else np.dtype(dtype)
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"unsupported dtype {dtype!r}; use one of {sorted(DTYPES)}") from exc
    if dt.name not in DTYPES:
        raise CheckpointError(f"unsupported dtype {dt.name!r}; use one of {sorted(DTYPES)}")
    return dt


def param_template(cfg: ModelConfig, dtype: Any) -> Any:
    """The params pytree as ShapeDtypeStructs: structure, shapes and dtypes, no memory."""
    module, dt = arch_module(cfg.arch), resolve_dtype(dtype)
    return jax.eval_shape(lambda: module.init_params(cfg, jax.random.key(0), dt))


def hf_layout(cfg: ModelConfig) -> tuple[list, dict[str, tuple[int, ...]], tuple[str, ...]]:
    """(specs, {hf name: shape}, ignorable hf names) for a config's architecture."""
    module = arch_module(cfg.arch)
    specs = module.hf_tensor_specs(cfg)
    expected = {name: tuple(spec.hf_shape) for spec in specs for name in spec.hf_names()}
    return specs, expected, tuple(getattr(module, "HF_IGNORED_TENSORS", ()))


def load_hf_params(model_dir: str | Path, cfg: ModelConfig, dtype: Any = "bfloat16") -> Any:
    """Read and validate an HF safetensors dir into a params pytree on the default device."""
    template = param_template(cfg, dtype)
    specs, expected, ignored = hf_layout(cfg)
    infos = index_model_dir(model_dir)
    validate(infos, expected, ignored)
    shapes = flatten_params(template)
    flat = {}
    bar = progress(len(specs), f"loading {Path(model_dir).name}")
    for spec in specs:
        bar.update(1)
        target = shapes[spec.param]
        leaf = spec.to_leaf([read_tensor(infos[name]) for name in spec.hf_names()])
        if leaf.shape != target.shape:  # a spec/init_params disagreement: a bug in the model module
            raise CheckpointError(f"{spec.hf_name}: spec gives leaf {spec.param} shape {leaf.shape}, "
                                  f"the model expects {target.shape}")
        # Cast on the device: bf16 -> f32 is exact and f32 -> bf16 rounds to nearest even either way,
        # but the device does it far faster than ml_dtypes on the host.
        flat[spec.param] = jnp.asarray(leaf).astype(target.dtype)
    bar.close()
    return unflatten_params(template, flat)


def save_hf_params(model_dir: str | Path, cfg: ModelConfig, params: Any, dtype: Any = None,
                   max_shard_bytes: int | None = None) -> Path:
    """Write params as HF safetensors (one file, or shards + index when max_shard_bytes is given).

    Weights only: config.json and tokenizer files are the caller's. Stale weight
    files in ``model_dir`` are removed first, since a leftover index or shard would
    make the directory ambiguous to the reader.
    """
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    dt = None if dtype is None else resolve_dtype(dtype)
    specs, _, _ = hf_layout(cfg)
    flat = flatten_params(params)
    tensors: dict[str, np.ndarray] = {}
    for spec in specs:
        leaf = np.asarray(flat[spec.param] if dt is None else jnp.asarray(flat[spec.param]).astype(dt))
        tensors.update(spec.from_leaf(leaf))
    for stale in [model_dir / SINGLE_FILE, model_dir / INDEX_FILE, *model_dir.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    if max_shard_bytes is None:
        write_safetensors(model_dir / SINGLE_FILE, tensors)
        return model_dir
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(model_dir / fname, shard)
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (model_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return model_dir

"""One entry point for every checkpoint layout: ``load_checkpoint(path)``.

A directory is either a converted rltjax checkpoint (it has the
``rltjax_checkpoint.json`` marker, written last by the converter, and an
``orbax/`` tree) or a Hugging Face directory (config.json + safetensors).
Callers never say which: the engine, CLI and tests all load the same way, and
the config always comes from the directory's config.json (plus overrides), so
both layouts yield the same ``ModelConfig``.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from rltjax.checkpoints.hf import load_hf_params, param_template, resolve_dtype
from rltjax.checkpoints.orbax_io import restore_params
from rltjax.checkpoints.safetensors_reader import CheckpointError
from rltjax.config import ModelConfig, load_hf_config

MARKER_FILE = "rltjax_checkpoint.json"
MARKER_FORMAT = "orbax"


@dataclasses.dataclass(frozen=True)
class LoadedCheckpoint:
    cfg: ModelConfig
    params: Any            # the model's params pytree, on the default device
    model_dir: Path        # where config/tokenizer files live
    dtype: np.dtype        # dtype of the floating-point leaves


def check_model_dir(path: str | Path) -> Path:
    """A readable model directory with a config.json, or a CheckpointError saying what is wrong."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {path} is a file; pass the model directory that holds it")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json: not a Hugging Face or rltjax model directory")
    return path


def read_marker(model_dir: Path) -> dict[str, Any] | None:
    """The converted-checkpoint marker, or None for an HF directory."""
    marker = model_dir / MARKER_FILE
    if not marker.is_file():
        return None
    try:
        info = json.loads(marker.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{marker}: not valid JSON: {exc}") from exc
    if not isinstance(info, dict) or info.get("format") != MARKER_FORMAT or "dtype" not in info:
        raise CheckpointError(f"{marker}: unknown checkpoint marker {info!r} "
                              f"(expected format {MARKER_FORMAT!r} and a dtype)")
    return info


def native_dtype(model_dir: Path, marker: dict[str, Any] | None) -> np.dtype:
    """The dtype a checkpoint was stored in: the marker's, else config.json's torch_dtype."""
    if marker is not None:
        return resolve_dtype(marker["dtype"])
    raw = json.loads((model_dir / "config.json").read_text())
    name = raw.get("torch_dtype") or raw.get("dtype") if isinstance(raw, dict) else None
    return resolve_dtype("float32" if name in (None, "auto") else name)


def load_checkpoint(path: str | Path, dtype: Any = None,
                    hf_overrides: Mapping[str, Any] | None = None) -> LoadedCheckpoint:
    """Load config + params from an HF or converted directory; ``dtype=None`` keeps the stored dtype."""
    model_dir = check_model_dir(path)
    cfg = load_hf_config(model_dir, hf_overrides)
    marker = read_marker(model_dir)
    dt = native_dtype(model_dir, marker) if dtype is None else resolve_dtype(dtype)
    if marker is not None:
        params = restore_params(model_dir, param_template(cfg, dt))
    else:
        params = load_hf_params(model_dir, cfg, dt)
    check_finite(params, model_dir)
    return LoadedCheckpoint(cfg=cfg, params=params, model_dir=model_dir, dtype=dt)


def check_finite(params: Any, model_dir: Path) -> None:
    """Refuse weights holding NaN or Inf (they would load silently and turn every logit into
    NaN): one jitted reduction a tensor, on the device."""
    import jax
    import jax.numpy as jnp

    from rltjax.models.params import flatten_params
    flat = flatten_params(params)
    finite = jax.jit(lambda xs: [jnp.isfinite(x).all() for x in xs])(list(flat.values()))
    bad = [name for name, ok in zip(flat, jax.device_get(finite)) if not ok]
    if bad:
        raise CheckpointError(f"{model_dir}: weights hold NaN or Inf values in {len(bad)} tensor(s): "
                              f"{', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}")

"""Strict reading (and writing) of Hugging Face safetensors model directories.

We parse the safetensors container ourselves: it is 8 bytes of little-endian
header length, a JSON header ``{name: {dtype, shape, data_offsets}}`` and the
raw little-endian tensor bytes. Doing it by hand costs ~50 lines and buys
error messages that name the file and tensor at fault (a truncated download,
a shard the index forgets, an int buffer where a weight should be) instead of
a deep stack trace from a serving process.

Only ``.safetensors`` is ever opened: pickle formats (``*.bin``, ``*.pt``)
can execute code on load, so they are refused, and nothing in the checkpoint
directory is ever imported.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit

# Weights must be floating point; anything else is a foreign buffer or a bug.
FLOAT_DTYPES = {"F32": np.dtype("<f4"), "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype("<f2")}
# The writer also knows integer codes, so tests can build deliberately bad files.
_WRITE_CODES = {np.dtype(v): k for k, v in FLOAT_DTYPES.items()} | {
    np.dtype("<f8"): "F64", np.dtype("<i8"): "I64", np.dtype("<i4"): "I32",
    np.dtype("<i2"): "I16", np.dtype("i1"): "I8", np.dtype("u1"): "U8", np.dtype("bool"): "BOOL"}


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded as the model it claims to be."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live: absolute byte range [start, end) in ``file``."""
    name: str
    file: Path
    dtype: str                 # safetensors code: "F32", "BF16", ...
    shape: tuple[int, ...]
    start: int
    end: int


def _names(items: Iterable[str], limit: int = 10) -> str:
    items = sorted(items)
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and bounds-check one file's header; no tensor data is read."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f"{path}: corrupt or truncated safetensors file "
                                  f"(header length {n} exceeds file size {size})")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header (not valid JSON: {exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    infos, base = {}, 8 + n
    for name, entry in header.items():
        try:
            dtype, shape = entry["dtype"], tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (TypeError, KeyError, ValueError) as exc:
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r}: {entry!r}") from exc
        if not 0 <= begin <= end or base + end > size:
            raise CheckpointError(f"{path}: truncated or corrupt file: tensor {name!r} data [{begin}, {end}) "
                                  f"lies past the end of the data ({size - base} bytes)")
        if dtype in FLOAT_DTYPES and end - begin != math.prod(shape) * FLOAT_DTYPES[dtype].itemsize:
            raise CheckpointError(f"{path}: corrupt header: tensor {name!r} {dtype}{list(shape)} "
                                  f"needs {math.prod(shape) * FLOAT_DTYPES[dtype].itemsize} bytes, "
                                  f"header gives {end - begin}")
        infos[name] = TensorInfo(name, path, dtype, shape, base + begin, base + end)
    return infos


def _read_index(model_dir: Path) -> dict[str, TensorInfo]:
    index_path = model_dir / INDEX_FILE
    try:
        index = json.loads(index_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{index_path}: not valid JSON: {exc}") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: missing or empty 'weight_map'")
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if Path(shard).name != shard or not shard.endswith(".safetensors"):
            raise CheckpointError(f"{index_path}: shard {shard!r} is not a .safetensors file in {model_dir}")
        if not (model_dir / shard).is_file():
            raise CheckpointError(f"{index_path}: shard file {shard} does not exist in {model_dir}")
    infos: dict[str, TensorInfo] = {}
    for shard in shards:
        found = read_header(model_dir / shard)
        listed = {name for name, s in weight_map.items() if s == shard}
        absent = listed - set(found)
        if absent:
            raise CheckpointError(f"{index_path}: tensors listed in shard {shard} are not in it: {_names(absent)}")
        unlisted = set(found) - set(weight_map)
        if unlisted:
            raise CheckpointError(f"{model_dir / shard}: holds tensors the index does not list: {_names(unlisted)}")
        infos.update({name: found[name] for name in listed})
    return infos


def index_model_dir(model_dir: str | Path) -> dict[str, TensorInfo]:
    """Every tensor of an HF model dir (single file or sharded), by name."""
    model_dir = Path(model_dir)
    single, index = model_dir / SINGLE_FILE, model_dir / INDEX_FILE
    if single.is_file() and index.is_file():
        raise CheckpointError(f"{model_dir} holds both {SINGLE_FILE} and {INDEX_FILE}; remove the stale one")
    if index.is_file():
        return _read_index(model_dir)
    if single.is_file():
        return read_header(single)
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{model_dir} holds only pickle weights ({_names(pickles)}): pickle formats are refused because "
            "loading them can execute code; convert the checkpoint to safetensors first")
    others = sorted(p.name for p in model_dir.glob("*.safetensors"))
    extra = f" (found {_names(others)} without an index)" if others else ""
    raise CheckpointError(f"{model_dir} has no {SINGLE_FILE} or {INDEX_FILE}{extra}")


def validate(infos: Mapping[str, TensorInfo], expected: Mapping[str, tuple[int, ...]],
             ignored: Iterable[str] = ()) -> None:
    """Every expected tensor present, float, and at its shape; nothing unexpected."""
    ignored = set(ignored)
    missing = set(expected) - set(infos)
    unexpected = set(infos) - set(expected) - ignored
    if missing or unexpected:
        dirs = sorted({str(i.file.parent) for i in infos.values()})
        files = sorted({i.file.name for i in infos.values()})
        parts = ([f"missing {len(missing)} tensor(s): {_names(missing)}"] if missing else []) + \
                ([f"unexpected {len(unexpected)} tensor(s): {_names(unexpected)}"] if unexpected else [])
        raise CheckpointError(f"checkpoint tensors in {', '.join(dirs)} ({', '.join(files)}) do not match "
                              "the model: " + "; ".join(parts))
    for name, shape in expected.items():
        info = infos[name]
        if info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{info.file}: tensor {name!r} has dtype {info.dtype}; "
                                  f"weights must be one of {sorted(FLOAT_DTYPES)}")
        if info.shape != tuple(shape):
            raise CheckpointError(f"{info.file}: tensor {name!r} has shape {list(info.shape)}, "
                                  f"the config expects {list(shape)}")


def read_tensor(info: TensorInfo) -> np.ndarray:
    """Read one tensor's bytes into a numpy array of its stored dtype (bf16 via ml_dtypes)."""
    if info.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"{info.file}: tensor {info.name!r} has non-float dtype {info.dtype}")
    with open(info.file, "rb") as f:
        f.seek(info.start)
        buf = f.read(info.end - info.start)
    if len(buf) != info.end - info.start:
        raise CheckpointError(f"{info.file}: truncated while reading tensor {info.name!r}")
    return np.frombuffer(buf, FLOAT_DTYPES[info.dtype]).reshape(info.shape)


def write_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> int:
    """Write one safetensors file (tensors in the given order); returns its size in bytes."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset, arrays = 0, []
    for name, t in tensors.items():
        t = np.ascontiguousarray(t)
        code = _WRITE_CODES.get(t.dtype)
        if code is None:
            raise CheckpointError(f"cannot write tensor {name!r}: dtype {t.dtype} has no safetensors code "
                                  "(big-endian arrays must be converted first)")
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
        arrays.append(t)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data section to 8 bytes, like the reference writer
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in arrays:
            f.write(t.tobytes())
    return 8 + len(raw) + offset

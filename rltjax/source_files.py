"""The project's Python sources, hashed: what names the code that ran (the benchmarks'
``source_digest``) and what keys compiled steps to the code that traced them (the
executable store's fingerprint)."""
from __future__ import annotations

import hashlib
import importlib.metadata
import sys
from pathlib import Path
from typing import Sequence


def python_sources(root: Path, dirs: Sequence[str]) -> list[Path]:
    """The ``*.py`` files under ``root / d`` for each of ``dirs``, sorted (caches left out)."""
    return sorted(p for d in dirs for p in (root / d).rglob("*.py") if "__pycache__" not in p.parts)


def hash_files(h, root: Path, files: Sequence[Path]) -> None:
    """Feed each file's path (relative to ``root``) and contents to the hash ``h``."""
    for path in files:
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")


def engine_code_digest(salt: str = "") -> str:
    """sha256 of the engine's code (the ``rltjax`` and ``kernels`` packages' sources) and of
    the versions of what traces and compiles it: jax, jaxlib, its GPU plugins, numpy, Python."""
    import jax
    import jaxlib
    import numpy

    import kernels
    import rltjax
    plugins = sorted(f"{d.metadata['Name']} {d.version}" for d in importlib.metadata.distributions()
                     if (d.metadata["Name"] or "").lower().replace("_", "-").startswith(("jax-cuda", "jax-rocm")))
    h = hashlib.sha256(f"{salt} jax {jax.__version__} jaxlib {jaxlib.__version__} numpy {numpy.__version__} "
                       f"python {sys.version} plugins {plugins}\n".encode())
    for package in (rltjax, kernels):
        root = Path(package.__file__).resolve().parents[1]
        hash_files(h, root, python_sources(root, (package.__name__,)))
    return h.hexdigest()

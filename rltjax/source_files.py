"""The project's Python sources, hashed: what names the code that ran (the benchmarks'
``source_digest``) and what keys compiled steps to the code that traced them (the
executable store's fingerprint)."""
from __future__ import annotations

import hashlib
import importlib.metadata
import subprocess
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

    import rltjax
    import rltjax.kernels
    plugins = sorted(f"{d.metadata['Name']} {d.version}" for d in importlib.metadata.distributions()
                     if (d.metadata["Name"] or "").lower().replace("_", "-").startswith(("jax-cuda", "jax-rocm")))
    h = hashlib.sha256(f"{salt} jax {jax.__version__} jaxlib {jaxlib.__version__} numpy {numpy.__version__} "
                       f"python {sys.version} plugins {plugins}\n".encode())
    for package in (rltjax, rltjax.kernels):     # kernels/ installs as rltjax.kernels
        folder = Path(package.__file__).resolve().parent
        hash_files(h, folder.parent, python_sources(folder.parent, (folder.name,)))
    return h.hexdigest()


ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("rltjax", "kernels", "checkpoints", "benchmarks", "scripts")


def source_digest(root: Path | str = ROOT) -> str:
    """sha256 (first 16 hex digits) over the paths and contents of the Python sources under
    SOURCE_DIRS and pyproject.toml: names the code that ran even where git metadata is
    missing or stale (a copied working tree). For a commit C: ``git archive C | tar -x -C
    DIR`` then ``source_digest(DIR)``."""
    root = Path(root)
    files = python_sources(root, SOURCE_DIRS)
    files += [root / "pyproject.toml"] if (root / "pyproject.toml").is_file() else []
    h = hashlib.sha256()
    hash_files(h, root, files)
    return h.hexdigest()[:16]


def source_identity() -> dict:
    """git commit, whether tracked files differ from it, and the ``source_digest``."""
    return dict(git_commit=run_quietly(["git", "rev-parse", "HEAD"]),
                git_dirty=bool(run_quietly(["git", "status", "--porcelain", "--untracked-files=no"])),
                source_digest=source_digest())


def run_quietly(cmd: list[str]) -> str | None:
    """A command's stripped stdout, run in the repository (None when it fails or is missing)."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None

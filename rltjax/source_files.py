"""The project's Python sources, hashed: what names the code that ran (the benchmarks'
``source_digest``) and what keys compiled steps to the code that traced them (the
executable store's fingerprint)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence


def python_sources(root: Path, dirs: Sequence[str]) -> list[Path]:
    """The ``*.py`` files under ``root / d`` for each of ``dirs``, sorted (caches left out)."""
    return sorted(p for d in dirs for p in (root / d).rglob("*.py") if "__pycache__" not in p.parts)


def hash_files(h, root: Path, files: Sequence[Path]) -> None:
    """Feed each file's path (relative to ``root``) and contents to the hash ``h``."""
    for path in files:
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")

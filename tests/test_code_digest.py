"""The executable store's code digest and its failure modes: what the digest covers, that it
is read once at import, and that a store which cannot key or prune its files stays out of
the engine's way."""
from __future__ import annotations

import importlib.metadata
import os

import pytest

import rltjax.engine.executable_store as executable_store
import rltjax.source_files as source_files
from rltjax.engine.executable_store import ExecutableStore, engine_fingerprint
from rltjax.source_files import engine_code_digest


class _Dist:
    def __init__(self, name: str, version: str):
        self.metadata, self.version = {"Name": name}, version


def test_code_digest_follows_the_gpu_plugins_versions_and_nothing_else_installed(monkeypatch):
    def digest_with(*dists):
        monkeypatch.setattr(importlib.metadata, "distributions", lambda: list(dists))
        return engine_code_digest("salt")

    base = digest_with(_Dist("jax-cuda13-plugin", "0.11.2"), _Dist("requests", "2.0"))
    assert digest_with(_Dist("jax-cuda13-plugin", "0.11.2"), _Dist("requests", "3.0")) == base
    assert digest_with(_Dist("jax-cuda13-plugin", "0.11.2")) == base
    assert digest_with(_Dist("jax-cuda13-plugin", "0.11.3"), _Dist("requests", "2.0")) != base
    assert digest_with(_Dist("jax-rocm7-plugin", "0.11.2"), _Dist("jax-cuda13-plugin", "0.11.2")) != base
    assert digest_with(_Dist("jax-cuda13-plugin", "0.11.2")) != engine_code_digest("other salt")


def test_the_fingerprint_keys_the_code_as_imported_not_the_files_read_again(monkeypatch):
    before = engine_fingerprint()

    def unreadable(*_):
        raise OSError("the sources changed or vanished after import")
    monkeypatch.setattr(source_files, "hash_files", unreadable)
    with pytest.raises(OSError):
        engine_code_digest()
    assert engine_fingerprint() == before


def test_a_store_whose_code_cannot_be_hashed_is_not_opened(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(executable_store, "_CODE_DIGEST", None)
    monkeypatch.setattr(executable_store, "_DIGEST_ERROR", PermissionError("rltjax/__init__.py"))
    with caplog.at_level("WARNING", logger="rltjax"):
        assert ExecutableStore.open(tmp_path / "executables") is None
    err = caplog.text
    assert "no executable store" in err and "could not be hashed" in err and "PermissionError" in err
    assert not (tmp_path / "executables").exists()


def test_a_store_that_cannot_mark_or_list_its_folders_prunes_nothing(tmp_path, monkeypatch):
    root = tmp_path / "executables"
    store = ExecutableStore.open(root)
    others = [root / f"{i:016x}" for i in range(6)]
    for folder in [store.directory, *others]:
        folder.mkdir(parents=True)

    def read_only(*_, **__):
        raise PermissionError("read-only file system")
    monkeypatch.setattr(os, "utime", read_only)
    assert store.prune(keep=1) == []
    assert sorted(root.iterdir()) == sorted([store.directory, *others])

"""Compiled engine steps kept on disk, found without tracing: a warm start's shortcut.

JAX's persistent compilation cache is keyed on the lowered program, so a warm start
still traces and lowers every bucket's step in Python before it finds the executable;
on an H200 that was 13 of the 18 s a warm start took with mixed-prefill windows
(``scripts/bench_serving.py --startup-cache-dir``). This store keeps each compiled step
(``jax.experimental.serialize_executable``) under a key computed *before* tracing,
from everything tracing reads:

- the engine's code: every module of the ``rltjax`` and ``kernels`` packages as they were
  when this module was imported (edits on disk after that do not run in this process, except
  in modules it has not imported yet, e.g. a model's or a kernel's, imported on first use), jax's,
  jaxlib's, numpy's, the GPU plugins' and Python's versions, the device (platform, its
  version, kind), ``XLA_FLAGS`` and JAX's configuration (``engine_fingerprint``, once a
  store);
- the step: its function, its jit options (XLA compiler options included) and the reprs
  of its static arguments (frozen dataclasses, so their fields: the model config, the
  window's settings);
- each dynamic argument's tree structure, shape, dtype, weak type and sharding.

A static argument whose repr shows a memory address cannot be keyed across processes:
that step is compiled as usual and not stored. Only an executable XLA has just compiled is
stored (``compile_fresh``): one that came from XLA's own persistent cache, or from jit's
in-memory cache after it ran, serialized into a file that loaded and then failed on the CPU
("Function ... not found"). A file that fails to load is removed and its step compiled
again. Each fingerprint has a folder of its own; opening a store keeps the
``KEEP_FINGERPRINTS`` most recently used and removes the others. ``dispatch.StepTable`` holds
the compiled steps of one engine, and ``dispatch.DispatchedStep`` calls them directly (jit's own path
would trace again on a first call).
"""
from __future__ import annotations

import hashlib
import logging
import os
import pickle
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any

import jax

from rltjax.engine import verified_file
from rltjax.source_files import engine_code_digest

log = logging.getLogger(__name__)
STORE_FORMAT = 2          # bump when what a file holds changes
KEEP_FINGERPRINTS = 4     # folders of other code / settings kept beside the current one's


# JAX settings that say where executables are kept and what is reported, not what a step
# computes; every other setting is in the key
_UNKEYED_CONFIG = frozenset({
    "jax_compilation_cache_dir", "jax_enable_compilation_cache", "jax_compilation_cache_max_size",
    "jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes",
    "jax_raise_persistent_cache_errors", "jax_explain_cache_misses", "jax_log_compiles",
    "jax_logging_level", "jax_debug_log_modules", "jax_compiler_detailed_logging_min_ops"})

# read once, at import: the code this process runs, not what the files hold when an engine starts
try:
    _CODE_DIGEST, _DIGEST_ERROR = engine_code_digest(f"format {STORE_FORMAT}"), None
except Exception as exc:  # noqa: BLE001 - engines then start without a store (ExecutableStore.open)
    _CODE_DIGEST, _DIGEST_ERROR = None, exc


def _device_ids(compiled) -> list[int]:
    """The ids of the devices a compiled step runs on (its arguments' devices)."""
    return sorted({d.id for s in jax.tree.leaves(compiled.input_shardings) for d in s.device_set})


def engine_fingerprint() -> str:
    """sha256 of what every engine step's trace depends on besides its arguments."""
    if _CODE_DIGEST is None:
        raise RuntimeError(f"the engine's code could not be hashed ({type(_DIGEST_ERROR).__name__}: {_DIGEST_ERROR})")
    h = hashlib.sha256(f"code {_CODE_DIGEST}\n".encode())
    device = jax.devices()[0]
    h.update(f"{device.platform} {device.client.platform_version} {device.device_kind} "
             f"x{jax.device_count()}\n".encode())
    h.update(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}\n".encode())
    for name, value in sorted(jax.config.values.items()):
        if name not in _UNKEYED_CONFIG:
            h.update(f"{name}={value!r}\n".encode())
    return h.hexdigest()


# jax.monitoring's events (jax/_src/dispatch.py, compiler.py): a backend compile's duration is
# recorded around XLA's compile or a persistent-cache read, and a cache hit is counted on its own
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_counting = threading.local()


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event == _COMPILE_EVENT and getattr(_counting, "on", False):
        _counting.compiles += 1


def _on_event(event: str, **kwargs) -> None:
    if event == _CACHE_HIT_EVENT and getattr(_counting, "on", False):
        _counting.cache_hits += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


def compile_fresh(lowered) -> tuple[Any, bool]:
    """(``lowered.compile()``, whether XLA compiled it just now: not from its persistent cache
    or jit's in-memory one)."""
    _counting.on, _counting.compiles, _counting.cache_hits = True, 0, 0
    try:
        compiled = lowered.compile()
    finally:
        _counting.on = False
    return compiled, _counting.compiles > 0 and _counting.cache_hits == 0


class ExecutableStore:
    """Compiled steps in ``directory``'s folder for this process's fingerprint (created on
    the first save)."""

    def __init__(self, directory: str | os.PathLike):
        self.fingerprint = engine_fingerprint()
        self.root = Path(directory)
        self.directory = self.root / self.fingerprint[:16]
        self.loaded = self.saved = self.failed = 0
        self.not_fresh = 0      # compiled steps that came from XLA's cache: not stored
        self._lock = threading.Lock()           # loads and saves run on the warm-up's threads

    @classmethod
    def open(cls, directory: str | os.PathLike) -> "ExecutableStore | None":
        """A store in ``directory`` with older fingerprints' folders pruned (``prune``), or
        None (with a note) when its key cannot be made."""
        try:
            store = cls(directory)
            store.prune()
            verified_file.remove_stale_temporaries(store.directory)   # a killed writer's
        except Exception as exc:  # noqa: BLE001 - the engine starts without the store
            log.warning(f"no executable store in {directory} ({type(exc).__name__}: {exc})")
            return None
        return store

    def prune(self, keep: int = KEEP_FINGERPRINTS) -> list[Path]:
        """Mark this fingerprint's folder used and remove all but the ``keep`` most recently
        used of the others, and any file of the older flat layout -> what was removed."""
        try:
            if self.directory.is_dir():
                os.utime(self.directory)
            entries = list(self.root.iterdir()) if self.root.is_dir() else []
        except OSError:             # a read-only store: nothing to mark or prune
            return []
        others = sorted((p for p in entries if p.is_dir() and p != self.directory), key=_last_used, reverse=True)
        removed = others[keep:] + [p for p in entries if p.is_file()]
        for path in removed:
            try:
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()
            except OSError:         # read-only, or another process's prune got there first
                pass
        return removed

    def file_key(self, program: str) -> str | None:
        """The file name of a ``program_key``'s compiled step; None when it names an object
        by its address, which another process would not share."""
        if " at 0x" in program:
            return None
        return hashlib.sha256(f"{self.fingerprint}\n{program}".encode()).hexdigest()[:40]

    def read(self, key: str) -> tuple[Any, tuple] | None:
        """(the step's output shapes, its serialized executable) saved under ``key``, or None.
        Reading is cheap; ``load`` (XLA's deserialization, about 0.4 s a step on an H200) can
        then run on another thread. A file that fails to read is removed."""
        path = self.directory / key
        try:
            data = verified_file.read(path)      # checked before anything deserializes it
            if data is None:
                return None
            out_specs, *payload = pickle.loads(data)
        except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file: compile instead
            self._drop(path, exc)
            return None
        return out_specs, tuple(payload)

    def load(self, key: str, payload: tuple):
        """The compiled step from ``read``'s payload, or None (its file is then removed and the
        step compiled on its first call)."""
        from jax.experimental.serialize_executable import deserialize_and_load
        try:
            *serialized, device_ids = payload
            by_id = {d.id: d for d in jax.devices()}
            # the devices it was compiled for: left out, deserialization assigns every local
            # device, and an executable for one device then expects a shard on each of them
            compiled = deserialize_and_load(*serialized, execution_devices=[by_id[i] for i in device_ids])
        except Exception as exc:  # noqa: BLE001
            self._drop(self.directory / key, exc)
            return None
        with self._lock:
            self.loaded += 1
        return compiled

    def save(self, key: str, compiled) -> None:
        """Write ``compiled`` under ``key`` (atomically, with a checksum; a step that cannot be
        serialized is skipped)."""
        from jax.experimental.serialize_executable import serialize
        try:
            out_specs = jax.tree.map(lambda i: jax.ShapeDtypeStruct(i.shape, i.dtype), compiled.out_info)
            data = pickle.dumps((out_specs, *serialize(compiled), _device_ids(compiled)))
            verified_file.write(self.directory / key, data)
        except Exception as exc:  # noqa: BLE001 - storing is an optimisation, never an error
            log.warning(f"not storing a compiled step ({type(exc).__name__}: {exc}); the next start compiles it again")
            with self._lock:
                self.failed += 1
            return
        with self._lock:
            self.saved += 1

    def count_not_fresh(self) -> None:
        """Note a step compiled from XLA's cache (not stored)."""
        with self._lock:
            self.not_fresh += 1

    def _drop(self, path: Path, exc: Exception) -> None:
        warnings.warn(f"rltjax: dropping the stored step {path} ({type(exc).__name__}: {exc})", stacklevel=3)
        try:
            path.unlink(missing_ok=True)
        except OSError:             # a read-only store: the step is compiled all the same
            pass
        with self._lock:
            self.failed += 1


def _last_used(folder: Path) -> float:
    try:
        return folder.stat().st_mtime
    except OSError:                 # removed meanwhile (another process's prune)
        return 0.0

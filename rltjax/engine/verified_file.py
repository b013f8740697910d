"""Files a killed process can never leave half-written, and whose bytes are checked on read.

``write`` puts the data in a temporary file beside the target, flushes it to disk and
renames it over the target (a reader sees the old file or the new one, never a mix), with a
header holding the data's SHA-256; ``read`` returns the data only when that digest matches,
so a torn, truncated or bit-flipped file (a disk error, a copy cut short) is never handed to
a deserializer. Used by the executable store and the memory plan's measured peaks.
"""
from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

MAGIC = b"rltjax-verified-1\n"


class CorruptFile(ValueError):
    """A file whose header or digest does not match its bytes."""


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + hashlib.sha256(data).digest() + data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read(path: Path) -> bytes | None:
    """The data, None when there is no file; CorruptFile when its bytes do not check out."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    head = len(MAGIC) + 32
    if len(raw) < head or not raw.startswith(MAGIC):
        raise CorruptFile(f"{path}: not an rltjax file (or cut short)")
    data = raw[head:]
    if hashlib.sha256(data).digest() != raw[len(MAGIC):head]:
        raise CorruptFile(f"{path}: its contents do not match their checksum")
    return data


def remove_stale_temporaries(folder: Path) -> int:
    """Temporary files a killed writer left behind (older than a minute); returns how many."""
    import time
    removed = 0
    try:
        for tmp in folder.glob(".*.tmp"):
            try:
                if time.time() - tmp.stat().st_mtime > 60:
                    tmp.unlink()
                    removed += 1
            except OSError:
                pass
    except OSError:
        pass
    return removed

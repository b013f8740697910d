"""``rltjax convert SRC DST``: HF safetensors (or a converted dir) -> Orbax.

The output directory is self-contained: ``orbax/`` with the params pytree
(already stacked, transposed and cast), the config/tokenizer files the engine
reads, and ``rltjax_checkpoint.json``. The marker is written last, atomically,
so a directory interrupted mid-conversion is never mistaken for a finished one.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

from rltjax.checkpoints.loader import MARKER_FILE, MARKER_FORMAT, load_checkpoint
from rltjax.checkpoints.orbax_io import ORBAX_SUBDIR, save_params
from rltjax.checkpoints.safetensors_reader import CheckpointError
from rltjax.config import ConfigError

COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
MARKER_VERSION = 1


def _prepare_dst(src: Path, dst: Path, overwrite: bool) -> None:
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"destination {dst} is a file, not a directory")
    if dst.resolve() == src.resolve():
        raise CheckpointError(f"destination {dst} is the source directory; choose another")
    if dst.is_dir() and any(dst.iterdir()):
        if not overwrite:
            raise CheckpointError(f"destination {dst} is not empty; pass overwrite=True (--overwrite) to replace it")
        # Remove only what a conversion writes; anything else the user put there stays.
        (dst / MARKER_FILE).unlink(missing_ok=True)
        shutil.rmtree(dst / ORBAX_SUBDIR, ignore_errors=True)
        for name in COPIED_FILES:
            (dst / name).unlink(missing_ok=True)
    dst.mkdir(parents=True, exist_ok=True)


def convert_checkpoint(src: str | Path, dst: str | Path, dtype: Any = None,
                       overwrite: bool = False) -> Path:
    """Convert ``src`` to an Orbax checkpoint in ``dst`` at ``dtype`` (None: the source's own);
    returns ``dst``."""
    src, dst = Path(src).expanduser(), Path(dst).expanduser()
    loaded = load_checkpoint(src, dtype)  # validates src fully before dst is touched
    _prepare_dst(src, dst, overwrite)
    save_params(dst, loaded.params)
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    marker = {"format": MARKER_FORMAT, "version": MARKER_VERSION, "dtype": loaded.dtype.name,
              "arch": loaded.cfg.arch, "params": ORBAX_SUBDIR, "source": str(src.resolve())}
    tmp = dst / (MARKER_FILE + ".tmp")
    tmp.write_text(json.dumps(marker, indent=2) + "\n")
    os.replace(tmp, dst / MARKER_FILE)
    return dst


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of ``rltjax convert`` (the CLI module owns the subparser)."""
    parser.add_argument("src", help="Hugging Face model dir (config.json + safetensors) or a converted dir")
    parser.add_argument("dst", help="output directory (must be empty unless --overwrite)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="dtype of the stored weights (default: the source's)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing conversion in DST")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``rltjax convert``; returns the process exit code."""
    try:
        dst = convert_checkpoint(args.src, args.dst, args.dtype, overwrite=args.overwrite)
    except (CheckpointError, ConfigError, NotImplementedError) as exc:
        print(f"rltjax convert: error: {exc}", file=sys.stderr)
        return 2
    dtype = json.loads((dst / MARKER_FILE).read_text())["dtype"]
    print(f"converted {args.src} -> {dst} ({dtype})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="rltjax convert", description=__doc__.splitlines()[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

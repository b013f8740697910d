"""Params pytrees <-> Orbax checkpoints (the fast-restore format).

Converting once to Orbax means a serving start-up restores ready-made,
stacked, transposed leaves straight into device buffers (tensorstore reads in
parallel) instead of re-validating and re-laying-out safetensors every time.

Save is synchronous: we wait for Orbax's background commit before returning,
so a conversion that says "done" is done. Restore fills a caller-given
template of ``jax.ShapeDtypeStruct``s, which fixes structure, shapes and the
dtype to restore into; the stored shapes are checked first so a config that
does not match the checkpoint fails with the offending leaf's name.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from rltjax.checkpoints.safetensors_reader import CheckpointError
from rltjax.models.params import flatten_params

ORBAX_SUBDIR = "orbax"


def save_params(dst: str | Path, params: Any) -> Path:
    """Write params to ``dst/orbax`` (which must not exist yet) and wait until committed."""
    path = Path(dst).resolve() / ORBAX_SUBDIR
    if path.exists():
        raise CheckpointError(f"{path} already exists; refusing to overwrite an Orbax checkpoint")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, params)
        ckptr.wait_until_finished()
    return path


def stored_shapes(dst: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{leaf name: (shape, dtype name)} as recorded in ``dst/orbax``'s metadata."""
    path = Path(dst).resolve() / ORBAX_SUBDIR
    if not path.is_dir():
        raise CheckpointError(f"{path} does not exist: not a converted rltjax checkpoint")
    with ocp.StandardCheckpointer() as ckptr:
        try:
            tree = ckptr.metadata(path).item_metadata.tree
        except Exception as exc:  # orbax raises assorted types for unreadable metadata
            raise CheckpointError(f"{path}: unreadable Orbax metadata: {exc}") from exc
    return {name: (tuple(m.shape), str(m.dtype)) for name, m in flatten_params(tree).items()}


def restore_params(dst: str | Path, template: Any) -> Any:
    """Restore ``dst/orbax`` into ``template``'s structure, shapes and dtypes (cast if they differ)."""
    stored = stored_shapes(dst)
    wanted = flatten_params(template)
    missing, extra = sorted(set(wanted) - set(stored)), sorted(set(stored) - set(wanted))
    if missing or extra:
        raise CheckpointError(f"{dst}: Orbax checkpoint leaves do not match the model: "
                              f"missing {missing}, unexpected {extra}")
    for name, leaf in wanted.items():
        if stored[name][0] != tuple(leaf.shape):
            raise CheckpointError(f"{dst}: leaf {name!r} has shape {list(stored[name][0])} in the checkpoint, "
                                  f"the config expects {list(leaf.shape)}")
    # Name the device explicitly: left unset, Orbax would reuse the sharding recorded at save
    # time, so a checkpoint converted on a CPU box would be restored onto the CPU of a GPU host.
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None) or device),
        template)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(Path(dst).resolve() / ORBAX_SUBDIR, target)

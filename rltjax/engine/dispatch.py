"""Calling compiled engine steps directly: a call's keys, and the table of one step's executables.

``call_signature`` tells two calls of one step apart (static values, argument shapes and
dtypes); ``program_key`` names a call's program across processes (``ExecutableStore``'s
file key). The warm-up fills a ``StepTable`` per step; ``DispatchedStep`` then calls the
executables directly, and jit only for a call none of them covers (jit's own path would
trace again on a first call).
"""
from __future__ import annotations

import functools
import inspect
import sys
import threading
from typing import Any, Callable

import jax

from rltjax.jit_options import jit_kwargs_of


def _leaf_spec(leaf) -> str:
    if isinstance(leaf, jax.Array):
        # the devices too: a sharding's repr names only the mesh's axis sizes, and a replica's
        # program must not load one compiled for another replica's devices
        devices = sorted(d.id for d in leaf.sharding.device_set)
        return f"{leaf.shape}{leaf.dtype}{'w' if leaf.weak_type else ''}@{leaf.sharding}{devices}"
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):            # numpy: a host value
        return f"{tuple(leaf.shape)}{leaf.dtype}@host"
    return f"{type(leaf).__name__}:{leaf!r}"                            # a Python scalar


def split_static(step: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """(sorted static (name, value) pairs passed, the dynamic keyword arguments); None when
    a static argument may have come by position (``DispatchedStep`` then defers to jit)."""
    names, first_position = _static_names(step)
    if len(args) > first_position:
        return None
    return (tuple((n, kwargs[n]) for n in names if n in kwargs),
            {k: v for k, v in kwargs.items() if k not in names})


@functools.cache
def _static_names(step: Callable) -> tuple[tuple[str, ...], int]:
    """(a step's sorted static argument names, the first position one of them can take)."""
    names = tuple(sorted(jit_kwargs_of(step).get("static_argnames", ())))
    params = list(inspect.signature(getattr(step, "__wrapped__", step)).parameters.values())
    positions = [i for i, p in enumerate(params) if p.name in names and p.kind is p.POSITIONAL_OR_KEYWORD]
    if jit_kwargs_of(step).get("static_argnums"):
        return names, -1                # static by position: every call goes to jit
    return names, min(positions, default=sys.maxsize)     # keyword-only: never by position


def call_signature(static: tuple, args: tuple, dynamic: dict) -> tuple:
    """What tells two calls of one step apart in a StepTable: its static values and the
    shapes, dtypes and weak types of every dynamic argument but the first (for most steps
    the weights, fixed for an engine; a compiled step checks the shape and dtype of every
    argument, so a first argument that differs raises)."""
    leaves, tree = jax.tree.flatten((args[1:], dynamic))
    # weak_type too: a compiled step's argument check ignores it, and a weakly typed scalar
    # changes the program's result types
    return static, tree, tuple((getattr(x, "shape", None), getattr(x, "dtype", type(x)),
                                getattr(x, "weak_type", False)) for x in leaves)


def program_key(step: Callable, static: tuple, args: tuple, dynamic: dict) -> str:
    """What names this call's program within a process: the step, its jit options, its
    static values' reprs and every dynamic argument's structure, shape, dtype, weak type
    and sharding."""
    fn = getattr(step, "__wrapped__", step)
    leaves, tree = jax.tree.flatten((args, dynamic))
    return "\n".join([f"{fn.__module__}.{fn.__qualname__}", repr(sorted(jit_kwargs_of(step).items())),
                      repr(static), str(tree)] + [_leaf_spec(x) for x in leaves])


class StepTable:
    """The compiled steps of one engine's step function, by ``call_signature``."""

    def __init__(self):
        self.compiled: dict[tuple, Any] = {}
        self.ambiguous: set[tuple] = set()
        self.out_info: dict[str, Any] = {}     # by program_key: its outputs' shapes (the warm-up's stand-ins)
        self._lock = threading.Lock()           # add runs on the warm-up's compile threads

    def add(self, signature: tuple, program: str, compiled) -> None:
        """Register ``compiled``; two different programs under one signature are both dropped
        (their calls go through jit), never one called with the other's arguments."""
        with self._lock:
            if signature in self.ambiguous:
                return
            old = self.compiled.get(signature)
            if old is not None and old[0] != program:
                del self.compiled[signature]
                self.ambiguous.add(signature)
                return
            self.compiled[signature] = (program, compiled)


class DispatchedStep:
    """A jitted step that calls its warm-up's compiled executables directly, and jit for
    any call they do not cover."""

    def __init__(self, step: Callable, table: StepTable):
        self.step = step
        self.table = table
        self.jit_calls = 0      # calls no compiled step covered (after a full warm-up: none)

    def __call__(self, *args, **kwargs):
        split = split_static(self.step, args, kwargs)
        if split is not None:
            static, dynamic = split
            entry = self.table.compiled.get(call_signature(static, args, dynamic))
            if entry is not None:
                return entry[1](*args, **dynamic)
        self.jit_calls += 1
        return self.step(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self.step.lower(*args, **kwargs)

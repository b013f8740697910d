"""The engine's jitted steps, rebuilt per engine with XLA compiler options.

Every device step is declared with ``engine_jit`` (``jax.jit`` that remembers its
arguments). ``with_options(step, options)`` returns the same step compiled with
those XLA options (``ExecutionConfig.xla_options``, ``--xla-option``): an
explicit, per-engine setting, never an environment variable. Engines with equal
options share one rebuilt function and so its compilation cache.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax

_DECLARED: dict[Any, tuple[Callable, dict]] = {}


def engine_jit(**jit_kwargs):
    """Decorator: ``jax.jit(fn, **jit_kwargs)``, rebuildable by ``with_options``."""
    def wrap(fn):
        jitted = jax.jit(fn, **jit_kwargs)
        _DECLARED[jitted] = (fn, jit_kwargs)
        return jitted
    return wrap


@functools.cache
def _rebuilt(jitted, options: tuple) -> Callable:
    fn, jit_kwargs = _DECLARED[jitted]
    return jax.jit(fn, **jit_kwargs, compiler_options=dict(options))


def check_options(options: tuple[tuple[str, Any], ...]) -> None:
    """Compile a trivial function with ``options`` so a bad name or value fails at start-up
    with XLA's own message, not at some later first compile."""
    if not options:
        return
    try:
        jax.jit(lambda x: x + 1, compiler_options=dict(options)).lower(0).compile()
    except Exception as exc:   # XLA raises a generic runtime error: name the setting
        raise ValueError(f"ExecutionConfig.xla_options {dict(options)}: XLA refused them: {exc}") from exc


def with_options(jitted, options: tuple[tuple[str, Any], ...] = ()) -> Callable:
    """``jitted`` compiled with XLA ``options`` ((name, value) pairs); itself when empty."""
    return _rebuilt(jitted, tuple(options)) if options else jitted

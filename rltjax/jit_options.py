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


# On a GPU, XLA's rematerialization pass sizes a program without the donated KV pool's
# aliasing (an H200 engine's 92 GiB pool counted three times: 275.7 GiB against a 101.7 GiB
# limit), cannot reach its limit, and recomputes a few small values anyway. In the decode
# window, with a full-size pool, the recomputed take of standby entries left an entry waiting
# after a row had taken it, so one request ran in two rows (tests/test_window_compile_gpu.py);
# with the pass off the same run is right. The pass saves no
# memory here, so the engine turns it off.
GPU_DEFAULT_OPTIONS = (("xla_disable_hlo_passes", "rematerialization"),)

# Where the decode projections run on the engine's own kernels (Ouro's shapes, up to 64 rows:
# ``runner.decode_projections_on_kernels``), XLA's GEMMs are the prefill's and the heads' of
# more than 8 rows; autotuning Triton tilings for each of their shapes was most of a cold
# start's compile. With cuBLAS alone, on one H200 (scripts/bench_serving.py): start-up at
# max_num_seqs 64 54.7 -> 45.8 s cold, ShareGPT at 32 streams 3,732.6 -> 3,738.8 tok/s,
# bench_throughput at 1 / 8 streams 213.9 / 1,493.1 -> 214.1 / 1,496.7. Elsewhere (Nanbeige's
# and Huginn's wider K, batches past 64 rows) decode GEMMs stay on XLA's choice: not measured.
KERNEL_DECODE_OPTIONS = (("xla_gpu_enable_triton_gemm", False),)


def engine_options(options: tuple[tuple[str, Any], ...], platform: str,
                   decode_on_kernels: bool = False) -> tuple[tuple[str, Any], ...]:
    """The XLA options an engine's steps compile with on ``platform``: the caller's, and on a
    GPU the passes of ``GPU_DEFAULT_OPTIONS`` disabled too (joined with any the caller
    disables) and, where ``decode_on_kernels``, ``KERNEL_DECODE_OPTIONS`` unless the caller
    sets them -> sorted pairs."""
    merged = dict(options)
    if platform == "gpu":
        for name, passes in GPU_DEFAULT_OPTIONS:     # comma-separated pass names
            items = f"{passes},{merged.get(name, '')}".split(",")
            merged[name] = ",".join(dict.fromkeys(i.strip() for i in items if i.strip()))
        if decode_on_kernels:
            for name, value in KERNEL_DECODE_OPTIONS:
                merged.setdefault(name, value)
    return tuple(sorted(merged.items()))


@functools.cache
def _rebuilt(jitted, options: tuple) -> Callable:
    fn, jit_kwargs = _DECLARED[jitted]
    jit_kwargs = dict(jit_kwargs, compiler_options=dict(options))
    rebuilt = jax.jit(fn, **jit_kwargs)
    _DECLARED[rebuilt] = (fn, jit_kwargs)
    return rebuilt


def jit_kwargs_of(jitted) -> dict:
    """The jit keyword arguments an ``engine_jit`` step (or its ``with_options`` rebuild) was
    made with, XLA compiler options included ({} for any other function)."""
    return dict(_DECLARED.get(jitted, (None, {}))[1])


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

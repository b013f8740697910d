"""Start-up compilation of every bucket, with XLA's compiles running in parallel.

A handful of executables serve every batch (prefill token buckets; loop, head and
window row buckets). Compiled one after another they made a cold start take
over 100 s on an H200: each compile is mostly XLA's per-shape GEMM autotuning and
Triton compilation, which run outside Python's lock. So the warm-up goes in two
passes over the same all-padding calls:

1. record: each call runs through the runner as usual, but its device step is only
   traced and lowered on this thread, its compile is handed to a thread pool, and it
   returns stand-in outputs (the input arrays where shapes match, so no second KV
   pool is allocated; zeros elsewhere). The runner's device state is restored after.
2. run: each call runs for real, once, through ``DispatchedStep``, which calls the
   executables the record pass compiled or loaded; a call it cannot match falls back to
   jit, which compiles. This pass should compile nothing; it counts what it did compile
   (``WarmUp.compiled_late``) so a miss cannot go unseen.

All-padding inputs touch only the scratch page and the dummy slot.

With an ``ExecutableStore`` the record pass first looks each call up there, by a key
made from the call's arguments without tracing; a step found is not traced, lowered or
compiled: its stored output shapes give the stand-ins, and the pool deserializes it.
Each step XLA compiles afresh is saved. After the warm-up the runner calls
the compiled steps directly (``executable_store.DispatchedStep``).
"""
from __future__ import annotations

import os
import sys
import time
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rltjax.benchmarks.compile_watch import CompileWatch
from rltjax.engine.executable_store import (DispatchedStep, ExecutableStore, StepTable, call_signature,
                                            compile_fresh, program_key, split_static)
from rltjax.engine.window_calls import WINDOW_SAMPLERS
from rltjax.engine.host_rows import idle_window_rows

COMPILE_THREADS = max(1, min(16, os.cpu_count() or 1))


class WarmUp(NamedTuple):
    seconds: float         # both passes
    executables: int       # compiled (or loaded from the persistent cache) in the record pass
    compiled_late: int     # compiled in the run pass: 0 unless jit's cache missed
    # where the seconds went: tracing and lowering on this thread (record pass), waiting for
    # the pool's compiles after it, and the run pass; and the tracing and lowering by
    # executable kind ("window", "prefill", ...): with a warm cache that is most of it
    phase_seconds: dict[str, float] = {}
    lower_seconds_by_kind: dict[str, float] = {}
    loaded: int = 0        # of the executables, found in the ExecutableStore (not traced)
    stored: int = 0        # of the executables, compiled and saved to the ExecutableStore


def warm_up(runner, block_tables: np.ndarray, boundary_block_tables: np.ndarray | None = None, *,
            show_progress: bool = True, threads: int = COMPILE_THREADS,
            store: ExecutableStore | None = None) -> WarmUp:
    """Compile (or load from ``store``) every executable ``runner`` can call, in ``threads``
    parallel compiles; then run each once."""
    t0 = time.perf_counter()
    jobs = bucket_jobs(runner)
    real_steps, state = runner.steps, (runner.kv, runner.slot_state, runner.bkv, runner.slot_inject,
                                       runner.slot_tokens, runner.standby)
    real_steps = type(real_steps)(*(getattr(step, "step", step) for step in real_steps))  # a second warm-up
    tables = [StepTable() for _ in real_steps]
    futures = []
    lower_by_kind = defaultdict(float)
    loaded_before, saved_before = (store.loaded, store.saved) if store else (0, 0)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        runner.steps = type(real_steps)(*(_recording(step, table, pool, futures, store)
                                          for step, table in zip(real_steps, tables)))
        try:
            for kind, n in jobs:
                t_job = time.perf_counter()
                run_job(runner, kind, n, block_tables, boundary_block_tables)
                lower_by_kind[kind.split("/")[0]] += time.perf_counter() - t_job
        finally:
            runner.steps = type(real_steps)(*(DispatchedStep(step, table)
                                              for step, table in zip(real_steps, tables)))
            runner.kv, runner.slot_state, runner.bkv, runner.slot_inject, runner.slot_tokens, runner.standby = state
        t_lowered = time.perf_counter()
        for done, future in enumerate(as_completed(futures), 1):
            future.result()
            if show_progress:
                print(f"\r[rltjax] compiling or loading {len(futures)} executables on {threads} threads "
                      f"({done} done)",
                      end="", file=sys.stderr, flush=True)
    t_compiled = time.perf_counter()
    with CompileWatch() as late:
        for kind, n in jobs:
            run_job(runner, kind, n, block_tables, boundary_block_tables)
        jax.block_until_ready(runner.kv)
    elapsed = time.perf_counter() - t0
    loaded, stored = (store.loaded - loaded_before, store.saved - saved_before) if store else (0, 0)
    if show_progress:
        print(f"\r[rltjax] {len(futures)} executables ready in {elapsed:.1f}s ({loaded} loaded from "
              f"{store.directory}, {stored} stored)" if store else
              f"\r[rltjax] compiled {len(futures)} executables in {elapsed:.1f}s" + " " * 20, file=sys.stderr)
    if store and store.not_fresh:
        print(f"[rltjax] {store.not_fresh} compiled steps came from XLA's persistent cache (or this process's "
              f"jit cache) and were not stored in {store.directory} (only fresh compiles are); later starts "
              "trace them again until XLA compiles them afresh (e.g. with an emptied cache directory)",
              file=sys.stderr)
    phases = dict(trace_and_lower=t_lowered - t0, compile_wait=t_compiled - t_lowered,
                  run=elapsed - (t_compiled - t0))
    return WarmUp(elapsed, len(futures), late.count, {k: round(v, 3) for k, v in phases.items()},
                  {k: round(v, 3) for k, v in lower_by_kind.items()}, loaded, stored)


def bucket_jobs(runner) -> list[tuple[str, int]]:
    """(kind, bucket) of every executable the runner's engine can call, the longest compiles
    first (mixed-prefill windows, decode windows, then prefill, largest buckets first): the
    pool then does not end on one long compile started last."""
    jobs = []
    if runner.window_spec:
        jobs += [(f"window_mixed/{sampler}", b) for b in reversed(runner.mixed_buckets) for sampler in WINDOW_SAMPLERS]
        jobs += [(f"window/{sampler}", b) for b in reversed(runner.window_buckets) for sampler in WINDOW_SAMPLERS]
        if runner.uses_standby:
            jobs += [("standby_put", runner.max_num_seqs + 1)]
        jobs += [("window_merge", b) for b in runner.window_buckets if not runner.standby_for(b)]
    jobs += [("prefill", t) for t in reversed(runner.token_buckets)]
    jobs += [("loop", b) for b in runner.row_buckets] + [("head", b) for b in runner.row_buckets]
    if runner.has_boundary:
        jobs += [("embed", b) for b in runner.row_buckets]
    return jobs


def run_job(runner, kind: str, n: int, block_tables, boundary_block_tables) -> None:
    """One all-padding call of ``kind`` over ``n`` rows / tokens."""
    zeros = lambda k: np.zeros(k, np.int32)
    dummy = np.full(n, runner.dummy_slot, np.int32)
    pad_rows = runner.padding_boundary_rows(n, boundary_block_tables)
    if kind == "prefill":
        runner.prefill(zeros(n), zeros(n), np.zeros((runner.prefill_write_planes, n), np.int32), zeros(n),
                       np.zeros((runner.cfg.num_loops, n), np.int32), dummy, block_tables, pad_rows)
    elif kind == "loop":
        runner.loop(dummy, zeros(n), np.zeros(n, bool), zeros(n) - 1, np.zeros((runner.num_planes, n), np.int32),
                    zeros(n), zeros(n), block_tables)
    elif kind.startswith("window/"):
        runner.window(idle_window_rows(n, runner.num_planes, runner.window_trace_width), block_tables,
                      boundary_block_tables, sampler=kind.split("/")[1])
    elif kind.startswith("window_mixed/"):
        t = runner.prompt_tokens_for(n)
        prompt = runner.window_prompt((zeros(t), zeros(t) - 1, np.zeros((runner.prefill_write_planes, t), np.int32),
                                       zeros(t), np.zeros((runner.cfg.num_loops, t), np.int32),
                                       np.full(t, runner.dummy_slot, np.int32)), np.zeros(n, bool))
        idle = idle_window_rows(n, runner.num_planes, runner.window_trace_width)
        runner.window_read(*runner.window_launch(idle, block_tables, boundary_block_tables,
                                                 kind.split("/")[1], prompt), n)
    elif kind == "window_merge":
        idle = idle_window_rows(n, runner.num_planes, runner.window_trace_width)
        runner.window_merge(jax.device_put(idle, runner.device), idle, np.zeros(n, bool))
    elif kind == "standby_put":
        runner.standby_put(idle_window_rows(n, runner.num_planes, runner.window_trace_width), np.zeros(n, bool))
    elif kind == "embed":
        runner.embed(dummy, zeros(n), zeros(n) - 1, zeros(n), pad_rows)
    elif kind == "head":
        runner.head(dummy, np.zeros(n, np.float32), zeros(n), np.ones(n, np.float32), np.zeros(n, np.uint32),
                    np.zeros(n, np.uint32), zeros(n), zeros(n) - 1, pad_rows)
    else:
        raise ValueError(f"unknown executable kind {kind!r}")


def _recording(step, table: StepTable, pool: ThreadPoolExecutor, futures: list, store: ExecutableStore | None):
    """``step`` loaded from ``store``, or traced and lowered here and compiled in ``pool``
    (then saved to ``store``); registered in ``table``; returns stand-in outputs."""
    def call(*args, **kwargs):
        split = split_static(step, args, kwargs)
        if split is None:       # a static argument passed by position: jit's own path
            lowered = step.lower(*args, **kwargs)
            futures.append(pool.submit(lowered.compile))
            return _stand_ins(lowered.out_info, args)
        static, dynamic = split
        signature, program = call_signature(static, args, dynamic), program_key(step, static, args, dynamic)
        if program in table.out_info:      # called again in this pass (e.g. a launch, then its read)
            return _stand_ins(table.out_info[program], args)
        file_key = store.file_key(program) if store else None
        stored = store.read(file_key) if file_key else None
        if stored is not None:          # XLA's deserialization on the pool, like a compile
            out_specs, payload = stored

            def load_and_keep():
                compiled = store.load(file_key, payload)
                if compiled is not None:        # else the run pass compiles it (compiled_late)
                    table.add(signature, program, compiled)
            futures.append(pool.submit(load_and_keep))
            table.out_info[program] = out_specs
            return _stand_ins(out_specs, args)
        lowered = step.lower(*args, **kwargs)
        table.out_info[program] = lowered.out_info

        def compile_and_keep():
            compiled, fresh = compile_fresh(lowered)
            table.add(signature, program, compiled)
            if file_key and fresh:
                store.save(file_key, compiled)
            elif file_key:
                store.count_not_fresh()
        futures.append(pool.submit(compile_and_keep))
        return _stand_ins(lowered.out_info, args)
    return call


def _stand_ins(out_info, args):
    """Arrays shaped like the outputs: input arrays of the same shape and dtype, taken in
    order (the donated state comes back as itself), else zeros on the inputs' device."""
    spare = defaultdict(deque)
    device = None
    for leaf in jax.tree.leaves(args):
        if isinstance(leaf, jax.Array):
            spare[(leaf.shape, leaf.dtype)].append(leaf)
            device = device or next(iter(leaf.devices()))

    def one(info):
        queue = spare[(tuple(info.shape), info.dtype)]
        if queue:
            return queue.popleft()
        if jax.dtypes.issubdtype(info.dtype, jax.dtypes.extended):
            return jnp.zeros(info.shape, info.dtype)
        # a host copy, not jnp.zeros: that compiles an executable per shape (~40 small compiles
        # on the start-up thread, none of them cached on disk)
        return jax.device_put(np.zeros(info.shape, info.dtype), device)
    return jax.tree.map(one, out_info)

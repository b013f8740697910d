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
the compiled steps directly (``dispatch.DispatchedStep``).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rltjax.engine.compile_watch import CompileWatch
from rltjax.engine.dispatch import DispatchedStep, StepTable, call_signature, program_key, split_static
from rltjax.engine.executable_store import ExecutableStore, compile_fresh
from rltjax.engine.window.rows import idle_window_rows
from rltjax.progress import progress
from rltjax.sampling import SAMPLERS

COMPILE_THREADS = max(1, min(16, os.cpu_count() or 1))
log = logging.getLogger(__name__)


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
    from_xla_cache: int = 0   # of the executables, served by XLA's own cache: not stored, traced at every start


@dataclasses.dataclass(frozen=True)
class Job:
    """One all-padding call of every executable the engine can call: ``run`` builds its
    batch with the engine's own builders (``host_batches``, ``window.rows``) and calls the
    runner as steady state does. ``kind`` labels the timing only."""
    kind: str
    size: int
    run: Callable[[], None]
    sampler: str = ""           # windows: the head's sampler


def warm_up(runner, batches, *, show_progress: bool = True, threads: int = COMPILE_THREADS,
            store: ExecutableStore | None = None) -> WarmUp:
    """Compile (or load from ``store``) every executable ``runner`` can call, in ``threads``
    parallel compiles; then run each once. batches: the engine's ``HostBatches``."""
    t0 = time.perf_counter()
    jobs = bucket_jobs(runner, batches)
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
            for job in jobs:
                t_job = time.perf_counter()
                job.run()
                lower_by_kind[job.kind] += time.perf_counter() - t_job
        finally:
            runner.steps = type(real_steps)(*(DispatchedStep(step, table)
                                              for step, table in zip(real_steps, tables)))
            runner.kv, runner.slot_state, runner.bkv, runner.slot_inject, runner.slot_tokens, runner.standby = state
        t_lowered = time.perf_counter()
        bar = progress(len(futures), "compiling", enabled=show_progress)
        for future in as_completed(futures):
            future.result()
            bar.update(1)
        bar.close()
    t_compiled = time.perf_counter()
    with CompileWatch() as late:
        for job in jobs:
            job.run()
        jax.block_until_ready(runner.kv)
    elapsed = time.perf_counter() - t0
    loaded, stored = (store.loaded - loaded_before, store.saved - saved_before) if store else (0, 0)
    log.info(f"{len(futures)} executables ready in {elapsed:.1f}s" +
             (f" ({loaded} loaded, {stored} stored in {store.directory})" if store else ""))
    if store and store.not_fresh:
        log.debug(f"{store.not_fresh} compiled steps came from XLA's persistent cache and were not stored in "
                  f"{store.directory}: later starts trace them again before XLA's cache finds them")
    phases = dict(trace_and_lower=t_lowered - t0, compile_wait=t_compiled - t_lowered,
                  run=elapsed - (t_compiled - t0))
    return WarmUp(elapsed, len(futures), late.count, {k: round(v, 3) for k, v in phases.items()},
                  {k: round(v, 3) for k, v in lower_by_kind.items()}, loaded, stored,
                  store.not_fresh if store else 0)


def bucket_jobs(runner, batches) -> list[Job]:
    """A job per executable the runner's engine can call, the longest compiles first
    (mixed-prefill windows, decode windows, then prefill, largest buckets first): the pool
    then does not end on one long compile started last."""
    s, jobs = runner.s, []
    w = s.window
    idle = lambda n: idle_window_rows(n, s.num_planes, w.trace_width)          # noqa: E731
    no_owner = np.full(s.max_num_seqs + 1, -1, np.int32)

    def window(n: int, sampler: str, prompt_tokens: int = 0):
        prompt = None if not prompt_tokens else batches.window_prompt([], prompt_tokens, np.zeros(n, bool))
        runner.window(idle(n), batches.block_tables(), batches.boundary_tables(), no_owner, sampler, prompt)[1].read()

    if w is not None:
        jobs += [Job("window_mixed", b, functools.partial(window, b, sampler, w.prompt_tokens_for(b)), sampler)
                 for b in reversed(w.mixed_buckets) for sampler in SAMPLERS]
        jobs += [Job("window", b, functools.partial(window, b, sampler), sampler) for b in reversed(w.buckets)
                 for sampler in SAMPLERS]
        if w.uses_standby:
            n = s.max_num_seqs + 1
            jobs.append(Job("standby_put", n, lambda: runner.standby_put(idle(n), np.zeros(n, bool))))
        jobs += [Job("window_merge", b, functools.partial(
            lambda n: runner.merge_rows(jax.device_put(idle(n), runner.device), idle(n), np.zeros(n, bool)), b))
            for b in w.buckets if not w.standby_for(b)]
    jobs += [Job("prefill", t, functools.partial(lambda t: runner.prefill(batches.prefill([], t)), t))
             for t in reversed(s.token_buckets)]
    jobs += [Job("loop", b, functools.partial(lambda b: runner.loop(batches.loop([], b)[0], 0).read(), b))
             for b in s.row_buckets]
    jobs += [Job("head", b, functools.partial(lambda b: runner.head(batches.head([], b), 0).read(), b))
             for b in s.row_buckets]
    if s.has_boundary:
        jobs += [Job("embed", b, functools.partial(lambda b: runner.embed(batches.embed_padding(b)), b))
                 for b in s.row_buckets]
    return jobs


def _recording(step, table: StepTable, pool: ThreadPoolExecutor, futures: list, store: ExecutableStore | None):
    """``step`` loaded from ``store``, or traced and lowered here and compiled in ``pool``
    (then saved to ``store``); registered in ``table``; returns stand-in outputs."""
    def call(*args, **kwargs):
        split = split_static(step, args, kwargs)
        if split is None:       # a static argument passed by position: jit's own path
            lowered = step.lower(*args, **kwargs)
            futures.append(pool.submit(lowered.compile))
            return stand_ins(lowered.out_info, args)
        static, dynamic = split
        signature, program = call_signature(static, args, dynamic), program_key(step, static, args, dynamic)
        if program in table.out_info:      # called again in this pass (e.g. a launch, then its read)
            return stand_ins(table.out_info[program], args)
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
            return stand_ins(out_specs, args)
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
        return stand_ins(lowered.out_info, args)
    return call


def stand_ins(out_info, args):
    """Arrays shaped like the outputs: input arrays of the same shape and dtype, taken in
    order (the donated state comes back as itself), else zeros on the inputs' device."""
    spare = defaultdict(deque)
    place = None         # where a zeros stand-in goes: an input's replicated sharding (on a mesh of
    for leaf in jax.tree.leaves(args):     # several processes, on every process's devices)
        if isinstance(leaf, jax.Array):
            spare[(leaf.shape, leaf.dtype)].append(leaf)
            if place is None or (leaf.sharding.is_fully_replicated and not place.is_fully_replicated):
                place = leaf.sharding

    def one(info):
        queue = spare[(tuple(info.shape), info.dtype)]
        if queue:
            return queue.popleft()
        if jax.dtypes.issubdtype(info.dtype, jax.dtypes.extended):
            return jnp.zeros(info.shape, info.dtype)
        # a host copy, not jnp.zeros: that compiles an executable per shape (~40 small compiles
        # on the start-up thread, none of them cached on disk)
        return jax.device_put(np.zeros(info.shape, info.dtype), place)
    return jax.tree.map(one, out_info)

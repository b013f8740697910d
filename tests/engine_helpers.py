"""Shared helpers for engine tests: build engines on the tiny fixture, drive workloads."""
from __future__ import annotations

import contextlib

from conftest import load_fixture, reference_model
from rltjax.engine_config import CacheConfig, ExecutionConfig, ExitConfig, SchedulerConfig
from rltjax.entrypoints.llm import build_engine
from rltjax.tokenizer import Tokenizer

from conftest import FIXTURES


def make_engine(*, kv_layout="last_exited", page_size=4, mode="refill", max_num_seqs=4,
                max_num_batched_tokens=16, prefill_chunk_size=8, exit_mode="ouro", num_pages=None,
                depths_by_request=None, compile_ahead=False, min_coda_batch_size=1,
                max_admission_bypasses=8, admission_scan_limit=32, name="ouro-tiny", tokenizer=False,
                max_prefill_batches_before_decode=1, lookahead_seed=0, hf_overrides=None, max_loops=None,
                decode_window=0, async_scheduling=False, xla_options=None, window_trip="early_stop",
                mixed_prefill_tokens=0, attn_impl="auto", interpret=False, decode_window_rows=None,
                compilation_cache_dir=None, executable_cache=True, kv_allocation="incremental", kv_watermark=0.0,
                enable_prefix_caching=False, swap_space=4.0, policy="fcfs", preemption_mode="recompute",
                speculative=None):
    """hf_overrides: config overrides (a dict), e.g. {"state_init": "zero"} for Huginn;
    max_loops: CacheConfig.max_loops (the engine's loop cap; None = R); decode_window: K passes
    per device-side window (0: step by step); window_trip: how a window's loop runs;
    mixed_prefill_tokens: prompts admitted into windows (0: off); decode_window_rows: the
    most rows a window runs (the rest of max_num_seqs wait as standby entries);
    compilation_cache_dir: XLA's cache and the engine's executable store (None: neither);
    executable_cache: False keeps XLA's cache only; kv_allocation .. preemption_mode: the KV
    memory manager's options (``CacheConfig``, ``SchedulerConfig``); speculative: a
    ``SpeculativeConfig``."""
    ckpt = load_fixture(name, "float32", tuple(sorted((hf_overrides or {}).items())))
    return build_engine(
        None, params=ckpt.params, cfg=ckpt.cfg,
        tokenizer=Tokenizer.from_dir(FIXTURES / name) if tokenizer else None,
        cache_config=CacheConfig(kv_layout=kv_layout, page_size=page_size, num_pages=num_pages,
                                 max_loops=max_loops, kv_allocation=kv_allocation, kv_watermark=kv_watermark,
                                 enable_prefix_caching=enable_prefix_caching, swap_space=swap_space),
        scheduler_config=SchedulerConfig(
            mode=mode, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            prefill_chunk_size=prefill_chunk_size, min_coda_batch_size=min_coda_batch_size,
            max_admission_bypasses=max_admission_bypasses, admission_scan_limit=admission_scan_limit,
            max_prefill_batches_before_decode=max_prefill_batches_before_decode, policy=policy,
            preemption_mode=preemption_mode),
        exit_config=ExitConfig(mode=exit_mode, depths_by_request=depths_by_request,
                               lookahead_seed=lookahead_seed),
        execution_config=ExecutionConfig(compile_ahead=compile_ahead, compilation_cache_dir=compilation_cache_dir,
                                         show_progress=False, decode_window=decode_window, window_trip=window_trip,
                                         async_scheduling=async_scheduling, xla_options=xla_options or {},
                                         mixed_prefill_tokens=mixed_prefill_tokens, attn_impl=attn_impl,
                                         interpret=interpret, decode_window_rows=decode_window_rows,
                                         executable_cache=executable_cache),
        speculative_config=speculative)


def run_workload(engine, arrivals, max_steps=10_000, aborts=None, after_step=None):
    """arrivals: list of (step_index, request_id, prompt, params); aborts: {step: request_id}
    aborted before that step; after_step(engine): a check after every step and abort.
    Returns outputs by id."""
    pending = sorted(arrivals, key=lambda a: a[0])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        if aborts and step in aborts:
            engine.abort_request(aborts[step])
            if after_step:
                after_step(engine)
        engine.step()
        if after_step:
            after_step(engine)
        step += 1
        assert step < max_steps, "workload did not finish"
    return {rid: engine.get_output(rid) for _, rid, _, _ in arrivals}


def run_with_abort(engine, arrivals, abort_at, victim, max_steps=5000):
    """run_workload that, at step ``abort_at``, aborts the request ``victim(engine)`` names
    (None: nobody yet, try the next step). Returns the aborted request's id (or None)."""
    pending, step, aborted = sorted(arrivals, key=lambda a: a[0]), 0, None
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        if abort_at is not None and step >= abort_at and aborted is None:
            aborted = victim(engine)
            if aborted is not None:
                engine.abort_request(aborted)
        engine.step()
        step += 1
        assert step < max_steps, "workload did not finish"
    return aborted


def assert_all_pages_free(engine):
    """Nothing runs or waits, and every page is free or held only by the prefix cache with
    no request using it (evictable); the allocators' and the cache's invariants hold."""
    blocks = engine.scheduler.blocks
    blocks.check_invariants()
    cache = blocks.cache
    for alloc, cached in ((blocks.allocator, cache.num_evictable_pages if cache is not None else 0),
                          (blocks.boundary_allocator, cache.num_evictable_boundary_pages if cache is not None else 0)):
        if alloc is None:      # no boundary pool (models without prelude/coda KV)
            continue
        assert alloc.num_free + cached == alloc.num_pages - 1 and alloc.num_reserved == 0
        assert alloc.num_used == cached
    if cache is not None:
        assert cache.num_blocks_in_use == 0
    assert len(engine.scheduler.free_slots) == engine.scheduler.config.max_num_seqs
    assert not engine.scheduler.running and not engine.scheduler.waiting


def reference_for(kv_layout, exit_mode="ouro", depths_by_request=None, lookahead_seed=0):
    if depths_by_request is None:
        return reference_model("ouro-tiny", kv_layout=kv_layout, exit_mode=exit_mode, lookahead_seed=lookahead_seed)
    from rltjax.models.base import get_model
    from rltjax.reference.generate import ReferenceModel
    ckpt = load_fixture("ouro-tiny")
    return ReferenceModel(get_model(ckpt.cfg), ckpt.params, kv_layout=kv_layout,
                          exit_config=ExitConfig(mode="trace", depths_by_request=depths_by_request))


def check_trace_replay(kv_layout, depths, arrivals, **engine_kwargs):
    """An engine replaying ``depths`` (trace mode) loops each token exactly its recorded depth and
    equals the oracle replaying the same trace; returns the engine for further checks."""
    engine = make_engine(kv_layout=kv_layout, exit_mode="trace", depths_by_request=depths, **engine_kwargs)
    outputs = run_workload(engine, arrivals)
    ref = reference_for(kv_layout, depths_by_request=depths)
    for _, rid, prompt, params in arrivals:
        assert outputs[rid].exit_depths == depths[rid]
        check_equal(outputs[rid], ref.generate(prompt, params, request_id=rid))
    assert_all_pages_free(engine)
    return engine


def check_outputs(engine, arrivals, ref, aborted=None):
    """Every request's output equals the oracle's; an aborted one's tokens and depths so far
    are a prefix of it. No page leaks."""
    for _, rid, prompt, params in arrivals:
        out, want = engine.get_output(rid), ref.generate(prompt, params, request_id=rid)
        if rid == aborted:
            assert out.finish_reason == "abort"
            assert out.token_ids == want.token_ids[:len(out.token_ids)]
            assert out.exit_depths == want.exit_depths[:len(out.exit_depths)]
        else:
            check_equal(out, want)
    assert_all_pages_free(engine)


def check_equal(out, ref):
    """An engine output equals the reference oracle's run of the same request."""
    assert out.token_ids == ref.token_ids
    assert out.exit_depths == ref.exit_depths
    assert out.finish_reason == ref.finish_reason
    assert out.error is None
    if ref.logprobs is not None:
        check_logprobs(out.logprobs, ref.logprobs)


def check_logprobs(got, want):
    """Per-token logprob entries: the same token ids, values to 1e-5."""
    import numpy as np
    assert [set(e) for e in got] == [set(e) for e in want]
    for a, b in zip(got, want):
        np.testing.assert_allclose([a[t] for t in sorted(a)], [b[t] for t in sorted(b)], rtol=1e-5, atol=1e-5)


@contextlib.contextmanager
def compile_events():
    """Collects the names of JAX compile events raised inside the block."""
    from rltjax.engine.compile_watch import CompileWatch
    with CompileWatch() as watch:
        yield watch.events


def closed_loop(engine, requests, *, clients: int, record=None):
    """Clients that each send their next request as soon as their last one finishes (the
    serving benchmark's closed loop). Returns outputs by id."""
    queue, done = list(requests), {}
    for _ in range(clients):
        rid, prompt, params = queue.pop(0)
        engine.add_request(rid, prompt, params)
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished and out.request_id not in done:
                done[out.request_id] = out
                if queue:
                    engine.add_request(*queue.pop(0))
    raise AssertionError("closed loop did not finish")


def record_calls(engine, names, events):
    """Wrap the runner's methods ``names`` to log their calls in ``events``."""
    for name in names:
        real = getattr(engine.runner, name)
        setattr(engine.runner, name, lambda *a, real=real, name=name, **kw: events.append(name) or real(*a, **kw))


def settings_for(scheduler_config, *, page_size=8, num_planes=1, max_model_len=128, layered=True, alignment=1,
                 prefill_kernel=False):
    """EngineSettings for a Scheduler on its own (no runner): the tiny Ouro's resolved settings
    with these scheduling facts in place of its own."""
    import dataclasses
    from rltjax.engine.settings import longest_prefill_chunk, prefill_budgets, resolve_settings
    from rltjax.models.base import get_model
    ckpt = load_fixture("ouro-tiny", "float32", ())
    base = resolve_settings(get_model(ckpt.cfg), cache=CacheConfig(page_size=page_size),
                            scheduler=SchedulerConfig(max_num_seqs=scheduler_config.max_num_seqs),
                            exit_config=ExitConfig(), execution=ExecutionConfig(decode_window=0),
                            max_model_len=max_model_len, kv_dtype="float32")
    config = prefill_budgets(scheduler_config, prefill_kernel)
    return dataclasses.replace(base, scheduler=config, page_size=page_size, num_planes=num_planes,
                               max_model_len=max_model_len, layered=layered, prefill_alignment=alignment,
                               max_prefill_chunk=longest_prefill_chunk(config, max_model_len, layered))


class DeviceCalls:
    """Records, in order, what an engine launches and reads (through its executor's one
    interface): ``events`` holds ("launch" | "read", step); ``windows`` the rows each window
    was launched from (host numpy or device rows) with its step."""

    def __init__(self, engine):
        self.events, self.windows = [], []
        launch, window = engine.executor.launch, engine.runner.window

        def launched(step):
            self.events.append(("launch", step))
            pending = launch(step)
            if pending is not None:
                read = pending.read
                pending.read = lambda: self.events.append(("read", step)) or read()
            return pending

        def window_call(rows, *args, **kwargs):
            self.windows.append(rows)
            return window(rows, *args, **kwargs)
        engine.executor.launch = launched
        engine.runner.window = window_call

    def kinds(self, of=("launch", "read")) -> str:
        """The events as letters: H / W / L / P launches of heads, windows, loop passes and
        prefill; h / w / l reads."""
        from rltjax.engine.plan import HeadStep, LoopStep, PrefillStep, WindowStep
        letter = {HeadStep: "h", WindowStep: "w", LoopStep: "l", PrefillStep: "p"}
        return "".join(letter[type(s)].upper() if e == "launch" else letter[type(s)] for e, s in self.events
                       if e in of)

    def steps(self, kind):
        return [s for e, s in self.events if e == "launch" and isinstance(s, kind)]


def wrap_reads(engine, kind, wrapper):
    """Wrap the read of every pending step of type ``kind`` the engine launches from now:
    ``wrapper(read, step)`` returns the callable that replaces ``pending.read``."""
    launch = engine.executor.launch

    def launched(step):
        pending = launch(step)
        if pending is not None and isinstance(step, kind):
            pending.read = wrapper(pending.read, step)
        return pending
    engine.executor.launch = launched


def check_page_accounting(engine):
    """Every page's refcount is exactly the running requests' table entries naming it plus
    one if the prefix cache holds it; no page is both free and mapped; waiting requests hold
    nothing; the allocators' and the cache's own invariants hold."""
    import collections
    blocks = engine.scheduler.blocks
    blocks.check_invariants()
    cache = blocks.cache
    cached = collections.Counter()
    if cache is not None:
        for block in cache._blocks.values():
            cached.update(block.pages)
    bcached = collections.Counter(b.boundary_page for b in (cache._blocks.values() if cache is not None else ())
                                  if b.boundary_page is not None)
    refs, brefs = collections.Counter(), collections.Counter()
    for r in engine.scheduler.running:
        core, boundary = blocks.pages_of(r)
        for plane in core:
            refs.update(plane)
        brefs.update(boundary)
    for r in engine.scheduler.waiting:
        assert not r.tables and r.boundary_table is None, f"waiting request {r.request_id} holds a block table"
    for alloc, mapped, held in ((blocks.allocator, refs, cached), (blocks.boundary_allocator, brefs, bcached)):
        if alloc is None:
            continue
        free = set(alloc._free)
        for page in range(1, alloc.num_pages):
            assert alloc.refcount(page) == mapped[page] + held[page], \
                f"page {page}: refcount {alloc.refcount(page)}, {mapped[page]} table(s) + {held[page]} cache"
            assert (page in free) == (alloc.refcount(page) == 0), f"page {page} free and mapped"


def run_checked(engine, arrivals, max_steps=10_000, aborts=None):
    """run_workload with ``check_page_accounting`` after every step and abort."""
    return run_workload(engine, arrivals, max_steps, aborts, after_step=check_page_accounting)

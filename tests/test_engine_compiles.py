"""The engine's executables: nothing compiles in steady state after ``compile_ahead`` (first
steps and continued decode windows included), warm-up compiles in parallel, ``xla_options``
rebuild every step, and the compiled decode window slices no weight stack inside its loop."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from engine_helpers import assert_all_pages_free, compile_events, make_engine, reference_for
from engine_trace_helpers import TOKENS, PlanLog, check_against_reference, drive, greedy
from rltjax.engine.llm_engine import RequestRejectedError
from rltjax.engine.sequence import Status
from rltjax.sampling_params import SamplingParams


def varied_workload():
    rng = np.random.default_rng(5)
    arrivals = [(0, "solo", TOKENS[:1], greedy(3))]                     # batch size 1 first
    lengths = [2, 5, 8, 13, 16, 17, 30, 45, 3, 9, 24, 1]
    for i, length in enumerate(lengths):
        start = int(rng.integers(0, 120 - length))
        arrivals.append((6 + 2 * i, f"v{i}", TOKENS[start:start + length], SamplingParams(
            max_tokens=int(rng.integers(1, 9)), temperature=[0.0, 1.0, 0.7][i % 3], top_k=[0, 5, 50][i % 3],
            top_p=[1.0, 0.9, 0.5][(i // 3) % 3], seed=int(rng.integers(0, 2**62)),
            exit_threshold=[0.3, 0.6, 1.0, 0.9][i % 4], min_loops=1 + i % 2, max_loops=[4, 3, 4, 2][i % 4],
            logprobs=[None, 0, 5, 20][i % 4], priority=i % 2, ignore_eos=bool(i % 5), stop_token_ids=[7] * (i % 2))))
    return arrivals


def test_no_compilation_after_warm_up():
    engines = [make_engine(compile_ahead=True, policy="priority"),
               make_engine(compile_ahead=True, mode="no_refill", min_coda_batch_size=2, policy="priority",
                           max_prefill_batches_before_decode=2),
               # a pool of 2 requests' pages: preempts, swapping (the copies compile at start-up)
               make_engine(compile_ahead=True, policy="priority", preemption_mode="swap", num_pages=120)]
    arrivals = varied_workload()
    aborts = {"v3": lambda r: r.status is Status.LOOPING and r.loops_done == 1,
              "v7": lambda r: r.status is Status.PREFILLING}
    events, listening = [], [False]

    def listener(event, duration, **kwargs):
        if listening[0] and "compile" in event:
            events.append((event, kwargs.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listener)
    results, batch_sizes = [], set()
    try:
        listening[0] = True
        jax.jit(lambda x: x * 3 + 1)(np.arange(7))           # positive control: a fresh compile is seen
        assert any(event == "/jax/core/compile/jaxpr_trace_duration" for event, _ in events)
        events.clear()
        for engine in engines:
            log = PlanLog(engine)
            results.append(drive(engine, arrivals, aborts))
            with pytest.raises(RequestRejectedError):                   # host-only path
                engine.add_request("toolong", TOKENS[:10], greedy(510))
            batch_sizes |= {(e["kind"], len(e["rows"])) for e in log.entries}
    finally:
        listening[0] = False
        jax.monitoring.unregister_event_duration_listener(listener)
    assert events == []
    assert {n for k, n in batch_sizes if k == "loop"} == {1, 2, 3, 4}
    assert {n for k, n in batch_sizes if k == "head"} >= {1, 2, 3}
    ref = reference_for("last_exited")
    assert engines[2].scheduler.preemptor.num_swapped > 0
    for engine, (outputs, seen, _) in zip(engines, results):
        assert seen.keys() == aborts.keys()
        check_against_reference(outputs, arrivals, ref, skip=aborts)
        assert_all_pages_free(engine)



@pytest.mark.parametrize("kwargs", [dict(decode_window=3), dict(name="huginn-tiny", exit_mode="latent_diff",
                                                                    decode_window=3, max_loops=6)])
def test_warm_up_compiles_in_parallel_then_runs_from_jit_cache(kwargs):
    """The record pass compiles one executable per bucket job, in a thread pool; the run pass
    that follows finds every one of them in jit's cache (ahead-of-time compiles fill it)."""
    from rltjax.engine.warm_up import bucket_jobs
    engine = make_engine(compile_ahead=True, max_num_seqs=2, **kwargs)
    report = engine.warm_up
    jobs = bucket_jobs(engine.runner, engine.batches)
    assert {job.kind for job in jobs} >= {"prefill", "loop", "head", "window"}
    windows = [job for job in jobs if job.kind == "window"]     # a window per row bucket and head sampler
    assert len(windows) == 3 * len(engine.settings.window.buckets)
    assert report.executables == len(jobs) and report.compiled_late == 0, report
    phases = report.phase_seconds    # the start-up split: its parts add up to the whole
    assert set(phases) == {"trace_and_lower", "compile_wait", "run"} and min(phases.values()) >= 0
    assert abs(sum(phases.values()) - report.seconds) < 0.01
    assert set(report.lower_seconds_by_kind) == {job.kind for job in jobs}
    assert sum(report.lower_seconds_by_kind.values()) <= phases["trace_and_lower"] + 0.01
    with compile_events() as events:     # and steady state compiles nothing either
        engine.add_request("a", TOKENS[:6], greedy(4))
        while engine.has_unfinished_requests():
            engine.step()
    assert events == []
    assert_all_pages_free(engine)


def test_warm_up_compiles_only_the_executables_it_hands_to_the_pool():
    """Start-up compiles one executable per bucket job and nothing else: the stand-in outputs
    of the record pass must not compile (jnp.zeros did, one small executable per shape, on the
    start-up thread and never cached on disk)."""
    from rltjax.engine.compile_watch import CompileWatch
    from rltjax.engine.warm_up import bucket_jobs, warm_up
    engine = make_engine(compile_ahead=False, max_num_seqs=2, decode_window=3)
    jax.clear_caches()     # nothing this process compiled before can hide a compile here
    with CompileWatch() as watch:
        report = warm_up(engine.runner, engine.batches, show_progress=False)
    assert report.executables == len(bucket_jobs(engine.runner, engine.batches)) and report.compiled_late == 0
    assert watch.count == report.executables, watch.events


def test_first_steps_after_warm_up_do_not_compile():
    """A fresh engine's first batches (a 1-token prefill first) reuse the warm-up executables:
    the state arrays the steps replace are committed to the device before warm-up."""
    engine = make_engine(compile_ahead=True, max_num_seqs=2)
    with compile_events() as events:
        for i, n in enumerate([1, 3, 9]):
            engine.add_request(f"c{i}", TOKENS[:n], greedy(3))
            while engine.has_unfinished_requests():
                engine.step()
    assert events == []
    assert_all_pages_free(engine)


@pytest.mark.parametrize("exit_mode", ["ouro", "fixed"])
def test_continued_windows_after_warm_up_do_not_compile(exit_mode):
    """Windows launched from the previous window's device rows reuse the warm-up executable:
    host rows are committed to the device like those device rows (an uncommitted first
    variant made the first continued window of each row bucket compile inside the run); so
    does a request admitted into a continued window (the standby merge is warmed up too), and an
    aborted request's row stopped in one."""
    engine = make_engine(compile_ahead=True, max_num_seqs=2, decode_window=3, exit_mode=exit_mode)
    launches = []
    real = engine.runner.window
    engine.runner.window = lambda rows, *rest: launches.append(
        not isinstance(rows.slots, np.ndarray)) or real(rows, *rest)
    admitted = []      # standby entries put while a window runs: an admission into a continued one
    real_put = engine.runner.standby_put
    engine.runner.standby_put = lambda *a: admitted.append(engine.windows_in_flight > 0) or real_put(*a)
    with compile_events() as events:
        for i in range(2):
            engine.add_request(f"c{i}", TOKENS[:5 + i], greedy(10 + 4 * i))
        added = False
        while engine.has_unfinished_requests():
            finished = any(o.finished for o in engine.step())
            if finished and not added:       # admitted behind the window in flight
                engine.add_request("late", TOKENS[2:6], greedy(6))
                added = True
            elif added and any(admitted) and not engine.get_output("c1").finished:
                aborted = engine.abort_request("c1")   # its row runs on until a continued window stops it
    assert sum(launches) >= 2, "no window continued from device rows"
    assert any(admitted), "no admission into a continued window"
    assert aborted.finished and engine.get_output("c1").finish_reason == "abort"
    assert events == []
    assert_all_pages_free(engine)


def test_xla_options_rebuild_the_engine_steps():
    """ExecutionConfig.xla_options compiles every engine step with them (same outputs as the
    default engine); a name XLA does not know fails at start-up, naming the setting."""
    plain = make_engine(decode_window=3)
    tuned = make_engine(decode_window=3, xla_options={"xla_cpu_enable_fast_math": False})
    assert tuned.runner.steps.loop is not plain.runner.steps.loop
    assert tuned.runner.steps.window is make_engine(xla_options={"xla_cpu_enable_fast_math": False},
                                                    decode_window=3).runner.steps.window   # shared
    outs = []
    for e in (plain, tuned):
        e.add_request("a", TOKENS[:6], greedy(5))
        while e.has_unfinished_requests():
            e.step()
        outs.append(e.get_output("a"))
    assert outs[0].token_ids == outs[1].token_ids and outs[0].exit_depths == outs[1].exit_depths
    with pytest.raises(ValueError, match="xla_options .*xla_no_such_option.*No such compile option"):
        make_engine(xla_options={"xla_no_such_option": 1})


def _called_computations(hlo: str, root: str) -> list[str]:
    """The text of ``root`` and of every computation it calls, transitively."""
    import re
    comps = {}
    for block in re.split(r"\n(?=\S)", hlo):
        m = re.match(r"(?:ENTRY )?%?([\w.\-]+)", block)
        if m:
            comps[m.group(1)] = block
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        todo += re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", comps[name])
        for branches in re.findall(r"branch_computations=\{([^}]*)\}", comps[name]):
            todo += [b.strip().lstrip("%") for b in branches.split(",")]
    return [comps[n] for n in seen]


def _run_one(engine, params) -> None:
    engine.add_request("a", TOKENS[:5], params)
    while engine.has_unfinished_requests():
        engine.step()


def _recorded_hlo(engine, step: str, run) -> str:
    """Compiled HLO of the first call of the runner's device step ``step`` while ``run()``."""
    seen = []
    real = getattr(engine.runner.steps, step)

    def recording(*args, **kwargs):
        seen.append((jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), args), kwargs))
        return real(*args, **kwargs)

    engine.runner.steps = engine.runner.steps._replace(**{step: recording})
    run()
    engine.runner.steps = engine.runner.steps._replace(**{step: real})
    args, kwargs = seen[0]
    return real.lower(*args, **kwargs).compile().as_text()


@pytest.mark.parametrize("window_trip", ["early_stop", "fixed"])
def test_window_loop_reads_per_layer_weights_without_slicing(window_trip):
    """Inside the window's while loop no layer weight is sliced out of its stack (XLA:GPU
    copied each such slice before its matmul, every pass): the loop reads per-layer arrays
    split before it. A fixed-trip window leaves XLA nothing to read back on the host between
    passes: a known trip count and no conditional."""
    import re

    engine = make_engine(decode_window=3, max_num_seqs=2, window_trip=window_trip)
    hlo = _recorded_hlo(engine, "window", lambda: _run_one(engine, greedy(4)))
    window_loops = _assert_loop_reads_weights_in_place(hlo, "decode_window", engine)
    conditionals = sum(" conditional(" in line for line in hlo.splitlines())
    trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', window_loops[0])
    if window_trip == "fixed":
        assert conditionals == 0 and trip and int(trip.group(1)) == 3, (conditionals, window_loops[0][-300:])
    else:   # the early-stop loop: a data-dependent trip count, the head under a cond
        assert conditionals >= 1 and trip is None


def _assert_loop_reads_weights_in_place(hlo: str, step: str, engine) -> list[str]:
    """No layer weight is sliced out of its stack inside the body of step's outer while loop
    (compiled HLO); returns that loop's lines."""
    import re

    loops = [line for line in hlo.splitlines() if " while(" in line and f'op_name="jit({step})/while"' in line]
    assert loops, f"no {step} while loop in the compiled HLO"
    body = _called_computations(hlo, re.search(r"body=%?([\w.\-]+)", loops[0]).group(1))
    layer = engine.runner.params.layers.layers[0]          # the runner holds them split (SplitLayers)
    cfg = engine.cfg
    shapes = [layer.wqkv.shape, layer.w_gate.shape, layer.w_down.shape,       # and q / k / v pieces
              (cfg.hidden_size, cfg.q_width), (cfg.hidden_size, cfg.kv_width)]
    per_layer = {",".join(map(str, shape)) for shape in shapes}
    outputs = tuple(f"= f32[{lead}{dims}]" for dims in per_layer for lead in ("", "1,"))
    slices = [line.strip()[:120] for comp in body for line in comp.splitlines()
              if re.search(r"\b(dynamic-)?slice\(", line) and any(o in line for o in outputs)]
    assert len(body) > 10 and not slices, f"weight slices inside the {step} loop: {slices[:3]}"
    return loops


def test_prefill_loop_reads_per_layer_weights_without_slicing():
    """Prefill's loop over the R loops reads per-layer weight arrays: on an H200 the copies of
    stacked-weight slices inside it cost as much as prefill's GEMMs."""
    engine = make_engine(max_num_seqs=2)
    hlo = _recorded_hlo(engine, "prefill", lambda: _run_one(engine, greedy(2)))
    _assert_loop_reads_weights_in_place(hlo, "prefill_step", engine)


@pytest.mark.parametrize("step, decode_window", [("prefill", 3), ("window", 3), ("loop", 0)])
def test_kv_pool_scatters_promise_unique_slots(step, decode_window):
    """Every scatter into the KV pool (row writes, written through to deeper planes) tells XLA its indices are
    unique (padding is dropped, not written to the scratch page), so XLA:GPU can store
    without atomic read-modify-write loops on 16-bit elements."""
    engine = make_engine(max_num_seqs=2, decode_window=decode_window, window_trip="fixed")
    hlo = _recorded_hlo(engine, step, lambda: _run_one(engine, greedy(4)))
    pool = "f32[" + ",".join(map(str, engine.runner.kv.k.shape)) + "]"
    scatters = [line for line in hlo.splitlines() if " scatter(" in line and f"= {pool}" in line]
    assert scatters, f"no scatter into the KV pool in the {step} HLO"
    assert all("unique_indices=true" in line for line in scatters), [s.strip()[:100] for s in scatters]


@pytest.mark.parametrize("step, decode_window", [("prefill", 3), ("window", 3), ("head", 3), ("loop", 0)])
def test_slot_buffer_scatters_promise_unique_slots(step, decode_window):
    """Every write into a per-slot buffer (state, first-head tokens) drops the padded rows'
    dummy slot and tells XLA the rest are unique: left in, the padding's repeated index makes
    XLA:GPU serialise the scatter."""
    engine = make_engine(max_num_seqs=2, decode_window=decode_window, window_trip="fixed")
    hlo = _recorded_hlo(engine, step, lambda: _run_one(engine, greedy(4)))
    slots = engine.runner.slot_state.shape[0]
    shapes = (f"f32[{slots},{engine.runner.slot_state.shape[1]}]", f"s32[{slots}]")
    scatters = [line for line in hlo.splitlines() if " scatter(" in line
                and any(f"= {shape}" in line for shape in shapes)]
    assert scatters, f"no scatter into a slot buffer in the {step} HLO"
    assert all("unique_indices=true" in line for line in scatters), [s.strip()[:100] for s in scatters]


def test_stacked_layers_run_as_one_scan_and_split_layers_as_their_own_arrays():
    """A stack of layers runs as one ``lax.scan`` (unrolled for decode: XLA folds the index,
    and every layer's matmul fusion is the same, so cold compiles autotune each shape once);
    ``SplitLayers`` (prefill, decode windows) run layer by layer on their own arrays, no scan, no slice,
    through one nested jit: the layer body is traced once, not once per layer."""
    import jax.numpy as jnp

    from rltjax.models.layers import SplitLayers, over_layers
    stack = {"w": jnp.arange(12.0).reshape(3, 2, 2) / 10}
    traces = []

    def step(x, xs):
        traces.append(1)
        layer, p = xs
        return x @ p["w"] + layer, None

    x = jnp.ones((1, 2))
    for layers, scans in ((stack, 1), (SplitLayers.split(stack), 0)):
        traces.clear()
        jaxpr = str(jax.make_jaxpr(lambda x, layers: over_layers(step, x, layers))(x, layers))
        assert jaxpr.count("scan[") == scans and (scans or "slice" not in jaxpr), jaxpr
        assert len(traces) == 1, f"layer body traced {len(traces)} times"
        want = x
        for i in range(3):
            want = want @ stack["w"][i] + i
        np.testing.assert_allclose(over_layers(step, x, layers), want)

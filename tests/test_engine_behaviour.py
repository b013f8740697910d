"""Engine behaviour beyond token equality (DESIGN section 2, Scheduling).

* exact scheduling traces of ``refill`` (CDB), ``no_refill`` and ``min_coda_batch_size``;
* batch invariance of sampling and exit decisions;
* aborts in every request state, and request rejection that leaves the queue alone;
* a failed batch errors only its own requests; the engine keeps working;
* no compilation in steady state after ``compile_ahead``;
* admission (bypass limit, scan limit, max_num_seqs) and forced decode after prefill batches.

Engines are built with the same shapes (page_size 4, 4 seqs, the default pool) so
their jitted steps are compiled once per process; only the small-pool engines used
for admission add a second set.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import reference_npz
from engine_helpers import assert_all_pages_free, make_engine, reference_for, run_workload
from rltjax.engine.llm_engine import RequestRejectedError
from rltjax.engine.sequence import Status
from rltjax.sampling_params import SamplingParams

TOKENS = [int(t) for t in reference_npz("ouro-tiny")["p2_input_ids"]] * 3   # 120 prompt ids
R = 4
SMALL_PAGES = 25      # 24 usable pages: 6 per plane, i.e. at most 24 positions for one request

TRACE = {"fast": [4, 1, 1, 1, 1, 1, 1, 1], "slow": [4, 4, 4, 4, 4, 4, 4, 4],
         "short": [4, 1], "first": [3, 1, 1, 1], "range": [4, 1, 3, 1], "float": [4, 1, 2.0, 1]}


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def check_equal(out, ref):
    assert out.token_ids == ref.token_ids
    assert out.exit_depths == ref.exit_depths
    assert out.finish_reason == ref.finish_reason
    assert out.error is None
    if ref.logprobs is not None:
        assert [set(e) for e in out.logprobs] == [set(e) for e in ref.logprobs]
        for a, b in zip(out.logprobs, ref.logprobs):
            np.testing.assert_allclose([a[t] for t in sorted(a)], [b[t] for t in sorted(b)], rtol=1e-5, atol=1e-5)


def check_against_reference(outputs, arrivals, ref, skip=()):
    for _, rid, prompt, params in arrivals:
        if rid not in skip:
            check_equal(outputs[rid], ref.generate(prompt, params, request_id=rid))


class PlanLog:
    """Wraps ``engine.scheduler.schedule``: per step, the plan and the requests' states
    at the moment it was chosen (after admission, before the batch ran)."""

    def __init__(self, engine):
        self.entries: list[dict] = []
        schedule = engine.scheduler.schedule

        def recorded():
            plan = schedule()
            sched = engine.scheduler
            if plan.kind == "loop":
                rows = tuple((r.request_id, r.loops_done) for r in plan.rows)
            elif plan.kind == "head":
                rows = tuple(r.request_id for r in plan.rows)
            else:
                rows = tuple((r.request_id, s, n) for r, s, n in plan.chunks)
            self.entries.append(dict(
                kind=plan.kind, rows=rows,
                status={r.request_id: (r.status, r.loops_done) for r in sched.running},
                waiting=[r.request_id for r in sched.waiting]))
            return plan

        engine.scheduler.schedule = recorded

    def compact(self):
        return [(e["kind"], e["rows"]) for e in self.entries]

    def admitted_at(self, rid):
        return next(i for i, e in enumerate(self.entries) if rid in e["status"])


def drive(engine, arrivals, aborts=None, max_steps=2000):
    """Like run_workload, but aborts ``rid`` before the first step at which
    ``aborts[rid](request)`` holds, and collects every output ``step`` returns.
    Returns (outputs by id, what each abort saw, outputs returned per step)."""
    aborts = aborts or {}
    pending = sorted(arrivals, key=lambda a: a[0])
    seen, returned, step = {}, [], 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for rid, when in aborts.items():
            req = engine.requests.get(rid)
            if rid not in seen and req is not None and not req.finished and when(req):
                seen[rid] = dict(status=req.status, loops_done=req.loops_done,
                                 num_prefilled=req.num_prefilled, num_output=len(req.output_token_ids))
                out = engine.abort_request(rid)
                assert out.finished and out.finish_reason == "abort" and out.request_id == rid
        returned.append(engine.step())
        step += 1
        assert step < max_steps, "workload did not finish"
    return {rid: engine.get_output(rid) for _, rid, _, _ in arrivals}, seen, returned


# -- 1. scheduling traces ------------------------------------------------------------------
FAST_SLOW = [(0, "fast", TOKENS[:3], greedy(4)),
             (0, "slow", TOKENS[10:15], SamplingParams(max_tokens=3, temperature=1.0, seed=7, ignore_eos=True))]


def loop(*rows):
    return ("loop", tuple(rows))


PREFILL_BOTH = ("prefill", (("fast", 0, 3), ("slow", 0, 5)))
HEADS_BOTH, HEAD_FAST, HEAD_SLOW = ("head", ("fast", "slow")), ("head", ("fast",)), ("head", ("slow",))
# A cohort that loops until its slow row exits; the fast row's head waits for it.
COHORT_TRACE = [PREFILL_BOTH, HEADS_BOTH,
                loop(("fast", 0), ("slow", 0)), loop(("slow", 1)), loop(("slow", 2)), loop(("slow", 3)),
                HEADS_BOTH,
                loop(("fast", 0), ("slow", 0)), loop(("slow", 1)), loop(("slow", 2)), loop(("slow", 3)),
                HEADS_BOTH,                                   # slow's 3rd token: slow finishes
                loop(("fast", 0)), HEAD_FAST]                 # no loop work left: a 1-row head
EXPECTED_TRACES = {
    # CDB: fast's next token starts its loop 0 beside slow's deeper rows
    ("refill", 1): [PREFILL_BOTH, HEADS_BOTH,
                    loop(("fast", 0), ("slow", 0)), HEAD_FAST,
                    loop(("fast", 0), ("slow", 1)), HEAD_FAST,
                    loop(("fast", 0), ("slow", 2)), HEAD_FAST,   # fast's 4th token: fast finishes
                    loop(("slow", 3)), HEAD_SLOW,
                    loop(("slow", 0)), loop(("slow", 1)), loop(("slow", 2)), loop(("slow", 3)), HEAD_SLOW],
    ("no_refill", 1): COHORT_TRACE,
    ("refill", 2): COHORT_TRACE,   # min_coda_batch_size=2: fast's head waits for a second row
}


@pytest.mark.parametrize("mode,min_coda", list(EXPECTED_TRACES))
def test_exact_scheduling_trace(mode, min_coda):
    engine = make_engine(mode=mode, exit_mode="trace", depths_by_request=TRACE, min_coda_batch_size=min_coda)
    log = PlanLog(engine)
    outputs = run_workload(engine, FAST_SLOW)
    assert log.compact() == EXPECTED_TRACES[mode, min_coda]

    # The property behind each trace: does a new token of fast start (loops_done 0) while
    # slow's current token is mid-loop (loops_done 1..3)?
    mixed = [e for e in log.entries if e["kind"] == "loop"
             and ("fast", 0) in e["rows"] and any(rid == "slow" and 1 <= d <= 3 for rid, d in e["rows"])]
    fast_starts_mid_slow = [e for e in log.entries if e["kind"] == "loop" and ("fast", 0) in e["rows"]
                            and e["status"].get("slow", (None, 0))[0] is Status.LOOPING
                            and 1 <= e["status"]["slow"][1] <= 3]
    if (mode, min_coda) == ("refill", 1):
        assert len(mixed) == 2 and len(fast_starts_mid_slow) == 2
    else:
        assert mixed == [] and fast_starts_mid_slow == []
    if min_coda > 1:   # a head with fewer rows only when no loop work remained
        for e in log.entries:
            if e["kind"] == "head" and len(e["rows"]) < min_coda:
                assert not any(s is Status.LOOPING for s, _ in e["status"].values())

    check_against_reference(outputs, FAST_SLOW, reference_for("last_exited", depths_by_request=TRACE))
    for _, rid, _, params in FAST_SLOW:
        assert outputs[rid].exit_depths == TRACE[rid][:params.max_tokens]
    assert_all_pages_free(engine)


# -- 2. batch invariance -----------------------------------------------------------------
def random_requests(rng, n, prefix, max_arrival=4):
    out = []
    for i in range(n):
        start, length = int(rng.integers(0, 80)), int(rng.integers(1, 30))
        out.append((int(rng.integers(0, max_arrival + 1)), f"{prefix}{i}", TOKENS[start:start + length],
                    SamplingParams(max_tokens=int(rng.integers(2, 10)), temperature=float(rng.choice([0.0, 0.7, 1.0])),
                                   top_k=int(rng.choice([0, 5])), top_p=float(rng.choice([1.0, 0.8])),
                                   seed=int(rng.integers(0, 2**40)),
                                   exit_threshold=float(rng.choice([0.3, 0.6, 0.9, 1.0])),
                                   min_loops=int(rng.integers(1, 3)), logprobs=[None, 2][int(rng.integers(0, 2))],
                                   ignore_eos=True)))
    return out


@pytest.mark.parametrize("mode", ["refill", "no_refill"])
def test_batch_invariance(mode):
    target = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=2024, exit_threshold=0.6,
                            logprobs=3, ignore_eos=True)
    prompt = TOKENS[7:20]
    alone = run_workload(make_engine(mode=mode), [(0, "t", prompt, target)])["t"]
    engine = make_engine(mode=mode)
    log = PlanLog(engine)
    together = run_workload(engine, random_requests(np.random.default_rng(11), 3, "o") + [(1, "t", prompt, target)])
    assert together["t"].token_ids == alone.token_ids
    assert together["t"].exit_depths == alone.exit_depths
    for a, b in zip(together["t"].logprobs, alone.logprobs):
        assert a.keys() == b.keys()
        np.testing.assert_allclose([a[t] for t in sorted(a)], [b[t] for t in sorted(b)], rtol=1e-6, atol=1e-6)
    # not vacuous: t exits early, and really shared passes (at other depths) and heads with others
    assert max(alone.exit_depths[1:]) < R
    shared = [e for e in log.entries if e["kind"] in ("loop", "head") and len(e["rows"]) > 1
              and any((r[0] if isinstance(r, tuple) else r) == "t" for r in e["rows"])]
    assert {e["kind"] for e in shared} == {"loop", "head"}
    assert any(len({d for _, d in e["rows"]}) > 1 for e in shared if e["kind"] == "loop") or mode == "no_refill"
    assert_all_pages_free(engine)


# -- 3. aborts and rejections ---------------------------------------------------------------
@pytest.mark.parametrize("mode", ["refill", "no_refill"])
def test_abort_in_every_state(mode):
    engine = make_engine(mode=mode, prefill_chunk_size=3)
    arrivals = [
        (0, "k", TOKENS[0:4], SamplingParams(max_tokens=6, temperature=1.0, seed=1, exit_threshold=0.6,
                                             ignore_eos=True)),
        (0, "p", TOKENS[20:44], greedy(4)),                              # 24-token prompt: 8 chunks of 3
        (0, "l", TOKENS[50:53], greedy(8)),                              # fixed depth 4: always mid-loop
        (0, "h", TOKENS[60:65], greedy(8, exit_threshold=0.6)),
        (0, "w", TOKENS[70:75], greedy(4)),                              # 5th: waits for a slot
        (0, "x", TOKENS[80:90], greedy(5, exit_threshold=0.5)),          # waits, runs once slots free
        (12, "n", TOKENS[90:97], SamplingParams(max_tokens=5, temperature=0.8, top_k=5, seed=3,
                                                exit_threshold=0.6, logprobs=2, ignore_eos=True)),
    ]
    aborts = {
        "w": lambda r: r.status is Status.WAITING,
        "p": lambda r: r.status is Status.PREFILLING and 6 <= r.num_prefilled <= r.prompt_len - 6,
        "l": lambda r: r.status is Status.LOOPING and r.loops_done == 2 and len(r.output_token_ids) >= 2,
        "h": lambda r: r.status is Status.AWAITING_HEAD and len(r.output_token_ids) >= 2,
    }
    outputs, seen, _ = drive(engine, arrivals, aborts)
    assert seen.keys() == aborts.keys()
    assert seen["w"]["status"] is Status.WAITING
    assert seen["p"]["status"] is Status.PREFILLING and 0 < seen["p"]["num_prefilled"] < 24
    assert seen["l"]["status"] is Status.LOOPING and seen["l"]["loops_done"] == 2
    assert seen["h"]["status"] is Status.AWAITING_HEAD
    ref = reference_for("last_exited")
    check_against_reference(outputs, arrivals, ref, skip=aborts)
    for rid in aborts:
        out = outputs[rid]
        assert out.finished and out.finish_reason == "abort" and out.error is None
        assert len(out.token_ids) == seen[rid]["num_output"]
        params = next(a[3] for a in arrivals if a[1] == rid)
        full = ref.generate(next(a[2] for a in arrivals if a[1] == rid), params, request_id=rid)
        assert out.token_ids == full.token_ids[:len(out.token_ids)]      # a prefix of the full run
        assert out.exit_depths == full.exit_depths[:len(out.token_ids)]
    assert outputs["w"].token_ids == [] and outputs["p"].token_ids == []
    assert engine.abort_request("k") is None and engine.abort_request("w") is None
    assert engine.abort_request("unknown") is None
    assert_all_pages_free(engine)


def rejection_cases():
    # (request id, prompt, params, what the message must name)
    return [
        ("toolong", TOKENS[:10], greedy(503), r"max_tokens \(503\).*max_model_len 512"),
        ("kvpages", TOKENS[:20], greedy(10), r"needs 32 KV pages.*cache has 24"),
        ("empty", [], greedy(2), r"prompt is empty"),
        ("oov", [3, 512], greedy(2), r"prompt token ids.*\[0, 512\)"),
        ("negative", [-1, 3], greedy(2), r"prompt token ids.*\[0, 512\)"),
        ("notint", [3, 1.5], greedy(2), r"prompt token ids"),
        ("before", TOKENS[:3], greedy(2), r"request_id 'before' is already in use"),
        ("maxloops", TOKENS[:3], greedy(2, max_loops=5), r"max_loops=5.*loop count 4"),
        ("minloops", TOKENS[:3], greedy(2, min_loops=5), r"min_loops=5.*max_loops 4"),
        ("stopids", TOKENS[:3], greedy(2, stop_token_ids=[600]), r"stop_token_ids.*\[600\].*512"),
        ("dict", {"ids": [1, 2]}, greedy(2), r"prompt_token_ids"),
        ("text", "hello", greedy(2), r"tokenizer"),
        ("params", TOKENS[:3], {"max_tokens": 2}, r"SamplingParams"),
    ]


def test_rejections_leave_the_queue_undisturbed():
    engine = make_engine(num_pages=SMALL_PAGES)
    before = (0, "before", TOKENS[:5], SamplingParams(max_tokens=4, temperature=1.0, seed=5, exit_threshold=0.6,
                                                       ignore_eos=True))
    engine.add_request(*before[1:])
    free = engine.scheduler.allocator.num_free
    for rid, prompt, params, message in rejection_cases():
        with pytest.raises(RequestRejectedError, match=message) as info:
            engine.add_request(rid, prompt, params)
        assert repr(rid) in str(info.value)
    assert list(engine.requests) == ["before"]
    assert [r.request_id for r in engine.scheduler.waiting] == ["before"]
    assert engine.scheduler.allocator.num_free == free
    # a rejected id was not consumed; the largest request that fits (24 positions) is accepted
    after = [(0, "empty", TOKENS[30:36], greedy(5, exit_threshold=0.6)),
             (0, "kvpages", TOKENS[40:61], greedy(4))]
    outputs = run_workload(engine, after)
    outputs["before"] = engine.get_output("before")
    check_against_reference(outputs, [before] + after, reference_for("last_exited"))
    assert_all_pages_free(engine)


def test_trace_rejections_leave_the_queue_undisturbed():
    engine = make_engine(exit_mode="trace", depths_by_request=TRACE)
    engine.add_request(*FAST_SLOW[0][1:])
    cases = [("nobody", greedy(2), r"depths_by_request\['nobody'\]: 0 depths recorded, max_tokens needs 2"),
             ("short", greedy(4), r"depths_by_request\['short'\]: 2 depths recorded, max_tokens needs 4"),
             ("first", greedy(4), r"\['first'\]\[0\]=3: the prefill depth must be R=4"),
             ("range", greedy(4, max_loops=2), r"\['range'\]\[2\]=3: must be within \[min_loops=1, max_loops=2\]"),
             ("float", greedy(4), r"\['float'\]\[2\]=2.0: must be within")]
    for rid, params, message in cases:
        with pytest.raises(RequestRejectedError, match=message):
            engine.add_request(rid, TOKENS[:3], params)
    assert list(engine.requests) == ["fast"]
    outputs = run_workload(engine, FAST_SLOW[1:])
    outputs["fast"] = engine.get_output("fast")
    check_against_reference(outputs, FAST_SLOW, reference_for("last_exited", depths_by_request=TRACE))
    assert_all_pages_free(engine)


# -- 4. failure injection ---------------------------------------------------------------------
FAILURE_WORKLOAD = [
    (0, "a", TOKENS[0:5], SamplingParams(max_tokens=5, temperature=1.0, seed=11, exit_threshold=0.6, ignore_eos=True)),
    (0, "b", TOKENS[10:34], greedy(4, exit_threshold=0.6)),      # 24-token prompt: still prefilling
    (0, "c", TOKENS[40:44], greedy(6)),
    (0, "d", TOKENS[50:53], greedy(3, exit_threshold=0.3)),
    (0, "e", TOKENS[60:70], greedy(4, exit_threshold=0.6)),      # waits for a slot
    (3, "f", TOKENS[70:76], SamplingParams(max_tokens=4, temperature=0.7, seed=5, logprobs=2, ignore_eos=True)),
]


@pytest.mark.parametrize("kind,fail_call", [("prefill", 2), ("loop", 3), ("head", 2)])
def test_failed_batch_errors_only_its_requests(kind, fail_call, monkeypatch):
    engine = make_engine()
    log = PlanLog(engine)
    real, calls, failed = getattr(engine.runner, kind), [], {}

    def flaky(*args, **kwargs):
        calls.append(len(log.entries) - 1)
        if len(calls) == fail_call:
            e = log.entries[-1]
            failed["step"] = len(log.entries) - 1
            failed["ids"] = {r if isinstance(r, str) else r[0] for r in e["rows"]}
            failed["others"] = set(e["status"]) - failed["ids"]
            raise RuntimeError("injected device failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, kind, flaky)
    outputs, _, returned = drive(engine, FAILURE_WORKLOAD)
    assert failed and failed["ids"]
    for rid in failed["ids"]:
        out = outputs[rid]
        assert out.finished and out.finish_reason == "error"
        assert out.error == "RuntimeError: injected device failure"
    assert {o.request_id for o in returned[failed["step"]]} == failed["ids"]
    assert all(o.finish_reason == "error" for o in returned[failed["step"]])
    # requests outside the failed batch (running at other stages, or still waiting) are unaffected
    ids = {a[1] for a in FAILURE_WORKLOAD}
    assert failed["others"] and (ids - failed["ids"] - failed["others"])
    ref = reference_for("last_exited")
    check_against_reference(outputs, FAILURE_WORKLOAD, ref, skip=failed["ids"])
    assert_all_pages_free(engine)
    # the engine keeps working (the patched call now succeeds)
    later = [(0, "g", TOKENS[3:9], SamplingParams(max_tokens=4, temperature=1.0, seed=2, exit_threshold=0.6,
                                                  ignore_eos=True))] + [(0, "h", TOKENS[30:42], greedy(3))]
    check_against_reference(run_workload(engine, later), later, ref)
    assert_all_pages_free(engine)


def test_failure_that_consumed_the_kv_pool_fails_every_request(monkeypatch):
    engine = make_engine()

    def lost(*args, **kwargs):   # e.g. a device error after the pool was donated
        engine.runner.kv.k.delete()
        engine.runner.kv.v.delete()
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "loop", lost)
    for _, rid, prompt, params in FAILURE_WORKLOAD:
        engine.add_request(rid, prompt, params)
    with pytest.raises(RuntimeError, match="device lost"):
        for _ in range(10):
            engine.step()
    for rid in engine.requests:
        out = engine.get_output(rid)
        assert out.finish_reason == "error" and out.error == "RuntimeError: device lost"
    assert_all_pages_free(engine)


def test_head_failure_after_some_rows_finished_keeps_their_finish(monkeypatch):
    """An error part-way through a head batch's host work errors the rows not yet done;
    a row that already finished normally keeps its finish reason and no error."""
    engine = make_engine()
    arrivals = [(0, "done", TOKENS[0:4], greedy(1)), (0, "bad", TOKENS[5:9], greedy(3))]
    for _, rid, prompt, params in arrivals:
        engine.add_request(rid, prompt, params)

    def boom(*args, **kwargs):
        raise ValueError("stop checker failed")

    monkeypatch.setattr(engine._stops["bad"], "check", boom)   # the host part of the head step fails
    _, _, returned = drive(engine, [])
    outputs = {rid: engine.get_output(rid) for _, rid, _, _ in arrivals}
    failed_step = next(outs for outs in returned if outs)       # the head batch reports both rows
    assert sorted((o.request_id, o.finish_reason) for o in failed_step) == [("bad", "error"), ("done", "length")]
    assert outputs["done"].finish_reason == "length" and outputs["done"].error is None
    check_equal(outputs["done"], reference_for("last_exited").generate(TOKENS[0:4], greedy(1)))
    assert outputs["bad"].finish_reason == "error" and outputs["bad"].error == "ValueError: stop checker failed"
    assert_all_pages_free(engine)


# -- 5. no compilation in steady state ----------------------------------------------------------
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
    engines = [make_engine(compile_ahead=True), make_engine(compile_ahead=True, mode="no_refill", min_coda_batch_size=2,
                                                            max_prefill_batches_before_decode=2)]
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
    for engine, (outputs, seen, _) in zip(engines, results):
        assert seen.keys() == aborts.keys()
        check_against_reference(outputs, arrivals, ref, skip=aborts)
        assert_all_pages_free(engine)


# -- 6. admission and prefill/decode interleaving ----------------------------------------------
def bypass_run(max_bypasses, scan_limit):
    """s0 runs; then a request needing the whole pool (24 pages) arrives while 4-page
    requests keep arriving, one per step."""
    engine = make_engine(num_pages=SMALL_PAGES, max_admission_bypasses=max_bypasses,
                         admission_scan_limit=scan_limit)
    log = PlanLog(engine)
    arrivals = ([(0, "s0", TOKENS[:3], greedy(2)), (1, "big", TOKENS[30:51], greedy(4, exit_threshold=0.6))]
                + [(i, f"s{i}", TOKENS[3 * i:3 * i + 3], greedy(2, exit_threshold=0.6)) for i in range(1, 16)])
    outputs = run_workload(engine, arrivals)
    check_against_reference(outputs, arrivals, reference_for("last_exited"))
    assert_all_pages_free(engine)
    big = log.admitted_at("big")
    passed = [f"s{i}" for i in range(1, 16) if log.admitted_at(f"s{i}") < big]
    assert log.entries[big - 1]["waiting"][0] == "big"       # it really waited at the head of the queue
    return passed, engine.requests["big"].bypassed


@pytest.mark.parametrize("max_bypasses,scan_limit,expected", [(0, 32, 0), (2, 32, 2), (8, 32, 8), (8, 1, 0)])
def test_admission_bypass_and_scan_limits(max_bypasses, scan_limit, expected):
    passed, bypassed = bypass_run(max_bypasses, scan_limit)
    assert len(passed) == expected and bypassed == expected
    assert passed == [f"s{i}" for i in range(1, expected + 1)]          # the earliest smalls, in order


@pytest.mark.parametrize("k", [1, 3])
def test_prefill_batches_interleave_with_decode_and_max_num_seqs(k):
    engine = make_engine(max_prefill_batches_before_decode=k)            # chunk 8, budget 16, 4 seqs
    log = PlanLog(engine)
    arrivals = [(2 * i, f"r{i}", TOKENS[7 * i:7 * i + 30 + 5 * (i % 3)], greedy(3, exit_threshold=0.6))
                for i in range(8)]
    outputs = run_workload(engine, arrivals)
    run, forced, longest_with_decode = 0, 0, 0
    for e in log.entries:
        decode_work = any(s in (Status.LOOPING, Status.AWAITING_HEAD) for s, _ in e["status"].values())
        prefilling = any(s is Status.PREFILLING for s, _ in e["status"].values())
        if e["kind"] == "prefill":
            run += 1
            if decode_work:
                assert run <= k, "decode not forced after max_prefill_batches_before_decode"
                longest_with_decode = max(longest_with_decode, run)
        else:
            forced += run == k and prefilling
            run = 0
        assert len(e["status"]) <= 4 and len(e["rows"]) <= (4 if e["kind"] != "prefill" else 16)
    assert forced > 0 and longest_with_decode == k
    assert max(len(e["status"]) for e in log.entries) == 4                # max_num_seqs caps running
    assert any(e["waiting"] for e in log.entries)
    check_against_reference(outputs, arrivals, reference_for("last_exited"))
    assert_all_pages_free(engine)


def test_min_coda_batch_size_on_a_random_workload():
    engine = make_engine(min_coda_batch_size=2)
    log = PlanLog(engine)
    arrivals = random_requests(np.random.default_rng(3), 6, "m", max_arrival=8)
    outputs = run_workload(engine, arrivals)
    deferred = 0
    for e in log.entries:
        statuses = [s for s, _ in e["status"].values()]
        if e["kind"] == "head" and len(e["rows"]) < 2:
            assert Status.LOOPING not in statuses
        if e["kind"] == "loop" and Status.AWAITING_HEAD in statuses:
            deferred += 1
    assert deferred > 0
    check_against_reference(outputs, arrivals, reference_for("last_exited"))
    assert_all_pages_free(engine)

"""Engine robustness: aborts in every request state, rejections that leave the queue alone,
a failed batch errors only its own requests (the engine keeps working, no page leaks).
What the engine compiles, and when, is in test_engine_compiles.py."""
from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import assert_all_pages_free, make_engine, reference_for, run_workload
from engine_trace_helpers import (FAST_SLOW, SMALL_PAGES, TOKENS, TRACE, PlanLog, check_against_reference,
                                  check_equal, drive, greedy)
from rltjax.engine.llm_engine import RequestRejectedError
from rltjax.engine.sequence import Status
from rltjax.sampling_params import SamplingParams


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
        ("falsy", TOKENS[:3], 0, r"SamplingParams"),                       # not taken for the defaults
        ("bools", [True, 3], greedy(2), r"prompt token ids"),
        ("bytes", b"abc", greedy(2), r"a prompt is a string"),
        ("scalar", np.array(5), greedy(2), r"a prompt is a string"),
        ("dicttext", {"prompt_token_ids": "hi"}, greedy(2), r"token ids, not text"),
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

    accept = engine.outputs.accept     # the host part of the head step fails for "bad" only
    monkeypatch.setattr(engine.outputs, "accept",
                        lambda r, *a, **kw: boom() if r.request_id == "bad" else accept(r, *a, **kw))
    _, _, returned = drive(engine, [])
    outputs = {rid: engine.get_output(rid) for _, rid, _, _ in arrivals}
    failed_step = next(outs for outs in returned if outs)       # the head batch reports both rows
    assert sorted((o.request_id, o.finish_reason) for o in failed_step) == [("bad", "error"), ("done", "length")]
    assert outputs["done"].finish_reason == "length" and outputs["done"].error is None
    check_equal(outputs["done"], reference_for("last_exited").generate(TOKENS[0:4], greedy(1)))
    assert outputs["bad"].finish_reason == "error" and outputs["bad"].error == "ValueError: stop checker failed"
    assert_all_pages_free(engine)

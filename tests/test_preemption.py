"""Preemption against the dense oracle: a recomputed request replays its outputs (each at its
recorded depth, its record kept if a replay samples otherwise), a swapped one comes back from
the host, a full swap space falls back to recompute, and an abort at any point around a
preemption frees everything."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import reference_model
from engine_helpers import (assert_all_pages_free, check_equal, check_page_accounting, make_engine, reference_for,
                            run_checked)
from rltjax.engine.sequence import Status
from rltjax.sampling_params import SamplingParams
from test_kv_memory import PAGE, growing_workload, pool_for, shared_prefix_workload


def test_a_replay_that_differs_from_its_record_keeps_it_and_warns_once(caplog):
    """A recompute replay whose heads sample other tokens than the record (as bf16 batches can):
    the record stays the output, every difference is counted, one warning names the request."""
    arrivals = shared_prefix_workload(max_tokens=16)
    engine = make_engine(page_size=PAGE, max_num_seqs=4, num_pages=pool_for("last_exited", arrivals, 3),
                         preemption_mode="recompute")
    preemptor, altered = engine.scheduler.preemptor, {}
    rewind = preemptor._rewind

    def rewind_and_alter(req):     # the record from output 1 on is not what the model samples
        rewind(req)
        if not altered and len(req.output_token_ids) >= 4:
            req.output_token_ids[1:] = [(t + 1) % engine.cfg.vocab_size for t in req.output_token_ids[1:]]
            altered[req.request_id] = list(req.output_token_ids)
    preemptor._rewind = rewind_and_alter
    with caplog.at_level("WARNING", logger="rltjax.engine.llm_engine"):
        outputs = run_checked(engine, arrivals)
    assert altered, "no request was recomputed after 4 outputs"
    (rid, record), = altered.items()
    assert outputs[rid].token_ids[:len(record)] == record
    assert engine.replay_mismatches >= 2
    warned = [m for m in caplog.messages if "replayed after a preemption" in m]
    assert len(warned) == 1 and repr(rid) in warned[0]
    assert_all_pages_free(engine)


@pytest.mark.parametrize("preemption, when", [("recompute", "waiting"), ("recompute", "replaying"),
                                              ("recompute", "resumed"), ("swap", "waiting"), ("swap", "resumed")])
def test_abort_around_a_preemption(preemption, when):
    """Aborting a request while it is preempted (its copy on the host, or rewound), while it
    rebuilds its KV, or right after it resumed, frees everything; the others equal the oracle."""
    arrivals = shared_prefix_workload(max_tokens=16)
    engine = make_engine(page_size=PAGE, max_num_seqs=4, num_pages=pool_for("last_exited", arrivals, 3),
                         preemption_mode=preemption, enable_prefix_caching=True)
    test = {"waiting": lambda r: r.num_preemptions and r.status is Status.WAITING,
            "replaying": lambda r: r.replay_left > 0 or (r.num_preemptions and r.status is Status.PREFILLING),
            "resumed": lambda r: r.num_preemptions and r.status is Status.LOOPING}[when]
    pending, step, aborted = sorted(arrivals, key=lambda a: a[0]), 0, None
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            engine.add_request(*pending.pop(0)[1:])
        if aborted is None:
            hit = [r for r in engine.requests.values() if not r.finished and test(r)]
            if hit:
                aborted = hit[0].request_id
                engine.abort_request(aborted)
                check_page_accounting(engine)
        engine.step()
        check_page_accounting(engine)
        step += 1
        assert step < 2000
    assert aborted is not None, "no request reached the state"
    ref = reference_for("last_exited")
    for _, rid, prompt, params in arrivals:
        out, want = engine.get_output(rid), ref.generate(prompt, params, request_id=rid)
        if rid == aborted:
            assert out.finish_reason == "abort" and out.token_ids == want.token_ids[:len(out.token_ids)]
        else:
            check_equal(out, want)
    assert engine.stats().swap_space_used == 0
    assert_all_pages_free(engine)


def test_swap_falls_back_to_recompute_when_the_swap_space_is_full():
    arrivals = growing_workload()
    engine = make_engine(page_size=PAGE, num_pages=1 + 4 * 9, preemption_mode="swap", swap_space=1e-9)
    outputs = run_checked(engine, arrivals)
    ref = reference_for("last_exited")
    for _, rid, prompt, params in arrivals:
        check_equal(outputs[rid], ref.generate(prompt, params, request_id=rid))
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.num_swapped == 0 and stats.num_recomputed == stats.num_preemptions


@pytest.mark.parametrize("mode", ["ouro", "ouro_delayed", "random_lookahead", "fixed"])
def test_a_replayed_token_exits_at_its_recorded_depth(mode):
    """The exit rule decides a fresh token; a token a recomputed request replays exits at its
    recorded depth, whatever its signals say (alone in a pass and beside a fresh row)."""
    from rltjax.engine.exit_policy import ExitPolicy
    from rltjax.engine.sequence import Request

    def row(replayed: bool, loops_done: int) -> Request:
        r = Request("x", [1, 2, 3], SamplingParams(max_tokens=4, exit_threshold=0.5), 0, 0, 1, 4)
        r.output_token_ids, r.exit_depths = [5, 6], ([4, 3, 2] if replayed else [4, 2])
        r.replay_left, r.status, r.loops_done = int(replayed), Status.LOOPING, loops_done
        return r

    policy = ExitPolicy(mode)
    sure, never = np.full(2, 0.999, np.float32), np.full(2, 1e-4, np.float32)
    for loops, signal, want_replayed in ((1, sure, False), (2, sure, False), (3, never, True)):
        both = [row(True, loops), row(False, loops)]
        assert bool(policy.after_pass(both, signal, signal)[0]) is want_replayed
        assert bool(policy.after_pass(both[:1], signal[:1], signal[:1])[0]) is want_replayed


@pytest.mark.parametrize("preemption, window", [("recompute", 0), ("swap", 0), ("swap", 3)])
def test_huginn_preempts_exactly(preemption, window):
    """Huginn under page pressure: its boundary pages, slot state and prelude injection are
    swapped or rebuilt with its latent-difference exits; outputs equal the oracle's."""
    from test_engine_huginn import SHAPE, workload
    arrivals = [(step // 2, rid, prompt, dataclasses.replace(params, max_tokens=params.max_tokens + 6))
                for step, rid, prompt, params in workload()]
    engine = make_engine(name="huginn-tiny", exit_mode="latent_diff", **{**SHAPE, "max_num_seqs": 3},
                         num_pages=1 + 12 * 7, preemption_mode=preemption, decode_window=window,
                         enable_prefix_caching=True)
    outputs = run_checked(engine, arrivals)
    ref = reference_model("huginn-tiny", exit_mode="latent_diff")
    for _, rid, prompt, params in arrivals:
        check_equal(outputs[rid], ref.generate(prompt, params, request_id=rid))
    assert engine.stats().num_preemptions > 0
    assert_all_pages_free(engine)

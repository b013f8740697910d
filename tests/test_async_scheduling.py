"""Async scheduling (a loop pass launched before the previous pass's exit signals are read)
gives exactly the synchronous engine's outputs: tokens, exit depths and float32 logprobs equal
the dense oracle for the delayed, lookahead, trace and fixed modes, over random workloads with
arrivals, aborts and reused request ids; same-step modes are rejected."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import reference_npz
from engine_helpers import (assert_all_pages_free, check_equal, make_engine, reference_for, run_with_abort,
                            run_workload, wrap_reads)
from rltjax.engine.plan import LoopStep
from rltjax.engine_config import EngineConfigError
from rltjax.sampling_params import SamplingParams

TOKENS = [int(t) for t in reference_npz("ouro-tiny")["p2_input_ids"]] * 3

request = st.tuples(
    st.integers(0, 8), st.integers(0, 60), st.integers(1, 14),   # arrival step, prompt start, length
    st.integers(1, 8), st.sampled_from([0.0, 0.9]), st.integers(0, 2**40),   # max_tokens, temp, seed
    st.sampled_from([0.3, 0.6, 1.0]), st.integers(1, 2), st.integers(3, 4),  # threshold, min, max loops
    st.sampled_from([None, 2]),                                             # logprobs
)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(kv_layout=st.sampled_from(["last_exited", "shared"]), mode=st.sampled_from(["refill", "no_refill"]),
       exit_mode=st.sampled_from(["ouro_delayed", "random_lookahead", "fixed"]),
       window=st.sampled_from([0, 4]), requests=st.lists(request, min_size=1, max_size=5),
       abort_at=st.sampled_from([None, 3, 6]))
def test_async_matches_reference(kv_layout, mode, exit_mode, window, requests, abort_at):
    if mode == "no_refill":
        window = 0
    engine = make_engine(kv_layout=kv_layout, mode=mode, exit_mode=exit_mode, page_size=4, max_num_seqs=3,
                         lookahead_seed=3, decode_window=window, async_scheduling=True)
    steps, late_reads = [0], []      # (step launched, step read) of every loop pass's signals
    real_step = engine.step
    engine.step = lambda: steps.__setitem__(0, steps[0] + 1) or real_step()

    def when_read(read, step):
        launched = steps[0]
        return lambda: late_reads.append((launched, steps[0])) or read()
    wrap_reads(engine, LoopStep, when_read)
    arrivals = []
    for i, (step, start, length, max_tokens, temp, seed, q, lo, hi, lp) in enumerate(requests):
        arrivals.append((step, f"r{i}", TOKENS[start:start + length],
                         SamplingParams(max_tokens=max_tokens, temperature=temp, seed=seed, exit_threshold=q,
                                        min_loops=lo, max_loops=hi, logprobs=lp, ignore_eos=True)))
    looping = lambda e: next((r.request_id for r in e.scheduler.running if r.loops_done > 0), None)
    aborted = run_with_abort(engine, arrivals, abort_at, looping)
    assert all(read > launched for launched, read in late_reads), \
        "async scheduling must not read a pass's signals in the step that launches it"
    ref = reference_for(kv_layout, "fixed" if exit_mode == "fixed" else exit_mode, lookahead_seed=3)
    for _, rid, prompt, params in arrivals:
        out, want = engine.get_output(rid), ref.generate(prompt, params, request_id=rid)
        if rid == aborted:
            assert out.token_ids == want.token_ids[:len(out.token_ids)]
            assert out.exit_depths == want.exit_depths[:len(out.exit_depths)]
        else:
            check_equal(out, want)
    assert_all_pages_free(engine)


def test_reused_id_ignores_the_aborted_requests_signals():
    """Abort a request while its pass's signals are in flight, reuse its id at once: the new
    request decides on its own signals only."""
    engine = make_engine(exit_mode="ouro_delayed", async_scheduling=True)
    params = SamplingParams(max_tokens=6, temperature=0.0, exit_threshold=0.5, ignore_eos=True)
    engine.add_request("a", TOKENS[:9], params)
    while not any(r.loops_done for r in engine.scheduler.running):
        engine.step()
    engine.abort_request("a")
    engine.forget("a")
    out = run_workload(engine, [(0, "a", TOKENS[20:27], params)])["a"]
    check_equal(out, reference_for("last_exited", "ouro_delayed").generate(TOKENS[20:27], params, request_id="a"))
    assert_all_pages_free(engine)


@pytest.mark.parametrize("threshold,min_loops", [(0.3, 1), (0.6, 1), (0.3, 2), (0.6, 2)])
def test_fresh_window_reads_the_async_pass_first(threshold, min_loops):
    """A window launched from host rows while an async pass's exit signals are unread (a
    still-prefilling request aborted right after that pass) reads them first: no pass's
    signal is lost, so exit depths and tokens equal the oracle's."""
    engine = make_engine(exit_mode="ouro_delayed", async_scheduling=True, decode_window=4, max_num_seqs=3,
                         num_pages=256, prefill_chunk_size=8, max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=14, temperature=0.0, exit_threshold=threshold, min_loops=min_loops,
                            ignore_eos=True)
    engine.add_request("a", TOKENS[:5], params)
    while len(engine.requests["a"].output_token_ids) < 2:
        engine.step()
    engine.add_request("b", TOKENS[10:50], SamplingParams(max_tokens=4, ignore_eos=True))  # 5 chunks
    async_pass_unread = lambda: any(isinstance(p.step, LoopStep) for p in engine._pending)
    while not (engine.requests["b"].num_prefilled and async_pass_unread()):
        engine.step()
    engine.abort_request("b")        # the prefill step that would have read the signals never comes
    while engine.has_unfinished_requests():
        engine.step()
    check_equal(engine.get_output("a"),
                reference_for("last_exited", "ouro_delayed").generate(TOKENS[:5], params, request_id="a"))
    assert_all_pages_free(engine)


def test_a_failed_signal_read_errors_only_its_pass():
    """The async pass's signals read during another request's prefill fail: the pass's request
    errors; the prefilling request, which had nothing in flight, finishes as the oracle's."""
    engine = make_engine(exit_mode="ouro_delayed", async_scheduling=True, max_num_seqs=3, num_pages=256,
                         prefill_chunk_size=8, max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=8, temperature=0.0, exit_threshold=0.6, ignore_eos=True)
    engine.add_request("a", TOKENS[:5], params)
    while len(engine.requests["a"].output_token_ids) < 2:
        engine.step()
    engine.add_request("b", TOKENS[10:40], params)     # chunked prefill: prefill and loop steps alternate
    failed = []

    def fail_once_during_a_prefill(read, step):
        def read_or_fail():
            if not failed and engine.requests["b"].num_prefilled < engine.requests["b"].prompt_len:
                failed.append(step.rows)
                raise RuntimeError("injected read failure")
            return read()
        return read_or_fail
    wrap_reads(engine, LoopStep, fail_once_during_a_prefill)
    while engine.has_unfinished_requests():
        engine.step()
    assert failed and [r.request_id for r in failed[0]] == ["a"]
    assert engine.get_output("a").finish_reason == "error"
    check_equal(engine.get_output("b"),
                reference_for("last_exited", "ouro_delayed").generate(TOKENS[10:40], params, request_id="b"))
    assert_all_pages_free(engine)


def test_trace_replay_async():
    depths = {"a": [4, 1, 3, 2, 4, 1, 2], "b": [4, 2, 2, 3, 1, 4, 4]}
    engine = make_engine(exit_mode="trace", depths_by_request=depths, async_scheduling=True)
    arrivals = [(0, "a", TOKENS[:7], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)),
                (2, "b", TOKENS[3:12], SamplingParams(max_tokens=7, temperature=1.0, seed=9, ignore_eos=True))]
    outputs = run_workload(engine, arrivals)
    ref = reference_for("last_exited", depths_by_request=depths)
    for _, rid, prompt, params in arrivals:
        assert outputs[rid].exit_depths == depths[rid]
        check_equal(outputs[rid], ref.generate(prompt, params, request_id=rid))


@pytest.mark.parametrize("exit_mode", ["ouro"])
def test_same_step_modes_are_rejected(exit_mode):
    with pytest.raises(EngineConfigError, match="one pass late"):
        make_engine(exit_mode=exit_mode, async_scheduling=True)

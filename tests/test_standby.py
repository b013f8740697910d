"""Standby entries (``ExecutionConfig.decode_window_rows`` below max_num_seqs): requests
prefilled beyond a window's rows wait on the device and take the row of the next request to
finish, in the pass after it finishes. Outputs equal the dense oracle's over random
workloads with arrivals, aborts (of rows and of waiting entries) and host-only stops; rows
are refilled inside windows, so the same work takes fewer passes; no page leaks."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engine_helpers import (wrap_reads, assert_all_pages_free, check_equal, check_outputs, make_engine, reference_for,
                            run_with_abort, run_workload)
from engine_trace_helpers import TOKENS
from rltjax.engine.plan import WindowStep
from rltjax.engine_config import EngineConfigError, ExecutionConfig
from rltjax.sampling_params import SamplingParams

request = st.tuples(
    st.integers(0, 6),                                   # arrival step
    st.integers(0, 60), st.integers(1, 12),              # prompt start, length
    st.integers(1, 12),                                  # max_tokens
    st.sampled_from([0.0, 0.9]), st.integers(0, 2**40),  # temperature, seed
    st.sampled_from([0.3, 0.6, 1.0]),                    # exit threshold
    st.integers(1, 2), st.integers(3, 4),                # min_loops, max_loops
    st.sampled_from([None, 2]),                          # logprobs
)


def record_swaps(engine) -> list[np.ndarray]:
    """Wrap the engine's window reads to collect each window's ``swap_col``."""
    swaps = []

    def recording(read, step):
        def read_and_record():
            got = read()
            swaps.append(np.asarray(got.out.swap_col)[:len(step.rows)])
            return got
        return read_and_record
    wrap_reads(engine, WindowStep, recording)
    return swaps


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(exit_mode=st.sampled_from(["ouro_delayed", "random_lookahead", "fixed"]),
       window=st.sampled_from([2, 3, 8]), window_trip=st.sampled_from(["early_stop", "fixed"]),
       requests=st.lists(request, min_size=9, max_size=14), abort_at=st.sampled_from([None, 1, 4, 9]),
       victim=st.sampled_from([0, -1]))
def test_standby_windows_match_reference(exit_mode, window, window_trip, requests, abort_at, victim):
    """12 admitted requests, 8 window rows: every output equals the oracle's (an aborted
    request's are a prefix of it), the aborted one a row's (victim 0) or, likely, a waiting
    entry's (the newest, -1); no page leaks."""
    engine = make_engine(exit_mode=exit_mode, page_size=4, max_num_seqs=12, decode_window_rows=8, num_pages=512,
                         lookahead_seed=3, decode_window=window, window_trip=window_trip)
    arrivals = []
    for i, (step, start, length, max_tokens, temp, seed, q, lo, hi, lp) in enumerate(requests):
        params = SamplingParams(max_tokens=max_tokens, temperature=temp, seed=seed, exit_threshold=q,
                                min_loops=lo, max_loops=hi, logprobs=lp, ignore_eos=True)
        arrivals.append((step, f"r{i}", TOKENS[start:start + length], params))
    aborted = run_with_abort(engine, arrivals, abort_at,
                             lambda e: e.scheduler.running[victim].request_id if e.scheduler.running else None)
    check_outputs(engine, arrivals, reference_for("last_exited", exit_mode, lookahead_seed=3), aborted)


def queued_trace_workload(n: int, seed: int = 0):
    """n requests queued at once (``bench_cdb``'s shape), depths drawn uniform over 1..4."""
    rng = np.random.default_rng(seed)
    arrivals = [(0, f"q{i}", TOKENS[int(s):int(s) + int(p)],
                 SamplingParams(max_tokens=int(m), temperature=0.0, ignore_eos=True))
                for i, (s, p, m) in enumerate(zip(rng.integers(0, 60, n), rng.integers(2, 10, n),
                                                  rng.integers(4, 14, n)))]
    depths = {rid: [4] + [int(d) for d in rng.integers(1, 5, 16)] for _, rid, _, _ in arrivals}
    return arrivals, depths


def test_rows_are_refilled_inside_windows():
    """A queue of trace-replay requests through 8 rows: with 4 standby entries a finished
    request's row is taken inside the window it finished in (a swap after the first column),
    so the workload runs in fewer passes than with every admitted request in a row; both
    equal the oracle replaying the trace."""
    arrivals, depths = queued_trace_workload(28)
    ref = reference_for("last_exited", depths_by_request=depths)
    passes = {}
    for rows in (None, 8):
        engine = make_engine(exit_mode="trace", depths_by_request=depths, decode_window=6, window_trip="fixed",
                             max_num_seqs=8 if rows is None else 12, decode_window_rows=rows, num_pages=256,
                             max_num_batched_tokens=64, prefill_chunk_size=16)
        swaps = record_swaps(engine)
        outs = run_workload(engine, arrivals)
        for _, rid, prompt, params in arrivals:
            assert outs[rid].exit_depths == depths[rid][:params.max_tokens]
            check_equal(outs[rid], ref.generate(prompt, params, request_id=rid))
        assert_all_pages_free(engine)
        passes[rows] = engine.steps_by_kind["window_passes"]
        if rows:
            assert any((s > 0).any() for s in swaps), "no row was refilled inside a window"
    assert passes[8] < passes[None], passes


def test_aborted_waiting_entry():
    """A request aborted while it waits as a standby entry (its prefill and first head done;
    the device may have given it a row the host has not read yet) finishes with its first
    token only; its slot and pages go to the next request, whose
    outputs are the oracle's, and nothing leaks."""
    engine = make_engine(exit_mode="ouro_delayed", decode_window=3, window_trip="fixed", max_num_seqs=10,
                         decode_window_rows=8, num_pages=512)     # pages for all 10 at once
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    arrivals = [(0, f"a{i}", TOKENS[i:i + 5], long) for i in range(10)]
    for _, rid, prompt, params in arrivals:
        engine.add_request(rid, prompt, params)
    for _ in range(50):
        engine.step()
        running = engine.scheduler.running
        if engine.windows_in_flight and len(running) == 10 and all(r.output_token_ids for r in running):
            break
    else:
        raise AssertionError("the 10 requests never decoded together in a window")
    waiting = [r for r in engine.scheduler.running if len(r.output_token_ids) == 1 and r.arrival_index >= 8]
    assert waiting, "no request waited as a standby entry"
    victim = waiting[-1].request_id
    engine.abort_request(victim)
    late = (0, "late", TOKENS[20:26], SamplingParams(max_tokens=7, temperature=0.9, seed=5, ignore_eos=True))
    engine.add_request(*late[1:])
    while engine.has_unfinished_requests():
        engine.step()
    ref = reference_for("last_exited", "ouro_delayed")
    prompts = {rid: prompt for _, rid, prompt, _ in arrivals}
    assert engine.get_output(victim).token_ids == ref.generate(prompts[victim], long).token_ids[:1]
    for _, rid, prompt, params in arrivals + [late]:
        if rid != victim:
            check_equal(engine.get_output(rid), ref.generate(prompt, params, request_id=rid))
    assert_all_pages_free(engine)


def test_host_only_stop_of_a_waiting_entry():
    """A stop string that a standby entry's first tokens hit ends it at the step-by-step
    engine's token, also when the device swapped it into a row before the host read the stop."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    step_engine = make_engine(tokenizer=True)
    greedy = run_workload(step_engine, [(0, "g", TOKENS[:6], params)])["g"]
    stop = greedy.text[len(greedy.text) // 3:][:2]
    assert stop.strip(), greedy.text
    stopped = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop])
    arrivals = [(0, f"f{i}", TOKENS[10 + i:16 + i], params) for i in range(9)] + [(0, "s", TOKENS[:6], stopped)]
    outs = run_workload(make_engine(tokenizer=True, decode_window=2, window_trip="fixed", max_num_seqs=12,
                                    decode_window_rows=8, num_pages=256), arrivals)
    want = run_workload(make_engine(tokenizer=True), arrivals)
    for rid in outs:
        assert outs[rid].token_ids == want[rid].token_ids and outs[rid].finish_reason == want[rid].finish_reason
    assert outs["s"].finish_reason == "stop"


@pytest.mark.parametrize("kwargs,match", [
    (dict(decode_window_rows=12), "power of two >= 8"),
    (dict(decode_window_rows=4), "power of two >= 8"),
    (dict(decode_window_rows=True), "power of two >= 8"),
])
def test_decode_window_rows_values_are_checked(kwargs, match):
    with pytest.raises(EngineConfigError, match=match):
        ExecutionConfig(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(decode_window=0, decode_window_rows=8), "decode_window_rows limits decode windows"),
    (dict(decode_window=4, window_trip="fixed", decode_window_rows=8, mixed_prefill_tokens=64),
     "mixed prefill's prompt rows"),
])
def test_decode_window_rows_combinations_rejected(kwargs, match):
    with pytest.raises(EngineConfigError, match=match):
        make_engine(max_num_seqs=12, **kwargs)

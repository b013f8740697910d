"""Device-side decode windows give exactly the step-by-step engine's outputs: tokens, exit
depths and (float32) logprobs equal the dense oracle over random workloads with arrivals
between windows, aborts, every window-capable exit mode, both KV layouts and several K;
host-only stops (stop strings, stop ids past the device's width) cut a window's extra tokens."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import reference_npz
from engine_helpers import (DeviceCalls, assert_all_pages_free, check_equal, check_outputs, check_trace_replay, make_engine,
                            reference_for, run_with_abort, run_workload)
from rltjax.engine.plan import WindowStep
from rltjax.engine.window.state import STOP_ID_WIDTH
from rltjax.engine_config import EngineConfigError, ExecutionConfig
from rltjax.sampling_params import SamplingParams

TOKENS = [int(t) for t in reference_npz("ouro-tiny")["p2_input_ids"]] * 3

request = st.tuples(
    st.integers(0, 8),                                   # arrival step
    st.integers(0, 60), st.integers(1, 14),              # prompt start, length
    st.integers(1, 9),                                   # max_tokens
    st.sampled_from([0.0, 0.9]), st.integers(0, 2**40),  # temperature, seed
    st.sampled_from([1.0, 1.0, 0.8]),                    # top_p (picks the window's sampler)
    st.sampled_from([0.3, 0.6, 1.0]),                    # exit threshold
    st.integers(1, 2), st.integers(3, 4),                # min_loops, max_loops
    st.sampled_from([None, 3]),                          # logprobs
)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(kv_layout=st.sampled_from(["last_exited", "shared"]),
       exit_mode=st.sampled_from(["ouro", "ouro_delayed", "random_lookahead"]),
       window=st.sampled_from([1, 3, 8]), max_num_seqs=st.sampled_from([2, 4]),
       requests=st.lists(request, min_size=1, max_size=5), abort_at=st.sampled_from([None, 2, 5]),
       window_trip=st.sampled_from(["early_stop", "fixed"]))
def test_windows_match_reference(kv_layout, exit_mode, window, max_num_seqs, requests, abort_at, window_trip):
    engine = make_engine(kv_layout=kv_layout, exit_mode=exit_mode, page_size=4, max_num_seqs=max_num_seqs,
                         lookahead_seed=3, decode_window=window, window_trip=window_trip)
    arrivals = []
    for i, (step, start, length, max_tokens, temp, seed, top_p, q, lo, hi, lp) in enumerate(requests):
        params = SamplingParams(max_tokens=max_tokens, temperature=temp, seed=seed, top_p=top_p, exit_threshold=q,
                                min_loops=lo, max_loops=hi, logprobs=lp, ignore_eos=True)
        arrivals.append((step, f"r{i}", TOKENS[start:start + length], params))
    aborted = run_with_abort(engine, arrivals, abort_at,
                             lambda e: e.scheduler.running[-1].request_id if e.scheduler.running else None)
    check_outputs(engine, arrivals, reference_for(kv_layout, exit_mode, lookahead_seed=3), aborted)


@pytest.mark.parametrize("params,sampler", [
    (dict(temperature=0.0), "greedy"), (dict(temperature=0.9), "draw"), (dict(temperature=0.9, top_k=5), "truncate"),
    (dict(temperature=0.0, logprobs=2), "truncate"), (dict(temperature=0.0, logprobs=0), "truncate"),
    (dict(temperature=0.9, top_p=0.5), "truncate")])
def test_window_head_is_the_cheapest_exact_variant(params, sampler):
    """A window's head sorts the vocabulary (and computes logprobs) only when one of its
    requests needs it (logprobs=0 too: the sampled token's own); its tokens are the oracle's
    either way."""
    engine = make_engine(decode_window=4, max_num_seqs=2)
    calls = DeviceCalls(engine)
    sp = SamplingParams(max_tokens=6, seed=5, ignore_eos=True, **params)
    prompt = TOKENS[:7]
    engine.add_request("x", prompt, sp)
    while engine.has_unfinished_requests():
        engine.step()
    used = [step.sampler for step in calls.steps(WindowStep)]
    assert used and set(used) == {sampler}
    check_equal(engine.get_output("x"), reference_for("last_exited", "ouro").generate(prompt, sp, request_id="x"))
    assert_all_pages_free(engine)


@pytest.mark.parametrize("window_trip", ["early_stop", "fixed"])
@pytest.mark.parametrize("kv_layout", ["last_exited", "shared"])
def test_windows_replay_traces_and_run(kv_layout, window_trip):
    depths = {"a": [4, 1, 3, 2, 4, 1, 2, 3, 1, 1], "b": [4, 2, 2, 3, 1, 4, 4, 2, 2, 2]}
    arrivals = [(0, "a", TOKENS[:7], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)),
                (0, "b", TOKENS[3:12], SamplingParams(max_tokens=10, temperature=1.0, seed=9, ignore_eos=True))]
    engine = check_trace_replay(kv_layout, depths, arrivals, decode_window=5, window_trip=window_trip)
    assert engine.steps_by_kind.get("window_passes", 0) > 0
    # the whole trace rides on the device: windows continue without the host re-packing them
    assert engine.steps_by_kind["window"] > engine.steps_by_kind.get("window_read", 0), engine.steps_by_kind


def test_host_only_stops_cut_the_window():
    """A stop id past the device's width and a stop string both end the request at the same
    token as the step-by-step engine; the window's extra tokens are dropped."""
    ref_engine = make_engine(tokenizer=True)
    greedy = run_workload(ref_engine, [(0, "g", TOKENS[:6], SamplingParams(max_tokens=12, temperature=0.0,
                                                                          ignore_eos=True))])["g"]
    stop_id = greedy.token_ids[4]
    filler = [t for t in range(100, 100 + 2 * STOP_ID_WIDTH) if t not in greedy.token_ids][:STOP_ID_WIDTH]
    text_stop = greedy.text[len(greedy.text) // 2:][:3] if len(greedy.text) > 6 else None
    cases = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=filler + [stop_id])]
    if text_stop and text_stop.strip():
        cases.append(SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[text_stop]))
    for params in cases:
        outs = [run_workload(make_engine(tokenizer=True, decode_window=w), [(0, "x", TOKENS[:6], params)])["x"]
                for w in (0, 16, 2)]        # 2: the stop is read while the next window already runs
        for other in outs[1:]:
            assert outs[0].token_ids == other.token_ids and outs[0].text == other.text
            assert other.finish_reason == "stop"
        assert len(outs[0].token_ids) < 12


@pytest.mark.parametrize("window_trip", ["early_stop", "fixed"])
def test_continued_windows_read_one_window_late(window_trip):
    """With nothing else to schedule, each window is launched from the previous one's device
    state before the host reads that one; outputs stay the oracle's, also when a request is
    aborted while a window runs and when requests finish inside a window that is not read yet
    (a fixed-trip window then runs its remaining passes over inactive rows)."""
    engine = make_engine(exit_mode="ouro_delayed", decode_window=3, max_num_seqs=3, window_trip=window_trip)
    calls = DeviceCalls(engine)
    params = [SamplingParams(max_tokens=n, temperature=t, seed=i, exit_threshold=0.6, ignore_eos=True, logprobs=2)
              for i, (n, t) in enumerate([(12, 0.0), (5, 0.8), (9, 0.0)])]
    prompts = [TOKENS[:8], TOKENS[10:15], TOKENS[30:41]]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"c{i}", p, sp)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 12:
            engine.abort_request("c2")
    launches = [not isinstance(rows.slots, np.ndarray) for rows in calls.windows]   # from the device's rows
    assert launches == [step.continues for step in calls.steps(WindowStep)]
    assert sum(launches) >= 2, "no window was launched from the device state of the one before"
    ref = reference_for("last_exited", "ouro_delayed")
    for i, (p, sp) in enumerate(zip(prompts, params)):
        out, want = engine.get_output(f"c{i}"), ref.generate(p, sp, request_id=f"c{i}")
        if i == 2 and out.finish_reason == "abort":
            assert out.token_ids == want.token_ids[:len(out.token_ids)]
        else:
            check_equal(out, want)
    assert_all_pages_free(engine)


@pytest.mark.parametrize("window", [3, 4, 8])
def test_no_window_is_launched_behind_one_that_finishes_every_row(window):
    """A closed loop of one request at a time, fixed depth, fixed-trip windows: the in-flight
    window surely ends the request (max_tokens), so the engine reads it instead of launching
    one more over finished rows (K passes that would hold back the next request's prefill).
    Outputs stay the oracle's."""
    engine = make_engine(exit_mode="ouro_delayed", decode_window=window, max_num_seqs=2, window_trip="fixed")
    launched_idle = []
    window = engine.runner.window
    # nothing to run: no active row and no standby entry waiting for one
    engine.runner.window = lambda rows, *rest: launched_idle.append(
        not np.asarray(rows.active).any() and not np.asarray(engine.runner.standby.active).any()) or window(rows, *rest)
    ref = reference_for("last_exited", "ouro_delayed")
    for i, n in enumerate([7, 1, 4, 12, 3]):
        sp = SamplingParams(max_tokens=n, temperature=0.0, exit_threshold=1.0, ignore_eos=True)
        engine.add_request(f"r{i}", TOKENS[i:i + 6], sp)
        while engine.has_unfinished_requests():
            engine.step()
        check_equal(engine.get_output(f"r{i}"), ref.generate(TOKENS[i:i + 6], sp, request_id=f"r{i}"))
    assert launched_idle and not any(launched_idle), launched_idle
    assert_all_pages_free(engine)


@pytest.mark.parametrize("name,kwargs", [("ouro-tiny", {}), ("huginn-tiny", {"hf_overrides": {"state_init": "zero"}})])
def test_first_heads_are_queued_before_the_window(name, kwargs):
    """When fresh prompts' heads are all that stands before a window, the heads and the window
    are queued together and the host reads the heads after: the window starts those requests
    from the tokens the heads left on the device. First tokens that end a request (max_tokens
    1, a stop id only the host checks) end it as step by step; outputs equal the step-by-step
    engine's, and no page leaks."""
    first = run_workload(make_engine(name=name, **kwargs), [(0, "p", TOKENS[:6], SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True))])["p"].token_ids[0]
    filler = [t for t in range(100, 100 + 2 * STOP_ID_WIDTH) if t != first][:STOP_ID_WIDTH]
    arrivals = [(0, "a", TOKENS[:7], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)),
                (3, "b", TOKENS[2:9], SamplingParams(max_tokens=6, temperature=0.9, seed=4, ignore_eos=True,
                                                     logprobs=2)),
                (3, "one", TOKENS[4:8], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)),
                (6, "p", TOKENS[:6], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                    stop_token_ids=filler + [first]))]
    engine = make_engine(name=name, decode_window=3, max_num_seqs=4, **kwargs)
    calls = DeviceCalls(engine)
    outs = run_workload(engine, arrivals)
    order = calls.kinds().replace("w", "")
    assert "HWh" in order, order                     # heads queued, then the window, then the heads' read
    want = run_workload(make_engine(name=name, **kwargs), arrivals)
    for rid in want:
        check_equal(outs[rid], want[rid])
    assert outs["p"].finish_reason == "stop" and outs["p"].token_ids == [first]
    assert_all_pages_free(engine)


def test_nanbeige_windows_match_step_engine():
    prompts = [TOKENS[:9], TOKENS[20:25]]
    outs = []
    for w in (0, 4):
        engine = make_engine(name="nanbeige-tiny", decode_window=w)
        arrivals = [(i, f"n{i}", p, SamplingParams(max_tokens=6, temperature=0.7, seed=i, ignore_eos=True,
                                                     logprobs=2)) for i, p in enumerate(prompts)]
        outs.append(run_workload(engine, arrivals))
        assert_all_pages_free(engine)
    for rid in outs[0]:
        assert outs[0][rid].token_ids == outs[1][rid].token_ids
        assert outs[0][rid].exit_depths == outs[1][rid].exit_depths
        for a, b in zip(outs[0][rid].logprobs, outs[1][rid].logprobs):
            assert a.keys() == b.keys()
            np.testing.assert_allclose(list(a.values()), list(b.values()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="no_refill"), "refill"),
    (dict(min_coda_batch_size=2), "min_coda_batch_size"),
])
def test_window_combinations_rejected(kwargs, match):
    with pytest.raises(EngineConfigError, match=match):
        make_engine(decode_window=4, **kwargs)


@pytest.mark.parametrize("kwargs, expected", [
    (dict(), "default"),                            # None: DEFAULT_DECODE_WINDOW where windows can run
    (dict(mode="no_refill"), 0),                    # ... and off where they cannot, without an error
    (dict(min_coda_batch_size=2), 0),
    (dict(decode_window=0), 0),
    (dict(decode_window=7), 7),
])
def test_window_default_resolution(kwargs, expected):
    from rltjax.engine_config import DEFAULT_DECODE_WINDOW
    kwargs = {"decode_window": None, **kwargs}
    engine = make_engine(**kwargs)
    passes = engine.settings.window.num_passes if engine.settings.window else 0
    assert passes == (DEFAULT_DECODE_WINDOW if expected == "default" else expected)
    assert (engine.scheduler.windows is None) == (passes == 0)


@pytest.mark.parametrize("value", [-1, 1025, True, 2.0])
def test_decode_window_values_are_checked(value):
    from rltjax.engine_config import ExecutionConfig
    with pytest.raises(EngineConfigError, match="decode_window"):
        ExecutionConfig(decode_window=value)


@pytest.mark.parametrize("name,kwargs,fixed", [("ouro-tiny", {}, True),
                                               ("huginn-tiny", dict(exit_mode="latent_diff", max_loops=6), False)])
def test_auto_window_trip_is_fixed_unless_the_model_has_boundary_stages(name, kwargs, fixed):
    """``auto`` (the default) runs fixed-trip windows, except for models whose prelude would
    then run every pass (Huginn): those stop early."""
    engine = make_engine(name=name, decode_window=4, window_trip="auto", **kwargs)
    assert engine.settings.window.fixed_trip is fixed
    assert ExecutionConfig().window_trip == "auto"


@pytest.mark.parametrize("window", [3, 5])
@pytest.mark.parametrize("window_trip", ["early_stop", "fixed"])
def test_a_window_runs_exactly_k_passes(window, window_trip):
    """Behaviourally, a window is K loop passes: a request that exits after every loop
    (max_loops 1) gains exactly K tokens per window read, every window but its last; one
    pass fewer or more would change that count though no output differs from the oracle."""
    engine = make_engine(exit_mode="ouro", decode_window=window, max_num_seqs=2, window_trip=window_trip)
    sp = SamplingParams(max_tokens=1 + 3 * window + 2, temperature=0.0, exit_threshold=1.0, min_loops=1,
                        max_loops=1, ignore_eos=True)
    engine.add_request("one", TOKENS[:6], sp)
    counts = [0]
    while engine.has_unfinished_requests():
        engine.step()
        counts.append(len(engine.get_output("one").token_ids))
    gains = [b - a for a, b in zip(counts, counts[1:]) if b != a]
    assert gains[0] == 1, gains                       # the prompt's head
    assert gains[1:-1] == [window] * 3 and gains[-1] == 2, gains
    check_equal(engine.get_output("one"), reference_for("last_exited", "ouro").generate(TOKENS[:6], sp,
                                                                                         request_id="one"))

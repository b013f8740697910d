"""Failure injection into decode windows (with and without standby entries): a window whose
launch or read raises errors its requests, and only once: no output for a request follows its
finish, the others equal the oracle's, no page leaks."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from engine_helpers import assert_all_pages_free, check_equal, make_engine, reference_for, wrap_reads
from engine_trace_helpers import TOKENS, drive
from rltjax.engine.plan import WindowStep
from rltjax.engine.runner import WindowResult
from rltjax.sampling_params import SamplingParams


def workload(n: int = 14):
    rng = np.random.default_rng(0)
    arrivals = []
    for i in range(n):
        start = int(rng.integers(0, 60))
        arrivals.append((int(rng.integers(0, 8)), f"r{i}", TOKENS[start:start + int(rng.integers(2, 10))],
                         SamplingParams(max_tokens=int(rng.integers(2, 12)), temperature=0.0, exit_threshold=0.6,
                                        ignore_eos=True)))
    return arrivals


def assert_no_output_after_finish(returned) -> None:
    """No request has an output in a step after the one that finished it (returned: per step)."""
    finished_at = {}
    for step, outs in enumerate(returned):
        for out in outs:
            assert out.request_id not in finished_at, f"{out.request_id}: output at step {step} after its finish"
            if out.finished:
                finished_at[out.request_id] = step


def assert_others_match_oracle(engine, arrivals, outputs, errors) -> None:
    """Every request not in ``errors`` equals the oracle's; no page leaks."""
    ref = reference_for("last_exited", "ouro_delayed")
    for _, rid, prompt, params in arrivals:
        if rid not in errors:
            check_equal(outputs[rid], ref.generate(prompt, params, request_id=rid))
    assert_all_pages_free(engine)


@pytest.mark.parametrize("standby", [True, False])
@pytest.mark.parametrize("call", ["launch", "read"])
@pytest.mark.parametrize("fail_at", [2, 7])
def test_failed_window_errors_its_requests_once(standby, call, fail_at, monkeypatch):
    rows = dict(decode_window_rows=8) if standby else {}
    engine = make_engine(exit_mode="ouro_delayed", page_size=4, max_num_seqs=12 if standby else 4, num_pages=512,
                         decode_window=3, window_trip="fixed", **rows)
    calls = [0]

    def flaky(real):
        def call_or_fail(*args, **kwargs):
            calls[0] += 1
            if calls[0] == fail_at:
                raise RuntimeError("injected window failure")
            return real(*args, **kwargs)
        return call_or_fail
    if call == "launch":
        monkeypatch.setattr(engine.runner, "window", flaky(engine.runner.window))
    else:
        wrap_reads(engine, WindowStep, lambda read, step: flaky(read))
    arrivals = workload()
    outputs, _, returned = drive(engine, arrivals)
    assert_no_output_after_finish(returned)
    errors = [rid for rid, out in outputs.items() if out.finish_reason == "error"]
    assert calls[0] >= fail_at and errors
    assert all(outputs[rid].error == "RuntimeError: injected window failure" for rid in errors)
    assert_others_match_oracle(engine, arrivals, outputs, errors)


def test_a_standby_entry_taken_twice_errors_instead_of_duplicating(monkeypatch):
    """A window read whose outputs put one request in two rows (its standby entry taken twice,
    as XLA's rematerialization pass made an H200 engine do; the engine turns that pass off) must not
    replay the request twice (two finishes, twice the tokens): its window's requests error once
    each, the rest of the workload runs on, no page leaks."""
    engine = make_engine(exit_mode="ouro_delayed", page_size=4, max_num_seqs=16, num_pages=512,
                         decode_window=3, window_trip="fixed")
    corrupted = []

    def with_a_twice_taken_entry(read, step):
        def read_and_corrupt():
            after, out = (jax.tree.map(np.array, t) for t in read())
            n = len(step.rows)
            took = np.nonzero(out.swap_col[:n] >= 0)[0]
            idle = np.nonzero((out.swap_col[:n] < 0) & (out.count[:n] == 0))[0]
            if not corrupted and len(took) and len(idle):   # an idle row takes the same entry
                i, j = int(took[0]), int(idle[0])
                out.swap_col[j], out.swap_tag[j], after.active[j] = 0, out.swap_tag[i], True
                corrupted.append(int(out.swap_tag[i]))
            return WindowResult(after, out)
        return read_and_corrupt
    wrap_reads(engine, WindowStep, with_a_twice_taken_entry)
    arrivals = workload(20)
    outputs, _, returned = drive(engine, arrivals)
    assert corrupted, "no read had both a swap and an idle row: the workload no longer exercises this"
    assert_no_output_after_finish(returned)
    errors = [rid for rid, out in outputs.items() if out.finish_reason == "error"]
    assert errors and all("standby entry was taken twice" in outputs[rid].error for rid in errors)
    assert len(outputs) == len(arrivals)
    assert_others_match_oracle(engine, arrivals, outputs, errors)


@pytest.mark.parametrize("standby", [True, False])
@pytest.mark.parametrize("fail_at", [1, 2])
def test_a_failed_drain_errors_its_window_and_streams_every_finish(standby, fail_at, monkeypatch):
    """A window whose read fails while the host drains it (before another kind of step; an
    H200 failure came this way) errors its requests instead of
    raising out of ``step``, and every request's finish is among the outputs ``step`` returned
    (a server streams only those), once."""
    rows = dict(decode_window_rows=8) if standby else {}
    engine = make_engine(exit_mode="ouro_delayed", page_size=4, max_num_seqs=12 if standby else 4, num_pages=512,
                         decode_window=3, window_trip="fixed", **rows)
    drains = [0]
    schedule = engine.scheduler.schedule

    def counting_drains():      # a drain: the host reads the window in flight before anything else
        plan = schedule()
        drains[0] += "window_drain" in plan.counts
        return plan

    def failing_when_drained(read, step):
        def read_or_fail():
            if drains[0] == fail_at and not failing_when_drained.done:
                failing_when_drained.done = True
                raise RuntimeError("injected read failure")
            return read()
        return read_or_fail
    failing_when_drained.done = False
    monkeypatch.setattr(engine.scheduler, "schedule", counting_drains)
    wrap_reads(engine, WindowStep, failing_when_drained)
    arrivals = workload()
    outputs, _, returned = drive(engine, arrivals)
    assert drains[0] >= fail_at, "the workload drained fewer windows: it no longer exercises this"
    assert_no_output_after_finish(returned)
    streamed = {out.request_id for outs in returned for out in outs if out.finished}
    assert streamed == {rid for _, rid, _, _ in arrivals}
    errors = [rid for rid, out in outputs.items() if out.finish_reason == "error"]
    assert errors and all(outputs[rid].error == "RuntimeError: injected read failure" for rid in errors)
    assert_others_match_oracle(engine, arrivals, outputs, errors)

"""Admissions while a decode window runs: the new requests' prefill (or, with mixed prefill,
their prompts), first heads and the next window, continued from the device, are queued before
the host reads the window in flight. Outputs equal the dense oracle's in closed loops; rows
the host finished are idled or replaced, never run into another request's pages or slot;
failures at every point of the path error the right requests and leak nothing."""
from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import (DeviceCalls, assert_all_pages_free, check_equal, closed_loop, make_engine, wrap_reads,
                            reference_for, run_workload)
from engine_trace_helpers import TOKENS
from rltjax.engine.plan import HeadStep, WindowStep
from rltjax.engine.window.state import STOP_ID_WIDTH
from rltjax.sampling_params import SamplingParams


def check_failed_and_rest(engine, requests, outs, failed_ids, error: str) -> None:
    """The failed requests finished with the error, every other one equals the oracle, no page
    leaks, and the engine still serves a new request exactly."""
    ref = reference_for("last_exited")
    for rid, prompt, params in requests:
        if rid in failed_ids:
            assert outs[rid].finish_reason == "error" and outs[rid].error == error
        else:
            check_equal(outs[rid], ref.generate(prompt, params, request_id=rid))
    assert_all_pages_free(engine)
    later = [(0, "z", TOKENS[7:13], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))]
    check_equal(run_workload(engine, later)["z"], ref.generate(TOKENS[7:13], later[0][3], request_id="z"))
    assert_all_pages_free(engine)


def test_admission_prefill_is_queued_behind_the_window_in_flight():
    """A request arriving while a window runs (a slot free) has its prefill launched before
    the host reads that window, so the GPU runs it while the host replays the window; every
    output still equals the oracle's, and no page leaks."""
    engine = make_engine(decode_window=4, max_num_seqs=2)
    calls = DeviceCalls(engine)
    first = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    late = SamplingParams(max_tokens=5, temperature=0.9, seed=4, ignore_eos=True)
    engine.add_request("a", TOKENS[:7], first)
    while not engine.windows_in_flight:
        engine.step()
    engine.add_request("b", TOKENS[2:9], late)     # arrives mid-window; slot 2 of 2 is free
    calls.events.clear()
    engine.step()
    order = calls.kinds()
    assert [c for c in order if c in "Pw"][:2] == ["P", "w"], order    # the prefill launched, then the window read
    while engine.has_unfinished_requests():
        engine.step()
    ref = reference_for("last_exited")
    check_equal(engine.get_output("a"), ref.generate(TOKENS[:7], first, request_id="a"))
    check_equal(engine.get_output("b"), ref.generate(TOKENS[2:9], late, request_id="b"))
    assert_all_pages_free(engine)


@pytest.mark.parametrize("exit_mode", ["ouro_delayed", "trace"])
def test_closed_loop_admissions_continue_the_window_from_the_device(exit_mode):
    """In a closed loop a request finishing inside a window frees its row while the next
    window already runs. The next request's prefill, first head and the window after are
    queued behind that window before the host reads it (the window continued from the device,
    the new request in the finished one's row): no host read stands between windows, for every
    request after the first three (back-to-back admissions too: the continued window counts as
    the decode step between prefill batches). Outputs
    equal the oracle's (trace replay: the recorded depths), and no page leaks."""
    rng = np.random.default_rng(0)
    requests = [(f"q{i}", TOKENS[int(s):int(s) + int(n)],
                 SamplingParams(max_tokens=int(m), temperature=float(t), seed=i, exit_threshold=0.6, ignore_eos=True,
                                logprobs=2 if i % 3 == 0 else None))
                for i, (s, n, m, t) in enumerate(zip(rng.integers(0, 60, 12), rng.integers(2, 12, 12),
                                                     rng.integers(6, 20, 12), rng.choice([0.0, 0.9], 12)))]
    depths = {rid: [4] + [int(d) for d in rng.integers(1, 5, 24)] for rid, _, _ in requests} if exit_mode == "trace" else None
    engine = make_engine(exit_mode=exit_mode, decode_window=3, max_num_seqs=3, depths_by_request=depths,
                         prefill_chunk_size=16, max_num_batched_tokens=48, num_pages=128)   # one prefill an admission
    calls = DeviceCalls(engine)
    admitted_into = []
    real_admit = engine.scheduler.windows.admitting
    engine.scheduler.windows.admitting = lambda fresh, *rest: admitted_into.append(len(fresh)) or real_admit(fresh,
                                                                                                          *rest)
    outs = closed_loop(engine, requests, clients=3)
    order = calls.kinds()
    assert sum(admitted_into) == len(requests) - 3, (admitted_into, order)     # every later request
    assert order.count("PHWwh") == len(admitted_into), order    # prefill, head, window queued; then the reads
    ref = reference_for("last_exited", exit_mode, depths_by_request=depths)
    for rid, prompt, params in requests:
        check_equal(outs[rid], ref.generate(prompt, params, request_id=rid))
    assert_all_pages_free(engine)


def test_rows_stopped_by_the_host_do_not_run_into_the_next_request():
    """Two requests stopped at once by a stop id only the host checks keep running on the
    device until the host replaces their rows. One request is admitted (into the row of one,
    the slot and pages of the other): the window continued from the device must idle the
    other row, or it writes into the new request's slot. Outputs equal the step-by-step
    engine's in the same closed loop, and no page leaks."""
    prompt = TOKENS[12:18]
    probe = run_workload(make_engine(), [(0, "g", prompt, SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True))])["g"].token_ids
    stop_at = next(i for i in range(1, len(probe)) if probe[i] not in probe[:i])   # 2nd distinct token
    assert stop_at >= 3, probe        # the stop must come after the window has all three rows
    filler = [t for t in range(100, 100 + 2 * STOP_ID_WIDTH) if t not in probe][:STOP_ID_WIDTH]
    stopped = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                             stop_token_ids=filler + [probe[stop_at]])
    requests = [("s0", prompt, stopped), ("s1", prompt, stopped),
                ("long", TOKENS[20:27], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)),
                ("next", TOKENS[40:47], SamplingParams(max_tokens=8, temperature=0.9, seed=5, ignore_eos=True))]
    engine = make_engine(decode_window=2, max_num_seqs=3, prefill_chunk_size=16, num_pages=128)
    admitted = []
    real_admit = engine.scheduler.windows.admitting
    engine.scheduler.windows.admitting = lambda fresh, *rest: (admitted.append([r.request_id for r in fresh])
                                                               or real_admit(fresh, *rest))
    outs = closed_loop(engine, requests, clients=3)
    assert ["next"] in admitted, admitted
    want = closed_loop(make_engine(max_num_seqs=3, prefill_chunk_size=16, num_pages=128), requests, clients=3)
    for rid, _, _ in requests:
        check_equal(outs[rid], want[rid])
    assert [outs[r].finish_reason for r in ("s0", "s1", "long", "next")] == ["stop", "stop", "length", "length"]
    assert_all_pages_free(engine)


@pytest.mark.parametrize("how", ["host_stop", "abort"])
def test_rows_the_host_finished_are_idled_in_continued_windows(how):
    """A request the host finishes while the device still runs its row (a stop id only the
    host checks, an abort) is idled in the next continued window, not run on to its
    max_tokens in every window after: at most two window reads after the finish still show
    its row running (the window launched before the finish, and the one in flight). The other
    request's outputs equal the step-by-step engine's, and no page leaks."""
    prompt = TOKENS[12:18]
    probe = run_workload(make_engine(), [(0, "g", prompt, SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True))])["g"].token_ids
    stop_at = next(i for i in range(1, len(probe)) if probe[i] not in probe[:i])   # 2nd distinct token
    filler = [t for t in range(100, 100 + 2 * STOP_ID_WIDTH) if t not in probe][:STOP_ID_WIDTH]
    stop_ids = filler + [probe[stop_at]] if how == "host_stop" else None
    requests = [("s0", prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                              stop_token_ids=stop_ids)),
                ("long", TOKENS[20:27], SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True))]
    engine = make_engine(decode_window=2, max_num_seqs=2, prefill_chunk_size=16, num_pages=128)
    reads = []

    def reading(read, step):
        def read_and_look():
            result = read()
            reads.append((engine.requests["s0"].finished, bool(result.after.active[0])))    # s0 is row 0
            return result
        return read_and_look

    wrap_reads(engine, WindowStep, reading)
    for _, rid, prompt_ids, params in [(0, *r) for r in requests]:
        engine.add_request(rid, prompt_ids, params)
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        if how == "abort" and len(engine.get_output("s0").token_ids) >= 3:
            engine.abort_request("s0")
    s0 = engine.get_output("s0")
    assert s0.finished and s0.finish_reason == ("stop" if how == "host_stop" else "abort")
    assert len(s0.token_ids) < 20
    ran_on = [i for i, (finished, active) in enumerate(reads) if finished and active]
    assert 0 < len(ran_on) <= 2 and len(reads) > ran_on[-1] + 10, reads
    want = run_workload(make_engine(max_num_seqs=2, prefill_chunk_size=16, num_pages=128), [(0, *requests[1])])
    check_equal(engine.get_output("long"), want["long"])
    assert_all_pages_free(engine)


@pytest.mark.parametrize("fail", ["head", "standby_put"])
def test_failure_admitting_behind_the_window_errors_only_the_new_requests(fail):
    """A failing head or window launch while requests are admitted into a continued window
    finishes those requests with the error; the requests of the window in flight go on to the
    oracle's outputs, the engine keeps serving, and no page leaks."""
    engine = make_engine(decode_window=3, max_num_seqs=3, prefill_chunk_size=16, num_pages=128)
    real, failed = getattr(engine.runner, fail), []

    def flaky(*args, **kwargs):
        if engine.windows_in_flight and not failed and engine.scheduler.waiting == [] and any(
                r.status.name == "AWAITING_HEAD" for r in engine.scheduler.running):
            failed.append([r.request_id for r in engine.scheduler.running if r.status.name == "AWAITING_HEAD"])
            raise RuntimeError("injected device failure")
        return real(*args, **kwargs)

    setattr(engine.runner, fail, flaky)
    requests = [(f"k{i}", TOKENS[5 * i:5 * i + 6], SamplingParams(max_tokens=6 + 3 * i, temperature=0.0,
                                                                  ignore_eos=True)) for i in range(6)]
    outs = closed_loop(engine, requests, clients=3)
    assert failed, "no admission behind a window was attempted"
    check_failed_and_rest(engine, requests, outs, failed[0], "RuntimeError: injected device failure")


@pytest.mark.parametrize("fail", [WindowStep, HeadStep])
@pytest.mark.parametrize("at_admission", [1, 2, 3])
def test_failed_read_after_admitting_errors_every_running_request(fail, at_admission):
    """Once the continued window is queued, a failing read of the window before it (or of the
    new requests' first heads) leaves the device running on from state the host never took:
    every running request finishes with the error (none with tokens the oracle would not
    give), requests that finished before keep their outputs, the engine keeps serving, and no
    page leaks."""
    engine = make_engine(decode_window=3, max_num_seqs=3, prefill_chunk_size=16, num_pages=128)
    armed, failed = [], []
    real_admit = engine.scheduler.windows.admitting
    engine.scheduler.windows.admitting = lambda fresh, *rest: armed.append(1) or real_admit(fresh, *rest)

    def flaky(read, step):
        def read_or_fail():
            if len(armed) == at_admission and not failed:
                failed.append([r.request_id for r in engine.scheduler.running])
                raise RuntimeError("injected read failure")
            return read()
        return read_or_fail

    wrap_reads(engine, fail, flaky)
    requests = [(f"k{i}", TOKENS[5 * i:5 * i + 6], SamplingParams(max_tokens=[6, 9, 7, 8][i % 4], temperature=0.0,
                                                                  ignore_eos=True)) for i in range(10)]
    outs = closed_loop(engine, requests, clients=3)
    assert failed, "no failure injected"
    check_failed_and_rest(engine, requests, outs, failed[0], "RuntimeError: injected read failure")


def test_windows_continue_while_an_admission_waits_for_pages():
    """A request waits for KV pages (a slot is free, the pages are not): each window tries the
    admission and, admitting nothing, continues from the device instead of making the host read
    it first. Far fewer windows are drained than launched; outputs equal the oracle's, and
    nothing leaks."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    arrivals = [(0, f"p{i}", TOKENS[i:i + 5], params) for i in range(6)]
    engine = make_engine(exit_mode="ouro_delayed", decode_window=3, window_trip="fixed", max_num_seqs=6,
                         num_pages=130)       # 29 positions x 4 planes = 32 pages a request: 4 fit
    outs = run_workload(engine, arrivals)
    ref = reference_for("last_exited", "ouro_delayed")
    for _, rid, prompt, p in arrivals:
        check_equal(outs[rid], ref.generate(prompt, p, request_id=rid))
    assert_all_pages_free(engine)
    kinds = engine.steps_by_kind
    assert kinds["window"] > 4 * kinds.get("window_drain", 0), kinds

"""Prefill/decode disaggregation on this machine's CPUs: worker processes, KV pulled through
``jax.experimental.transfer``. The oracle is one colocated engine with the same settings:
tokens, exit depths and float32 logprobs must equal it; after every workload each live
worker's pages are all free; a worker killed with SIGKILL costs retries or errors, never a hang."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from conftest import FIXTURES
from engine_helpers import make_engine, run_workload
from rltjax.disagg.coordinator import DisaggEngine
from rltjax.engine.sequence import RequestRejectedError
from rltjax.engine_config import CacheConfig, ExecutionConfig, ExitConfig, SchedulerConfig
from rltjax.sampling_params import SamplingParams

ENGINE = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk_size=8, decode_window=8)


def configs(overrides=None):
    return dict(dtype="float32", hf_overrides=overrides,
                cache_config=CacheConfig(page_size=4, num_pages=256),
                scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk_size=8),
                exit_config=ExitConfig(),
                execution_config=ExecutionConfig(compile_ahead=False, show_progress=False, decode_window=8))


def workload(n=6, seed=0):
    """Random arrivals; prompts up to 40 tokens (5 prefill chunks); greedy and seeded sampling."""
    rng = np.random.default_rng(seed)
    return [(int(rng.integers(0, 6)), f"r{i}", rng.integers(3, 500, int(rng.integers(3, 40))).tolist(),
             SamplingParams(max_tokens=int(rng.integers(2, 10)), temperature=0.0 if i % 2 else 0.9, seed=i,
                            exit_threshold=0.6, ignore_eos=True, logprobs=1)) for i in range(n)]


def check_same(got, want, skip=()):
    for rid, w in want.items():
        if rid in skip:
            continue
        g = got[rid]
        assert (g.token_ids, g.exit_depths, g.finish_reason) == (w.token_ids, w.exit_depths, w.finish_reason), rid
        np.testing.assert_allclose([max(d.values()) for d in g.logprobs], [max(d.values()) for d in w.logprobs],
                                   atol=1e-5)


def all_free(engine, timeout=10.0):
    """Every live worker reports no request and no page held (its reports may lag a step)."""
    import time
    deadline, stats = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        engine.step()
        stats = engine.worker_stats()
        if stats and all(s.kv_pages_used == 0 and s.num_running == 0 and s.num_waiting == 0 for s in stats):
            return
        time.sleep(0.05)
    raise AssertionError([(s.kv_pages_used, s.num_running, s.num_waiting) for s in stats])


@pytest.mark.parametrize("name,overrides,p,d,stream", [("ouro-tiny", None, 1, 1, True),
                                                       ("ouro-tiny-gqa", None, 1, 2, True),
                                                       ("nanbeige-tiny", None, 2, 1, True),
                                                       ("huginn-tiny", {"state_init": "zero"}, 1, 2, True),
                                                       ("ouro-tiny", None, 1, 1, False)])
def test_disaggregated_equals_colocated(name, overrides, p, d, stream):
    """stream False: every page moves once the first token is out (stream_pages=False)."""
    want = run_workload(make_engine(name=name, hf_overrides=overrides, **ENGINE), workload())
    engine = DisaggEngine(str(FIXTURES / name), configs(overrides), num_prefill=p, num_decode=d, stream_pages=stream)
    try:
        aborted = {3: "r4"}                   # mid-prefill or mid-transfer, whichever it is at step 3
        got = run_workload(engine, workload(), aborts=aborted)
        check_same(got, want, skip={"r4"})
        assert got["r4"].finish_reason in ("abort", "length")
        if stream:
            assert 0 < engine.streamed_bytes < engine.transfer_bytes     # prompt pages moved while prompts ran
        else:
            assert engine.streamed_bytes == 0 < engine.transfer_bytes
        all_free(engine)
    finally:
        engine.close()


def test_a_prefill_worker_killed_mid_transfer_makes_its_requests_retry():
    want = run_workload(make_engine(**ENGINE), workload(4, seed=1))
    engine = DisaggEngine(str(FIXTURES / "ouro-tiny"), configs(), num_prefill=2, num_decode=1)
    try:
        hand_over, killed = engine._hand_over, []

        def kill_first(rid, t, ready):      # its pages wait on the worker's transfer server: kill it now
            if not killed:
                killed.append(t.prefill.index)
                os.kill(t.prefill.proc.pid, signal.SIGKILL)
                t.prefill.proc.wait(30)
            return hand_over(rid, t, ready)
        engine._hand_over = kill_first
        got = run_workload(engine, workload(4, seed=1))
        check_same(got, want)
        assert killed and engine.retries >= 1
        all_free(engine)
    finally:
        engine.close()


def test_a_decode_worker_killed_mid_decode_fails_its_requests_only():
    engine = DisaggEngine(str(FIXTURES / "ouro-tiny"), configs(), num_prefill=1, num_decode=2)
    try:
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        for i in range(4):
            engine.add_request(f"r{i}", [5 + i, 9, 17], long)
        while not all(t.imported for t in engine.requests.values()):
            engine.step()
        victim = engine.requests["r0"].decode
        os.kill(victim.proc.pid, signal.SIGKILL)
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs[out.request_id] = out
        for rid, t in engine.requests.items():
            assert outs[rid].finish_reason == ("error" if t.decode is victim else "length"), rid
        assert any(outs[rid].finish_reason == "length" for rid in outs)
        after = run_workload(engine, [(0, "late", [4, 5, 6], SamplingParams(max_tokens=3, temperature=0.0))])
        assert after["late"].finish_reason == "length"       # the server side goes on with the live worker
        all_free(engine)
    finally:
        engine.close()


def test_a_decode_workers_cached_prefix_is_not_sent_again():
    """Prefix caching on both sides: a decode worker offers the prompt pages it imported to its
    own prefix cache; a later prompt with the same prefix gets those pages held at once, the
    prefill worker sends only the rest, and outputs still equal one engine's."""
    import dataclasses
    system = list(range(3, 35))                  # 32 tokens: 8 full pages
    arrivals = [(i, f"r{i}", system + [40 + i, 50 + i, 60 + i],
                 SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)) for i in range(3)]
    want = run_workload(make_engine(**ENGINE, enable_prefix_caching=True), arrivals)
    cached = configs()
    cached["cache_config"] = dataclasses.replace(cached["cache_config"], enable_prefix_caching=True)
    engine = DisaggEngine(str(FIXTURES / "ouro-tiny"), cached, num_prefill=1, num_decode=1)
    try:
        got, moved = {}, []
        for step, rid, prompt, sp in arrivals:          # one after another: the first fills the cache
            before = engine.transfer_bytes
            got.update(run_workload(engine, [(0, rid, prompt, sp)]))
            moved.append(engine.transfer_bytes - before)
        check_same(got, want)
        assert engine.cached_pages == 2 * 8             # the later two found the 8 prefix pages
        assert moved[1] < moved[0] / 2 and moved[2] < moved[0] / 2, moved
        all_free(engine)
    finally:
        engine.close()


def test_decode_workers_speculate():
    """With a SpeculativeConfig the decode workers run speculative rounds (the prefill workers
    make one token a request and run without it): outputs equal one speculating engine's."""
    from rltjax.engine_config import SpeculativeConfig
    spec = SpeculativeConfig(3, 2)
    want = run_workload(make_engine(**ENGINE, exit_mode="fixed", speculative=spec), workload(4, seed=3))
    engine = DisaggEngine(str(FIXTURES / "ouro-tiny"), {**configs(), "exit_config": ExitConfig(mode="fixed"),
                                                       "speculative_config": spec}, num_prefill=1, num_decode=1)
    try:
        check_same(run_workload(engine, workload(4, seed=3)), want)
        assert engine.stats().spec_draft_tokens > 0
        # more drafts than the decode workers make: refused before its prompt runs anywhere
        with pytest.raises(RequestRejectedError, match="num_speculative_tokens"):
            engine.add_request("too-many", [5, 6, 7], SamplingParams(max_tokens=2, num_speculative_tokens=4))
        assert "too-many" not in engine.requests
        all_free(engine)
    finally:
        engine.close()


def test_workers_started_on_their_own_connect_to_the_coordinator(monkeypatch):
    """--disagg-remote-workers: the coordinator starts no worker; workers started by hand (as on
    other hosts: their number, the coordinator's address, the shared key, their transfer host)
    connect in any order, before the coordinator listens too, and serve as usual."""
    import secrets
    import subprocess
    import sys

    from server_helpers import free_port
    address, key = f"127.0.0.1:{free_port()}", secrets.token_hex(16)
    monkeypatch.setenv("RLTJAX_DISAGG_KEY", key)
    env = {**os.environ, "RLTJAX_TRANSFER_HOST": "127.0.0.1"}
    procs = [subprocess.Popen([sys.executable, "-m", "rltjax.disagg.worker", address, str(k)], env=env)
             for k in (1, 0)]
    want = run_workload(make_engine(**ENGINE), workload(3, seed=2))
    try:
        engine = DisaggEngine(str(FIXTURES / "ouro-tiny"), configs(), num_prefill=1, num_decode=1, address=address,
                              remote_workers=True)
        assert all(link.proc is None for link in engine.links)
        try:
            check_same(run_workload(engine, workload(3, seed=2)), want)
            all_free(engine)
        finally:
            engine.close()
        assert [p.wait(30) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()


def test_server_level_combinations_are_in_the_rules_table():
    from rltjax.engine.rules import ServerInputs, check_rules
    from rltjax.engine_config import EngineConfigError
    check_rules(ServerInputs(1, 2))
    for inputs, match in [(ServerInputs(1, 0), "both kinds"), (ServerInputs(1, 1, processes=2), "jax.distributed"),
                          (ServerInputs(1, 1, data_parallel=2), "data-parallel"),
                          (ServerInputs(processes=2, data_parallel=2), "separate job")]:
        with pytest.raises(EngineConfigError, match=match):
            check_rules(inputs)


def test_serve_with_prefill_and_decode_workers():
    """``rltjax serve --num-prefill-workers 1 --num-decode-workers 1``: answers equal the oracle,
    streamed too, and a SIGTERM stops the server and its workers."""
    import subprocess
    import time

    import httpx

    from server_helpers import free_port, greedy_reference, serve_process, sse_events, wait_healthy

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve_process(port, "--num-prefill-workers", "1", "--num-decode-workers", "1", stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, [proc])
        body = {"model": "m", "prompt": "The cook said", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        want = greedy_reference(body["prompt"], 6)
        assert httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"] == want
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            events = sse_events(list(r.iter_lines()))
        assert "".join(e["choices"][0]["text"] for e in events) == want
        from prometheus_client.parser import text_string_to_metric_families
        time.sleep(0.3)
        samples = {(x.name, x.labels.get("stage")): x.value for f in
                   text_string_to_metric_families(httpx.get(url + "/metrics").text) for x in f.samples}
        for stage in ("hold", "prefill", "transfer", "first_token"):
            assert samples[("rltjax:disagg_stage_seconds_count", stage)] == 2, stage
        assert samples[("rltjax:disagg_transfer_bytes_total", None)] > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    finally:
        proc.kill()


def test_llm_with_prefill_and_decode_workers():
    from rltjax import LLM
    want = run_workload(make_engine(**ENGINE), workload(3, seed=2))
    cfg = configs()
    llm = LLM(str(FIXTURES / "ouro-tiny"), dtype="float32", cache_config=cfg["cache_config"],
              scheduler_config=cfg["scheduler_config"], execution_config=cfg["execution_config"],
              num_prefill_workers=1, num_decode_workers=1)
    try:
        outs = llm.generate([p for _, _, p, _ in workload(3, seed=2)], [sp for _, _, _, sp in workload(3, seed=2)],
                            use_tqdm=False)
        for out, (_, rid, _, _) in zip(outs, workload(3, seed=2)):
            assert (out.token_ids, out.exit_depths) == (want[rid].token_ids, want[rid].exit_depths)
    finally:
        llm.close()

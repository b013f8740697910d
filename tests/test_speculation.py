"""Self-speculative decoding: greedy output equals plain decoding at the target depth (the
dense oracle's, token for token, with exit depths and float32 logprobs) over random workloads
on every plain fixture; rows that do not speculate sample exactly as plain decoding does; the
KV a round leaves equals plain decoding's on every plane; options that cannot combine are
refused by the rules table."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import reference_model, reference_npz
from engine_helpers import assert_all_pages_free, check_equal, check_outputs, make_engine, run_with_abort, run_workload
from rltjax.engine.sequence import RequestRejectedError
from rltjax.engine_config import EngineConfigError, SpeculativeConfig
from rltjax.sampling_params import SamplingParams

TOKENS = [int(t) for t in reference_npz("ouro-tiny")["p2_input_ids"]] * 3

request = st.tuples(
    st.integers(0, 6),                                   # arrival step
    st.integers(0, 50), st.integers(1, 12),              # prompt start, length
    st.integers(1, 14),                                  # max_tokens
    st.sampled_from([None, None, 0, 1]),                 # num_speculative_tokens (None: the engine's K)
    st.sampled_from([None, None, 3, 1]),                 # max_loops (None: the target depth)
    st.sampled_from([None, 2]),                          # logprobs
    st.sampled_from([(), (), (113,), (17, 340)]),        # stop_token_ids (ids the tiny model emits)
)


def _arrivals(requests, vocab_size, greedy=True):
    arrivals = []
    for i, (step, start, length, max_tokens, k, hi, lp, stops) in enumerate(requests):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if greedy else 0.8, seed=i, max_loops=hi,
                                logprobs=lp, ignore_eos=True, stop_token_ids=stops, num_speculative_tokens=k)
        arrivals.append((step, f"r{i}", [t % vocab_size for t in TOKENS[start:start + length]], params))
    return arrivals


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(k=st.sampled_from([1, 3]), d=st.sampled_from([1, 2]), rounds=st.sampled_from([1, 2]),
       trip=st.sampled_from(["fixed", "early_stop"]), max_num_seqs=st.sampled_from([2, 4]),
       requests=st.lists(request, min_size=1, max_size=5), abort_at=st.sampled_from([None, 3]))
def test_greedy_rounds_equal_plain_decoding(k, d, rounds, trip, max_num_seqs, requests, abort_at):
    """Ouro at D = 4 (R): random arrivals, aborts mid-round, max_tokens and stop ids inside a
    round, shallower requests and requests that opt out, all in the same windows."""
    engine = make_engine(exit_mode="fixed", max_num_seqs=max_num_seqs, decode_window=4, window_trip=trip,
                         speculative=SpeculativeConfig(k, d, rounds_per_window=rounds))
    arrivals = _arrivals(requests, 512)
    aborted = run_with_abort(engine, arrivals, abort_at,
                             lambda e: e.scheduler.running[-1].request_id if e.scheduler.running else None)
    check_outputs(engine, arrivals, reference_model("ouro-tiny", exit_mode="fixed"), aborted)


@pytest.mark.parametrize("name,k,d,target", [("ouro-tiny-gqa", 3, 2, None), ("nanbeige-tiny", 2, 1, 2),
                                             ("ouro-tiny", 4, 1, 3)])
def test_greedy_rounds_on_each_fixture(name, k, d, target):
    """GQA, Nanbeige (D = 2, d = 1) and a target below R (requests default to it)."""
    engine = make_engine(name=name, exit_mode="fixed", max_num_seqs=3, decode_window=4,
                         speculative=SpeculativeConfig(k, d, target_loops=target))
    vocab = engine.cfg.vocab_size
    arrivals = [(i, f"r{i}", [t % vocab for t in TOKENS[5 * i:5 * i + 6 + i]],
                 SamplingParams(max_tokens=12 + i, temperature=0.0, ignore_eos=True, logprobs=1,
                                max_loops=target))
                for i in range(4)]
    outs = run_workload(engine, arrivals)
    ref = reference_model(name, exit_mode="fixed")
    for _, rid, prompt, params in arrivals:
        check_equal(outs[rid], ref.generate(prompt, params, request_id=rid))
        assert outs[rid].exit_depths[1:] == [target or engine.cfg.num_loops] * (len(outs[rid].token_ids) - 1)
    stats = engine.stats()
    assert stats.spec_draft_tokens > 0 and 0 <= stats.spec_accepted_tokens <= stats.spec_draft_tokens
    assert len(stats.spec_accepted_by_position) == k
    assert_all_pages_free(engine)


def test_sampled_rows_that_do_not_speculate_sample_as_plain_decoding():
    """Sampled requests beside speculating ones: one with num_speculative_tokens=0 draws its
    tokens with plain decoding's keys (the oracle's), and speculating ones keep to one stream
    per (seed, output index): alone or in a batch they sample the same tokens."""
    spec = SpeculativeConfig(3, 2)
    plain = SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=7, ignore_eos=True, logprobs=1,
                           num_speculative_tokens=0)
    drafting = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    prompts = [TOKENS[:7], TOKENS[9:20], TOKENS[30:36]]
    engine = make_engine(exit_mode="fixed", max_num_seqs=4, decode_window=4, speculative=spec)
    outs = run_workload(engine, [(0, "plain", prompts[0], plain), (0, "a", prompts[1], drafting),
                                 (1, "b", prompts[2], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))])
    check_equal(outs["plain"], reference_model("ouro-tiny", exit_mode="fixed").generate(prompts[0], plain,
                                                                                        request_id="plain"))
    alone = make_engine(exit_mode="fixed", max_num_seqs=4, decode_window=4, speculative=spec)
    assert run_workload(alone, [(0, "a", prompts[1], drafting)])["a"].token_ids == outs["a"].token_ids
    assert len(outs["a"].token_ids) == 12


def test_kv_planes_after_rounds_equal_plain_decoding():
    """Every plane of every position a request committed holds what plain decoding writes
    there (float32, compared in the pool itself; the pages are read while the request runs)."""
    prompt, sp = TOKENS[:9], SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    pools = []
    for spec in (None, SpeculativeConfig(3, 2)):
        engine = make_engine(exit_mode="fixed", max_num_seqs=2, decode_window=4, speculative=spec)
        pages = {}

        def keep_pages(e):
            for r in e.scheduler.running:
                pages[r.request_id] = [e.scheduler.blocks.block_tables.array[t].copy() for t in r.tables]
        out = run_workload(engine, [(0, "x", prompt, sp)], after_step=keep_pages)["x"]
        kv = engine.runner.kv
        committed = len(prompt) + len(out.token_ids) - 1      # the last token is never looped
        planes = []
        for table in pages["x"]:
            at = [(table[p // 4], p % 4) for p in range(committed)]
            planes.append(np.stack([np.asarray(kv.k[:, :, pg, off]) for pg, off in at] +
                                   [np.asarray(kv.v[:, :, pg, off]) for pg, off in at]))
        pools.append((out.token_ids, planes))
    (plain_ids, plain_planes), (spec_ids, spec_planes) = pools
    assert plain_ids == spec_ids
    assert len(plain_planes) == len(spec_planes) == 4
    for a, b in zip(plain_planes, spec_planes):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)


def test_stop_string_inside_a_round_cuts_the_round():
    """A host-only stop (a stop string) landing inside a round drops the round's later tokens:
    the output equals plain decoding's, cut at the same place."""
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = make_engine(exit_mode="fixed", max_num_seqs=2, decode_window=4, tokenizer=True)
    full = run_workload(plain, [(0, "x", TOKENS[:8], sp)])["x"]
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    assert stop.strip()
    cut = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop])
    outs = []
    for spec in (None, SpeculativeConfig(4, 1, rounds_per_window=2)):
        engine = make_engine(exit_mode="fixed", max_num_seqs=2, decode_window=4, tokenizer=True, speculative=spec)
        outs.append(run_workload(engine, [(0, "x", TOKENS[:8], cut)])["x"])
        assert_all_pages_free(engine)
    assert outs[1].token_ids == outs[0].token_ids and outs[1].text == outs[0].text
    assert outs[1].finish_reason == "stop" and len(outs[1].token_ids) < len(full.token_ids)


@pytest.mark.parametrize("kwargs,match", [
    (dict(exit_mode="ouro"), "fixed depth"),
    (dict(kv_layout="shared"), "last_exited"),
    (dict(decode_window=0), "inside decode windows"),
    (dict(mixed_prefill_tokens=32, decode_window=6, window_trip="fixed"), "speculative rounds replace"),
    (dict(name="huginn-tiny"), "boundary KV"),
])
def test_rules_refuse_what_cannot_combine(kwargs, match):
    kwargs = {"exit_mode": "fixed", "decode_window": 4, **kwargs}
    with pytest.raises(EngineConfigError, match=match):
        make_engine(speculative=SpeculativeConfig(2, 2), **kwargs)


def test_config_and_request_errors_name_the_field():
    with pytest.raises(EngineConfigError, match="draft_loops"):
        SpeculativeConfig(2, draft_loops=4, target_loops=4)
    with pytest.raises(EngineConfigError, match="target_loops=5"):
        make_engine(exit_mode="fixed", decode_window=4, speculative=SpeculativeConfig(2, 2, target_loops=5))
    engine = make_engine(exit_mode="fixed", decode_window=4, speculative=SpeculativeConfig(2, 2, target_loops=3))
    with pytest.raises(RequestRejectedError, match="num_speculative_tokens=3"):
        engine.add_request("a", TOKENS[:4], SamplingParams(num_speculative_tokens=3))
    with pytest.raises(RequestRejectedError, match="max_loops=4"):
        engine.add_request("b", TOKENS[:4], SamplingParams(max_loops=4))
    plain = make_engine(exit_mode="fixed", decode_window=4)
    with pytest.raises(RequestRejectedError, match="does not speculate"):
        plain.add_request("c", TOKENS[:4], SamplingParams(num_speculative_tokens=1))
    assert not engine.has_unfinished_requests() and not plain.has_unfinished_requests()


def test_server_streams_speculative_rounds_with_exact_usage():
    """Through the OpenAI server: the streamed text is plain greedy decoding's, usage counts
    every token, a request may opt out, and /metrics counts drafts and kept drafts."""
    import httpx
    from server_helpers import ENGINE, MODEL, LiveServer, greedy_reference

    def factory():
        return make_engine(**ENGINE, exit_mode="fixed", decode_window=4, speculative=SpeculativeConfig(3, 2))
    with LiveServer(factory=factory) as srv:
        client = srv.client()
        for extra in ({}, {"num_speculative_tokens": 0}):
            chunks = list(client.completions.create(
                model=MODEL, prompt="Hello there", max_tokens=20, temperature=0.0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True, **extra}))
            assert "".join(c.choices[0].text for c in chunks if c.choices) == greedy_reference("Hello there", 20)
            assert chunks[-1].usage.completion_tokens == 20
        metrics = {line.split()[0]: float(line.split()[1]) for line in httpx.get(srv.url + "/metrics").text.splitlines()
                   if line.startswith("rltjax:spec_decode")}
        drafted = metrics["rltjax:spec_decode_num_draft_tokens_total"]
        kept = metrics["rltjax:spec_decode_num_accepted_tokens_total"]
        assert drafted > 0 and 0 <= kept <= drafted
        assert sum(v for k, v in metrics.items() if "per_pos_total{" in k) == kept
        srv.wait_idle()

"""The batched engine equals the dense reference oracle, request by request."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import reference_npz
from engine_helpers import (assert_all_pages_free, check_equal, check_trace_replay, make_engine, reference_for,
                            run_workload)
from rltjax.sampling_params import SamplingParams

TOKENS = [int(t) for t in reference_npz("ouro-tiny")["p2_input_ids"]] * 3   # 120 prompt ids




request = st.tuples(
    st.integers(0, 6),                                   # arrival step
    st.integers(0, 60), st.integers(1, 22),              # prompt start, length (crosses pages)
    st.integers(1, 7),                                   # max_tokens
    st.sampled_from([0.0, 0.8, 1.0]),                    # temperature
    st.sampled_from([0, 5]), st.sampled_from([1.0, 0.8]),  # top_k, top_p
    st.integers(0, 2**40),                               # seed
    st.sampled_from([0.3, 0.6, 0.9, 1.0]),               # exit threshold
    st.integers(1, 2), st.integers(3, 4),                # min_loops, max_loops
    st.sampled_from([None, 2]),                          # logprobs
)


@settings(max_examples=9, deadline=None, suppress_health_check=list(HealthCheck))
@given(kv_layout=st.sampled_from(["last_exited", "shared"]), mode=st.sampled_from(["refill", "no_refill"]),
       exit_mode=st.sampled_from(["ouro", "ouro_delayed", "random_lookahead"]),
       page_size=st.sampled_from([4, 8]), chunk=st.sampled_from([3, 8]), max_num_seqs=st.sampled_from([2, 4]),
       requests=st.lists(request, min_size=1, max_size=4))
def test_engine_matches_reference(kv_layout, mode, exit_mode, page_size, chunk, max_num_seqs, requests):
    engine = make_engine(kv_layout=kv_layout, mode=mode, exit_mode=exit_mode, page_size=page_size,
                         prefill_chunk_size=chunk, max_num_seqs=max_num_seqs, lookahead_seed=3)
    arrivals = []
    for i, (step, start, length, max_tokens, temp, top_k, top_p, seed, q, lo, hi, lp) in enumerate(requests):
        params = SamplingParams(max_tokens=max_tokens, temperature=temp, top_k=top_k, top_p=top_p, seed=seed,
                                exit_threshold=q, min_loops=lo, max_loops=hi, logprobs=lp, ignore_eos=True)
        arrivals.append((step, f"r{i}", TOKENS[start:start + length], params))
    outputs = run_workload(engine, arrivals)
    ref = reference_for(kv_layout, exit_mode, lookahead_seed=3)
    for _, rid, prompt, params in arrivals:
        check_equal(outputs[rid], ref.generate(prompt, params, request_id=rid))
    assert_all_pages_free(engine)


@pytest.mark.parametrize("kv_layout", ["last_exited", "shared"])
def test_trace_replay_matches_reference(kv_layout):
    """Early exits followed by deeper queries: with logprobs, a token read at the wrong plane
    (the last_exited rule: min(d, e)) shows even where the sampled tokens do not change."""
    depths = {"a": [4, 1, 3, 2, 4, 1, 2], "b": [4, 2, 2, 3, 1, 4, 4]}
    arrivals = [(0, "a", TOKENS[:7], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, logprobs=2)),
                (2, "b", TOKENS[3:12], SamplingParams(max_tokens=7, temperature=1.0, seed=9, ignore_eos=True,
                                                      logprobs=2))]
    check_trace_replay(kv_layout, depths, arrivals)


def test_eos_and_stop_tokens_finish_like_the_reference():
    ref = reference_for("last_exited")
    greedy = ref.generate(TOKENS[:6], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    stop = greedy.token_ids[3]
    engine = make_engine()
    params = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop])
    out = run_workload(engine, [(0, "x", TOKENS[:6], params)])["x"]
    check_equal(out, ref.generate(TOKENS[:6], params))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert_all_pages_free(engine)

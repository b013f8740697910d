"""Prompt logprobs (``SamplingParams.prompt_logprobs``) against the dense reference.

The oracle is ``sequence_forward``: every prompt position at the model's full depth R with
a dense KV cache, its head's log-softmax read at the next prompt token. The engine computes
them in its (chunked, paged) prefill; prefix caching, preemption and decode windows must not
change them.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import reference_model
from engine_helpers import assert_all_pages_free, make_engine, run_workload
from rltjax.reference.stages import sequence_forward
from rltjax.sampling_params import SamplingParams, SamplingParamsError

PROMPT = [5, 9, 17, 3, 3, 41, 8, 22, 60, 7, 12, 31, 2, 19, 44, 5, 6, 70, 13, 9, 1]
FIXTURES = [("ouro-tiny", ()), ("ouro-tiny-gqa", ()), ("nanbeige-tiny", ()), ("huginn-tiny", (("state_init", "zero"),))]


def oracle(name, overrides, prompt, seed=0):
    rm = reference_model(name, overrides=overrides)
    logits = sequence_forward(rm.model, rm.params, prompt, rm.cfg.num_loops, seed=seed)["logits"]
    logp = logits - np.logaddexp.reduce(logits.astype(np.float64), axis=-1, keepdims=True)
    return logp


def check_against_oracle(entries, prompt, logp, k):
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        entry, row = entries[p], logp[p - 1]
        assert prompt[p] in entry and len(entry) in (k, k + 1)
        np.testing.assert_allclose(entry[prompt[p]], row[prompt[p]], atol=2e-4, rtol=1e-4)
        top = sorted((t for t in entry if t != prompt[p] or len(entry) == k), key=lambda t: -entry[t])[:k]
        np.testing.assert_allclose([entry[t] for t in top], np.sort(row)[::-1][:k], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name,overrides", FIXTURES, ids=[f[0] for f in FIXTURES])
def test_prompt_logprobs_equal_the_dense_reference(name, overrides):
    """A prompt longer than the prefill chunk (several scored chunks), beside a plain request."""
    eng = make_engine(name=name, hf_overrides=dict(overrides) or None, prefill_chunk_size=8,
                      max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=3, seed=11)
    out = run_workload(eng, [(0, "scored", PROMPT, params),
                             (0, "plain", PROMPT[:9], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))])
    check_against_oracle(out["scored"].prompt_logprobs, PROMPT, oracle(name, overrides, PROMPT, seed=11), 3)
    assert out["plain"].prompt_logprobs is None
    assert_all_pages_free(eng)


def test_prompt_logprobs_bypass_the_prefix_cache_and_decode_windows():
    """A cached prefix would skip the positions to score, and a window's mixed prefill has no
    per-token head: a scored request recomputes its whole prompt in the prefill step."""
    eng = make_engine(enable_prefix_caching=True, decode_window=8, window_trip="fixed", mixed_prefill_tokens=64,
                      page_size=4)
    greedy = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = run_workload(eng, [(0, "a", PROMPT, SamplingParams(**greedy))])
    out = run_workload(eng, [(0, "b", PROMPT, SamplingParams(**greedy, prompt_logprobs=0)),
                             (0, "c", PROMPT, SamplingParams(**greedy))])
    assert out["c"].num_cached_tokens > 0 and out["b"].num_cached_tokens == 0
    check_against_oracle(out["b"].prompt_logprobs, PROMPT, oracle("ouro-tiny", (), PROMPT), 0)
    assert out["b"].token_ids == out["c"].token_ids == first["a"].token_ids
    assert_all_pages_free(eng)


def test_prompt_logprobs_survive_recompute_preemption():
    """Preempted and recomputed, the request's prompt runs again; its record stays whole."""
    eng = make_engine(num_pages=41, page_size=4, max_num_seqs=3, preemption_mode="recompute")
    scored = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    other = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, priority=0)
    victims = []
    preempt = eng.scheduler.preemptor.preempt
    eng.scheduler.preemptor.preempt = lambda r: victims.append(r.request_id) or preempt(r)
    out = run_workload(eng, [(0, "o1", PROMPT[5:15], other), (0, "o2", PROMPT[2:12], other),
                             (1, "s", PROMPT[:10], scored)])   # the latest arrival is the victim
    check_against_oracle(out["s"].prompt_logprobs, PROMPT[:10], oracle("ouro-tiny", (), PROMPT[:10]), 2)
    assert "s" in victims and eng.stats().num_recomputed > 0
    assert_all_pages_free(eng)


def test_one_token_prompt_and_bad_values():
    eng = make_engine()
    out = run_workload(eng, [(0, "one", [7], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))])
    assert out["one"].prompt_logprobs == [None]
    for bad in (-1, 21, 1.5, "2"):
        with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_a_long_chunk_is_scored_in_slices():
    """A 300-token chunk (a 512-token batch): the head runs on 256-row slices, same numbers."""
    prompt = np.random.default_rng(3).integers(3, 500, 300).tolist()
    eng = make_engine(prefill_chunk_size=512, max_num_batched_tokens=512, page_size=16)
    out = run_workload(eng, [(0, "long", prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))])
    check_against_oracle(out["long"].prompt_logprobs, prompt, oracle("ouro-tiny", (), prompt), 1)

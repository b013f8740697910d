"""Sampling: greedy, temperature, top-k, top-p, per-request keys, batch invariance, logprobs."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rltjax.sampling import SAMPLERS, sample_one, sample_tokens, sampler_for, split_seed, token_logprobs
from rltjax.sampling_params import SamplingParams, SamplingParamsError

PROBS = np.array([0.5, 0.3, 0.15, 0.05], np.float32)
LOGITS = np.log(PROBS)


def draws(logits, n=400, **kw):
    return [sample_one(logits, seed=11, output_index=i, **kw) for i in range(n)]


def batch_sample(logits, temperature, top_k, top_p, seeds, index, sampler="auto"):
    hi, lo = zip(*(split_seed(s) for s in seeds))
    return np.asarray(sample_tokens(jnp.asarray(logits, jnp.float32), jnp.float32(temperature),
                                    jnp.int32(top_k), jnp.float32(top_p), jnp.uint32(hi),
                                    jnp.uint32(lo), jnp.int32(index), sampler=sampler))


def test_greedy_is_argmax_with_first_index_on_ties():
    logits = np.array([0.1, 2.0, 2.0, -1.0], np.float32)
    assert {sample_one(logits, temperature=0.0, top_k=0, top_p=1.0, seed=s, output_index=0)
            for s in range(5)} == {1}


def test_top_k_one_is_argmax_at_any_temperature():
    assert set(draws(LOGITS, 50, temperature=5.0, top_k=1, top_p=1.0)) == {0}


def test_top_p_keeps_smallest_set_reaching_p():
    # mass before each ranked token: 0, .5, .8, .95
    assert set(draws(LOGITS, 200, temperature=1.0, top_k=0, top_p=0.5)) == {0}
    assert set(draws(LOGITS, 300, temperature=1.0, top_k=0, top_p=0.7)) == {0, 1}
    assert set(draws(LOGITS, 400, temperature=1.0, top_k=0, top_p=0.81)) == {0, 1, 2}
    # the most likely token is always kept even for tiny p
    assert set(draws(LOGITS, 50, temperature=1.0, top_k=0, top_p=1e-6)) == {0}


def test_top_k_then_top_p_order():
    # top_k=2 renormalises to (.625, .375); top_p=0.6 then keeps only the first
    assert set(draws(LOGITS, 200, temperature=1.0, top_k=2, top_p=0.6)) == {0}
    assert set(draws(LOGITS, 300, temperature=1.0, top_k=3, top_p=1.0)) == {0, 1, 2}


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_frequencies_follow_tempered_softmax(temperature):
    n = 3000
    counts = np.bincount(draws(LOGITS, n, temperature=temperature, top_k=0, top_p=1.0), minlength=4)
    p = np.exp(LOGITS / temperature)
    p /= p.sum()
    # 5-sigma band of a binomial: deterministic draws, so this never flakes
    assert np.all(np.abs(counts / n - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-3)


def test_same_seed_and_index_same_token_different_index_varies():
    logits = np.zeros(64, np.float32)
    a = draws(logits, 30, temperature=1.0, top_k=0, top_p=1.0)
    b = draws(logits, 30, temperature=1.0, top_k=0, top_p=1.0)
    assert a == b and len(set(a)) > 10


def test_seeds_beyond_32_bits_differ():
    logits = np.zeros(1024, np.float32)
    x = [sample_one(logits, temperature=1.0, top_k=0, top_p=1.0, seed=s, output_index=0)
         for s in (5, 5 + 2**40)]
    assert x[0] != x[1]


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 6), st.integers(0, 5), st.data())
def test_batch_invariance(batch, row, data):
    """A row samples the same token alone and inside any batch."""
    row = row % batch
    rng = np.random.default_rng(data.draw(st.integers(0, 1000)))
    logits = rng.normal(size=(batch, 97)).astype(np.float32) * 3
    temps = rng.choice([0.0, 0.7, 1.0, 1.5], size=batch)
    top_k = rng.choice([0, 1, 5, 50], size=batch)
    top_p = rng.choice([1.0, 0.9, 0.3], size=batch)
    seeds = rng.integers(0, 2**62, size=batch).tolist()
    index = rng.integers(0, 100, size=batch)
    full = batch_sample(logits, temps, top_k, top_p, seeds, index)
    alone = batch_sample(logits[row:row + 1], temps[row:row + 1], top_k[row:row + 1],
                         top_p[row:row + 1], seeds[row:row + 1], index[row:row + 1])
    assert full[row] == alone[0]


@settings(max_examples=12, deadline=None)
@given(st.data())
def test_cheapest_sampler_draws_what_the_truncating_one_draws(data):
    """``sampler_for`` picks "greedy" / "draw" only for rows where they are exact: the
    sampler it picks (and "auto") draws the same tokens as the general, sorting one."""
    batch, vocab = data.draw(st.integers(1, 5)), 61
    rng = np.random.default_rng(data.draw(st.integers(0, 1000)))
    logits = rng.normal(size=(batch, vocab)).astype(np.float32) * 3
    temps = np.float32(data.draw(st.lists(st.sampled_from([0.0, 0.0, 0.7, 1.3]), min_size=batch, max_size=batch)))
    top_k = np.int32(data.draw(st.lists(st.sampled_from([0, 0, 3, vocab, vocab + 5]), min_size=batch,
                                        max_size=batch)))
    top_p = np.float32(data.draw(st.lists(st.sampled_from([1.0, 1.0, 0.5]), min_size=batch, max_size=batch)))
    seeds = rng.integers(0, 2**62, size=batch).tolist()
    index = rng.integers(0, 100, size=batch)
    chosen = sampler_for(temps, top_k, top_p, vocab)
    general = batch_sample(logits, temps, top_k, top_p, seeds, index, sampler="truncate")
    assert np.array_equal(batch_sample(logits, temps, top_k, top_p, seeds, index, sampler=chosen), general)
    assert np.array_equal(batch_sample(logits, temps, top_k, top_p, seeds, index), general)    # "auto"
    sampled = temps > 0
    truncating = sampled & (((top_k > 0) & (top_k < vocab)) | (top_p < 1))
    assert chosen in SAMPLERS
    assert chosen == ("greedy" if not sampled.any() else "truncate" if truncating.any() else "draw")


def test_draw_without_truncation_follows_the_tempered_softmax():
    """The sort-free sampler is a real draw: frequencies within 5 sigma of the softmax."""
    n, temperature = 3000, 0.8
    hi, lo = split_seed(3)
    tokens = np.asarray(sample_tokens(jnp.tile(jnp.asarray(LOGITS)[None], (n, 1)), jnp.full(n, temperature),
                                      jnp.zeros(n, jnp.int32), jnp.ones(n), jnp.full(n, hi, jnp.uint32),
                                      jnp.full(n, lo, jnp.uint32), jnp.arange(n, dtype=jnp.int32), sampler="draw"))
    p = np.exp(LOGITS / temperature)
    p /= p.sum()
    counts = np.bincount(tokens, minlength=4) / n
    assert np.all(np.abs(counts - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-3)


def test_unknown_sampler_is_rejected():
    with pytest.raises(ValueError, match="sampler"):
        batch_sample(LOGITS[None], [1.0], [0], [1.0], [1], [0], sampler="nucleus")


def test_logprobs_are_raw_log_softmax():
    logits = np.array([[1.0, 2.0, 0.5, -1.0]], np.float32)
    chosen, top_ids, top_lp = token_logprobs(jnp.asarray(logits), jnp.int32([2]), 2)
    expected = logits[0] - np.log(np.exp(logits[0]).sum())
    np.testing.assert_allclose(float(chosen[0]), expected[2], rtol=1e-6)
    assert top_ids[0].tolist() == [1, 0]
    np.testing.assert_allclose(np.asarray(top_lp[0]), expected[[1, 0]], rtol=1e-6)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("temperature", -0.1), ("temperature", float("inf")), ("top_k", -2),
    ("top_p", 0.0), ("top_p", 1.5), ("seed", -1), ("min_loops", 0), ("exit_threshold", 1.2),
    ("logprobs", 21), ("stop", [""]), ("stop_token_ids", [-3]), ("ignore_eos", 1),
    ("max_tokens", True), ("priority", 0.5), ("stop_token_ids", 7), ("stop_token_ids", "7"), ("stop", 3),
    ("stop", [None]), ("top_k", 2**31), ("temperature", 10**400), ("temperature", 3.5e38),
])
def test_invalid_fields_name_the_field(field, value):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**{field: value})


def test_none_stop_fields_mean_none():
    params = SamplingParams(stop=None, stop_token_ids=None)
    assert params.stop == () and params.stop_token_ids == ()
    assert SamplingParams(stop="x", stop_token_ids=[3, 4]).stop == ("x",)


def test_loop_bounds_checked_against_model():
    with pytest.raises(SamplingParamsError, match="max_loops"):
        SamplingParams(max_loops=5).resolved_loops(4)
    with pytest.raises(SamplingParamsError, match="max_loops"):
        SamplingParams(min_loops=3, max_loops=2)
    with pytest.raises(SamplingParamsError, match="min_loops"):
        SamplingParams(min_loops=5).resolved_loops(4)
    assert SamplingParams(min_loops=2).resolved_loops(4) == (2, 4)

"""The GPU tests' oracle comparison (``near_ties``): it finds the oracle's near-ties, compares
everything before the first one exactly, and fails on any difference there."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from near_ties import check_equal_before_ties, exit_is_near_tie, first_near_tie, sample_is_near_tie
from rltjax.sampling_params import SamplingParams

V = 16


def test_exit_near_tie_is_the_cdf_at_the_threshold():
    h2 = 1 - 0.5 / 0.7                       # cdf after loop 2: 1 - 0.7 * (1 - h2) = 0.5
    assert exit_is_near_tie([0.3, h2], 0.5, 1, 1e-4)
    assert not exit_is_near_tie([0.3, 0.2], 0.5, 1, 1e-4)           # cdf 0.44
    assert not exit_is_near_tie([0.3, h2], 0.5, 3, 1e-4)            # loop 2 cannot exit


def test_sampled_near_tie_follows_the_noise():
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=4)
    clear = np.full(V, -30.0, np.float32)
    clear[5] = 10.0
    assert not sample_is_near_tie(clear, sp, 0, 3, 1e-4)
    flat = np.zeros(V, np.float32)                                  # noise of 10 re-ranks the draw
    assert sample_is_near_tie(flat, sp, 0, 3, 10.0)


def test_logprob_set_boundary_is_a_tie():
    sp = SamplingParams(temperature=0.0, logprobs=2, max_tokens=4)
    logits = np.arange(V, dtype=np.float32)
    assert not sample_is_near_tie(logits, sp, 0, 0, 1e-4)
    logits[V - 3] = logits[V - 2]                                   # 2nd and 3rd largest equal
    assert sample_is_near_tie(logits, sp, 0, 0, 1e-4)


def oracle_run(n=5, tie_at=None):
    """A greedy oracle run of n tokens (token i = argmax of logits[i]); a top-2 tie at tie_at."""
    logits = [np.eye(V, dtype=np.float32)[i + 1] * 5 for i in range(n)]
    if tie_at is not None:
        logits[tie_at][0] = 5.0
    tokens = [int(np.argmax(lg)) for lg in logits]
    return SimpleNamespace(token_ids=tokens, exit_depths=[4] * n, finish_reason="length", logprobs=None,
                           loop_probs=[[]] + [[0.1, 0.1, 0.1, 0.1]] * (n - 1), logits=logits)


def engine_output(tokens, depths):
    return SimpleNamespace(token_ids=list(tokens), exit_depths=list(depths), finish_reason="length",
                           error=None, logprobs=None)


def test_compares_up_to_the_first_tie_and_fails_before_it():
    sp = SamplingParams(temperature=0.0, max_tokens=5, seed=0, exit_threshold=0.5)
    ref = oracle_run(tie_at=2)
    assert first_near_tie(ref, sp, exit_mode="ouro_delayed") == 2
    diverged = ref.token_ids[:3] + [9, 9]                             # differs after the tie: allowed
    assert check_equal_before_ties(engine_output(diverged, [4] * 5), ref, sp, exit_mode="ouro_delayed") == 2
    early = [9] + ref.token_ids[1:]                                   # differs before it: a failure
    with pytest.raises(AssertionError):
        check_equal_before_ties(engine_output(early, [4] * 5), ref, sp, exit_mode="ouro_delayed")
    with pytest.raises(AssertionError):                               # a depth before the tie
        check_equal_before_ties(engine_output(ref.token_ids, [3] + [4] * 4), ref, sp, exit_mode="ouro_delayed")


def test_without_ties_everything_is_compared():
    sp = SamplingParams(temperature=0.0, max_tokens=5, seed=0, exit_threshold=0.5)
    ref = oracle_run()
    assert check_equal_before_ties(engine_output(ref.token_ids, [4] * 5), ref, sp, exit_mode="ouro_delayed") == 5
    with pytest.raises(AssertionError):                               # the last token differs
        check_equal_before_ties(engine_output(ref.token_ids[:4] + [0], [4] * 5), ref, sp,
                                exit_mode="ouro_delayed")


def test_exit_tie_cuts_at_its_token():
    sp = SamplingParams(temperature=0.0, max_tokens=5, seed=0, exit_threshold=0.5)
    ref = oracle_run()
    ref.loop_probs[3] = [0.3, 1 - 0.5 / 0.7, 0.1, 0.1]
    assert first_near_tie(ref, sp, exit_mode="ouro_delayed") == 3
    assert first_near_tie(ref, sp, exit_mode="fixed") == 5

"""Groundwork for self-speculative decoding: the round arithmetic (``benchmarks.speculation``)
and converging random weights (``checkpoints.random_init.converging``)."""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks.speculation import break_even, expected_tokens, round_cost
from conftest import load_fixture
from rltjax.checkpoints.random_init import converging
from rltjax.models.base import get_model
from rltjax.reference.stages import sequence_forward


def test_expected_tokens_and_break_even():
    assert expected_tokens(1.0, 4) == 5 and expected_tokens(0.0, 4) == 1
    # by enumeration: accepted drafts before the first rejection, plus the target's token
    a, k = 0.6, 3
    enum = sum((j + 1) * a ** j * (1 - a) for j in range(k)) + (k + 1) * a ** k
    assert expected_tokens(a, k) == pytest.approx(enum)
    for k in (2, 4, 8):
        be = break_even(k, 2, 4, 0.25)
        assert expected_tokens(be, k) * 4.25 == pytest.approx(round_cost(k, 2, 4, 0.25), rel=1e-6)
    assert break_even(2, 2, 4, 0.25) < break_even(4, 2, 4, 0.25) < break_even(8, 2, 4, 0.25)
    assert break_even(4, 3, 4, 0.25) > break_even(4, 2, 4, 0.25)     # deeper drafts need more acceptance


def test_converging_weights_dial_the_agreement_of_shallow_and_full_depth():
    ckpt = load_fixture("ouro-tiny")
    model, tokens = get_model(ckpt.cfg), np.random.default_rng(0).integers(3, 500, 160).tolist()

    def agreement(params):
        shallow = sequence_forward(model, params, tokens, 2)["logits"].argmax(-1)
        return float((shallow == sequence_forward(model, params, tokens, 4)["logits"].argmax(-1)).mean())
    same = converging(ckpt.params, 1.0)
    assert np.array_equal(np.asarray(same.layers.attn_post_norm), np.asarray(ckpt.params.layers.attn_post_norm))
    assert agreement(converging(ckpt.params, 0.05)) > agreement(ckpt.params) + 0.3
    with pytest.raises(ValueError, match="scale"):
        converging(ckpt.params, 0.0)


def test_round_cost_counts_the_passes_of_a_round():
    """By hand: K + 1 positions through d loops, K draft heads, one verify of D - d loops over
    the K + 1 positions, and its head (the H100 round of K = 2 measured 8.75 passes)."""
    assert round_cost(2, 2, 4, 0.25) == 3 * 2 + 2 * 0.25 + 2 + 0.25 == 8.75
    assert round_cost(4, 2, 4, 0.25) == 5 * 2 + 4 * 0.25 + 2 + 0.25 == 13.25
    assert round_cost(4, 1, 4, 0.0) == 5 + 3


def test_a_window_runs_one_round_by_default_whatever_its_passes():
    """rounds_per_window defaults to 1 (each round's tokens reach the stream together), also in
    a window of more passes than the target's depth; the target defaults to R."""
    from rltjax.engine.settings import resolve_settings
    from rltjax.engine_config import (CacheConfig, ExecutionConfig, ExitConfig, SchedulerConfig,
                                      SpeculativeConfig)
    ckpt = load_fixture("ouro-tiny")
    for window, rounds in ((16, None), (16, 3)):
        spec = SpeculativeConfig(4, 2) if rounds is None else SpeculativeConfig(4, 2, rounds_per_window=rounds)
        settings = resolve_settings(get_model(ckpt.cfg), cache=CacheConfig(), scheduler=SchedulerConfig(),
                                    exit_config=ExitConfig(mode="fixed"),
                                    execution=ExecutionConfig(decode_window=window), max_model_len=64,
                                    kv_dtype="float32", speculative=spec)
        got = settings.window.speculative
        assert got.rounds == (rounds or 1) and got.target_loops == ckpt.cfg.num_loops

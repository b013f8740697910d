"""The dense reference oracle: behaviour and an independent numpy replay of both KV layouts."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import FIXTURES, load_fixture, reference_model, reference_npz
from numpy_ouro import NumpyOuro
from rltjax.engine_config import EngineConfigError, ExitConfig
from rltjax.models.base import get_model
from rltjax.reference.exits import TokenExit
from rltjax.reference.generate import ReferenceModel
from rltjax.sampling_params import SamplingParams, SamplingParamsError

PROMPT = [int(t) for t in reference_npz("ouro-tiny")["p1_input_ids"]]


@pytest.fixture(scope="module")
def oracle():
    return NumpyOuro(FIXTURES / "ouro-tiny", load_fixture("ouro-tiny").cfg)


def check_against_numpy(oracle, out, kv_layout, mode, sp):
    """Logits match a numpy replay; every depth follows the rule on the numpy hazards."""
    logits, hazards = oracle.replay(out.prompt_token_ids, out.token_ids, out.exit_depths, kv_layout)
    np.testing.assert_allclose(np.stack(out.logits), logits, rtol=1e-4, atol=1e-5)
    R = oracle.cfg.num_loops
    min_loops, max_loops = sp.resolved_loops(R)
    for i, token_hazards in enumerate(hazards, start=1):
        if mode in ("ouro", "ouro_delayed"):
            cdf = 1 - np.cumprod(1 - np.asarray(token_hazards))
            if np.min(np.abs(cdf - sp.exit_threshold)) < 1e-4:
                continue  # too close to the threshold to judge across implementations
            rule = TokenExit(mode, min_loops=min_loops, max_loops=max_loops, threshold=sp.exit_threshold)
            expected = next(r for r, h in enumerate(token_hazards, start=1) if rule.after_loop(r, h))
            assert out.exit_depths[i] == expected, (i, token_hazards)
        np.testing.assert_allclose(out.loop_probs[i][:len(token_hazards)] if mode != "random_lookahead"
                                   else token_hazards, token_hazards, rtol=1e-4)


@pytest.mark.parametrize("kv_layout,mode,q,min_loops", [
    ("last_exited", "ouro", 0.3, 1), ("last_exited", "ouro", 0.7, 2), ("last_exited", "ouro_delayed", 0.3, 1),
    ("shared", "ouro", 0.9, 1), ("shared", "ouro", 0.7, 2), ("shared", "ouro_delayed", 0.6, 1)])
def test_matches_numpy_replay(oracle, kv_layout, mode, q, min_loops):
    rm = reference_model("ouro-tiny", kv_layout=kv_layout, exit_mode=mode)
    sp = SamplingParams(max_tokens=10, temperature=1.0, seed=7, exit_threshold=q, min_loops=min_loops,
                        ignore_eos=True)
    out = rm.generate(PROMPT[:9], sp, record_logits=True)
    assert out.exit_depths[0] == 4
    if min_loops == 1:
        assert len(set(out.exit_depths[1:])) > 1, "workload must exercise several exit depths"
    check_against_numpy(oracle, out, kv_layout, mode, sp)


def test_layouts_differ_once_tokens_exit_early():
    sp = SamplingParams(max_tokens=8, temperature=0.0, exit_threshold=0.5, ignore_eos=True)
    a = reference_model("ouro-tiny", kv_layout="last_exited").generate(PROMPT[:9], sp, record_logits=True)
    b = reference_model("ouro-tiny", kv_layout="shared").generate(PROMPT[:9], sp, record_logits=True)
    assert not np.allclose(np.stack(a.logits[1:]), np.stack(b.logits[1:]), atol=1e-6)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kv_layout=st.sampled_from(["last_exited", "shared"]),
       mode=st.sampled_from(["ouro", "ouro_delayed", "random_lookahead", "fixed"]),
       q=st.sampled_from([0.2, 0.45, 0.8, 1.0]), min_loops=st.integers(1, 3), max_loops=st.integers(3, 4),
       prompt_len=st.integers(1, 12), temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 99))
def test_random_settings_match_numpy_replay(oracle, kv_layout, mode, q, min_loops, max_loops,
                                           prompt_len, temperature, seed):
    rm = reference_model("ouro-tiny", kv_layout=kv_layout, exit_mode=mode, lookahead_seed=3)
    sp = SamplingParams(max_tokens=6, temperature=temperature, seed=seed, exit_threshold=q,
                        min_loops=min_loops, max_loops=max_loops, ignore_eos=True)
    out = rm.generate(PROMPT[:prompt_len], sp, record_logits=True)
    assert all(min_loops <= d <= max_loops for d in out.exit_depths[1:])
    check_against_numpy(oracle, out, kv_layout, mode, sp)


def test_trace_mode_replays_depths_and_validates():
    depths = [4, 1, 3, 2, 4, 1]
    cfg = load_fixture("ouro-tiny")
    rm = ReferenceModel(get_model(cfg.cfg), cfg.params,
                        exit_config=ExitConfig(mode="trace", depths_by_request={"a": depths, "b": [3, 1]}))
    out = rm.generate(PROMPT[:5], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), request_id="a")
    assert out.exit_depths == depths
    with pytest.raises(EngineConfigError, match="'b'"):
        rm.generate(PROMPT[:5], SamplingParams(max_tokens=2, temperature=0.0), request_id="b")
    with pytest.raises(EngineConfigError, match="max_tokens"):
        rm.generate(PROMPT[:5], SamplingParams(max_tokens=9, temperature=0.0), request_id="a")
    with pytest.raises(EngineConfigError, match=r"\[2\]"):
        rm.generate(PROMPT[:5], SamplingParams(max_tokens=6, max_loops=2, temperature=0.0), request_id="a")


def test_fixed_depth_and_max_loops():
    rm = reference_model("ouro-tiny")
    out = rm.generate(PROMPT[:4], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert out.exit_depths == [4] * 5
    out = rm.generate(PROMPT[:4], SamplingParams(max_tokens=5, temperature=0.0, max_loops=2, ignore_eos=True))
    assert out.exit_depths == [4, 2, 2, 2, 2]


def test_seeded_sampling_is_reproducible():
    rm = reference_model("ouro-tiny")
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
    a, b = rm.generate(PROMPT[:4], sp), rm.generate(PROMPT[:4], sp)
    c = rm.generate(PROMPT[:4], SamplingParams(max_tokens=8, temperature=1.0, seed=4321, ignore_eos=True))
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_stopping_rules():
    rm = reference_model("ouro-tiny")
    greedy = rm.generate(PROMPT[:5], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 6
    stop_at = greedy.token_ids[2]
    first = greedy.token_ids.index(stop_at)
    out = rm.generate(PROMPT[:5], SamplingParams(max_tokens=6, temperature=0.0), eos_token_ids=[stop_at])
    assert out.finish_reason == "stop" and out.token_ids == greedy.token_ids[:first + 1]
    out = rm.generate(PROMPT[:5], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                      eos_token_ids=[stop_at])
    assert out.token_ids == greedy.token_ids
    out = rm.generate(PROMPT[:5], SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[stop_at],
                                                 ignore_eos=True))
    assert out.finish_reason == "stop" and out.token_ids == greedy.token_ids[:first + 1]


def test_logprobs_entries():
    rm = reference_model("ouro-tiny")
    out = rm.generate(PROMPT[:5], SamplingParams(max_tokens=3, temperature=1.0, seed=3, logprobs=4,
                                                 ignore_eos=True), record_logits=True)
    for tok, entry, logits in zip(out.token_ids, out.logprobs, out.logits):
        assert tok in entry and 4 <= len(entry) <= 5
        lp = logits - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()
        np.testing.assert_allclose(entry[tok], lp[tok], rtol=1e-5)
        assert sorted(entry, key=lambda t: -lp[t])[:4] == list(np.argsort(-lp)[:4])


@pytest.mark.parametrize("prompt,params,match", [
    ([], SamplingParams(), "empty"),
    ([1, 512], SamplingParams(), "token ids"),
    ([1] * 500, SamplingParams(max_tokens=20), "positions"),
    ([1, 2], SamplingParams(max_loops=5), "max_loops"),
    ([1, 2], SamplingParams(stop_token_ids=[600]), "stop_token_ids"),
])
def test_rejections(prompt, params, match):
    with pytest.raises(SamplingParamsError, match=match):
        reference_model("ouro-tiny").generate(prompt, params)

"""The batched engine serves Huginn-0125 (boundary KV, seeded initial state, recurrence
beyond R, latent-difference exits) and Nanbeige exactly like the dense reference."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import reference_model, reference_npz
from engine_helpers import assert_all_pages_free, check_equal, compile_events, make_engine, run_workload
from rltjax.engine.llm_engine import RequestRejectedError
from rltjax.engine_config import EngineConfigError
from rltjax.sampling_params import SamplingParams

NAME = "huginn-tiny"
ZERO = {"state_init": "zero"}
REF = reference_npz(NAME)
TOKENS = [int(t) for t in np.concatenate([REF["p2_input_ids"], REF["p1_input_ids"], REF["p0_input_ids"]])]
CAP = 12   # CacheConfig.max_loops: planes for recurrence up to 12 (R = mean_recurrence = 4)
# One engine shape for every Huginn test (few buckets: compiles dominate the run time on CPU).
SHAPE = dict(max_loops=CAP, max_num_seqs=2, prefill_chunk_size=4, max_num_batched_tokens=4)




def workload():
    """Staggered arrivals; per-request recurrence caps 2, 4 (R), 7, 12 and latent-diff thresholds
    that exit at varied depths; chunked prompts that cross pages; greedy and sampled. Every
    request names its seed: the like-init initial state depends on it even when greedy."""
    def sp(max_tokens, **kw):
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)
    return [
        (0, "a", TOKENS[:10], sp(6, temperature=0.0, seed=1, max_loops=12, exit_threshold=0.2, logprobs=3)),
        (1, "b", TOKENS[20:25], sp(5, temperature=1.0, seed=7, max_loops=2, exit_threshold=0.9)),
        (2, "c", TOKENS[3:14], sp(5, temperature=0.8, top_k=5, seed=11, max_loops=7, min_loops=2,
                                  exit_threshold=0.3, logprobs=2)),
        (4, "d", TOKENS[40:49], sp(4, temperature=0.0, seed=3)),                       # default: R loops
        (5, "e", TOKENS[30:33], sp(6, temperature=1.0, top_p=0.8, seed=5, max_loops=12, min_loops=3,
                                   exit_threshold=0.1)),
        (7, "f", TOKENS[50:57], sp(4, temperature=0.0, seed=9, max_loops=4, exit_threshold=0.6)),
    ]


def run_against_reference(kv_layout, mode, overrides, **engine_kw):
    engine = make_engine(name=NAME, hf_overrides=overrides, kv_layout=kv_layout, mode=mode, exit_mode="latent_diff",
                         **SHAPE, **engine_kw)
    arrivals = workload()
    outputs = run_workload(engine, arrivals)
    ref = reference_model(NAME, kv_layout=kv_layout, overrides=tuple(overrides.items()), exit_mode="latent_diff")
    depths = set()
    for _, rid, prompt, params in arrivals:
        expected = ref.generate(prompt, params, request_id=rid)
        check_equal(outputs[rid], expected)
        depths |= set(expected.exit_depths[1:])
    assert_all_pages_free(engine)
    assert engine.scheduler.boundary_allocator is not None
    return depths


# every pair of the three settings' values once (4 of the 8 combinations: CI time)
@pytest.mark.parametrize("kv_layout, mode, state_init", [
    ("last_exited", "refill", "zero"), ("shared", "refill", "like-init"),
    ("last_exited", "no_refill", "like-init"), ("shared", "no_refill", "zero")])
def test_huginn_engine_matches_reference(kv_layout, mode, state_init):
    depths = run_against_reference(kv_layout, mode, ZERO if state_init == "zero" else {})
    assert {2, 4, 7} <= depths and max(depths) > 7 and len(depths) >= 5, depths   # varied, beyond R


@pytest.mark.parametrize("state_init, window_trip", [("zero", "early_stop"), ("like-init", "early_stop"),
                                                    ("like-init", "fixed")])
@pytest.mark.parametrize("kv_layout", ["last_exited", "shared"])
def test_huginn_decode_windows_match_reference(kv_layout, state_init, window_trip):
    """Windows carry the boundary pool: the prelude runs on device when a row starts a token
    (seeded initial state), the coda in the head; latent-difference exits and mixed recurrence
    caps decide on device. Fixed-trip windows run prelude and coda every pass, writing only
    the rows that start or exit."""
    depths = run_against_reference(kv_layout, "refill", ZERO if state_init == "zero" else {}, decode_window=5,
                                   window_trip=window_trip)
    assert {2, 4, 7} <= depths and max(depths) > 7, depths


def test_huginn_greedy_equals_upstream_and_no_compilation_after_warm_up():
    """Zero initial state at R = 4 loops reproduces the upstream fixture's greedy ids, with
    every executable compiled ahead of time (boundary embed/head included)."""
    engine = make_engine(name=NAME, hf_overrides=ZERO, compile_ahead=True, exit_mode="latent_diff", **SHAPE)
    arrivals = [(i, p, [int(t) for t in REF[f"{p}_input_ids"]],
                 SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1, seed=i))
                for i, p in enumerate(["p0", "p1", "p2"])]
    arrivals.append((4, "deep", TOKENS[:9], SamplingParams(max_tokens=3, temperature=0.0, max_loops=CAP,
                                                           seed=5, ignore_eos=True)))
    with compile_events() as events:
        outputs = run_workload(engine, arrivals)
    assert events == []
    ref = reference_model(NAME, overrides=tuple(ZERO.items()), exit_mode="latent_diff")
    for _, rid, prompt, params in arrivals:
        check_equal(outputs[rid], ref.generate(prompt, params))
        if rid != "deep":
            assert outputs[rid].token_ids == [int(t) for t in REF[f"{rid}_gen_ids"]]
            assert outputs[rid].exit_depths == [4] * 12
    assert outputs["deep"].exit_depths == [4, CAP, CAP]
    assert_all_pages_free(engine)


def test_loop_cap_is_checked():
    engine = make_engine(name=NAME, hf_overrides=ZERO, exit_mode="latent_diff", max_loops=CAP)
    with pytest.raises(RequestRejectedError, match=r"max_loops=13: exceeds this engine's loop cap "
                                                   r"CacheConfig.max_loops=12"):
        engine.add_request("deep", [5, 6], SamplingParams(max_tokens=2, max_loops=13))
    with pytest.raises(RequestRejectedError, match=r"max_loops=129: exceeds the model's loop count 128"):
        engine.add_request("deeper", [5, 6], SamplingParams(max_tokens=2, max_loops=129))
    default = make_engine(name=NAME, hf_overrides=ZERO)           # cap defaults to R = 4
    with pytest.raises(RequestRejectedError, match=r"CacheConfig.max_loops=4"):
        default.add_request("five", [5, 6], SamplingParams(max_tokens=2, max_loops=5))
    # KV planes follow the cap: 12 per request for last_exited, 1 for shared
    assert engine.scheduler.num_planes == CAP and default.scheduler.num_planes == 4
    assert make_engine(name=NAME, hf_overrides=ZERO, max_loops=CAP, kv_layout="shared").scheduler.num_planes == 1
    with pytest.raises(EngineConfigError, match=r"CacheConfig.max_loops=5: must be in \[R=4, 4\]"):
        make_engine(max_loops=5)                                   # Ouro: no recurrence beyond R
    with pytest.raises(EngineConfigError, match=r"CacheConfig.max_loops=3: must be in \[R=4, 128\]"):
        make_engine(name=NAME, max_loops=3)
    with pytest.raises(EngineConfigError, match="latent_diff"):
        make_engine(exit_mode="latent_diff")                      # Ouro's signal is a gate logit


@pytest.mark.parametrize("kv_layout,mode", [("last_exited", "refill"), ("shared", "no_refill")])
def test_nanbeige_engine_matches_reference_and_upstream(kv_layout, mode):
    ref_npz = reference_npz("nanbeige-tiny")
    engine = make_engine(name="nanbeige-tiny", kv_layout=kv_layout, mode=mode, max_num_seqs=2)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    arrivals = [(2 * i, p, [int(t) for t in ref_npz[f"{p}_input_ids"]], greedy)
                for i, p in enumerate(["p0", "p1", "p2"])]
    arrivals.append((1, "shallow", [int(t) for t in ref_npz["p1_input_ids"]][:9],
                     SamplingParams(max_tokens=5, temperature=1.0, seed=4, max_loops=1, ignore_eos=True)))
    outputs = run_workload(engine, arrivals)
    ref = reference_model("nanbeige-tiny", kv_layout=kv_layout)
    for _, rid, prompt, params in arrivals:
        check_equal(outputs[rid], ref.generate(prompt, params))
        if rid != "shallow":
            assert outputs[rid].exit_depths == [2] * 12
            if kv_layout == "last_exited":   # shared KV changes the model's attention inputs
                assert outputs[rid].token_ids == [int(t) for t in ref_npz[f"{rid}_gen_ids"]]
    assert outputs["shallow"].exit_depths == [2, 1, 1, 1, 1]
    assert engine.scheduler.boundary_allocator is None and engine.runner.bkv is None
    assert_all_pages_free(engine)

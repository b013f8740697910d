"""One fixed request on every executor the engine has, against the oracle.

The request (ouro exits, q 0.3, min_loops 2, max_loops 4) exits at depth 2 where the gate
alone would exit at 1, so an executor that ignored min_loops would change its depths (async
passes need a delayed mode: there the request has min_loops 3, which binds the same way); it
arrives while another request decodes, so the windows take it in flight (standby entries,
mixed prefill). Hypothesis workloads reach these paths too, but only when they happen to
draw such a request."""
from __future__ import annotations

import dataclasses

import pytest

from conftest import reference_npz
from engine_helpers import assert_all_pages_free, check_equal, make_engine, reference_for, run_workload
from rltjax.sampling_params import SamplingParams

TOKENS = [int(t) for t in reference_npz("ouro-tiny")["p2_input_ids"]] * 3
FIXED = SamplingParams(max_tokens=10, temperature=0.0, exit_threshold=0.3, min_loops=2, max_loops=4,
                       ignore_eos=True)
# async scheduling decides one pass late: ouro_delayed, where min_loops 3 binds on this prompt
FIXED_DELAYED = dataclasses.replace(FIXED, min_loops=3)
BACKGROUND = SamplingParams(max_tokens=24, temperature=0.0, exit_threshold=1.0, ignore_eos=True)

EXECUTORS = {
    "steps": dict(decode_window=0),
    "async_steps": dict(decode_window=0, async_scheduling=True, exit_mode="ouro_delayed"),
    "window_early_stop": dict(decode_window=3, window_trip="early_stop"),
    "window_fixed_trip": dict(decode_window=3, window_trip="fixed"),
    "window_standby": dict(decode_window=3, window_trip="fixed", max_num_seqs=12, decode_window_rows=8),
    "window_mixed_prefill": dict(decode_window=6, window_trip="fixed", mixed_prefill_tokens=32, prefill_chunk_size=16),
}


def test_min_loops_binds_for_the_fixed_request():
    """The precondition: without min_loops the oracle's depths differ (else this file tests nothing)."""
    for mode, params in (("ouro", FIXED), ("ouro_delayed", FIXED_DELAYED)):
        ref = reference_for("last_exited", mode)
        loose = dataclasses.replace(params, min_loops=params.min_loops - 1)
        assert (ref.generate(TOKENS[:9], params, request_id="x").exit_depths
                != ref.generate(TOKENS[:9], loose, request_id="x").exit_depths)


@pytest.mark.parametrize("executor", list(EXECUTORS))
def test_fixed_request_matches_the_oracle(executor):
    kwargs = dict(page_size=4, max_num_seqs=4, num_pages=512, exit_mode="ouro")
    kwargs.update(EXECUTORS[executor])
    engine = make_engine(**kwargs)
    fixed = FIXED_DELAYED if kwargs["exit_mode"] == "ouro_delayed" else FIXED
    arrivals = [(0, "background", TOKENS[20:27], BACKGROUND), (4, "fixed", TOKENS[:9], fixed),
                (5, "fixed-alone-later", TOKENS[:9], fixed)]
    outputs = run_workload(engine, arrivals)
    ref = reference_for("last_exited", kwargs["exit_mode"])
    for _, rid, prompt, params in arrivals:
        check_equal(outputs[rid], ref.generate(prompt, params, request_id=rid))
    assert min(outputs["fixed"].exit_depths) >= fixed.min_loops
    assert_all_pages_free(engine)
    if executor == "window_mixed_prefill":
        assert engine.steps_by_kind.get("mixed_prefill"), "the prompt never rode a window"
    if executor == "window_standby":
        assert engine.steps_by_kind.get("window"), "no window ran"

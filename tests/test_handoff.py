"""A running request handed from one engine to another continues exactly (the core of
prefill/decode disaggregation): a prefill engine runs the prompt and the first head, a decode
engine (windows on) takes it from there; the oracle is one engine running it throughout."""
from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import assert_all_pages_free, make_engine, run_workload
from rltjax.engine.handoff import export_running, import_running
from rltjax.engine.sequence import RequestRejectedError
from rltjax.sampling_params import SamplingParams

FIXTURES = [("ouro-tiny", None), ("ouro-tiny-gqa", None), ("nanbeige-tiny", None),
            ("huginn-tiny", {"state_init": "zero"})]


def requests():
    rng = np.random.default_rng(0)
    return [(0, f"r{i}", rng.integers(3, 500, 5 + 4 * i).tolist(),
             SamplingParams(max_tokens=10, temperature=0.0 if i % 2 else 0.9, seed=i, exit_threshold=0.6,
                            ignore_eos=True, logprobs=1)) for i in range(4)]


@pytest.mark.parametrize("name,overrides", FIXTURES, ids=[f[0] for f in FIXTURES])
@pytest.mark.parametrize("after", [1, 4])
def test_a_request_handed_off_continues_exactly(name, overrides, after):
    """``after`` tokens on the prefill engine (1: the first head only), the rest on the decode engine."""
    want = run_workload(make_engine(name=name, hf_overrides=overrides, decode_window=8), requests())
    prefill = make_engine(name=name, hf_overrides=overrides, decode_window=0)
    decode = make_engine(name=name, hf_overrides=overrides, decode_window=8, max_num_seqs=3)
    for _, rid, prompt, params in requests():
        prefill.add_request(rid, prompt, params)
    moved = []
    while prefill.has_unfinished_requests():
        prefill.step()
        for rid, req in list(prefill.requests.items()):
            if not req.finished and len(req.output_token_ids) >= after and req.replay_left == 0:
                moved.append(export_running(prefill, rid))
    assert len(moved) == 4
    assert_all_pages_free(prefill)
    with pytest.raises(RequestRejectedError, match="computes something else"):
        import_running(make_engine(name=name, hf_overrides=overrides, page_size=16), moved[0])
    for h in moved:
        import_running(decode, h)
    while decode.has_unfinished_requests():
        decode.step()
    for rid, w in want.items():
        got = decode.get_output(rid)
        assert (got.token_ids, got.exit_depths, got.finish_reason) == (w.token_ids, w.exit_depths, w.finish_reason)
        np.testing.assert_allclose([max(d.values()) for d in got.logprobs], [max(d.values()) for d in w.logprobs],
                                   atol=1e-5)
    assert_all_pages_free(decode)

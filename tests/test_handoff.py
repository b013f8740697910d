"""A running request handed from one engine to another continues exactly (the core of
prefill/decode disaggregation): a prefill engine runs the prompt and the first head, a decode
engine (windows on) takes it from there; the oracle is one engine running it throughout."""
from __future__ import annotations

import dataclasses

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


@pytest.mark.parametrize("name,overrides", [FIXTURES[0], FIXTURES[3]], ids=["ouro-tiny", "huginn-tiny"])
def test_pages_streamed_while_the_prompt_runs_put_together_exactly(name, overrides):
    """Each step, the prompt pages that completed are copied (``export_pages``); with the first
    token the rest follows (``export_running(start_page=...)``); the decode engine, which held
    pages for each request before its prompt ran, puts the pieces together (``assemble``) and
    continues exactly as one engine would."""
    from rltjax.engine.handoff import assemble, complete_pages, export_pages
    want = run_workload(make_engine(name=name, hf_overrides=overrides, decode_window=8), requests())
    prefill = make_engine(name=name, hf_overrides=overrides, decode_window=0)
    decode = make_engine(name=name, hf_overrides=overrides, decode_window=8, max_num_seqs=3)
    blocks = decode.scheduler.blocks
    free = blocks.num_free_pages
    for _, rid, prompt, params in requests():
        prefill.add_request(rid, prompt, params)
        assert blocks.hold(rid, len(prompt) + 1) == 0          # held; nothing of it cached here
    assert blocks.num_free_pages < free
    parts, sent, moved = {}, {}, []
    while prefill.has_unfinished_requests():
        prefill.step()
        for rid, req in list(prefill.requests.items()):
            if req.finished:
                continue
            if req.output_token_ids:
                moved.append(export_running(prefill, rid, sent.get(rid, 0)))
                continue
            full = complete_pages(prefill, rid)
            if full > sent.get(rid, 0):
                parts.setdefault(rid, {})[sent.get(rid, 0)] = (full - sent.get(rid, 0),
                                                              export_pages(prefill, rid, sent.get(rid, 0), full))
                sent[rid] = full
    assert sum(len(p) for p in parts.values()) >= 4 and any(h.start_page > 0 for h in moved)
    for h in moved:
        whole = assemble(h, parts.get(h.request_id, {}), decode.settings.num_planes)
        import_running(decode, dataclasses.replace(h, data=whole, start_page=0))
    while decode.has_unfinished_requests():
        decode.step()
    for rid, w in want.items():
        got = decode.get_output(rid)
        assert (got.token_ids, got.exit_depths, got.finish_reason) == (w.token_ids, w.exit_depths, w.finish_reason)
    assert_all_pages_free(decode)


def test_a_hold_is_given_back_and_never_blocks_its_own_request():
    engine = make_engine(num_pages=40, decode_window=8)
    blocks = engine.scheduler.blocks
    free = blocks.num_free_pages
    assert blocks.hold("a", 30) == 0 and blocks.hold("b", 200) is None   # 8 pages per plane x 4 planes; b won't fit
    assert blocks.num_free_pages == free - 32
    blocks.drop_hold("a")
    assert blocks.num_free_pages == free
    assert blocks.hold("c", 36) == 0            # its own admission may use every held page
    run_workload(engine, [(0, "c", list(range(3, 33)), SamplingParams(max_tokens=4, ignore_eos=True))])
    assert_all_pages_free(engine)

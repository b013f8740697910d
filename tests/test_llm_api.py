"""The offline LLM API: prompt kinds, input order, per-prompt params, text and stop strings."""
from __future__ import annotations

import pytest

from conftest import FIXTURES, reference_model
from rltjax import LLM, CacheConfig, ExecutionConfig, SamplingParams, SchedulerConfig
from rltjax.engine.llm_engine import RequestRejectedError
from rltjax.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def llm():
    return LLM(str(FIXTURES / "ouro-tiny"), dtype="float32", cache_config=CacheConfig(page_size=8),
               scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_size=16),
               execution_config=ExecutionConfig(compile_ahead=False, compilation_cache_dir=None))


def test_prompt_kinds_and_input_order(llm, capsys):
    tok = Tokenizer.from_dir(FIXTURES / "ouro-tiny")
    text = "Rivers carry stones to the sea."
    ids = tok.encode(text)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [text, ids, {"prompt_token_ids": ids}, ids[:3], "Another one entirely."]
    outs = llm.generate(prompts, greedy)
    assert [o.prompt_token_ids for o in outs] == [ids, ids, ids, ids[:3], tok.encode("Another one entirely.")]
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    assert outs[0].prompt == text and outs[1].prompt is None
    ref = reference_model("ouro-tiny").generate(ids[:3], greedy)
    assert outs[3].token_ids == ref.token_ids and outs[3].exit_depths == ref.exit_depths
    for o in outs:
        assert o.finished and o.finish_reason == "length" and len(o.exit_depths) == 6
        assert o.text == tok.decode(o.token_ids)
    assert "requests" not in capsys.readouterr().err     # no progress bar where stderr is not a terminal


def test_single_prompt_and_per_prompt_params(llm):
    out = llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out) == 1 and len(out[0].token_ids) == 3
    outs = llm.generate(["a b", "c d"], [SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                                         SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)])
    assert [len(o.token_ids) for o in outs] == [2, 5]
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()])


def test_stop_string_truncates_text(llm):
    base = llm.generate("The cook said", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert len(base.text) > 4
    stop = base.text[2:4]
    out = llm.generate("The cook said", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                       stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[:base.text.index(stop)]
    assert out.token_ids == base.token_ids[:len(out.token_ids)]


def test_rejected_prompt_leaves_the_engine_clean(llm):
    with pytest.raises(RequestRejectedError, match="max_model_len"):
        llm.generate(["ok", "x" * 3], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=600)])
    assert not llm.engine.has_unfinished_requests()
    alloc = llm.engine.scheduler.allocator
    assert alloc.num_free == alloc.num_pages - 1


def test_bad_input_midway_leaves_nothing_behind(llm):
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with pytest.raises(RequestRejectedError, match="prompt"):
        llm.generate([[1, 2, 3], 7], sp)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    import numpy as np
    out = llm.generate(np.array([5, 6, 7]), sp)
    assert len(out) == 1 and out[0].prompt_token_ids == [5, 6, 7]
    assert not llm.engine.requests


def test_integer_request_ids_work_everywhere(llm):
    eng = llm.engine
    eng.add_request(5, [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.get_output(5).request_id == "5" and len(eng.get_output(5).token_ids) == 2
    eng.forget(5)
    assert "5" not in eng.requests


def test_forget_refuses_a_running_request_and_unknown_ids_are_named(llm):
    """forget() of a request still running would orphan its pages and slot: it is refused,
    the request finishes normally, and afterwards forget works."""
    eng = llm.engine
    eng.add_request("run", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    eng.step()
    with pytest.raises(ValueError, match=r"'run' is not finished: abort_request it before forget"):
        eng.forget("run")
    while eng.has_unfinished_requests():
        eng.step()
    assert len(eng.get_output("run").token_ids) == 3
    eng.forget("run")
    eng.forget("never-added")      # unknown ids are ignored
    with pytest.raises(KeyError, match=r"no request 'run' \(never added, or forgotten\)"):
        eng.get_output("run")
    alloc = eng.scheduler.allocator
    assert alloc.num_free == alloc.num_pages - 1


@pytest.mark.parametrize("prompts, params, message", [
    (None, None, r"prompts: a string, a list of token ids.*got NoneType"),
    (5, None, r"prompts: .*got int"),
    ([[1, 2]], (SamplingParams() for _ in range(1)), r"sampling_params: a SamplingParams, a list of them or None"),
])
def test_generate_names_bad_argument_types(llm, prompts, params, message):
    with pytest.raises(TypeError, match=message):
        llm.generate(prompts, params)
    assert not llm.engine.requests

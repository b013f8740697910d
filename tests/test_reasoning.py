"""Thinking models in chat: ``chat_template_kwargs`` reach the template, and the reasoning
parsers split ``<think>...</think>`` into ``reasoning_content``, streamed or not.

The end-to-end tests run a scripted model: the tiny Ouro fixture with every layer's output
projections zeroed, so each position's state is its own token's embedding, and an lm_head
that maps each token of a chosen chain to the next (greedy decoding walks the chain). Its
tokenizer is the fixture's with two vocabulary entries renamed to ``<think>`` / ``</think>``
(plain added tokens, as in Qwen3), and a chat template that closes an empty think block when
``enable_thinking`` is false.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import httpx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import FIXTURES, load_fixture
from rltjax.engine_config import CacheConfig, ExecutionConfig, SchedulerConfig
from rltjax.entrypoints.llm import build_engine
from rltjax.entrypoints.server.reasoning import END, START, ReasoningParser, check_tokenizer
from rltjax.tokenizer import Tokenizer
from server_helpers import CHAT, LiveServer, post, sse_events

THINK, THINK_END, NEWLINE, IM_END = 500, 501, 201, 2
# greedy walks: "\n" -> <think> us as </think> ation ch <|im_end|>
CHAIN = [NEWLINE, THINK, 300, 301, THINK_END, 317, 318, IM_END]
TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
            "{% if enable_thinking is defined and not enable_thinking %}{{ '<think></think>' }}{% endif %}{% endif %}")


def thinking_model_dir(tmp, special=False):
    d = tmp / "ouro-think"
    shutil.copytree(FIXTURES / "ouro-tiny", d)
    t = json.loads((d / "tokenizer.json").read_text())
    vocab, inv = t["model"]["vocab"], {v: k for k, v in t["model"]["vocab"].items()}
    old = {inv[THINK], inv[THINK_END]}
    t["model"]["merges"] = [m for m in t["model"]["merges"] if not ({m[0], m[1], m[0] + m[1]} & old)]
    for i, content in ((THINK, START), (THINK_END, END)):
        del vocab[inv[i]]
        vocab[content] = i
        t["added_tokens"].append({"id": i, "content": content, "single_word": False, "lstrip": False,
                                  "rstrip": False, "normalized": False, "special": special})
    (d / "tokenizer.json").write_text(json.dumps(t))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return d


def scripted_engine(model_dir):
    ckpt = load_fixture("ouro-tiny")
    p = ckpt.params
    e = np.asarray(p.embed, np.float32)
    head = np.zeros_like(np.asarray(p.lm_head))
    for a, b in zip(CHAIN, CHAIN[1:]):
        head[:, b] += 20.0 * e[a] / np.linalg.norm(e[a])
    layers = dataclasses.replace(p.layers, wo=np.zeros_like(p.layers.wo), w_down=np.zeros_like(p.layers.w_down))
    params = dataclasses.replace(p, layers=layers, norm=np.ones_like(p.norm), lm_head=head)
    return build_engine(None, params=params, cfg=ckpt.cfg, tokenizer=Tokenizer.from_dir(model_dir),
                        cache_config=CacheConfig(page_size=8),
                        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32,
                                                         prefill_chunk_size=32),
                        execution_config=ExecutionConfig(compile_ahead=False, show_progress=False))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return thinking_model_dir(tmp_path_factory.mktemp("think"))


def chat(srv, stream=False, **extra):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "temperature": 0.0, **extra}
    if not stream:
        res = post(srv, CHAT, body)
        assert res.status_code == 200, res.text
        return res.json()["choices"][0]["message"]
    with httpx.stream("POST", srv.url + CHAT, json={**body, "stream": True}, timeout=60) as r:
        deltas = [e["choices"][0]["delta"] for e in sse_events(list(r.iter_lines()))]
    return {k: "".join(d.get(k) or "" for d in deltas) for k in ("content", "reasoning_content")}


@pytest.mark.parametrize("parser,off_split", [("qwen3", ("", "ationch")), ("deepseek_r1", ("ationch", ""))])
def test_reasoning_parsers_on_a_thinking_chat(model_dir, parser, off_split):
    with LiveServer(factory=lambda: scripted_engine(model_dir), reasoning_parser=parser) as srv:
        plain = post(srv, CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16,
                                 "temperature": 0.0}).json()
        assert plain["choices"][0]["message"]["reasoning_content"] == "usas"
        assert plain["choices"][0]["message"]["content"] == "ationch"
        assert chat(srv, stream=True) == {"reasoning_content": "usas", "content": "ationch"}
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        want = {"reasoning_content": off_split[0], "content": off_split[1]}
        assert chat(srv, stream=True, **off) == want
        got = chat(srv, **off)
        assert {k: got[k] or "" for k in want} == want
        srv.wait_idle()


def test_without_a_parser_the_think_block_stays_in_the_content(model_dir):
    with LiveServer(factory=lambda: scripted_engine(model_dir)) as srv:
        assert chat(srv) == {"role": "assistant", "content": "<think>usas</think>ationch"}
        bad = post(srv, CHAT, {"messages": [{"role": "user", "content": "Hi"}],
                               "chat_template_kwargs": {"messages": []}})
        assert bad.status_code == 400 and "chat_template_kwargs" in bad.json()["error"]["message"]


def test_a_tokenizer_that_drops_the_markers_is_refused(tmp_path):
    tok = Tokenizer.from_dir(thinking_model_dir(tmp_path, special=True))
    with pytest.raises(ValueError, match="special"):
        check_tokenizer(tok, "qwen3")
    with pytest.raises(ValueError, match="choose one of"):
        ReasoningParser("nope")


PIECES = ["a", "b ", "<", "think", ">", "</", "think>", "<think>", "</think>", "\n", "é"]


@settings(max_examples=60 if os.environ.get("CI") else 300, deadline=None)
@given(parts=st.lists(st.sampled_from(PIECES), max_size=12), cuts=st.lists(st.integers(0, 60), max_size=6),
       name=st.sampled_from(["qwen3", "deepseek_r1"]))
def test_streamed_splits_add_up_to_the_final_split(parts, cuts, name):
    """Whatever way the text arrives, the deltas never take anything back."""
    parser, text = ReasoningParser(name), "".join(parts)
    sent = ("", "")
    for cut in sorted(c for c in cuts if c < len(text)) + [len(text)]:
        now = parser.split(text[:cut], finished=cut == len(text))
        assert now.reasoning.startswith(sent[0]) and now.content.startswith(sent[1])
        sent = (now.reasoning, now.content)
    final = parser.split(text, True)
    assert sent == (final.reasoning, final.content)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("deltas", [["<th", "ink>x</think>y"], ["<", "t", "hink>", "abc", "</th", "ink>", "z"]])
def test_a_marker_split_across_deltas_is_held_back(name, deltas):
    parser, text, sent = ReasoningParser(name), "", ("", "")
    for d in deltas:
        text += d
        now = parser.split(text, False)
        assert now.reasoning.startswith(sent[0]) and now.content.startswith(sent[1]), (text, now, sent)
        sent = (now.reasoning, now.content)
    final = parser.split(text, True)
    assert final.reasoning.startswith(sent[0]) and final.content.startswith(sent[1])
    assert "<" not in final.reasoning

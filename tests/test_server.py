"""The OpenAI-compatible server, live on 127.0.0.1: the official client, raw-HTTP errors,
metrics (tiny fixture model, compiled on first use)."""
from __future__ import annotations


import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import reference_model
from rltjax.sampling_params import SamplingParams
from server_helpers import C, CHAT, MODEL, MSG, OK, LiveServer, post, server, sse_events, tok  # noqa: F401  (fixtures)


# -- the official client ---------------------------------------------------------------
def test_completion_matches_the_reference_oracle(server, tok):
    text = "Rivers carry stones to the sea."
    greedy = dict(max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
    res = server.client().completions.create(model=MODEL, prompt=text, **greedy)
    ref = reference_model(MODEL).generate(tok.encode(text), SamplingParams(max_tokens=8, temperature=0.0,
                                                                           ignore_eos=True))
    choice = res.choices[0]
    assert choice.text == tok.decode(ref.token_ids) and choice.finish_reason == "length"
    assert (res.usage.prompt_tokens, res.usage.completion_tokens, res.usage.total_tokens) == (
        len(tok.encode(text)), 8, len(tok.encode(text)) + 8)
    assert res.model == MODEL and res.object == "text_completion"
    for prompt in (tok.encode(text), [text], [tok.encode(text)]):   # every prompt form, one prompt each
        again = server.client().completions.create(model="alias", prompt=prompt, **greedy)
        assert again.choices[0].text == choice.text


def stop_across_a_token_boundary(logprobs) -> str:
    """Two characters straddling the first boundary between two plain-ASCII tokens."""
    toks = logprobs.tokens
    for i in range(len(toks) - 1):
        if toks[i].isascii() and toks[i + 1].isascii() and toks[i].strip() and toks[i + 1].strip():
            return "".join(toks[:i + 1])[-1] + toks[i + 1][0]
    pytest.skip("no ASCII token pair in the sample")


def test_streamed_text_equals_non_streamed_with_a_stop_string(server):
    client = server.client()
    args = dict(model=MODEL, prompt="The cook said", max_tokens=24, temperature=1.0, seed=11,
                extra_body={"ignore_eos": True})
    base = client.completions.create(logprobs=0, **args).choices[0]
    stop = stop_across_a_token_boundary(base.logprobs)
    full = client.completions.create(stop=[stop], **args).choices[0]
    assert full.finish_reason == "stop" and full.text == base.text[:base.text.index(stop)]
    chunks = list(client.completions.create(stop=[stop], stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks) == full.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    plain = list(client.completions.create(stream=True, **args))   # no stop: the whole sample
    assert "".join(c.choices[0].text for c in plain) == base.text


def test_stream_include_usage(server):
    chunks = list(server.client().completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 5
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_logprobs_format(server):
    res = server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0.0,
                                             logprobs=3, extra_body={"ignore_eos": True})
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 3 <= len(top) <= 4 and top[token] == chosen   # greedy: the top-1 token


def test_chat_completion_and_stream(server, tok):
    client = server.client()
    args = dict(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Name a river."}],
                max_tokens=10, temperature=0.7, seed=3, extra_body={"ignore_eos": True})
    res = client.chat.completions.create(logprobs=True, top_logprobs=2, **args)
    msg = res.choices[0]
    assert msg.message.role == "assistant" and res.object == "chat.completion"
    prompt_ids = tok.apply_chat_template(args["messages"], add_generation_prompt=True, tokenize=True)
    assert res.usage.prompt_tokens == len(prompt_ids) and res.usage.completion_tokens == 10
    content = msg.logprobs.content
    assert len(content) == 10 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.message.content
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 10


def test_chat_max_tokens_defaults_to_the_rest_of_the_context(server, tok):
    messages = [{"role": "user", "content": "x " * 245}]
    prompt_len = len(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    assert 490 < prompt_len < 512
    res = server.client().chat.completions.create(model=MODEL, messages=messages, temperature=0.0,
                                                  extra_body={"ignore_eos": True})
    assert res.usage.completion_tokens == 512 - prompt_len and res.choices[0].finish_reason == "length"


def test_loop_extras_models_and_health(server):
    res = server.client().completions.create(
        model=MODEL, prompt="Loops", max_tokens=6, temperature=1.0, seed=1,
        extra_body={"min_loops": 1, "max_loops": 3, "exit_threshold": 0.4, "ignore_eos": True, "top_k": 20})
    assert res.usage.completion_tokens == 6
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL, "alias"] and models["data"][0]["max_model_len"] == 512
    assert httpx.get(server.url + "/health").status_code == 200
    missing = httpx.get(server.url + "/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()


# -- bad input: 4xx naming the field, never a 500, never a dead engine -----------------
BAD = [
    (C, b'{"prompt": ', 400, None), (C, b"[1, 2]", 400, None), (C, b"", 400, None),
    (C, {**OK, "max_tokens": "5"}, 400, "max_tokens"), (C, {**OK, "foo": 1}, 400, "foo"),
    (C, {"max_tokens": 2}, 400, "prompt"), (C, {**OK, "prompt": 5}, 400, "prompt"),
    (C, {**OK, "temperature": -1}, 400, "temperature"), (C, {**OK, "top_p": 0}, 400, "top_p"),
    (C, {**OK, "max_tokens": 0}, 400, "max_tokens"), (C, {**OK, "logprobs": 50}, 400, "logprobs"),
    (C, {**OK, "seed": -1}, 400, "seed"), (C, {**OK, "top_k": -5}, 400, "top_k"),
    (C, {**OK, "top_k": 2**31}, 400, "top_k"),       # past int32: it failed the batch (other requests too)
    (C, {**OK, "exit_threshold": 2}, 400, "exit_threshold"), (C, {**OK, "max_loops": 9}, 400, "max_loops"),
    (C, {**OK, "min_loops": 3, "max_loops": 2}, 400, "max_loops"), (C, {**OK, "stop": [""]}, 400, "stop"),
    (C, {**OK, "prompt": ""}, 400, "prompt"), (C, {**OK, "prompt": []}, 400, "prompt"),
    (C, {**OK, "prompt": [[]]}, 400, "prompt"), (C, {**OK, "prompt": ["a", "b"]}, 400, "prompt"),
    (C, {**OK, "prompt": [5, 99999]}, 400, "prompt"), (C, {**OK, "prompt": [7] * 600}, 400, "prompt"),
    (C, {**OK, "max_tokens": 600}, 400, "max_tokens"), (C, {**OK, "n": 2}, 400, "n"),
    (C, {**OK, "best_of": 3}, 400, "best_of"), (C, {**OK, "echo": True, "suffix": "x"}, 400, "suffix"),
    (C, {**OK, "presence_penalty": 0.5}, 400, "presence_penalty"),
    (C, {**OK, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {**OK, "stream": True, "stream_options": {"x": 1}}, 400, "stream_options.x"),
    (C, {**OK, "model": "gpt-4"}, 404, "model"),
    (CHAT, {**MSG, "messages": []}, 400, "messages"), (CHAT, {"model": MODEL}, 400, "messages"),
    (CHAT, {**MSG, "messages": [{"content": "Hi"}]}, 400, "messages[0].role"),
    (CHAT, {**MSG, "messages": [{"role": "wizard", "content": "Hi"}]}, 400, "messages[0].role"),
    (CHAT, {**MSG, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {**MSG, "top_logprobs": 2}, 400, "top_logprobs"), (CHAT, {**MSG, "logprobs": "yes"}, 400, "logprobs"),
    (CHAT, {**MSG, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    (CHAT, {**MSG, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {**MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"), (CHAT, {**MSG, "n": 3}, 400, "n"),
    (CHAT, {**MSG, "tools": []}, 400, "tools"), (CHAT, {**MSG, "model": "nope"}, 404, "model"),
    (CHAT, {**MSG, "messages": [{"role": "user", "content": "x " * 600}]}, 400, "messages"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_4xx_naming_the_field(server, path, body, status, param):
    res = post(server, path, body)
    assert res.status_code == status, res.text
    err = res.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and err["code"] == status


def test_engine_survives_bad_input(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert post(server, C, OK).status_code == 200 and post(server, CHAT, MSG).status_code == 200
    server.wait_idle()


def test_a_failed_batch_is_a_500_for_its_requests_only(server):
    runner = server.engine.runner
    real_head = runner.head

    def failing_head(*args):
        runner.head = real_head   # fail once
        raise RuntimeError("injected device failure")

    runner.head = failing_head
    res = post(server, C, {**OK, "max_tokens": 3})
    assert res.status_code == 500 and "injected device failure" in res.json()["error"]["message"]
    runner.head = failing_head
    with httpx.stream("POST", server.url + C, json={**OK, "stream": True}, timeout=30) as res:
        events = sse_events(list(res.iter_lines()))
    assert res.status_code == 200 and events[-1]["error"]["code"] == 500
    assert post(server, C, OK).status_code == 200 and httpx.get(server.url + "/health").status_code == 200
    server.wait_idle()


def test_metrics_after_requests(server):
    post(server, C, {**OK, "max_tokens": 4, "ignore_eos": True})
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    value = lambda name, suffix: sum(s.value for s in families[name].samples if s.name == name + suffix)
    for name in ("rltjax:time_to_first_token_seconds", "rltjax:time_per_output_token_seconds",
                 "rltjax:inter_token_latency_seconds", "rltjax:e2e_request_latency_seconds", "rltjax:exit_depth"):
        assert value(name, "_count") > 0, name
    assert value("rltjax:prompt_tokens", "_total") > 0 and value("rltjax:generation_tokens", "_total") > 0
    for gauge in ("rltjax:num_requests_waiting", "rltjax:num_requests_running", "rltjax:kv_cache_pages_used"):
        assert gauge in families
    assert value("rltjax:kv_cache_pages_total", "") > 0
    assert value("rltjax:request_success", "_total") > 0




def test_prefix_caching_priority_and_their_metrics(tok):
    """A server with prefix caching and priority scheduling: a repeated prompt reports its
    cached tokens in usage and equals the oracle; priority is a request field; /metrics
    counts the lookups, hits and preemptions. Under fcfs a priority is a 400 naming it."""
    text = "Rivers carry stones to the sea, and the sea keeps them. " * 3
    greedy = dict(max_tokens=4, temperature=0.0, extra_body={"ignore_eos": True, "priority": 2})
    with LiveServer({"enable_prefix_caching": True, "policy": "priority"}) as srv:
        client = srv.client()
        first = client.completions.create(model=MODEL, prompt=text, **greedy)
        again = client.completions.create(model=MODEL, prompt=text, **greedy)
        n = len(tok.encode(text))
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 8 * 8 > 0
        ref = reference_model(MODEL).generate(tok.encode(text), SamplingParams(max_tokens=4, temperature=0.0,
                                                                               ignore_eos=True))
        assert first.choices[0].text == again.choices[0].text == tok.decode(ref.token_ids)
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)}
        value = lambda name: sum(s.value for s in families[name].samples if s.name in (name, name + "_total"))
        assert value("rltjax:prefix_cache_queries") == 2 * ((n - 1) // 8 * 8)
        assert value("rltjax:prefix_cache_hits") == (n - 1) // 8 * 8
        assert value("rltjax:num_preemptions") == 0 and "rltjax:kv_cache_usage_perc" in families
        srv.wait_idle()


def test_priority_needs_the_priority_policy(server):
    res = post(server, C, {**OK, "priority": 1})
    assert res.status_code == 400 and res.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in res.json()["error"]["message"]


def test_sse_events_stay_one_line_and_logprobs_stay_json():
    """Characters str.splitlines takes for line ends are escaped in an SSE event, and non-finite
    logprobs (weights that overflow) serialise as strict JSON (-inf as -9999.0, NaN as null)."""
    import json

    from rltjax.engine.outputs import RequestOutput
    from rltjax.entrypoints.server.formatting import ChatFormat, CompletionFormat, TokenStrings, sse
    text = "a\x85b\u2028c\u2029d\nq"
    event = sse({"text": text})
    assert len(event.strip().splitlines()) == 1 and json.loads(event[len("data: "):])["text"] == text
    out = RequestOutput("r", token_ids=[3, 4], logprobs=[{3: float("nan"), 5: -1.0}, {4: float("-inf")}], text="xy")
    for fmt in (CompletionFormat, ChatFormat):
        body = fmt("r", "m", 0, TokenStrings(None), 2, False).response(out)
        json.dumps(body, allow_nan=False)                  # strict JSON, as the response is sent
        assert "-9999.0" in json.dumps(body) and "null" in json.dumps(body)

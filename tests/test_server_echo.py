"""``echo`` with ``logprobs`` on /v1/completions: the prompt's log-probabilities, computed at
its full depth, equal the dense reference's (what lm-eval's loglikelihood tasks read)."""
from __future__ import annotations

import numpy as np

from conftest import reference_model
from rltjax.reference.stages import sequence_forward
from server_helpers import C, MODEL, post, server, sse_events, tok  # noqa: F401  (fixtures)


def _oracle(ids):
    rm = reference_model(MODEL)
    logits = sequence_forward(rm.model, rm.params, ids, rm.cfg.num_loops)["logits"].astype(np.float64)
    return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)


def test_echo_logprobs_of_the_prompt_equal_the_reference(server, tok):
    text = "Rivers carry stones to the sea."
    ids = tok.encode(text)
    res = post(server, C, {"model": MODEL, "prompt": text, "max_tokens": 0, "echo": True, "logprobs": 2})
    assert res.status_code == 200, res.text
    choice = res.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert res.json()["usage"]["completion_tokens"] == 0
    assert lp["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    logp = _oracle(ids)
    want = [logp[p - 1, ids[p]] for p in range(1, len(ids))]
    np.testing.assert_allclose(lp["token_logprobs"][1:], want, atol=2e-4)
    for p in range(1, len(ids)):
        top = lp["top_logprobs"][p]
        assert len(top) in (2, 3) and lp["tokens"][p] in top
        assert abs(max(top.values()) - logp[p - 1].max()) < 2e-4
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and all(b - a == len(s) for a, b, s in zip(offsets, offsets[1:], lp["tokens"]))


def test_echo_with_a_completion_streamed_and_not(server, tok):
    """The echo is the completion's prefix; streamed, the first chunk carries it; ids echo as text."""
    ids = tok.encode("The cook said")
    body = {"model": MODEL, "prompt": ids, "max_tokens": 4, "echo": True, "logprobs": 1, "temperature": 0.0,
            "ignore_eos": True}
    plain = post(server, C, {**body, "echo": False}).json()["choices"][0]
    full = post(server, C, body).json()["choices"][0]
    prompt_text = tok.decode(ids, skip_special_tokens=False)
    assert full["text"] == prompt_text + plain["text"]
    assert full["logprobs"]["tokens"][len(ids):] == plain["logprobs"]["tokens"]
    np.testing.assert_allclose(full["logprobs"]["token_logprobs"][len(ids):], plain["logprobs"]["token_logprobs"],
                               atol=1e-5)
    with httpx_stream(server, body) as lines:
        events = sse_events(lines)
    first = events[0]["choices"][0]
    assert first["text"].startswith(prompt_text) and first["logprobs"]["token_logprobs"][0] is None
    assert "".join(e["choices"][0]["text"] for e in events) == full["text"]
    streamed = [x for e in events for x in e["choices"][0]["logprobs"]["token_logprobs"]]
    np.testing.assert_allclose(streamed[1:], full["logprobs"]["token_logprobs"][1:], atol=1e-5)


def test_max_tokens_zero_needs_echo(server):
    res = post(server, C, {"model": MODEL, "prompt": "Hi", "max_tokens": 0})
    assert res.status_code == 400 and res.json()["error"]["param"] == "max_tokens"


class httpx_stream:
    def __init__(self, server, body):
        import httpx
        self.cm = httpx.stream("POST", server.url + C, json={**body, "stream": True}, timeout=60)

    def __enter__(self):
        return list(self.cm.__enter__().iter_lines())

    def __exit__(self, *exc):
        self.cm.__exit__(*exc)

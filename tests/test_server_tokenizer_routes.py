"""vLLM's tokenizer routes (lm-eval's remote tokenizer): the server's tokenizer, its errors,
and the same API key as /v1."""
from __future__ import annotations

import httpx

from server_helpers import MODEL, LiveServer, post, server, tok  # noqa: F401  (fixtures)


def test_tokenize_detokenize_and_info(server, tok):
    text = "Rivers carry stones <|im_end|> to the sea."
    res = post(server, "/tokenize", {"model": MODEL, "prompt": text, "add_special_tokens": False}).json()
    assert res["tokens"] == tok.encode(text) and res["count"] == len(res["tokens"])
    assert res["max_model_len"] == server.engine.scheduler.max_model_len
    messages = [{"role": "user", "content": "Hi"}]
    chat = post(server, "/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == tok.apply_chat_template(messages, True, True)
    back = post(server, "/detokenize", {"model": MODEL, "tokens": res["tokens"]}).json()
    assert back["prompt"] == tok.decode(res["tokens"], skip_special_tokens=False)
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert tok.encode(info["eos_token"])[0] in tok.eos_token_ids


def test_tokenizer_route_errors(server, tok):
    for path, body, status, param in (
            ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "prompt"),
            ("/tokenize", {}, 400, "prompt"), ("/tokenize", {"prompt": "a", "model": "nope"}, 404, "model"),
            ("/detokenize", {"tokens": [1, tok.vocab_size]}, 400, "tokens"),
            ("/detokenize", {"tokens": "12"}, 400, "tokens")):
        res = post(server, path, body)
        assert res.status_code == status and res.json()["error"]["param"] == param, (path, body, res.text)


def test_tokenizer_routes_need_the_api_key():
    with LiveServer(api_key="k") as srv:
        assert post(srv, "/tokenize", {"prompt": "a"}).status_code == 401
        assert httpx.get(srv.url + "/tokenizer_info").status_code == 401
        ok = post(srv, "/tokenize", {"prompt": "a"}, headers={"authorization": "Bearer k"})
        assert ok.status_code == 200 and ok.json()["tokens"]

"""A live rltjax server on 127.0.0.1 for tests, plus small HTTP helpers."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest

from conftest import FIXTURES, reference_model
from engine_helpers import assert_all_pages_free, make_engine
from rltjax.entrypoints.server.app import build_app
from rltjax.entrypoints.server.async_engine import AsyncEngine
from rltjax.entrypoints.server.launcher import make_server
from rltjax.tokenizer import Tokenizer

MODEL = "ouro-tiny"
C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
MSG = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
ENGINE = dict(tokenizer=True, page_size=8, max_num_seqs=8, max_num_batched_tokens=32, prefill_chunk_size=32)


class LiveServer:
    """uvicorn in a background thread on a free 127.0.0.1 port, around a tiny-fixture engine."""

    def __init__(self, engine_kwargs=None, factory=None, **app_kwargs):
        """factory: builds the engine (default: the tiny fixture's with ENGINE and engine_kwargs)."""
        kwargs = {**ENGINE, **(engine_kwargs or {})}
        self.async_engine = AsyncEngine(factory or (lambda: make_engine(**kwargs)))
        self.app = build_app(self.async_engine, served_names=[MODEL, "alias"], **app_kwargs)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = make_server(self.app, host="127.0.0.1", port=0, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def engine(self):
        return self.async_engine.engine

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError("server did not become healthy")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Every request gone from the engine and the server; all KV pages free."""
        eng, deadline = self.engine, time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = eng.scheduler
            if (not s.running and not s.waiting and not eng.requests and eng.stats().kv_pages_used == 0
                    and s.allocator.num_reserved == 0 and self.async_engine.in_flight == 0):
                break
            time.sleep(0.02)
        assert not eng.requests and self.async_engine.in_flight == 0
        assert_all_pages_free(eng)


@pytest.fixture(scope="module")
def server():
    with LiveServer() as srv:
        yield srv


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(FIXTURES / MODEL)


def post(srv, path, body, **kw):
    """POST a JSON body (a dict, or raw text sent as JSON as is)."""
    data = json.dumps(body) if isinstance(body, dict) else body
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(srv.url + path, content=data, headers=headers, **{"timeout": 60, **kw})


def sse_events(lines):
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]




def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_process(port: int, *args: str, env=None, stderr=None, text=False, compile_ahead=False):
    """``rltjax serve`` of the tiny fixture as its own process on ``port`` (served as "m",
    float32, compiled on first use unless ``compile_ahead``); ``args``: more flags."""
    import os
    import subprocess
    import sys
    return subprocess.Popen([sys.executable, "-m", "rltjax", "serve", str(FIXTURES / MODEL), "--port", str(port),
                             "--served-model-name", "m", "--compile-ahead" if compile_ahead else "--no-compile-ahead",
                             "--compilation-cache-dir", "",
                             "--log-level", "warning", "--dtype", "float32", *args],
                            env={**os.environ, **(env or {})}, stderr=stderr, text=text)


def wait_healthy(url: str, procs, timeout: float = 180.0, why=lambda: "") -> None:
    """Until /health answers 200; fails at once when a process of ``procs`` has ended."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), f"server did not start {why()}"
        time.sleep(0.2)


def greedy_reference(prompt: str, max_tokens: int) -> str:
    """The oracle's greedy text for a prompt of the tiny fixture."""
    from rltjax.sampling_params import SamplingParams
    tok = Tokenizer.from_dir(FIXTURES / MODEL)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return tok.decode(reference_model(MODEL).generate(tok.encode(prompt), params).token_ids)

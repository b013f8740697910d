"""The server's lifecycle: disconnects abort and free pages, auth, body limit, 429, draining,
and the CLI."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rltjax.entrypoints.cli import main
from server_helpers import C, ENGINE, MODEL, OK, LiveServer, post, server, sse_events, tok  # noqa: F401  (fixtures)


# -- disconnects -----------------------------------------------------------------------
def aborted(srv) -> float:
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)}
    return sum(s.value for s in families["rltjax:request_success"].samples
               if s.labels.get("finished_reason") == "abort" and s.name.endswith("_total"))


def test_streaming_disconnect_aborts_and_frees_pages(server):
    before = aborted(server)
    body = {**OK, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + C, json=body, timeout=30) as res:
        assert res.status_code == 200
        for line in res.iter_lines():
            if line.startswith("data: "):
                break
    server.wait_idle()
    assert aborted(server) == before + 1


def test_non_streaming_disconnect_aborts(server):
    before = aborted(server)
    with pytest.raises(httpx.ReadTimeout):
        post(server, C, {**OK, "max_tokens": 500, "ignore_eos": True}, timeout=httpx.Timeout(30, read=0.5))
    server.wait_idle()
    assert aborted(server) == before + 1


# -- auth, body limit, backpressure, draining ------------------------------------------
def test_api_key_body_limit_and_429():
    with LiveServer(api_key="s3cret", max_request_bytes=2048, max_waiting_requests=1) as srv:
        auth = {"Authorization": "Bearer s3cret"}
        assert post(srv, C, OK).status_code == 401
        assert post(srv, C, OK, headers={"Authorization": "Bearer wrong"}).json()["error"]["code"] == 401
        with pytest.raises(openai.AuthenticationError):
            srv.client("wrong").completions.create(model=MODEL, prompt="a", max_tokens=1)
        assert srv.client("s3cret").completions.create(model=MODEL, prompt="a", max_tokens=1).choices
        assert httpx.get(srv.url + "/health").status_code == 200   # health and metrics stay open
        big = {**OK, "prompt": "x" * 4000}
        assert post(srv, C, big, headers=auth).status_code == 413
        chunked = (json.dumps(big).encode()[i:i + 100] for i in range(0, 4200, 100))   # no Content-Length
        assert post(srv, C, chunked, headers=auth).status_code == 413
        assert post(srv, C, OK, headers=auth).status_code == 200

        async def burst():
            async with httpx.AsyncClient(base_url=srv.url, headers=auth, timeout=60) as client:
                body = {**OK, "max_tokens": 120, "ignore_eos": True}
                return await asyncio.gather(*(client.post(C, json=body) for _ in range(24)))

        responses = asyncio.run(burst())
        statuses = [r.status_code for r in responses]
        assert set(statuses) == {200, 429} and statuses.count(200) >= 8   # 8 run, 1 may wait
        for r in responses:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
        srv.wait_idle()
        plain = httpx.post(srv.url + C, content=json.dumps(OK), headers={**auth, "content-type": "text/plain"})
        assert plain.status_code == 415 and "application/json" in plain.json()["error"]["message"]
        # every refusal counted, the guard's (401, 413 by Content-Length, 415) as the handlers'
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)}
        refused = {s.labels["status"]: s.value for s in families["rltjax:request_rejected"].samples
                   if s.name.endswith("_total")}
        assert refused["401"] == 3 and refused["413"] == 2 and refused["415"] == 1   # 401: two posts, the client
        assert refused["429"] == statuses.count(429)


def test_graceful_shutdown_drains_in_flight_requests():
    srv = LiveServer().__enter__()
    lines = []
    with httpx.stream("POST", srv.url + C, timeout=60,
                      json={**OK, "max_tokens": 40, "ignore_eos": True, "stream": True}) as res:
        it = res.iter_lines()
        lines.append(next(it))
        srv.server.should_exit = True
        time.sleep(0.3)
        try:
            late = post(srv, C, OK, timeout=5).status_code
        except httpx.TransportError:
            late = "refused"
        lines.extend(it)
    srv.thread.join(30)
    assert late in (503, "refused")
    events = sse_events(lines)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert not srv.thread.is_alive() and srv.async_engine.draining


def test_serve_cli(tmp_path, capsys):
    res = subprocess.run([sys.executable, "-m", "rltjax", "serve", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "--api-key" in res.stdout and "--max-waiting-requests" in res.stdout
    rc = main(["serve", str(tmp_path / "missing"), "--port", "0", "--log-level", "error",
               "--compilation-cache-dir", ""])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


def test_serve_exits_0_after_a_drained_sigterm(tmp_path):
    """SIGTERM drains and the process exits cleanly (uvicorn would raise the signal again);
    the API key may come from the environment instead of the command line."""
    import os
    import signal
    from conftest import FIXTURES
    env = {**os.environ, "RLTJAX_API_KEY": "from-env"}
    proc = subprocess.Popen([sys.executable, "-m", "rltjax", "serve", str(FIXTURES / MODEL), "--port", "0",
                             "--log-level", "info", "--no-compile-ahead", "--compilation-cache-dir", ""],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        for line in proc.stderr:
            if "startup complete" in line or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    finally:
        proc.kill()
    from rltjax.entrypoints.cli import build_parser
    old = os.environ.get("RLTJAX_API_KEY")
    os.environ["RLTJAX_API_KEY"] = "from-env"
    try:
        _, commands = build_parser()
        assert commands["serve"].parse_args(["m"]).api_key == "from-env"
    finally:
        os.environ.pop("RLTJAX_API_KEY") if old is None else os.environ.__setitem__("RLTJAX_API_KEY", old)

"""Load: a few hundred concurrent requests against a live 127.0.0.1 server (tiny model).

A fixed-seed mix of streaming / non-streaming completions and chats, some
disconnected mid-way; staggered arrivals with a small waiting queue so some get
429. Every request must be accounted for (completed, cancelled or 429), none
may see a 5xx, and afterwards the engine holds no request and no KV page.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx

from server_helpers import MODEL, LiveServer

NUM_REQUESTS = 250


def make_plan(rng: random.Random, i: int) -> dict:
    chat = rng.random() < 0.4
    body = {"model": MODEL, "max_tokens": rng.randint(1, 24), "temperature": rng.choice([0.0, 0.8]),
            "seed": i, "ignore_eos": rng.random() < 0.7}
    if rng.random() < 0.3:
        body["exit_threshold"] = rng.choice([0.3, 0.6])
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(["e", " t", "an"])]
    if chat:
        body["messages"] = [{"role": "user", "content": f"Request {i}: " + "word " * rng.randint(1, 40)}]
    else:
        body["prompt"] = f"Prompt {i} " + "token " * rng.randint(0, 60)
        if rng.random() < 0.2:
            body["logprobs"] = 2
    stream = rng.random() < 0.5
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": rng.random() < 0.5}
    return {"path": "/v1/chat/completions" if chat else "/v1/completions", "body": body, "stream": stream,
            "delay": rng.uniform(0, 2.0), "cancel_after": rng.choice([None, None, None, 1, 3]),
            "cancel_timeout": rng.uniform(0.01, 0.3)}


async def run_one(client: httpx.AsyncClient, plan: dict) -> str:
    await asyncio.sleep(plan["delay"])
    if not plan["stream"]:
        request = client.post(plan["path"], json=plan["body"])
        try:
            res = await (asyncio.wait_for(request, plan["cancel_timeout"]) if plan["cancel_after"] else request)
        except TimeoutError:
            return "cancelled"
        if res.status_code == 429:
            assert res.headers["retry-after"] and res.json()["error"]["code"] == 429
            return "429"
        assert res.status_code == 200, res.text
        assert res.json()["choices"][0]["finish_reason"] in ("stop", "length")
        return "completed"
    async with client.stream("POST", plan["path"], json=plan["body"]) as res:
        if res.status_code == 429:
            return "429"
        assert res.status_code == 200, (await res.aread()).decode()
        events = []
        async for line in res.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if plan["cancel_after"] and len(events) >= plan["cancel_after"]:
                    return "cancelled"   # leaving the block drops the connection mid-stream
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] in ("stop", "length")
    if plan["body"]["stream_options"]["include_usage"]:
        assert chunks[-1]["usage"]["completion_tokens"] >= 1
    return "completed"


async def probe(url: str, stop: asyncio.Event) -> list[float]:
    """/health stays 200 and fast while the engine is busy: requests never block each other."""
    latencies = []
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/metrics")).status_code == 200
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0.1)
    return latencies


async def load(url: str) -> list[str]:
    rng = random.Random(20240601)
    plans = [make_plan(rng, i) for i in range(NUM_REQUESTS)]
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=NUM_REQUESTS + 10, max_keepalive_connections=NUM_REQUESTS + 10)
    stop = asyncio.Event()
    prober = asyncio.create_task(probe(url, stop))
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        results = await asyncio.gather(*(run_one(client, p) for p in plans))
    stop.set()
    latencies = await prober
    print(f"load phase {time.perf_counter() - t0:.1f}s", end=" ")
    assert latencies and max(latencies) < 2.0, max(latencies)
    return results


def test_hundreds_of_concurrent_requests():
    # compiled ahead (free after test_server.py: jit caches are per process), so the load
    # phase measures serving, not XLA compiles
    with LiveServer({"compile_ahead": True}, max_waiting_requests=96) as srv:
        t0 = time.monotonic()
        results = asyncio.run(asyncio.wait_for(load(srv.url), 60))
        counts = {k: results.count(k) for k in set(results)}
        print(counts)
        assert set(counts) <= {"completed", "cancelled", "429"} and sum(counts.values()) == NUM_REQUESTS
        assert counts.get("completed", 0) >= NUM_REQUESTS // 4 and counts.get("cancelled", 0) > 0, counts
        srv.wait_idle(timeout=15)
        assert httpx.get(srv.url + "/health").status_code == 200
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'rltjax:request_rejected_total{status="429"}' in metrics or "429" not in counts
        assert not any(line.startswith("rltjax:request_rejected_total{status=\"5")
                       for line in metrics.splitlines())
        assert time.monotonic() - t0 < 60

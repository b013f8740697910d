"""Closed-loop load generators: C requests in flight, a finished one replaced at once.

- ``run_http``: C asyncio workers stream ``/v1/completions`` from an
  OpenAI-compatible server (``stream=true`` with usage, ``ignore_eos``), and
  time every streamed chunk on the client;
- ``run_engine``: the same loop in process, driving an ``LLMEngine`` directly
  (``add_request`` / ``step``); a token's arrival is the end of the engine step
  whose head sampled it.

Both return one ``RequestTiming`` per request, in workload order, and the wall
time from the first request's start to the last one's end.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Sequence

from benchmarks.dataset import BenchRequest
from benchmarks.metrics import RequestTiming

clock = time.perf_counter


def completion_body(req: BenchRequest, model: str, *, prompt_format: str = "text", temperature: float = 0.0,
                    exit_threshold: float = 1.0, max_tokens: int | None = None) -> dict:
    """A streamed /v1/completions request for one benchmark request."""
    return {"model": model, "prompt": req.prompt if prompt_format == "text" else list(req.prompt_ids),
            "max_tokens": max_tokens or req.output_len, "temperature": temperature, "ignore_eos": True,
            "exit_threshold": exit_threshold, "stream": True, "stream_options": {"include_usage": True}}


async def stream_one(client, body: dict, prompt_tokens: int, headers: dict | None = None) -> RequestTiming:
    """POST one streamed completion; the timing of each chunk that carries text or a finish."""
    import httpx
    t = RequestTiming(start=clock(), prompt_tokens=prompt_tokens)
    usage = None
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                t.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300].decode(errors='replace')}"
                return t
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                now, obj = clock(), json.loads(data)
                if "error" in obj:
                    t.error = str(obj["error"].get("message"))
                    break
                usage = obj.get("usage") or usage
                choice = (obj.get("choices") or [None])[0]
                if choice and (choice.get("text") or choice.get("finish_reason")):
                    t.arrivals.append(now)
        t.end = clock()
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        t.error = f"{type(exc).__name__}: {exc}"
    if usage:
        t.prompt_tokens, t.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
    else:
        t.output_tokens = len(t.arrivals)
    return t


async def _closed_loop_http(base_url: str, bodies: Sequence[dict], prompt_lens: Sequence[int], concurrency: int,
                            api_key: str | None, timeout: float) -> tuple[list[RequestTiming], float]:
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    timings: list[RequestTiming | None] = [None] * len(bodies)
    pending = iter(range(len(bodies)))
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        async def worker():
            for i in pending:   # a shared iterator: each index is taken by exactly one worker
                timings[i] = await stream_one(client, bodies[i], prompt_lens[i], headers)
        t0 = clock()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(bodies)))))
        wall = clock() - t0
    return timings, wall


def run_http(base_url: str, requests: Sequence[BenchRequest], concurrency: int, model: str, *,
             prompt_format: str = "text", temperature: float = 0.0, exit_threshold: float = 1.0,
             api_key: str | None = None, timeout: float = 3600.0,
             max_tokens: int | None = None) -> tuple[list[RequestTiming], float]:
    """Closed loop at ``concurrency`` against ``base_url`` (the server root, without /v1)."""
    bodies = [completion_body(r, model, prompt_format=prompt_format, temperature=temperature,
                              exit_threshold=exit_threshold, max_tokens=max_tokens) for r in requests]
    return asyncio.run(_closed_loop_http(base_url.rstrip("/"), bodies, [r.prompt_len for r in requests],
                                         concurrency, api_key, timeout))


def scrape_metrics(base_url: str, names: Sequence[str]) -> dict[str, float] | None:
    """The server's /metrics samples named ``names`` (all of them), or None if unavailable."""
    import httpx
    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    found = {}
    for line in text.splitlines():
        name = line.split(" ", 1)[0]
        if name in names:
            found[name] = float(line.split()[-1])
    return found if len(found) == len(names) else None


def scrape_exit_depth(base_url: str) -> tuple[float, float] | None:
    """(sum, count) of the server's exit-depth histogram (decode tokens), or None if unavailable."""
    found = scrape_metrics(base_url, ("rltjax:exit_depth_sum", "rltjax:exit_depth_count"))
    return (found["rltjax:exit_depth_sum"], found["rltjax:exit_depth_count"]) if found else None


MEMORY_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")


def memory_counters(engine=None, base_url: str | None = None) -> dict[str, float] | None:
    """The engine's prefix-cache and preemption totals: from ``engine.stats()`` in process,
    else the server's /metrics counters (None if unavailable)."""
    if engine is not None:
        stats = engine.stats()
        return {k: float(getattr(stats, k)) for k in MEMORY_COUNTERS}
    found = scrape_metrics(base_url, tuple(f"rltjax:{k}_total" for k in MEMORY_COUNTERS))
    return {k: found[f"rltjax:{k}_total"] for k in MEMORY_COUNTERS} if found else None


def memory_report(before: dict | None, after: dict | None) -> dict | None:
    """A run's prefix-cache hit rate and preemptions from the counters around it."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in MEMORY_COUNTERS}
    return dict(prefix_cache_queries=int(d["prefix_cache_queries"]), prefix_cache_hits=int(d["prefix_cache_hits"]),
                prefix_cache_hit_rate=d["prefix_cache_hits"] / d["prefix_cache_queries"]
                if d["prefix_cache_queries"] else None, preemptions=int(d["num_preemptions"]))


def fold_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """Token ids folded into a smaller vocabulary (tiny test models): lengths are kept."""
    return [int(t) % vocab_size for t in ids]


def run_engine(engine, requests: Sequence[BenchRequest], concurrency: int, *, temperature: float = 0.0,
               exit_threshold: float = 1.0, tag: str = "bench",
               max_tokens: int | None = None) -> tuple[list[RequestTiming], float]:
    """Closed loop at ``concurrency`` on an in-process LLMEngine."""
    from rltjax.sampling_params import SamplingParams
    vocab = engine.cfg.vocab_size
    timings: list[RequestTiming] = []
    ids: dict[str, int] = {}
    submitted = finished = 0
    t0 = clock()
    while finished < len(requests):
        while submitted < len(requests) and submitted - finished < concurrency:
            req, rid = requests[submitted], f"{tag}-{submitted}"
            params = SamplingParams(max_tokens=max_tokens or req.output_len, temperature=temperature,
                                    ignore_eos=True, exit_threshold=exit_threshold, seed=submitted)
            prompt = fold_ids(req.prompt_ids, vocab)
            timings.append(RequestTiming(start=clock(), prompt_tokens=req.prompt_len))
            engine.add_request(rid, prompt, params)
            ids[rid] = submitted
            submitted += 1
        outputs = engine.step()
        now = clock()
        for out in outputs:
            t = timings[ids[out.request_id]] if out.request_id in ids else None
            if t is None or t.end is not None:   # the closed loop's count would be wrong from here on
                raise RuntimeError(f"the engine returned output for request {out.request_id!r}, which this run "
                                   f"{'did not submit' if t is None else 'saw finish already'} (finish_reason "
                                   f"{out.finish_reason!r}, {len(out.token_ids)} tokens, error {out.error!r}): "
                                   f"an engine bug")
            t.arrivals.extend([now] * (len(out.token_ids) - t.output_tokens))
            t.output_tokens = len(out.token_ids)
            if out.finished:
                t.end, t.exit_depths = now, list(out.exit_depths)
                if out.finish_reason == "error":
                    t.error = out.error or "error"
                engine.forget(out.request_id)
                finished += 1
    return timings, clock() - t0

"""Tensor parallel and data-parallel replicas on 4 CPU devices (a subprocess: the device count
is fixed when JAX starts). Oracle: the same engine on one device. Float32: tokens and exit
depths equal, logprobs within 1e-5 (a sharded sum adds in another order)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).parent


def outputs(name, window, sizes, abort=False, pallas=False, cfg=None, store=None, spec=False):
    """cfg: (kv_layout, exit mode) other than the defaults; store: compile ahead with this cache folder;
    spec: self-speculative decoding (K = 2, d = 2) at fixed depth."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "PYTHONPATH": str(HERE)}
    mode = ("abort" if abort else "pallas" if pallas else "spec" if spec else f"cfg:{cfg[0]}:{cfg[1]}" if cfg
            else f"store:{store}" if store else "-")
    res = subprocess.run([sys.executable, str(HERE / "parallel_worker.py"), name, str(window), mode, *sizes],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def same(a, b):
    assert a.keys() == b.keys()
    for rid in a:
        assert (a[rid]["tokens"], a[rid]["depths"], a[rid]["finish"]) == (b[rid]["tokens"], b[rid]["depths"],
                                                                          b[rid]["finish"]), rid
        np.testing.assert_allclose(a[rid]["logprobs"], b[rid]["logprobs"], atol=1e-5)


@pytest.mark.parametrize("name,window,cfg", [
    ("ouro-tiny", 0, None), ("ouro-tiny", 8, None), ("ouro-tiny-gqa", 8, None), ("nanbeige-tiny", 0, None),
    ("huginn-tiny", 0, None), ("huginn-tiny", 8, ("last_exited", "latent_diff")),
    ("ouro-tiny", 8, ("shared", "ouro_delayed")), ("ouro-tiny", 0, ("last_exited", "random_lookahead"))])
def test_tensor_parallel_equals_one_device(name, window, cfg):
    got = outputs(name, window, ["1x1", "2x1", "4x1"], cfg=cfg)
    base = got["1x1"]["outputs"]
    same(got["2x1"]["outputs"], base)
    assert got["2x1"]["kv_devices"] == 2
    if "error" in got["4x1"]:           # GQA with 2 KV heads, Nanbeige's 2 KV heads: 4 does not divide
        assert "sizes that work: 1, 2" in got["4x1"]["error"]
    else:
        same(got["4x1"]["outputs"], base)
        assert got["4x1"]["kv_devices"] == 4 and got["4x1"]["kv_shard_heads"] * 4 == got["1x1"]["kv_shard_heads"]


def test_speculative_rounds_under_tensor_parallel_equal_one_device():
    """Drafts and the (K + 1)-row verify batch split by heads: greedy and sampled outputs equal
    one device's."""
    got = outputs("ouro-tiny", 4, ["1x1", "2x1"], spec=True)
    same(got["2x1"]["outputs"], got["1x1"]["outputs"])


def test_pallas_attention_kernels_run_per_device_under_tensor_parallel():
    """The attention kernels (interpret mode here) run on each device's heads inside shard_map:
    each call sees half the heads, and the outputs equal one device's."""
    got = outputs("small-ouro", 0, ["1x1", "2x1"], pallas=True)
    same(got["2x1"]["outputs"], got["1x1"]["outputs"])
    one, two = got["1x1"]["kernel_heads"], got["2x1"]["kernel_heads"]
    assert one and two and max(one) == 2 * max(two), (one, two)


def test_replicas_compiled_ahead_with_the_executable_store(tmp_path):
    """TP 2 x DP 2 compiled ahead into one store, cold then warm: a replica never loads a program
    compiled for the other's devices (the program key names them)."""
    base = outputs("ouro-tiny", 8, ["1x1"])["1x1"]["outputs"]
    for _ in ("cold", "warm"):
        got = outputs("ouro-tiny", 8, ["2x2"], store=str(tmp_path))
        assert "error" not in got["2x2"], got["2x2"]
        same(got["2x2"]["outputs"], base)


def test_data_parallel_replicas_share_the_work_and_equal_one_engine():
    got = outputs("ouro-tiny", 8, ["1x1", "1x2", "2x2"], abort=True)
    base = got["1x1"]["outputs"]
    for size in ("1x2", "2x2"):
        same(got[size]["outputs"], base)
        assert sorted(set(got[size]["placed"])) == [0, 1], got[size]["placed"]    # both replicas took work
    assert base["r1"]["finish"] == "abort"      # freed on its replica: the worker checks every pool is empty


def test_serve_with_tensor_parallel_replicas():
    """``rltjax serve -tp 2 -dp 2`` on 4 devices: greedy answers equal the reference oracle's,
    both replicas take requests (by the /metrics replica label), and a client that goes away
    mid-stream leaves no page held on any replica."""
    import threading
    import time

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from server_helpers import free_port, greedy_reference, serve_process, wait_healthy

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve_process(port, "-tp", "2", "-dp", "2", env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
                         stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, [proc])
        prompts = ["The cook said", "Rivers carry", "Loops", "Hello there", "A token", "Depth"]
        answers = {}

        def ask(p):
            body = {"model": "m", "prompt": p, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
            answers[p] = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "model": "m", "prompt": "Gone", "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
            next(r.iter_lines())      # one event, then the client goes away
        for t in threads:
            t.join(120)
        for p in prompts:
            assert answers[p] == greedy_reference(p, 6), p
        time.sleep(0.5)
        metrics = {(s.name, s.labels.get("replica")): s.value
                   for f in text_string_to_metric_families(httpx.get(url + "/metrics").text) for s in f.samples}
        for replica in ("0", "1"):
            assert metrics[("rltjax:replica_requests_total", replica)] > 0
            assert metrics[("rltjax:replica_kv_cache_pages_used", replica)] == 0
    finally:
        proc.terminate()
        proc.wait(60)


def _two_processes(argv_of, env_extra=None, timeout=300):
    from server_helpers import free_port
    port = free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "PYTHONPATH": str(HERE),
           **(env_extra or {})}
    procs = [subprocess.Popen(argv_of(pid, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for pid in (0, 1)]
    try:
        return [p.communicate(timeout=timeout) + (p.returncode,) for p in procs]
    finally:
        for p in procs:
            p.kill()


def test_two_processes_through_jax_distributed_equal_one_process():
    """2 processes x 2 CPU devices, tensor parallel over all 4 (gloo collectives)."""
    single = outputs("ouro-tiny", 0, ["1x1"])["1x1"]["outputs"]
    runs = _two_processes(lambda pid, port: [sys.executable, str(HERE / "multihost_worker.py"), str(pid), str(port),
                                             "ouro-tiny"])
    for out, err, rc in runs:
        assert rc == 0, err[-3000:]
        got = json.loads(out.strip().splitlines()[-1])
        assert got["kv_devices"] == 4
        same(got["outputs"], single)


def test_serve_across_two_processes():
    """``rltjax serve`` as a two-process job, compiled ahead: process 0 answers HTTP and process 1
    follows its steps (its devices hold half of every weight and KV page); a SIGTERM to process 0
    drains, lets process 1 go, and both exit 0."""
    import signal
    import threading

    import httpx

    from server_helpers import free_port, greedy_reference, serve_process, wait_healthy

    http, coord = free_port(), free_port()
    # two rows: the requests come one at a time, and fewer buckets compile ahead (48 -> 31 s on 2 cores)
    procs = [serve_process(http, "-tp", "4", "--max-num-seqs", "2", "--num-processes", "2",
                           "--process-id", str(pid), "--coordinator-address", f"127.0.0.1:{coord}",
                           env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
                           stderr=subprocess.PIPE, text=True, compile_ahead=True) for pid in (0, 1)]
    logs = [[], []]
    for p, log in zip(procs, logs):
        threading.Thread(target=lambda p=p, log=log: log.extend(p.stderr), daemon=True).start()
    url = f"http://127.0.0.1:{http}"
    try:
        wait_healthy(url, procs, why=lambda: "".join(logs[0] + logs[1]))
        for prompt in ("The cook said", "Loops"):
            body = {"model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
            text = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
            assert text == greedy_reference(prompt, 6)
        sampled = {"model": "m", "prompt": "Hello", "max_tokens": 8, "temperature": 1.0}   # a seed drawn on process 0
        assert httpx.post(url + "/v1/completions", json=sampled, timeout=120).status_code == 200
        procs[0].send_signal(signal.SIGTERM)
        assert [p.wait(120) for p in procs] == [0, 0], "".join(logs[0] + logs[1])[-3000:]
    finally:
        for p in procs:
            p.kill()


def test_kernel_attention_is_wrapped_per_device_on_a_mesh():
    """The kernel call sits inside shard_map on a mesh (interpret-mode kernels are plain XLA,
    so equal outputs alone would not show it); XLA's attention is left to the partitioner."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from rltjax.cache.paged_kv import PagedKV, PagedKVBackend, PagedMeta

    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    kv = PagedKV(jnp.zeros((1, 2, 4, 8, 64)), jnp.zeros((1, 2, 4, 8, 64)))
    n = 2
    meta = PagedMeta(jnp.zeros(n, jnp.int32), jnp.ones(n, jnp.int32), jnp.zeros(n, jnp.int32),
                     jnp.zeros(n, jnp.int32), jnp.ones(n, jnp.int32), jnp.ones((1, 4), jnp.int32))
    q = jnp.zeros((n, 4, 64))

    def primitives(backend):
        return str(jax.make_jaxpr(lambda q, kv: backend.attend(kv, 0, q, meta))(q, kv))
    assert "shard_map" in primitives(PagedKVBackend(attn_impl="pallas", interpret=True, mesh=mesh))
    assert "shard_map" not in primitives(PagedKVBackend(attn_impl="pallas", interpret=True))
    assert "shard_map" not in primitives(PagedKVBackend(attn_impl="xla", mesh=mesh))

"""kill -9 under load, then a restart on the same cache folder: the server starts warm from
the executable store, answers as before, and never loads a damaged entry (store files are
written atomically with a checksum, which is checked before anything deserializes them)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from conftest import FIXTURES
from server_helpers import free_port

PROMPTS = ["The cook said", "Rivers carry stones", "Loops of the model", "Hello"]


class Server:
    def __init__(self, cache: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-W", "always", "-m", "rltjax", "serve", str(FIXTURES / "ouro-tiny"), "--port",
             str(self.port), "--served-model-name", "m", "--log-level", "info", "--compilation-cache-dir", str(cache),
             "--max-num-seqs", "8"], stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and self.proc.poll() is None, "".join(self.log)
            time.sleep(0.2)

    def greedy(self) -> list[str]:
        body = {"model": "m", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        return [httpx.post(self.url + "/v1/completions", json={**body, "prompt": p}, timeout=60).json()
                ["choices"][0]["text"] for p in PROMPTS]

    def ready_line(self) -> str:
        return next(line for line in self.log if "executables ready" in line)


def test_kill_9_under_load_then_a_warm_restart_that_never_loads_a_damaged_entry(tmp_path):
    cache = tmp_path / "cache"
    first = Server(cache)
    try:
        want = first.greedy()
        body = {"model": "m", "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 1.0}
        streams = [threading.Thread(target=lambda p=p: _drain(first.url, {**body, "prompt": p}), daemon=True)
                   for p in PROMPTS * 2]
        for t in streams:
            t.start()
        time.sleep(1.0)                         # mid-stream
        first.proc.send_signal(signal.SIGKILL)
        assert first.proc.wait(30) == -signal.SIGKILL
    finally:
        first.proc.kill()
    entries = sorted(p for p in cache.glob("executables/*/*") if not p.name.startswith(".") and p.suffix != ".pkl")
    stored = int(re.search(r"(\d+) stored", first.ready_line()).group(1))
    assert len(entries) == stored > 2
    flipped, cut = entries[0], entries[1]
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF                # a bit flip deep inside the serialized executable
    flipped.write_bytes(bytes(data))
    whole = cut.read_bytes()
    cut.write_bytes(whole[:len(whole) // 3])      # cut short: a copy that stopped
    stale = flipped.parent / f".{flipped.name}.999.1.tmp"      # what a writer killed mid-write leaves
    stale.write_bytes(b"half a file")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    second = Server(cache)
    try:
        ready = second.ready_line()
        # the two damaged steps were compiled again (from XLA's own cache, so not stored anew)
        assert f"{stored} executables ready" in ready and f"({stored - 2} loaded" in ready, ready
        dropped = [line for line in second.log if "dropping the stored step" in line]
        assert len(dropped) == 2 and all("checksum" in d or "cut short" in d for d in dropped), dropped
        assert second.greedy() == want
        assert not stale.exists()
    finally:
        second.proc.terminate()
        second.proc.wait(60)


def _drain(url, body):
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for _ in r.iter_lines():
                pass
    except httpx.HTTPError:
        pass                                    # the server was killed under it

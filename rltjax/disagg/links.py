"""The coordinator's worker processes: started here (or on other hosts), connected, stopped.

Each worker is one process with one engine (``disagg.worker``). ``start_workers`` launches them
on this host, worker k on GPUs k x tp .. (k + 1) x tp - 1, or, for workers on other hosts,
waits for them to connect: every worker connects to the coordinator's address, says which it
is, gets its ``Setup`` and answers ``Hello`` once its engine is built. The workers must compute
the same thing (their fingerprints, checked here).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Listener

from rltjax.disagg.messages import Hello, Setup, Stop
from rltjax.engine.stats import EngineStats

log = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0


@dataclasses.dataclass
class Link:
    role: str
    index: int
    proc: subprocess.Popen | None     # None: a worker started elsewhere (another host)
    conn: object = None
    hello: Hello | None = None
    stats: EngineStats | None = None
    alive: bool = True
    load: int = 0                 # requests it holds


def start_workers(model: str, configs: dict, num_prefill: int, num_decode: int, address: str,
                  remote: bool, stream: bool = True) -> tuple[Listener, list[Link]]:
    """Workers 0..P-1 prefill, P..P+D-1 decode, each built and checked -> (listener, links).
    remote: start none here; they connect from other hosts (RLTJAX_DISAGG_KEY: the shared key).
    stream: prompt pages move as they complete (else all once the first token is out)."""
    if num_prefill < 1 or num_decode < 1:
        raise ValueError("--num-prefill-workers and --num-decode-workers must both be >= 1")
    if remote and "RLTJAX_DISAGG_KEY" not in os.environ:
        raise ValueError("workers on other hosts need RLTJAX_DISAGG_KEY (one hex key, the same on every host)")
    key = bytes.fromhex(os.environ["RLTJAX_DISAGG_KEY"]) if remote else secrets.token_bytes(16)
    host, port = address.rsplit(":", 1)
    listener = Listener((host, int(port)), authkey=key)
    address = "%s:%d" % listener.address
    roles = [(role, i) for role, n in (("prefill", num_prefill), ("decode", num_decode)) for i in range(n)]
    tp = configs["parallel_config"].tensor_parallel_size if configs.get("parallel_config") else 1
    links = []
    for k, (role, i) in enumerate(roles):
        env = {**os.environ, "RLTJAX_DISAGG_KEY": key.hex(), "RLTJAX_WORKER": str(k),
               "CUDA_VISIBLE_DEVICES": ",".join(str(k * tp + j) for j in range(tp))}
        links.append(Link(role, i, None if remote else subprocess.Popen(
            [sys.executable, "-m", "rltjax.disagg.worker", address], env=env)))
    if remote:
        log.info(f"waiting for {len(roles)} workers at {address}: start worker K (0..{num_prefill - 1} prefill, "
                 f"the rest decode) with `python -m rltjax.disagg.worker {address} K`")
    try:
        _accept(listener, links)
        for link in links:
            link.conn.send(Setup(model, configs, link.role, link.index, stream))
        deadline = time.monotonic() + START_TIMEOUT_S
        for link in links:
            if not link.conn.poll(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"{link.role} worker {link.index} did not start in {START_TIMEOUT_S:.0f} s")
            link.hello = link.conn.recv()
        prints = {link.hello.fingerprint for link in links}
        if len(prints) > 1:
            raise ValueError(f"the workers compute different things: {sorted(prints)}")
    except BaseException:
        stop_workers(listener, links)
        raise
    return listener, links


def _accept(listener: Listener, links: list[Link]) -> None:
    """Each worker connects and says which it is; one that never does fails the start (no wait
    without end on a worker that died first)."""
    def accept():
        while any(link.conn is None for link in links):
            conn = listener.accept()
            k = conn.recv()
            if not (isinstance(k, int) and 0 <= k < len(links)) or links[k].conn is not None:
                conn.close()
                continue
            links[k].conn = conn
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    thread.join(START_TIMEOUT_S)
    missing = [f"{link.role} {link.index}" for link in links if link.conn is None]
    if missing:
        raise RuntimeError(f"workers did not connect in {START_TIMEOUT_S:.0f} s: {', '.join(missing)}")


def stop_workers(listener: Listener, links: list[Link]) -> None:
    for link in links:
        if link.alive and link.conn is not None:
            try:
                link.conn.send(Stop())
            except (OSError, ValueError):
                pass
    for link in links:
        if link.proc is None:
            continue
        try:
            link.proc.wait(30)
        except subprocess.TimeoutExpired:
            link.proc.kill()
    listener.close()

"""A prefill or decode worker: one engine in its own process, driven by the coordinator.

    python -m rltjax.disagg.worker ADDRESS        (the key in RLTJAX_DISAGG_KEY; the coordinator starts it)

Prefill: each prompt runs with its first head (the engine steps without decode windows, so
a request is never in flight when it is taken off), then ``engine.handoff.export_running``
copies it out; its pages wait on this process's transfer server until the decode worker pulls
them, and the first token goes to the coordinator at once. Decode: a request's pages are
pulled from the prefill worker's server and ``import_running`` queues it as a swapped request.
"""
from __future__ import annotations

import dataclasses
import datetime
import itertools
import os
import queue
import sys
import threading
import time
from multiprocessing.connection import Client

import jax
import numpy as np
from jax.experimental import transfer

from rltjax.disagg.messages import Abort, Failed, Hello, Import, Output, Prefill, Pulled, Ready, Setup, Stats, Stop
from rltjax.engine.handoff import export_running, fingerprint, import_running

PULL_TIMEOUT_S = 60.0


class Worker:
    def __init__(self, conn, setup: Setup):
        from rltjax.entrypoints.llm import build_engine
        self.conn, self.role = conn, setup.role
        configs = dict(setup.configs)
        if self.role == "prefill":   # a request is taken off between steps: nothing may be in flight
            configs["execution_config"] = dataclasses.replace(configs["execution_config"], decode_window=0,
                                                              async_scheduling=False)
            configs.pop("speculative_config", None)   # a prefill worker makes one token a request
        self.engine = build_engine(setup.model, **configs)
        host = os.environ.get("RLTJAX_TRANSFER_HOST", "127.0.0.1")
        self.server = transfer.start_transfer_server(jax.devices()[0].client, f"{host}:0", [f"{host}:0"])
        self.uuids = itertools.count(1 + 1000 * setup.index + (0 if self.role == "prefill" else 500))
        self.waiting_pull: dict[str, list] = {}     # prefill: arrays kept alive until pulled
        self.peers: dict[str, object] = {}
        self.started: dict[str, float] = {}
        self.pulled: queue.Queue = queue.Queue()       # decode: (Import, data or exception, seconds)
        self.pulling: set[str] = set()                 # decode: pulls on their way (a dead peer may stall one)
        s = self.engine.scheduler
        conn.send(Hello(self.role, setup.index, self.server.address(), fingerprint(self.engine),
                        dict(max_model_len=s.max_model_len, num_pages=s.allocator.num_pages, num_planes=s.num_planes,
                             page_size=s.page_size, max_num_seqs=s.config.max_num_seqs)))

    def run(self) -> None:
        while True:
            busy = self.engine.has_unfinished_requests() or not self.pulled.empty()
            while self.conn.poll(0 if busy else 0.02):
                if not self.handle(self.conn.recv()):
                    return
            while not self.pulled.empty():
                self._imported(*self.pulled.get())
            if self.engine.has_unfinished_requests():
                self.step()

    def handle(self, msg) -> bool:
        if isinstance(msg, Stop):
            return False
        if isinstance(msg, Prefill):
            self.started[msg.request_id] = time.monotonic()
            self._guard(msg.request_id, self.engine.add_request, msg.request_id,
                        {"prompt_token_ids": msg.prompt_token_ids}, msg.params)
        elif isinstance(msg, Import):
            self.pulling.add(msg.ready.request_id)
            threading.Thread(target=self._pull, args=(msg,), daemon=True).start()
        elif isinstance(msg, Pulled):
            self.waiting_pull.pop(msg.request_id, None)
        elif isinstance(msg, Abort):
            self.waiting_pull.pop(msg.request_id, None)
            self.pulling.discard(msg.request_id)          # a pull still on its way is dropped when it ends
            if msg.request_id in self.engine.requests:
                self.engine.abort_request(msg.request_id)
                self.engine.forget(msg.request_id)
            self.conn.send(Stats(self.engine.stats()))
        return True

    def _guard(self, rid, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - the request fails, the worker goes on
            self.conn.send(Failed(rid, f"{type(exc).__name__}: {exc}"))

    def step(self) -> None:
        outs = self.engine.step()
        for out in outs:
            if self.role == "prefill" and out.token_ids and not out.finished:
                self.conn.send(Output(out))
                self._export(out.request_id)
            else:
                self.conn.send(Output(out))
                if out.finished:
                    self.engine.forget(out.request_id)
        self.conn.send(Stats(self.engine.stats()))

    def _export(self, rid: str) -> None:
        h = export_running(self.engine, rid)
        arrays = jax.device_put([[jax.device_put(np.asarray(x)) for x in jax.tree.leaves(piece)] for piece in h.data])
        uuid = next(self.uuids)
        self.server.await_pull(uuid, arrays)
        self.waiting_pull[rid] = arrays
        specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), h.data)
        self.conn.send(Ready(rid, dataclasses.replace(h, data=specs), uuid, h.nbytes,
                             time.monotonic() - self.started.pop(rid, time.monotonic())))

    def _pull(self, msg: Import) -> None:
        """On its own thread: the pages from the prefill worker's transfer server."""
        ready, t0 = msg.ready, time.monotonic()
        try:
            peer = self.peers.get(msg.transfer_address) or self.server.connect(msg.transfer_address)
            self.peers[msg.transfer_address] = peer
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            specs = ready.handoff.data
            flat = [[jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device) for x in jax.tree.leaves(piece)]
                    for piece in specs]
            deadline = datetime.datetime.now() + datetime.timedelta(seconds=PULL_TIMEOUT_S)
            pulled = peer.pull(ready.uuid, flat, timeout=deadline)
            data = [jax.tree.unflatten(jax.tree.structure(piece), [np.asarray(a) for a in arrays])
                    for piece, arrays in zip(specs, pulled)]
            self.pulled.put((msg, data, time.monotonic() - t0))
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator by the main loop
            self.pulled.put((msg, exc, time.monotonic() - t0))

    def _imported(self, msg: Import, data, seconds: float) -> None:
        rid = msg.ready.request_id
        if rid not in self.pulling:          # aborted (or retried elsewhere) meanwhile
            return
        self.pulling.discard(rid)
        if isinstance(data, Exception):
            self.conn.send(Failed(rid, f"pulling its KV failed: {type(data).__name__}: {data}"))
            return
        try:
            out = import_running(self.engine, dataclasses.replace(msg.ready.handoff, data=data))
        except Exception as exc:  # noqa: BLE001
            self.conn.send(Failed(rid, f"{type(exc).__name__}: {exc}"))
            return
        self.conn.send(Output(out, transfer_seconds=seconds))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    host, port = argv[0].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["RLTJAX_DISAGG_KEY"]))
    conn.send(int(os.environ["RLTJAX_WORKER"]))       # which of the coordinator's processes this is
    setup = conn.recv()
    worker = Worker(conn, setup)
    try:
        worker.run()
    except (EOFError, ConnectionError):      # the coordinator is gone
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A prefill or decode worker: one engine in its own process, driven by the coordinator.

    python -m rltjax.disagg.worker ADDRESS [WORKER]   (the key in RLTJAX_DISAGG_KEY)

The coordinator starts its workers itself, or (``--disagg-remote-workers``) waits for them to
connect from other hosts: then each is started with the coordinator's address and its number,
and its transfer server listens on RLTJAX_TRANSFER_HOST (an address the other workers reach).

Prefill: each prompt runs chunk by chunk with its first head (the engine steps without decode
windows, so a request is never in flight when it is taken off). After every step the prompt
pages that completed are copied out (``handoff.export_pages``) and wait on this process's
transfer server, announced as a ``Chunk``: the decode worker pulls them while the next chunk
runs. With the first token, ``handoff.export_running`` copies the rest and the slot rows.
Decode: pages are held for a request before its prompt runs (``Hold``); its chunks are pulled
on threads as they are announced, and once the rest arrives the pieces are put together
(``handoff.assemble``) and ``import_running`` queues it as a swapped request.
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

from rltjax.disagg.messages import (Abort, Chunk, Failed, Held, Hello, Hold, Import, Output, Prefill, Pulled,
                                    PullChunk, Ready, Setup, Stats, Stop)
from rltjax.engine.admission import prefix_part
from rltjax.engine.handoff import (assemble, complete_pages, export_pages, export_running, fingerprint,
                                   import_running)

PULL_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 300.0


class Worker:
    def __init__(self, conn, setup: Setup):
        from rltjax.entrypoints.llm import build_engine
        self.conn, self.role, self.stream = conn, setup.role, setup.stream
        configs = dict(setup.configs)
        if self.role == "prefill":   # a request is taken off between steps: nothing may be in flight
            configs["execution_config"] = dataclasses.replace(configs["execution_config"], decode_window=0,
                                                              async_scheduling=False)
            configs.pop("speculative_config", None)   # a prefill worker makes one token a request
        self.engine = build_engine(setup.model, **configs)
        host = os.environ.get("RLTJAX_TRANSFER_HOST", "127.0.0.1")
        self.server = transfer.start_transfer_server(jax.devices()[0].client, f"{host}:0", [f"{host}:0"])
        self.uuids = itertools.count(1)
        self.waiting_pull: dict[str, list] = {}     # prefill: arrays kept alive until pulled
        self.sent: dict[str, int] = {}              # prefill: pages per plane announced as chunks
        self.started: dict[str, float] = {}
        self.attempts: dict[str, int] = {}          # prefill: each request's attempt (``Prefill.attempt``)
        self.peers: dict[str, object] = {}
        self.peers_lock = threading.Lock()
        self.pulled: queue.Queue = queue.Queue()    # decode: (kind, message, data or exception, seconds)
        self.parts: dict[str, tuple] = {}           # decode: request -> (attempt, start page -> (pages, data or None))
        self.finals: dict[str, tuple] = {}          # decode: request -> (Import, data, when asked) pulled
        self.cached: dict[str, int] = {}            # decode: request -> prefix pages per plane held from its cache
        s = self.engine.scheduler
        conn.send(Hello(self.role, setup.index, self.server.address(), fingerprint(self.engine),
                        dict(max_model_len=s.max_model_len, num_pages=s.allocator.num_pages, num_planes=s.num_planes,
                             page_size=s.page_size, max_num_seqs=s.config.max_num_seqs,
                             speculative=self.engine.settings.window and self.engine.settings.window.speculative)))

    def run(self) -> None:
        while True:
            busy = self.engine.has_unfinished_requests() or not self.pulled.empty()
            while self.conn.poll(0 if busy else 0.02):
                if not self.handle(self.conn.recv()):
                    return
            while not self.pulled.empty():
                self._pulled(*self.pulled.get())
            if self.engine.has_unfinished_requests():
                self.step()

    def handle(self, msg) -> bool:
        if isinstance(msg, Stop):
            return False
        if isinstance(msg, Prefill):
            # a request's drafts are the decode worker's business (checked when it is imported there)
            msg = dataclasses.replace(msg, params=dataclasses.replace(msg.params, num_speculative_tokens=None))
            self.started[msg.request_id] = time.monotonic()
            self.attempts[msg.request_id] = msg.attempt
            self.sent[msg.request_id] = msg.skip_pages      # the decode worker has these
            self._guard(msg.request_id, self.engine.add_request, msg.request_id,
                        {"prompt_token_ids": msg.prompt_token_ids}, msg.params)
        elif isinstance(msg, Hold):
            self._hold(msg)
        elif isinstance(msg, PullChunk):
            c = msg.chunk
            if self._current(c.request_id, c.attempt):
                self.parts[c.request_id][1][c.start] = (c.num_pages, None)
                self._pull("chunk", msg, msg.transfer_address, c.uuid, c.specs)
        elif isinstance(msg, Import):
            self.parts.setdefault(msg.ready.request_id, (msg.ready.attempt, {}))
            self._pull("final", msg, msg.transfer_address, msg.ready.uuid, msg.ready.handoff.data)
        elif isinstance(msg, Pulled):
            self.waiting_pull.pop(msg.request_id, None)
        elif isinstance(msg, Abort):
            self._forget(msg.request_id)
            if msg.request_id in self.engine.requests:
                self.engine.abort_request(msg.request_id)
                self.engine.forget(msg.request_id)
            self.conn.send(Stats(self.engine.stats()))
        return True

    def _hold(self, msg: Hold) -> None:
        """Pages for a request about to be prefilled elsewhere (no room: it waits at import);
        the coordinator learns how much of its prompt's prefix is cached here."""
        rid, blocks = msg.request_id, self.engine.scheduler.blocks
        blocks.drop_hold(rid)                              # a retry's earlier hold
        self.parts[rid] = (msg.attempt, {})
        self.finals.pop(rid, None)
        part = prefix_part(msg.seed, self.engine.settings.state_seeded)
        cached = blocks.hold(rid, msg.positions, msg.prompt_token_ids, part)
        self.cached[rid] = cached or 0
        self.conn.send(Held(rid, msg.attempt, cached or 0))

    def _forget(self, rid: str) -> None:
        """Whatever this worker keeps for a request outside its engine (pulls still on their way
        are dropped when they end)."""
        for kept in (self.waiting_pull, self.sent, self.started, self.attempts, self.parts, self.finals, self.cached):
            kept.pop(rid, None)
        self.engine.scheduler.blocks.drop_hold(rid)

    def _guard(self, rid, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - the request fails, the worker goes on
            self.conn.send(Failed(rid, f"{type(exc).__name__}: {exc}"))

    def step(self) -> None:
        outs = self.engine.step()
        for out in outs:
            self.conn.send(Output(out))
            if self.role == "prefill" and out.token_ids and not out.finished:
                self._export(out.request_id)
            elif out.finished:
                self._forget(out.request_id)
                self.engine.forget(out.request_id)
        if self.role == "prefill" and self.stream:
            self._stream()
        self.conn.send(Stats(self.engine.stats()))

    # -- prefill: pages out ----------------------------------------------------------------
    def _offer(self, data) -> tuple[int, object]:
        """Pieces put on the transfer server -> (uuid, their shapes)."""
        arrays = jax.device_put([[jax.device_put(np.asarray(x)) for x in jax.tree.leaves(piece)] for piece in data])
        uuid = next(self.uuids)
        self.server.await_pull(uuid, arrays)
        return uuid, arrays

    def _stream(self) -> None:
        """Announce the prompt pages each prefilling request completed in this step."""
        for rid in list(self.started):
            if rid not in self.engine.requests or self.engine.requests[rid].finished:
                continue
            full, sent = complete_pages(self.engine, rid), self.sent.get(rid, 0)
            if full <= sent:
                continue
            data = export_pages(self.engine, rid, sent, full)
            uuid, arrays = self._offer(data)
            self.waiting_pull.setdefault(rid, []).append(arrays)
            self.sent[rid] = full
            self.conn.send(Chunk(rid, uuid, sent, full - sent, _specs(data), _nbytes(data), self.attempts.get(rid, 1)))

    def _export(self, rid: str) -> None:
        h = export_running(self.engine, rid, self.sent.pop(rid, 0), trim=True)
        uuid, arrays = self._offer(h.data)
        self.waiting_pull.setdefault(rid, []).append(arrays)
        self.conn.send(Ready(rid, dataclasses.replace(h, data=_specs(h.data)), uuid, h.nbytes,
                             time.monotonic() - self.started.pop(rid, time.monotonic()), self.attempts.pop(rid, 1)))

    # -- decode: pages in ------------------------------------------------------------------
    def _pull(self, kind: str, msg, address: str, uuid: int, specs) -> None:
        """Pull on a thread of its own; the result joins ``pulled`` for the main loop."""
        def pull():
            t0 = time.monotonic()
            try:
                with self.peers_lock:       # one connection a peer: pulls run on several threads
                    if address not in self.peers:
                        self.peers[address] = self.server.connect(address)
                    peer = self.peers[address]
                device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
                flat = [[jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device) for x in jax.tree.leaves(piece)]
                        for piece in specs]
                deadline = datetime.datetime.now() + datetime.timedelta(seconds=PULL_TIMEOUT_S)
                pulled = peer.pull(uuid, flat, timeout=deadline)
                data = [jax.tree.unflatten(jax.tree.structure(piece), [np.asarray(a) for a in arrays])
                        for piece, arrays in zip(specs, pulled)]
                self.pulled.put((kind, msg, data, t0))
            except Exception as exc:  # noqa: BLE001 - reported to the coordinator by the main loop
                self.pulled.put((kind, msg, exc, t0))
        threading.Thread(target=pull, daemon=True).start()

    def _current(self, rid: str, attempt: int) -> bool:
        """Whether pages of this prefill attempt are still wanted (not aborted, not retried since)."""
        return rid in self.parts and self.parts[rid][0] == attempt

    def _pulled(self, kind: str, msg, data, asked: float) -> None:
        rid, attempt = ((msg.chunk.request_id, msg.chunk.attempt) if kind == "chunk" else
                        (msg.ready.request_id, msg.ready.attempt))
        if not self._current(rid, attempt):   # aborted, or retried meanwhile
            return
        if kind == "chunk":
            self.parts[rid][1][msg.chunk.start] = (msg.chunk.num_pages, data)
        else:
            self.finals[rid] = (msg, data, asked)
        final = self.finals.get(rid)
        if final is None or any(d is None for _, d in self.parts[rid][1].values()):
            return
        msg, data, asked = final
        failed = [d for d in [data] + [d for _, d in self.parts[rid][1].values()] if isinstance(d, Exception)]
        parts = self.parts.pop(rid)[1]
        self.finals.pop(rid)
        if failed:
            self.engine.scheduler.blocks.drop_hold(rid)
            self.conn.send(Failed(rid, f"pulling its KV failed: {type(failed[0]).__name__}: {failed[0]}", pull=True,
                                  attempt=msg.ready.attempt))
            return
        try:
            h, cached = msg.ready.handoff, self.cached.pop(rid, 0)
            data = assemble(dataclasses.replace(h, data=data), parts, self.engine.settings.num_planes, cached)
            out = import_running(self.engine, dataclasses.replace(h, data=data, start_page=cached), cached)
        except Exception as exc:  # noqa: BLE001
            if rid in self.engine.requests:       # queued without its copy: it must not prefill here
                self.engine.abort_request(rid)
                self.engine.forget(rid)
            self.engine.scheduler.blocks.drop_hold(rid)
            self.conn.send(Failed(rid, f"{type(exc).__name__}: {exc}"))
            return
        self.conn.send(Output(out, transfer_seconds=time.monotonic() - asked, attempt=msg.ready.attempt))


def _specs(data):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), data)


def _nbytes(data) -> int:
    return sum(int(np.asarray(x).nbytes) for x in jax.tree.leaves(data))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    host, port = argv[0].rsplit(":", 1)
    deadline = time.monotonic() + CONNECT_TIMEOUT_S      # a worker may start before its coordinator listens
    while True:
        try:
            conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["RLTJAX_DISAGG_KEY"]))
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    conn.send(int(argv[1]) if len(argv) > 1 else int(os.environ["RLTJAX_WORKER"]))   # which worker this is
    setup = conn.recv()
    worker = Worker(conn, setup)
    try:
        worker.run()
    except (EOFError, ConnectionError):      # the coordinator is gone
        pass
    # Leave without tearing down the transfer server and its peer connections: their native
    # destructors, run in the interpreter's arbitrary teardown order, aborted a decode worker.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())

"""The coordinator: the engine the server drives when prefill and decode run on separate workers.

``DisaggEngine`` has the engine interface ``AsyncEngine`` uses (add, step, abort, outputs,
stats). It starts the workers (``disagg.worker``, one process each), gives each request to the
least-loaded prefill worker and, once its prompt ran, to the least-loaded decode worker, which
pulls the pages straight from the prefill worker's transfer server. ``step`` waits briefly
for what the workers report and returns the outputs that changed. A worker that dies is
handled, never waited on: its requests in prefill go to another prefill worker (or fail when
none is left), those on a dead decode worker fail; the server stays up.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import subprocess
import sys
import time
from multiprocessing.connection import Listener, wait

from rltjax.disagg.messages import (Abort, Failed, Hello, Import, Output, Prefill, Pulled, Ready, Setup, Stats,
                                    Stop)
from rltjax.engine.outputs import RequestOutput
from rltjax.engine.request_intake import resolve_seed
from rltjax.engine.sequence import RequestRejectedError
from rltjax.engine.stats import EngineStats
from rltjax.tokenizer import Tokenizer

log = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0


@dataclasses.dataclass
class _Link:
    role: str
    index: int
    proc: subprocess.Popen
    conn: object = None
    hello: Hello | None = None
    stats: EngineStats | None = None
    alive: bool = True
    load: int = 0                 # requests it holds


@dataclasses.dataclass
class _Tracked:
    prompt_token_ids: list[int]
    params: object
    output: RequestOutput
    prefill: _Link | None = None
    decode: _Link | None = None
    stage: str = "prefill"        # prefill | decode | done
    imported: bool = False        # the decode worker has its pages


class _Facts:
    """What the server reads of an engine's scheduler (the decode workers')."""

    def __init__(self, facts: dict):
        self.max_model_len, self.num_planes, self.page_size = (facts["max_model_len"], facts["num_planes"],
                                                               facts["page_size"])
        self.allocator = type("Pool", (), {"num_pages": facts["num_pages"]})()
        self.config = type("Config", (), {"max_num_seqs": facts["max_num_seqs"]})()


class DisaggEngine:
    def __init__(self, model: str, configs: dict, *, num_prefill: int, num_decode: int):
        if num_prefill < 1 or num_decode < 1:
            raise ValueError("--num-prefill-workers and --num-decode-workers must both be >= 1")
        key = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=key)
        address = "%s:%d" % self._listener.address
        roles = [(role, i) for role, n in (("prefill", num_prefill), ("decode", num_decode)) for i in range(n)]
        tp = configs["parallel_config"].tensor_parallel_size if configs.get("parallel_config") else 1
        self.links = []
        for k, (role, i) in enumerate(roles):     # worker k owns GPUs k*tp .. (k+1)*tp - 1 (CPUs: its own)
            env = {**os.environ, "RLTJAX_DISAGG_KEY": key.hex(), "RLTJAX_WORKER": str(k),
                   "CUDA_VISIBLE_DEVICES": ",".join(str(k * tp + j) for j in range(tp))}
            self.links.append(_Link(role, i, subprocess.Popen(
                [sys.executable, "-m", "rltjax.disagg.worker", address], env=env)))
        for _ in self.links:          # workers connect in any order and say which they are
            conn = self._listener.accept()
            self.links[conn.recv()].conn = conn
        for link in self.links:
            link.conn.send(Setup(model, configs, link.role, link.index))
        deadline = time.monotonic() + START_TIMEOUT_S
        for link in self.links:
            if not link.conn.poll(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"{link.role} worker {link.index} did not start in {START_TIMEOUT_S:.0f} s")
            link.hello = link.conn.recv()
        prints = {link.hello.fingerprint for link in self.links}
        if len(prints) > 1:
            self.close()
            raise ValueError(f"the workers compute different things: {sorted(prints)}")
        try:
            self.tokenizer = Tokenizer.from_dir(model)
        except ValueError:            # a model without a tokenizer takes token ids
            self.tokenizer = None
        self.scheduler = _Facts(self._decoders()[0].hello.facts)
        self.requests: dict[str, _Tracked] = {}
        self.steps_by_kind: dict[str, int] = {}
        self.transfer_bytes = 0
        self.transfer_seconds = 0.0
        self.retries = 0
        self._changed: dict[str, RequestOutput] = {}     # outputs to hand out at the next step
        self._stages: list[tuple[str, float]] = []         # (stage, seconds) since the last take_stage_timings

    def _decoders(self) -> list[_Link]:
        return [link for link in self.links if link.role == "decode" and link.alive]

    def _prefillers(self) -> list[_Link]:
        return [link for link in self.links if link.role == "prefill" and link.alive]

    # -- the engine interface ------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params=None) -> None:
        request_id = str(request_id)
        if request_id in self.requests:
            raise RequestRejectedError(f"request_id {request_id!r} is already in use")
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else (
            self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt))
        params = resolve_seed(params)
        out = RequestOutput(request_id, prompt_token_ids=list(ids))
        out.metrics["arrival_time"] = time.monotonic()
        if not self._prefillers() or not self._decoders():
            raise RequestRejectedError("no prefill or no decode worker is alive")
        self.requests[request_id] = _Tracked(list(ids), params, out)
        self._send_prefill(request_id)

    def _send_prefill(self, rid: str) -> None:
        t = self.requests[rid]
        t.prefill = min(self._prefillers(), key=lambda w: w.load)
        t.prefill.load += 1
        t.stage = "prefill"
        self._send(t.prefill, Prefill(rid, t.prompt_token_ids, t.params))

    def step(self) -> list[RequestOutput]:
        live = {link.conn: link for link in self.links if link.alive}
        ready = wait(list(live), timeout=0.005 if self.has_unfinished_requests() else 0.0)
        for conn in ready:
            link = live[conn]
            try:
                while link.alive and conn.poll():
                    self._receive(link, conn.recv())
            except (EOFError, ConnectionError, OSError):
                self._lost(link)
        if not ready:
            self.steps_by_kind["idle"] = self.steps_by_kind.get("idle", 0) + 1
        changed, self._changed = self._changed, {}
        return list(changed.values())

    def _send(self, link: _Link, msg) -> bool:
        """Send, or learn that the worker is gone (its requests are then retried or failed)."""
        try:
            link.conn.send(msg)
            return True
        except (OSError, EOFError, ValueError):
            if link.alive:
                self._lost(link)
            return False

    def _receive(self, link: _Link, msg) -> None:
        if isinstance(msg, Stats):
            link.stats = msg.stats
            return
        rid = msg.request_id if not isinstance(msg, Output) else msg.output.request_id
        t = self.requests.get(rid)
        if t is None or t.stage == "done":     # aborted meanwhile (a late report)
            if isinstance(msg, Ready):
                self._send(link, Pulled(rid))
            return
        if isinstance(msg, Output):
            self._update(rid, t, msg)
        elif isinstance(msg, Ready):
            self._hand_over(rid, t, msg)
        elif isinstance(msg, Failed):
            if link.role == "decode" and t.decode is not link:
                return                           # stale: it was retried elsewhere meanwhile
            if link.role == "decode" and not t.imported and (t.prefill is None or not t.prefill.alive):
                self._retry(rid, t)     # the pull failed: its prefill worker died mid-transfer
            else:
                self._fail(rid, msg.error)

    def _update(self, rid, t: _Tracked, msg: Output) -> None:
        out = msg.output
        if msg.transfer_seconds is not None:
            t.imported = True
            self.transfer_seconds += msg.transfer_seconds
            self._stages.append(("transfer", msg.transfer_seconds))
            if t.prefill is not None and t.prefill.alive:
                self._send(t.prefill, Pulled(rid))
        if len(out.token_ids) < len(t.output.token_ids) and not out.finished:
            return                                 # the decode worker's echo of what was already sent
        out.metrics = {**t.output.metrics, **{k: v for k, v in out.metrics.items() if v is not None}}
        t.output = out
        if out.finished:
            self._done(t)
        self._changed[rid] = out

    def _hand_over(self, rid, t: _Tracked, ready: Ready) -> None:
        self._stages.append(("prefill", ready.prefill_seconds))
        t.prefill.load -= 1
        workers = self._decoders()
        if not workers:
            return self._fail(rid, "no decode worker is alive")
        t.decode, t.stage = min(workers, key=lambda w: w.load), "decode"
        t.decode.load += 1
        self.transfer_bytes += ready.nbytes
        self._send(t.decode, Import(ready, t.prefill.hello.transfer_address))

    def _lost(self, link: _Link) -> None:
        """A worker died: retry its prompts elsewhere, fail what it was decoding."""
        link.alive = False
        try:
            code = link.proc.wait(1)
        except subprocess.TimeoutExpired:
            code = None
        log.warning(f"{link.role} worker {link.index} is gone (exit status {code})")
        for rid, t in list(self.requests.items()):
            if t.stage == "prefill" and t.prefill is link:
                link.load, t.stage = link.load - 1, "retry"
                self._retry(rid, t)
            elif t.stage == "decode" and t.decode is link:
                self._fail(rid, "the decode worker holding it died")
            elif t.stage == "decode" and t.prefill is link and not t.imported:
                if t.decode.alive:
                    self._send(t.decode, Abort(rid))   # its pull cannot finish: prefill again
                self._retry(rid, t)

    def _retry(self, rid: str, t: _Tracked) -> None:
        if t.stage == "decode":
            t.decode.load -= 1
        t.decode, t.stage = None, "retry"
        if not self._prefillers() or not self._decoders():
            return self._fail(rid, "no prefill or decode worker left to retry on")
        self.retries += 1
        self._send_prefill(rid)

    def _fail(self, rid: str, error: str) -> None:
        t = self.requests[rid]
        out = dataclasses.replace(t.output, finished=True, finish_reason="error", error=error)
        t.output = out
        self._done(t)
        self._changed[rid] = out

    def _done(self, t: _Tracked) -> None:
        if t.stage == "prefill" and t.prefill is not None:
            t.prefill.load -= 1
        if t.stage == "decode" and t.decode is not None:
            t.decode.load -= 1
        t.stage = "done"

    def abort_request(self, request_id: str) -> RequestOutput | None:
        t = self.requests.get(str(request_id))
        if t is None or t.stage == "done":
            return None
        for link in (t.prefill, t.decode):
            if link is not None and link.alive:
                self._send(link, Abort(str(request_id)))
        t.output = dataclasses.replace(t.output, finished=True, finish_reason="abort")
        self._done(t)
        return t.output

    def has_unfinished_requests(self) -> bool:
        return any(t.stage != "done" for t in self.requests.values())

    def get_output(self, request_id: str) -> RequestOutput:
        return self.requests[str(request_id)].output

    def forget(self, request_id: str) -> None:
        self.requests.pop(str(request_id), None)

    def take_stage_timings(self) -> tuple[list[tuple[str, float]], int]:
        """(stage, seconds) of each prompt's prefill and pages' transfer since the last call, and
        the bytes moved in total (the server's /metrics)."""
        stages, self._stages = self._stages, []
        return stages, self.transfer_bytes

    def worker_stats(self) -> list[EngineStats]:
        return [link.stats for link in self.links if link.alive and link.stats is not None]

    def stats(self) -> EngineStats:
        each = [link.stats for link in self.links if link.alive and link.stats is not None and link.role == "decode"]
        fields = [f.name for f in dataclasses.fields(EngineStats)]
        if not each:
            return EngineStats(**{f: 0 for f in fields})
        return EngineStats(**{f: sum(getattr(s, f) for s in each) for f in fields})

    def close(self) -> None:
        for link in self.links:
            if link.alive:
                try:
                    link.conn.send(Stop())
                except (OSError, ValueError):
                    pass
        for link in self.links:
            try:
                link.proc.wait(30)
            except subprocess.TimeoutExpired:
                link.proc.kill()
        self._listener.close()

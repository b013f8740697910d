"""The coordinator: the engine the server drives when prefill and decode run on separate workers.

``DisaggEngine`` has the engine interface ``AsyncEngine`` uses (add, step, abort, outputs,
stats). It starts the workers (``disagg.worker``, one process each; or waits for them to connect
from other hosts), and gives each request to the least-loaded decode worker, which holds pages
for its prompt, and to the least-loaded prefill worker, whose completed prompt pages the decode
worker pulls straight from the prefill worker's transfer server while the rest of the prompt
runs (``Chunk``), then the rest once its first token is out. ``step`` waits briefly
for what the workers report and returns the outputs that changed. A worker that dies is
handled, never waited on: its requests in prefill go to another prefill worker (or fail when
none is left), those on a dead decode worker fail; the server stays up.
"""
from __future__ import annotations

import dataclasses
import logging
import subprocess
import time
from multiprocessing.connection import wait

from rltjax.disagg.links import Link, start_workers, stop_workers
from rltjax.disagg.messages import (Abort, Chunk, Failed, Held, Hold, Import, Output, Prefill, Pulled, PullChunk,
                                    Ready, Stats)
from rltjax.engine.outputs import RequestOutput
from rltjax.engine.request_intake import resolve_seed, speculative_tokens
from rltjax.engine.sequence import RequestRejectedError
from rltjax.engine.stats import EngineStats
from rltjax.sampling_params import SamplingParamsError
from rltjax.tokenizer import Tokenizer

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 3      # prefills a request gets when its pages cannot be pulled


@dataclasses.dataclass
class _Tracked:
    prompt_token_ids: list[int]
    params: object
    output: RequestOutput
    prefill: Link | None = None
    decode: Link | None = None
    stage: str = "prefill"        # prefill | decode | done
    imported: bool = False        # the decode worker has its pages
    attempts: int = 0             # prefills asked for it
    held_asked: float = 0.0       # when its decode worker was asked to hold pages


class _Facts:
    """What the server reads of an engine's scheduler (the decode workers')."""

    def __init__(self, facts: dict):
        self.max_model_len, self.num_planes, self.page_size = (facts["max_model_len"], facts["num_planes"],
                                                               facts["page_size"])
        self.allocator = type("Pool", (), {"num_pages": facts["num_pages"]})()
        self.config = type("Config", (), {"max_num_seqs": facts["max_num_seqs"]})()


class DisaggEngine:
    def __init__(self, model: str, configs: dict, *, num_prefill: int, num_decode: int,
                 address: str = "127.0.0.1:0", remote_workers: bool = False, stream_pages: bool = True):
        """address: where the workers reach this coordinator (HOST:PORT; port 0: any free one).
        remote_workers: start no worker here; wait for num_prefill + num_decode workers started
        on other hosts (``python -m rltjax.disagg.worker HOST:PORT K``, K = 0 .. P + D - 1, the
        first P prefill; RLTJAX_DISAGG_KEY the same hex key on every host, and each worker's
        RLTJAX_TRANSFER_HOST an address the other workers reach). stream_pages: a prompt's pages
        move as they complete (False: all once its first token is out; ``scripts/bench_disagg.py``
        compares the two)."""
        self._listener, self.links = start_workers(model, configs, num_prefill, num_decode, address, remote_workers,
                                                   stream_pages)
        try:
            self.tokenizer = Tokenizer.from_dir(model)
        except ValueError:            # a model without a tokenizer takes token ids
            self.tokenizer = None
        self.scheduler = _Facts(self._decoders()[0].hello.facts)
        self.requests: dict[str, _Tracked] = {}
        self.steps_by_kind: dict[str, int] = {}
        self.transfer_bytes = 0
        self.streamed_bytes = 0          # of them, pulled while their prompt still ran
        self.cached_pages = 0            # prompt pages per plane not sent: the decode worker's prefix cache had them
        self.transfer_seconds = 0.0
        self.retries = 0
        self._changed: dict[str, RequestOutput] = {}     # outputs to hand out at the next step
        self._stages: list[tuple[str, float]] = []         # (stage, seconds) since the last take_stage_timings

    def _decoders(self) -> list[Link]:
        return [link for link in self.links if link.role == "decode" and link.alive]

    def _prefillers(self) -> list[Link]:
        return [link for link in self.links if link.role == "prefill" and link.alive]

    # -- the engine interface ------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params=None) -> None:
        request_id = str(request_id)
        if request_id in self.requests:
            raise RequestRejectedError(f"request_id {request_id!r} is already in use")
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else (
            self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt))
        params = resolve_seed(params)
        self._check_speculation(request_id, params)
        out = RequestOutput(request_id, prompt_token_ids=list(ids))
        out.metrics["arrival_time"] = time.monotonic()
        if not self._prefillers() or not self._decoders():
            raise RequestRejectedError("no prefill or no decode worker is alive")
        self.requests[request_id] = _Tracked(list(ids), params, out)
        self._send_prefill(request_id)

    def _check_speculation(self, rid: str, params) -> None:
        """A request's speculation against the decode workers' (the prefill workers run none):
        refused here, before its prompt runs, as a decode worker would refuse it."""
        spec = self._decoders()[0].hello.facts.get("speculative") if self._decoders() else None
        depth = params.max_loops if params.max_loops is not None else (spec.target_loops if spec else 0)
        try:
            speculative_tokens(params, depth, spec)
        except SamplingParamsError as exc:
            raise RequestRejectedError(f"request {rid!r}: {exc}") from None

    def _send_prefill(self, rid: str) -> None:
        """The least-loaded decode worker holds pages for the prompt (``Held`` says how much of
        its prefix it has cached); then the least-loaded prefill worker runs it."""
        t = self.requests[rid]
        if t.decode is None:
            t.decode = min(self._decoders(), key=lambda w: w.load)
            t.decode.load += 1
        t.attempts += 1
        t.stage, t.held_asked = "holding", time.monotonic()
        reuse = t.params.prompt_logprobs is None        # those run (and score) every prompt token
        self._send(t.decode, Hold(rid, len(t.prompt_token_ids) + 1, t.attempts,
                                  tuple(t.prompt_token_ids) if reuse else (), t.params.seed))

    def _held(self, rid: str, t: _Tracked, msg: Held) -> None:
        if t.stage != "holding" or msg.attempt != t.attempts:
            return                                       # a retry's earlier hold
        self._stages.append(("hold", time.monotonic() - t.held_asked))
        if not self._prefillers():
            return self._fail(rid, "no prefill worker is alive")
        t.prefill = min(self._prefillers(), key=lambda w: w.load)
        t.prefill.load += 1
        t.stage = "prefill"
        self.cached_pages += msg.cached_pages
        self._send(t.prefill, Prefill(rid, t.prompt_token_ids, t.params, t.attempts, msg.cached_pages))

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

    def _send(self, link: Link, msg) -> bool:
        """Send, or learn that the worker is gone (its requests are then retried or failed)."""
        try:
            link.conn.send(msg)
            return True
        except (OSError, EOFError, ValueError):
            if link.alive:
                self._lost(link)
            return False

    def _receive(self, link: Link, msg) -> None:
        if isinstance(msg, Stats):
            link.stats = msg.stats
            return
        rid = msg.request_id if not isinstance(msg, Output) else msg.output.request_id
        t = self.requests.get(rid)
        if t is None or t.stage == "done":     # aborted meanwhile (a late report): let go of its pages
            if isinstance(msg, Ready):
                self._send(link, Pulled(rid))
            elif isinstance(msg, Held):
                self._send(link, Abort(rid))
            return
        if isinstance(msg, Output):
            self._update(rid, t, msg)
        elif isinstance(msg, Held):
            self._held(rid, t, msg)
        elif isinstance(msg, Chunk):
            self.transfer_bytes += msg.nbytes
            self.streamed_bytes += msg.nbytes
            if t.decode is not None and t.decode.alive:
                self._send(t.decode, PullChunk(msg, link.hello.transfer_address))
        elif isinstance(msg, Ready):
            self._hand_over(rid, t, msg)
        elif isinstance(msg, Failed):
            if (link.role == "decode" and t.decode is not link) or (msg.pull and msg.attempt != t.attempts):
                return                           # stale: it was retried meanwhile
            if msg.pull and t.prefill is not None and t.prefill.alive and t.prefill.proc is not None \
                    and t.prefill.proc.poll() is not None:
                self._lost(t.prefill)           # the pull failed because its prefill worker died: retried
            elif msg.pull and not t.imported and t.attempts < MAX_ATTEMPTS:
                self._retry(rid, t)             # the pull failed (its prefill worker died mid-transfer)
            else:
                self._fail(rid, msg.error)

    def _update(self, rid, t: _Tracked, msg: Output) -> None:
        out = msg.output
        if msg.transfer_seconds is not None and msg.attempt != t.attempts:
            return                                 # an import of an attempt aborted since (its worker died)
        if msg.transfer_seconds is not None:
            t.imported = True
            self.transfer_seconds += msg.transfer_seconds
            self._stages.append(("transfer", msg.transfer_seconds))
            if t.prefill is not None and t.prefill.alive:
                self._send(t.prefill, Pulled(rid))
        if len(out.token_ids) < len(t.output.token_ids) and not out.finished:
            return                                 # the decode worker's echo of what was already sent
        if out.token_ids and not t.output.token_ids:     # its first token, from the prefill worker
            self._stages.append(("first_token", time.monotonic() - t.output.metrics["arrival_time"]))
        out.metrics = {**t.output.metrics, **{k: v for k, v in out.metrics.items() if v is not None}}
        t.output = out
        if out.finished:
            if t.stage == "prefill" and t.decode is not None and t.decode.alive:
                self._send(t.decode, Abort(rid))     # done in its prefill: the held pages go back
            self._done(t)
        self._changed[rid] = out

    def _hand_over(self, rid, t: _Tracked, ready: Ready) -> None:
        self._stages.append(("prefill", ready.prefill_seconds))
        t.prefill.load -= 1
        t.stage = "decode"
        if not t.decode.alive:
            return self._fail(rid, "the decode worker holding its pages died")
        self.transfer_bytes += ready.nbytes
        self._send(t.decode, Import(ready, t.prefill.hello.transfer_address))

    def _lost(self, link: Link) -> None:
        """A worker died: retry its prompts elsewhere, fail what it was decoding."""
        link.alive = False
        try:
            code = link.proc.wait(1) if link.proc is not None else None
        except subprocess.TimeoutExpired:
            code = None
        log.warning(f"{link.role} worker {link.index} is gone (exit status {code})")
        for rid, t in list(self.requests.items()):
            if t.stage in ("holding", "prefill", "decode") and t.decode is link:
                self._fail(rid, "the decode worker holding it died")     # aborts it on the prefill worker
            elif t.stage == "prefill" and t.prefill is link:
                link.load = link.load - 1
                self._retry(rid, t)
            elif t.stage == "decode" and t.prefill is link and not t.imported:
                self._retry(rid, t)     # its pull cannot finish: the decode worker drops it, prefill again

    def _retry(self, rid: str, t: _Tracked) -> None:
        """Its prompt again on another prefill worker; the decode worker drops what it pulled
        and holds its pages again."""
        t.stage = "retry"
        for link in (t.decode, t.prefill):      # what either kept of the failed attempt goes
            if link is not None and link.alive:
                self._send(link, Abort(rid))
        if not self._prefillers() or t.decode is None or not t.decode.alive:
            return self._fail(rid, "no prefill or decode worker left to retry on")
        self.retries += 1
        self._send_prefill(rid)

    def _fail(self, rid: str, error: str) -> None:
        t = self.requests[rid]
        for link in (t.prefill, t.decode):      # pages held, copies waiting to be pulled: freed
            if link is not None and link.alive:
                self._send(link, Abort(rid))
        out = dataclasses.replace(t.output, finished=True, finish_reason="error", error=error)
        t.output = out
        self._done(t)
        self._changed[rid] = out

    def _done(self, t: _Tracked) -> None:
        if t.stage == "prefill" and t.prefill is not None:
            t.prefill.load -= 1
        if t.stage != "done" and t.decode is not None:
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
        """(stage, seconds) since the last call, and the bytes moved in total (the server's
        /metrics): each request's hold (its decode worker holding pages), prefill (on its prefill
        worker, waiting there included), transfer (after its first token, until the decode worker
        queued it) and first_token (from its arrival here)."""
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
        stop_workers(self._listener, self.links)

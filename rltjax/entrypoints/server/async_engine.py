"""AsyncEngine: the synchronous LLMEngine driven by its own thread, fed from asyncio.

Why a thread: ``LLMEngine.step`` blocks on the device for a whole batch. Run on
the event loop it would stall every connection; run here, the loop only parses
requests and writes responses while the engine thread steps. The engine is
touched by this thread alone (no lock around the engine): the loop hands it
commands (add, abort) through a condition-guarded list, and the thread hands
back each ``RequestOutput`` to the request's ``asyncio.Queue`` through
``loop.call_soon_threadsafe``. With no work the thread sleeps on the condition.

``RequestStream`` (request_stream.py) is one request's handle on the loop side.
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any, Callable

from rltjax.engine.outputs import RequestOutput
from rltjax.entrypoints.server.request_stream import RequestStream


class EngineUnavailable(RuntimeError):
    """The engine is loading, draining or dead: the caller should answer 503."""


@dataclasses.dataclass
class _Track:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    submitted: float
    num_tokens: int = 0
    last_token: float | None = None


class AsyncEngine:
    def __init__(self, engine_factory: Callable[[], Any], metrics=None,
                 on_fatal: Callable[[str], None] | None = None):
        self._factory = engine_factory
        self.metrics = metrics
        self.on_fatal = on_fatal
        self.engine = None
        self.ready = False            # loaded (and compiled ahead, if configured)
        self.draining = False
        self.error: str | None = None
        self.in_flight = 0            # loop side: streams opened and not closed
        self.num_running = 0          # engine side snapshots, read by the loop
        self.num_waiting = 0
        self._cond = threading.Condition()
        self._cmds: list[tuple] = []
        self._stop = False
        self._dead = False            # the thread has ended: commands are refused at once
        self._tracks: dict[str, _Track] = {}
        self._thread = threading.Thread(target=self._run, name="rltjax-engine", daemon=True)

    # -- loop side --------------------------------------------------------------------
    def start(self) -> None:
        """Start loading the engine in its thread (idempotent)."""
        if self._thread.ident is None:
            self._thread.start()

    def check_available(self) -> None:
        if self.error:
            raise EngineUnavailable(f"the engine is not available: {self.error}")
        if self.draining or self._dead:
            raise EngineUnavailable("the server is shutting down")
        if not self.ready:
            raise EngineUnavailable("the model is still loading")

    def waiting_estimate(self) -> int:
        """Requests accepted but not yet running, up to one engine step of lag.

        At most max_num_seqs run, so any excess is waiting; and the engine's last
        report counts requests that free slots could not admit (KV pages short).
        """
        replicas = len(getattr(self.engine, "replicas", (self.engine,)))
        slots = self.engine.scheduler.config.max_num_seqs * replicas if self.engine is not None else 0
        return max(0, self.in_flight - slots, self.num_waiting)

    def open_stream(self, request_id: str) -> RequestStream:
        """Synchronous, so capacity checks and the slot they grant cannot interleave."""
        self.check_available()
        self.in_flight += 1
        return RequestStream(self, request_id)

    async def submit(self, stream: RequestStream, prompt, params) -> None:
        """Queue the request; raise what ``add_request`` raised (e.g. RequestRejectedError)."""
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()
        track = _Track(loop, stream.queue, time.monotonic())
        self._command(("add", stream.request_id, prompt, params, track, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(stream.request_id)
            raise

    def abort(self, request_id: str) -> None:
        self._command(("abort", request_id))

    def begin_drain(self) -> None:
        self.draining = True

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is left and end the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _command(self, cmd: tuple) -> None:
        with self._cond:
            if not self._dead:
                self._cmds.append(cmd)
                self._cond.notify()
                return
        if cmd[0] == "add":
            _settle(cmd[5], EngineUnavailable(f"the engine is not available: {self.error or 'stopped'}"))

    # -- engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as exc:  # noqa: BLE001 - reported to the server, which exits
            self._die(f"loading failed: {type(exc).__name__}: {exc}")
            return
        self.ready = True
        while True:
            with self._cond:
                while not self._cmds and not self._stop and not self.engine.has_unfinished_requests():
                    self._publish()
                    self._cond.wait()
                cmds, self._cmds, stop = self._cmds, [], self._stop
            for cmd in cmds:
                self._apply(cmd)
            if stop:
                for rid in list(self._tracks):
                    self._apply(("abort", rid))
                self._publish()
                if hasattr(self.engine, "close"):     # a multi-host leader lets its followers go
                    self.engine.close()
                self._die(None)
                return
            if self.engine.has_unfinished_requests():
                idle = self.engine.steps_by_kind.get("idle", 0)
                try:
                    outs = self.engine.step()
                except Exception as exc:  # noqa: BLE001 - KV pool gone or host state unknown
                    self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                    return
                for out in outs:
                    self._deliver(out)
                if self.engine.steps_by_kind.get("idle", 0) > idle:   # nothing runnable: do not spin
                    with self._cond:
                        self._cond.wait(0.005)
            self._publish()

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, prompt, params, track, accepted = cmd
            try:
                replica = self.engine.add_request(rid, prompt, params)
            except Exception as exc:  # noqa: BLE001 - handed to the submitter
                _call(track.loop, _settle, accepted, exc)
                return
            if self.metrics is not None:
                self.metrics.replica_requests.labels(str(replica or 0)).inc()
            self._tracks[rid] = track
            _call(track.loop, _settle, accepted, None)
        else:
            out = self.engine.abort_request(cmd[1])
            if out is not None:
                self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        track = self._tracks.get(out.request_id)
        if track is None:
            return
        if self.metrics is not None:
            self.metrics.observe(track, out, time.monotonic())
        _call(track.loop, track.queue.put_nowait, out)
        if out.finished:
            del self._tracks[out.request_id]
            self.engine.forget(out.request_id)

    def _publish(self) -> None:
        each = self.engine.replica_stats() if hasattr(self.engine, "replica_stats") else [self.engine.stats()]
        stats = self.engine.stats() if len(each) > 1 else each[0]
        self.num_running, self.num_waiting = stats.num_running, stats.num_waiting
        if self.metrics is not None:
            self.metrics.set_state(stats)
            self.metrics.set_replicas(each)
            if hasattr(self.engine, "take_stage_timings"):      # prefill/decode workers
                self.metrics.observe_stages(*self.engine.take_stage_timings())

    def _fail_all(self, message: str) -> None:
        """Finish every tracked request with an error (the engine cannot go on), then die."""
        for rid in list(self._tracks):
            out = self.engine.get_output(rid)
            if not out.finished:
                out.finished, out.finish_reason, out.error = True, "error", message
            self._deliver(out)
        self._die(message)

    def _die(self, message: str | None) -> None:
        """End of the thread (``message`` None: a requested stop). Refuse what is queued."""
        with self._cond:
            self._dead, self.ready = True, False
            self.error = self.error or message
            cmds, self._cmds = self._cmds, []
        for cmd in cmds:
            if cmd[0] == "add":
                _call(cmd[4].loop, _settle, cmd[5], EngineUnavailable("the engine stopped"))
        if message is not None and hasattr(self.engine, "close"):
            try:                     # worker processes, or a multi-host job's followers, let go
                self.engine.close()
            except Exception:  # noqa: BLE001 - already failing; the message below says why
                pass
        if message is not None and self.on_fatal is not None:
            self.on_fatal(message)


def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:   # the loop is closed: nobody is listening any more
        pass


def _settle(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():   # the submitter was cancelled meanwhile
        return
    fut.set_result(None) if exc is None else fut.set_exception(exc)

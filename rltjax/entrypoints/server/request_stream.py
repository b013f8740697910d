"""RequestStream: one request's handle on the event-loop side of the AsyncEngine.

The engine thread puts each new ``RequestOutput`` (a full snapshot, not a delta)
on ``queue``; a reader that fell behind can skip to the newest one. ``close()``
is the single exit path: it gives back the in-flight count used for
backpressure and aborts the request unless it finished, so a client that went
away frees its KV pages at once.
"""
from __future__ import annotations

import asyncio

from rltjax.engine.outputs import RequestOutput


class RequestStream:
    """Loop-side handle: ``async for out in stream`` yields outputs until the final one."""

    def __init__(self, engine, request_id: str):
        self.engine, self.request_id, self.queue = engine, request_id, asyncio.Queue()
        self.finished = self._closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self.queue.get()
        while not out.finished and not self.queue.empty():   # a slow reader skips to the newest state
            out = self.queue.get_nowait()
        self.finished = out.finished
        return out

    async def final(self) -> RequestOutput:
        async for out in self:
            if out.finished:
                return out

    def close(self) -> None:
        """Idempotent: abort if still running and give back the in-flight slot."""
        if self._closed:
            return
        self._closed = True
        self.engine.in_flight -= 1
        if not self.finished:
            self.engine.abort(self.request_id)

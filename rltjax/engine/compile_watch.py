"""Executables obtained while a benchmark is timed.

A compile (or a persistent-cache load) inside a timed run stalls every request in
flight for its whole duration, and on a GPU that is seconds to tens of seconds: a
run that pays one measures the compiler, not the engine. Every benchmark wraps its
timed runs in ``CompileWatch`` and reports what it saw, so such a number cannot
pass unnoticed (it is how a second decode-window executable, compiled at the first
continued window of each row bucket, showed up as "slow fixed-depth windows").
"""
from __future__ import annotations

import jax

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"   # every XLA compile or cache load


class CompileWatch:
    """``with CompileWatch() as w: ...`` then ``w.count`` executables in ``w.seconds``;
    ``w.events`` lists every compile-stage event (tracing and lowering included)."""

    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        self.events: list[str] = []

    def _listener(self, event: str, duration: float, **kwargs) -> None:
        if "compile" in event:
            self.events.append(event)
        if event == BACKEND_COMPILE:
            self.count += 1
            self.seconds += duration

    def __enter__(self) -> "CompileWatch":
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listener)

    def report(self) -> dict:
        return dict(count=self.count, seconds=round(self.seconds, 3))

    def warning(self, what: str) -> str | None:
        """A line for the log when the run compiled anything, else None."""
        if not self.count:
            return None
        return (f"WARNING: {what} compiled {self.count} executable(s) inside the timed run "
                f"({self.seconds:.1f}s): its numbers include that stall")

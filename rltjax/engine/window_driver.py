"""Host side of decode windows: pack the rows, launch, continue, read one window late.

The device side is ``decode_window``. Here a window over every decoding request is
launched and left running; while nothing else can be scheduled (the same requests, all
still decoding, no admission possible), the next window is launched from the device's
row state before the host reads the last one. Reading replays the outputs through the
engine's per-token acceptance (stop checks, finish) and takes each request's exit state
back, so a step-by-step step can follow at any point.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from rltjax.engine.decode_window import window_rows
from rltjax.engine.sequence import Request, Status


class WindowDriver:
    def __init__(self, runner, batches, *, layered: bool, num_planes: int,
                 token_stop_ids: Callable[[str], tuple[int, ...]], accept_token: Callable[..., bool],
                 steps_by_kind: dict[str, int]):
        """accept_token(request, token, chosen, top_ids, top_lp, now) -> finished: the engine's
        acceptance of one sampled token; steps_by_kind: the engine's step counters."""
        self.runner = runner
        self.batches = batches
        self.layered = layered
        self.num_planes = num_planes
        self.token_stop_ids = token_stop_ids
        self.accept_token = accept_token
        self.steps_by_kind = steps_by_kind
        self._inflight: tuple[list[Request], Any, Any] | None = None    # launched, not yet read
        self._sampler = "truncate"       # the in-flight window's head sampler (continuations keep it)

    @property
    def inflight(self) -> bool:
        return self._inflight is not None

    def run(self, rows: list[Request]) -> list[Request]:
        """Launch a window over rows (every running request, all decoding). The first launch
        returns nothing; a continuation returns the requests the previous window changed."""
        block_tables, boundary_tables = self.batches.block_tables(), self.batches.boundary_tables()
        if self._inflight is not None:
            previous, after, out = self._inflight
            self._inflight = (previous,) + self.runner.window_launch(after, block_tables, boundary_tables,
                                                                     self._sampler)
            return self._apply(previous, after, out)
        tables = [r.tables[p if self.layered else 0] for r in rows for p in range(self.num_planes)]
        state = window_rows(rows, self.runner.window_trace_width, tables,
                            [self.token_stop_ids(r.request_id) for r in rows])
        self._sampler = self.runner.window_sampler([r.params for r in rows])
        self._inflight = (list(rows),) + self.runner.window_launch(state, block_tables, boundary_tables,
                                                                   self._sampler)
        return []

    def can_continue(self, scheduler) -> bool:
        """Whether the next step may launch from the in-flight window's device state: the same
        requests, all still decoding, and no admission possible."""
        rows, running = self._inflight[0], scheduler.running
        return (len(rows) == len(running)
                and {id(r) for r in rows} == {id(r) for r in running}
                and all(r.status is Status.LOOPING for r in running)
                and (not scheduler.waiting or not scheduler.free_slots))

    def drain(self) -> list[Request]:
        """Read the in-flight window now (the host must catch up before another kind of step)."""
        rows, after, out = self._inflight
        self._inflight = None
        return self._apply(rows, after, out)

    def _apply(self, rows: list[Request], after_dev, out_dev) -> list[Request]:
        """Replay a window's outputs; take each request's state back. Returns the requests it
        changed (not those that had finished before)."""
        after, out = self.runner.window_read(after_dev, out_dev, len(rows))
        self.steps_by_kind["window_passes"] = self.steps_by_kind.get("window_passes", 0) + int(out.passes)
        now = time.monotonic()
        changed = []
        for i, r in enumerate(rows):
            if r.finished:     # aborted, or a host-only stop in the window before this one
                continue
            changed.append(r)
            for j in range(int(out.count[i])):
                r.exit_depths.append(int(out.depths[i, j]))
                if self.accept_token(r, int(out.tokens[i, j]), out.chosen[i, j], out.top_ids[i, j],
                                     out.top_lp[i, j], now):
                    break          # a host-only stop (stop string, or a stop id past the device's width)
            if not r.finished:
                if not after.active[i]:
                    raise RuntimeError(f"request {r.request_id!r}: the decode window finished it but the host "
                                       f"stop checks did not (this is a bug)")
                r.status, r.loops_done = Status.LOOPING, int(after.loops_done[i])
                r.exit_remaining, r.exit_triggered = np.float32(after.remaining[i]), bool(after.triggered[i])
        return changed

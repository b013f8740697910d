"""Step-by-step loop passes: the path a step takes when it is not a decode window.

One pass over the scheduled rows, then the exit decisions: from the pass's own signals
(synchronous), or with ``ExecutionConfig.async_scheduling`` from the previous pass's,
read one pass late while this one runs. A late signal is applied only to the row it was
computed for: a row that exited, finished or was aborted since (or whose id now names
another request) no longer matches its (request, position, depth) tag and is skipped.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from rltjax.engine.sequence import Request, Status


class LoopPasses:
    def __init__(self, runner, batches, exit_policy, *, async_scheduling: bool, requests: dict[str, Request]):
        """requests: the engine's live requests by id (a late signal's row must still be one)."""
        self.runner = runner
        self.batches = batches
        self.exit_policy = exit_policy
        self.async_scheduling = async_scheduling
        self.requests = requests
        # async: the last launched pass's signals, each row tagged (request, position, depth)
        self._pending: tuple[list[tuple[Request, int, int]], Any] | None = None

    def run(self, rows: list[Request]) -> None:
        """One loop pass over rows; rows that exit after it await their head."""
        signals = self.runner.loop(*self.batches.loop(rows), fetch=not self.async_scheduling)
        for r in rows:
            r.loops_done += 1
        if self.async_scheduling:
            # this pass is in flight; the previous pass's signals decide which rows exit after it
            self.read_pending()
            exits = self.exit_policy.count_exits(rows) | np.array([r.exit_triggered for r in rows], bool)
            self._pending = ([(r, r.decode_position, r.loops_done) for r in rows], signals)
        else:
            exits = self.exit_policy.after_pass(rows, signals.hazard, signals.score, signals.signal)
        # the pass wrote each row's K/V through to its deeper planes: an exit needs no copy
        for r, exit_now in zip(rows, exits):
            if exit_now:
                r.status = Status.AWAITING_HEAD
                r.exit_depths.append(r.loops_done)

    def read_pending(self) -> None:
        """Async: apply the last launched pass's signals to the rows they still belong to (a
        no-op when none is pending). Called before anything else reads the rows' exit state."""
        if self._pending is None:
            return
        tags, pending = self._pending
        self._pending = None
        signals = pending.read()
        live = [i for i, (r, pos, depth) in enumerate(tags)
                if r.status is Status.LOOPING and self.requests.get(r.request_id) is r
                and r.decode_position == pos and r.loops_done >= depth]
        if live:
            idx = np.asarray(live)
            self.exit_policy.read_signals([tags[i][0] for i in live], np.array([tags[i][2] for i in live]),
                                          None if signals.hazard is None else signals.hazard[idx],
                                          None if signals.score is None else signals.score[idx])

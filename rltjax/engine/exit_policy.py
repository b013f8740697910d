"""Exit decisions for a loop pass, vectorised over its rows (host, float32).

The device returns, per row, the gate hazard sigmoid(gate logit) and the
lookahead score, or, for modes that read the loop's own signal (``latent_diff``:
Huginn's relative latent change), that raw signal; everything else is float32
numpy arithmetic here, so a decision does not depend on which rows shared the
pass. Each mode is one vectorised rule (DESIGN section 2); a new mode adds a row
to ``EXIT_RULES``. The rules use only array operators, so the device-side decode
window (``decode_window``) applies the very same functions to jax arrays.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from rltjax.engine.sequence import Request, Status
from rltjax.engine_config import EngineConfigError

F32 = np.float32


def _ouro(r, lo, hi, q, cdf, score, signal, triggered):
    exit_now = (r >= hi) | ((q < 1) & (r >= lo) & (cdf >= q))
    return exit_now, exit_now & False


def _ouro_delayed(r, lo, hi, q, cdf, score, signal, triggered):
    exit_now = (r >= hi) | triggered
    return exit_now, ~exit_now & (q < 1) & (r >= lo) & (cdf >= q)


def _random_lookahead(r, lo, hi, q, cdf, score, signal, triggered):
    exit_now = (r >= hi) | triggered
    return exit_now, ~exit_now & (q < 1) & (r + 1 >= lo) & (score >= q)


def _fixed(r, lo, hi, q, cdf, score, signal, triggered):
    exit_now = r >= hi
    return exit_now, exit_now & False


def _latent_diff(r, lo, hi, q, cdf, score, signal, triggered):
    exit_now = (r >= hi) | ((q < 1) & (r >= lo) & (signal < q))
    return exit_now, exit_now & False


# mode -> (uses the cumulative hazard, rule(r, min, max, q, cdf, score, signal, triggered) -> (exit, trigger))
EXIT_RULES: dict[str, tuple[bool, Callable]] = {
    "ouro": (True, _ouro),
    "ouro_delayed": (True, _ouro_delayed),
    "random_lookahead": (False, _random_lookahead),
    "fixed": (False, _fixed),
    "latent_diff": (False, _latent_diff),
}
# modes whose rule can set ``triggered`` (exit after the next loop); the others' is always false
TRIGGER_MODES = ("ouro_delayed", "random_lookahead")
# modes that read the loop's raw signal instead of hazard / lookahead score
RAW_SIGNAL_MODES = ("latent_diff",)
# modes whose exit after pass r reads pass r's own signal: the host must read it before
# launching pass r + 1, so they cannot run with async scheduling (``engine.rules``)
SAME_STEP_MODES = ("ouro", "latent_diff")


def _trace_depths(rows: Sequence[Request]) -> np.ndarray:
    """Trace mode: each row's recorded depth for the token now looping."""
    return np.array([row.trace_depths[row.cursor + 1] for row in rows])


def _forced(rows: Sequence[Request]) -> np.ndarray:
    """Each row's recorded exit depth where its token is replayed (a recomputed request
    rebuilding its KV), else 0."""
    return np.array([row.forced_depth or 0 for row in rows], np.int64)


class ExitPolicy:
    """Applies one exit mode (as the engine's settings resolved it) to the rows of each pass."""

    def __init__(self, mode: str):
        if mode not in EXIT_RULES and mode != "trace":
            raise ValueError(f"unknown exit mode {mode!r}")
        self.mode = mode

    def after_pass(self, rows: Sequence[Request], hazard: np.ndarray | None, score: np.ndarray | None,
                   signal: np.ndarray | None = None) -> np.ndarray:
        """Rows have just run loop ``row.loops_done``; returns the rows that exit now.

        hazard / score: sigmoid(gate) and the lookahead score (None when ``raw_signal``);
        signal: the loop's raw signal (only when ``raw_signal``)."""
        r = np.array([row.loops_done for row in rows])
        forced = _forced(rows)
        if self.mode == "trace":
            return r >= _trace_depths(rows)
        if forced.all():
            return r >= forced
        triggered = np.array([row.exit_triggered for row in rows], bool)
        exit_now = self._apply_rule(rows, r, hazard, score, signal, triggered)
        return np.where(forced > 0, r >= forced, exit_now)

    def _apply_rule(self, rows, r, hazard, score, signal, triggered) -> np.ndarray:
        """The mode's rule at pass r (per row): stores exit_remaining and exit_triggered on the
        rows, returns exit_now."""
        cumulative, rule = EXIT_RULES[self.mode]
        lo = np.array([row.min_loops for row in rows])
        hi = np.array([row.max_loops for row in rows])
        q = np.array([row.params.exit_threshold for row in rows], F32)
        remaining = np.array([row.exit_remaining for row in rows], F32)
        if cumulative:
            remaining = (remaining * (F32(1) - hazard.astype(F32))).astype(F32)
        exit_now, trigger = rule(np.asarray(r), lo, hi, q, (F32(1) - remaining).astype(F32),
                                 None if score is None else score.astype(F32),
                                 None if signal is None else signal.astype(F32), triggered)
        for row, rem, trig in zip(rows, remaining, trigger):
            row.exit_remaining = F32(rem)
            row.exit_triggered = bool(trig)
        return exit_now

    def count_exits(self, rows: Sequence[Request]) -> np.ndarray:
        """Async scheduling: rows that exit after pass ``row.loops_done`` whatever its signal
        (max_loops, or the trace's depth); signal-driven exits come from ``exit_triggered``."""
        r = np.array([row.loops_done for row in rows])
        if self.mode == "trace":
            return r >= _trace_depths(rows)
        forced = _forced(rows)
        return np.where(forced > 0, r >= forced, r >= np.array([row.max_loops for row in rows]))

    def read_signals(self, rows: Sequence[Request], depths: np.ndarray, hazard: np.ndarray | None,
                     score: np.ndarray | None) -> None:
        """Async scheduling: the signals of pass ``depths`` (each row's, read one pass late) update
        ``exit_remaining`` and set ``exit_triggered`` (exit after pass depth + 1), exactly as
        ``after_pass`` would have right after that pass. Delayed modes only."""
        if self.mode in SAME_STEP_MODES:
            raise EngineConfigError(f"exit mode {self.mode!r} decides on the pass's own signal (sync only)")
        if self.mode in ("trace", "fixed") or not rows:
            return
        # rows still looping did not exit after pass `depth`, so exit_now there was False
        self._apply_rule(rows, depths, hazard, score, None, np.zeros(len(rows), bool))

    # -- a loop pass's rows ------------------------------------------------------------
    def apply_pass(self, rows: Sequence[Request], signals) -> None:
        """Synchronous: rows have run one more loop; those the rule exits await their heads.
        signals: the pass's ``LoopSignals`` (hazard and score, or the raw signal)."""
        for r in rows:
            r.loops_done += 1
        _exit(rows, self.after_pass(rows, signals.hazard, signals.score, signals.signal))

    def launched_late(self, rows: Sequence[Request]) -> tuple:
        """Async, once the previous pass's signals are applied: rows have run one more loop;
        those that exit whatever this pass's signal says (max_loops, a trace's depth, or a
        trigger from the pass before) await their heads. Returns each row's tag (request,
        position, depth) for ``apply_late``."""
        for r in rows:
            r.loops_done += 1
        _exit(rows, self.count_exits(rows) | np.array([r.exit_triggered for r in rows], bool))
        return tuple((r, r.decode_position, r.loops_done) for r in rows)

    def apply_late(self, tags, signals, current: Callable[[Request], bool]) -> None:
        """Async: a pass's signals, read one pass late, applied only to the rows they were
        computed for, still looping at that position; a row that exited, finished or was
        aborted since (``current`` false: its id names another request now) is skipped."""
        live = [i for i, (r, pos, depth) in enumerate(tags)
                if r.status is Status.LOOPING and current(r) and r.decode_position == pos and r.loops_done >= depth
                and r.forced_depth is None]
        if live:
            idx = np.asarray(live)
            self.read_signals([tags[i][0] for i in live], np.array([tags[i][2] for i in live]),
                              None if signals.hazard is None else signals.hazard[idx],
                              None if signals.score is None else signals.score[idx])


def _exit(rows: Sequence[Request], exits) -> None:
    """Rows that exit await their heads (the pass wrote each row's K/V through to its deeper
    planes: an exit needs no copy)."""
    for r, exit_now in zip(rows, exits):
        if exit_now:
            if r.forced_depth is None:      # a replayed token's exit is on record already
                r.exit_depths.append(r.loops_done)
            r.status = Status.AWAITING_HEAD

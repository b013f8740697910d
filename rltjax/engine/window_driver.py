"""Host side of decode windows: pack the rows, launch, continue, read one window late.

The device side is ``decode_window``. Here a window over every decoding request is
launched and left running; while the same unfinished requests are all decoding, no
admission is possible and not all of them surely finish inside the window in flight, the
next window is launched from the device's row state before the host reads the last one
(rows the host finished meanwhile are idled in it). When only an admission stops that,
``run_admitting`` continues the window with the fresh requests in the rows of finished
requests or the bucket's padding. Reading replays the outputs through the
engine's per-token acceptance (stop checks, finish) and takes each request's exit state
back, so a step-by-step step can follow at any point.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from rltjax.engine.window_state import STOP_ID_WIDTH, WindowRows
from rltjax.engine.sequence import Request, Status
from rltjax.sampling import split_seed


class WindowDriver:
    def __init__(self, runner, batches, *, num_passes: int, layered: bool, num_planes: int,
                 token_stop_ids: Callable[[str], tuple[int, ...]], accept_token: Callable[..., bool],
                 steps_by_kind: dict[str, int]):
        """num_passes: K of a window; accept_token(request, token, chosen, top_ids, top_lp, now)
        -> finished: the engine's acceptance of one sampled token; steps_by_kind: the engine's
        step counters."""
        self.runner = runner
        self.num_passes = num_passes
        self.batches = batches
        self.layered = layered
        self.num_planes = num_planes
        self.token_stop_ids = token_stop_ids
        self.accept_token = accept_token
        self.steps_by_kind = steps_by_kind
        self._inflight: tuple[list[Request], Any, Any] | None = None    # launched, not yet read
        self._sampler = "truncate"       # the in-flight window's head sampler (continuations keep it)
        # per row of the last window read: whether the device still ran it after that window
        self._device_active: np.ndarray | None = None

    @property
    def inflight(self) -> bool:
        return self._inflight is not None

    def run(self, rows: list[Request], first=None) -> list[Request]:
        """Launch a window over rows (every running request, all decoding). The first launch
        returns nothing; a continuation returns the requests the previous window changed.
        first: per row, whether its first head was just launched and not read (a fresh
        launch only)."""
        block_tables, boundary_tables = self.batches.block_tables(), self.batches.boundary_tables()
        if self._inflight is not None:
            if first is not None and any(first):
                raise RuntimeError("a window continued from the device cannot take fresh heads (this is a bug)")
            previous, after, out = self._inflight
            start = self._idle_stopped(previous, after)
            self._inflight = (previous,) + self.runner.window_launch(start, block_tables, boundary_tables,
                                                                     self._sampler)
            return self._apply(previous, after, out)
        self._device_active = None       # describes another window's rows
        state = self._host_rows(rows, first)
        self._sampler = self.runner.window_sampler([r.params for r in rows])
        self._inflight = (list(rows),) + self.runner.window_launch(state, block_tables, boundary_tables,
                                                                   self._sampler)
        return []

    def room(self) -> int:
        """Rows a window continued from the in-flight one can give fresh requests: the rows of
        requests the host has finished, and the padding of its row bucket."""
        rows, after, _ = self._inflight
        return sum(r.finished for r in rows) + after.slots.shape[0] - len(rows)

    def run_admitting(self, fresh: list[Request], prompt_args: tuple | None = None) -> Callable[[], list[Request]]:
        """Continue the in-flight window's rows from the device, every row whose request the
        host has finished replaced: by the fresh requests in order (their first heads queued
        just before), else by an idle row, so no finished request runs on into pages or a
        slot that may now be another's. Returns the read of the previous window (a call that
        returns the requests it changed): the host reads it after queueing more work.
        prompt_args: the fresh requests' whole prompts (``BatchBuilder.prefill``), run in the
        window's first R passes (mixed prefill); else their first heads were queued."""
        previous, after, out = self._inflight
        bucket = after.slots.shape[0]
        finished = [i for i, r in enumerate(previous) if r.finished]
        places = (finished + list(range(len(previous), bucket)))[:len(fresh)]
        if len(places) < len(fresh):
            raise RuntimeError(f"{len(fresh)} fresh requests for {len(places)} free window rows (this is a bug)")
        rows = list(previous) + [None] * (max(places, default=-1) + 1 - len(previous))
        for i, r in zip(places, fresh):
            rows[i] = r
        host = idle_window_rows(bucket, self.num_planes, self.runner.window_trace_width)
        if fresh:
            built = self._host_rows(fresh, [True] * len(fresh))
            if prompt_args is not None:      # rows wait, inactive, for their prompts' first heads
                built.active[:], built.first[:] = False, False
            for field, values in vars(built).items():
                getattr(host, field)[places] = values
        replace = np.zeros(bucket, bool)
        replace[finished + places] = True
        prompt = None
        if prompt_args is not None:
            waiting = np.zeros(bucket, bool)
            waiting[places] = True
            prompt = self.runner.window_prompt(prompt_args, waiting)
        self._sampler = self.runner.window_sampler([r.params for r in rows if not r.finished])
        state = self.runner.window_merge(after, host, replace)
        self._inflight = (rows,) + self.runner.window_launch(state, self.batches.block_tables(),
                                                             self.batches.boundary_tables(), self._sampler, prompt)
        return lambda: self._apply(previous, after, out)

    def _idle_stopped(self, rows: list[Request], after):
        """The device rows ``after`` with every row whose request the host finished while the
        device still ran it (a host-only stop, an abort) made idle, so it does not run on to
        its max_tokens in every continued window (at most two merges a row: the read that
        shows it idle comes one window late)."""
        if self._device_active is None:
            return after
        stale = np.zeros(after.slots.shape[0], bool)
        n = len(self._device_active)
        stale[:n] = self._device_active & np.array([r.finished for r in rows[:n]], bool)
        if not stale.any():
            return after
        idle = idle_window_rows(len(stale), self.num_planes, self.runner.window_trace_width)
        return self.runner.window_merge(after, idle, stale)

    def _host_rows(self, requests: list[Request], first) -> WindowRows:
        """``window_rows`` of these requests with their plane tables and token-stop ids."""
        tables = [r.tables[p if self.layered else 0] for r in requests for p in range(self.num_planes)]
        return window_rows(requests, self.runner.window_trace_width, tables,
                           [self.token_stop_ids(r.request_id) for r in requests], first)

    @staticmethod
    def takes(plan, running: list[Request]) -> bool:
        """Whether a window runs this step's plan: a loop plan over every running request, or
        a head plan of fresh prompts (no output yet) while every other request decodes (their
        heads are queued just before the window: ``LLMEngine._first_heads_then_window``)."""
        if plan.kind == "loop":
            return len(plan.rows) == len(running)
        return plan.kind == "head" and all(
            r.status is Status.LOOPING or (r.status is Status.AWAITING_HEAD and not r.output_token_ids)
            for r in running)

    def can_continue(self, scheduler) -> bool:
        """Whether the next step may launch from the in-flight window's device state: the same
        requests, all still decoding, no admission possible, and not all of them certain to
        reach max_tokens inside the in-flight window (a window launched behind it would run
        K passes over finished rows, holding back the next request's prefill)."""
        live = [r for r in self._inflight[0] if not r.finished]
        return (self._same_rows_decoding(scheduler) and (not scheduler.waiting or not scheduler.free_slots)
                and not all(finishes_within(r, self.num_passes, self.runner.cfg.num_loops) for r in live))

    def only_admission_waits(self, scheduler) -> bool:
        """Whether the in-flight window could continue but for an admission (a request waits
        and a slot is free)."""
        return self._same_rows_decoding(scheduler) and bool(scheduler.waiting) and bool(scheduler.free_slots)

    def _same_rows_decoding(self, scheduler) -> bool:
        """The in-flight window's unfinished requests are every running one, all decoding
        (rows the host finished are idled when the window continues, ``_idle_stopped``, or
        replaced by fresh requests, ``run_admitting``)."""
        live, running = [r for r in self._inflight[0] if not r.finished], scheduler.running
        return (bool(live) and len(live) == len(running) and {id(r) for r in live} == {id(r) for r in running}
                and all(r.status is Status.LOOPING for r in running))

    def drain(self) -> list[Request]:
        """Read the in-flight window now (the host must catch up before another kind of step)."""
        rows, after, out = self._inflight
        self._inflight = None
        return self._apply(rows, after, out)

    def _apply(self, rows: list[Request], after_dev, out_dev) -> list[Request]:
        """Replay a window's outputs; take each request's state back. Returns the requests it
        changed (not those that had finished before)."""
        after, out = self.runner.window_read(after_dev, out_dev, len(rows))
        self._device_active = np.asarray(after.active, bool)
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


def finishes_within(r: Request, num_passes: int, num_loops: int) -> bool:
    """Whether a decoding request surely reaches max_tokens within num_passes loop passes from
    its host state: each token takes at most max_loops passes (the current one max_loops -
    loops_done more; a first token still in a window's prompt passes, mixed prefill: R)."""
    first = num_loops if not r.output_token_ids else r.max_loops - r.loops_done
    surely_made = 0 if num_passes < first else 1 + (num_passes - first) // r.max_loops
    return r.params.max_tokens - len(r.output_token_ids) <= surely_made


def stop_id_matrix(stop_sets: list[tuple[int, ...]]) -> np.ndarray:
    """[rows, STOP_ID_WIDTH] int32 token-stop ids per row, padded with -1. Ids past the width
    stop the request on the host only (the device then runs on until the window ends and the
    host drops the extra tokens): a fixed width keeps one executable per row bucket."""
    m = np.full((len(stop_sets), STOP_ID_WIDTH), -1, np.int32)
    for i, ids in enumerate(stop_sets):
        ids = list(ids)[:STOP_ID_WIDTH]
        m[i, :len(ids)] = ids
    return m


def idle_window_rows(n: int, num_planes: int, trace_width: int) -> WindowRows:
    """n inactive rows (warm-up compiles; a window over them runs no pass)."""
    z = lambda dtype=np.int32: np.zeros(n, dtype)
    return WindowRows(slots=z(), tokens=z(), positions=z(), loops_done=z(), remaining=np.ones(n, np.float32),
                      triggered=z(bool), active=z(bool), num_out=z(), max_tokens=z(), min_loops=z(), max_loops=z(),
                      threshold=z(np.float32), temperature=z(np.float32), top_k=z(), top_p=np.ones(n, np.float32),
                      seed_hi=z(np.uint32), seed_lo=z(np.uint32), tables=np.zeros((n, num_planes), np.int32),
                      btables=z(), stop_ids=np.full((n, STOP_ID_WIDTH), -1, np.int32),
                      trace=np.zeros((n, trace_width), np.int32), first=z(bool))


def window_rows(requests, trace_width: int, plane_tables: list[int], stop_sets: list[tuple[int, ...]],
                first=None) -> WindowRows:
    """The WindowRows of decoding requests (host numpy). trace_width: ``trace_width`` of the
    engine; plane_tables: each request's block table per plane, flattened request-major;
    stop_sets: each request's token-stop ids; first: per request, whether its first head is
    queued on the device but not read (its token then comes from ``slot_tokens``; the row
    starts as it will once the host takes that token: one output, the next position)."""
    n = len(requests)
    first = np.zeros(n, bool) if first is None else np.asarray(first, bool)
    arr = lambda f, dtype=np.int32: np.array([f(r) for r in requests], dtype)
    seeds = np.array([split_seed(r.seed) for r in requests], np.uint32).reshape(n, 2)
    # trace mode: the recorded depth of every output index (past the end: max_loops)
    trace = np.array([((list(r.trace_depths[:trace_width]) if r.trace_depths else [])
                       + [r.max_loops] * trace_width)[:trace_width] for r in requests], np.int32)
    return WindowRows(
        slots=arr(lambda r: r.slot), tokens=arr(lambda r: r.output_token_ids[-1] if r.output_token_ids else 0),
        positions=arr(lambda r: r.decode_position) + first, loops_done=np.where(first, 0, arr(lambda r: r.loops_done)),
        remaining=np.where(first, np.float32(1.0), arr(lambda r: r.exit_remaining, np.float32)),
        triggered=~first & arr(lambda r: r.exit_triggered, bool),
        active=np.ones(n, bool), num_out=arr(lambda r: len(r.output_token_ids)) + first,
        max_tokens=arr(lambda r: r.params.max_tokens), min_loops=arr(lambda r: r.min_loops),
        max_loops=arr(lambda r: r.max_loops), threshold=arr(lambda r: r.params.exit_threshold, np.float32),
        temperature=arr(lambda r: r.params.temperature, np.float32), top_k=arr(lambda r: r.params.top_k),
        top_p=arr(lambda r: r.params.top_p, np.float32), seed_hi=seeds[:, 0], seed_lo=seeds[:, 1],
        tables=np.asarray(plane_tables, np.int32).reshape(n, -1),
        btables=arr(lambda r: r.boundary_table if r.boundary_table is not None else 0),
        stop_ids=stop_id_matrix(stop_sets),
        trace=trace, first=first)

"""Host side of decode windows: hand the requests over, launch, continue, read one window late.

The device side is ``decode_window``. Here a window over every decoding request is
launched and left running; while the same unfinished requests are all decoding, no
admission is possible and not all of them surely finish inside the window in flight, the
next window is launched from the device's row state before the host reads the last one
(rows whose request the host finished meanwhile stop there: ``owners``). When only an
admission stops that, ``run_admitting`` continues the window with the fresh requests.
In windows of a row bucket that carries no prompts (``ModelRunner.standby_for``: every
bucket without mixed prefill) the requests go to the device as standby entries
(``standby``): free rows take them at the start of any pass, so a row freed inside a window
is refilled in the next pass, and the outputs say which request each row's columns belong
to. In the buckets of mixed prefill (``mixed_buckets``) the host places the fresh requests
in the rows of finished requests or the bucket's padding. A fresh launch picks the way by
its bucket; continued windows keep both. Reading replays the outputs through the engine's
per-token acceptance
(stop checks, finish) and takes each request's exit state back, so a step-by-step step
can follow at any point.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from rltjax.engine.host_rows import idle_window_rows, tag_of, window_rows
from rltjax.engine.sequence import Request, Status


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
        self.standby = runner.uses_standby   # the in-flight window's way of taking requests (set at each fresh launch)
        # launched, not yet read: (the host's row list, rows after, outputs). With standby the
        # continued windows share one list, which each read updates with the rows' swaps.
        self._inflight: tuple[list[Request | None], Any, Any] | None = None
        self._sampler = "truncate"       # the in-flight window's head sampler (continuations keep it)
        self._on_device: dict[int, Request] = {}   # tag -> unfinished request handed to the device
        self._waiting: set[int] = set()            # tags of standby entries not yet read taking a row

    @property
    def inflight(self) -> bool:
        return self._inflight is not None

    def run(self, rows: list[Request], first=None) -> list[Request]:
        """Launch a window over rows (every running request, all decoding). The first launch
        returns nothing; a continuation returns the requests the previous window changed.
        first: per row, whether its first head was just launched and not read (a fresh
        launch only)."""
        if self._inflight is not None:
            if first is not None and any(first):
                raise RuntimeError("a window continued from the device cannot take fresh heads (this is a bug)")
            previous, after, out = self._inflight
            self._inflight = (previous,) + self._launch(after)
            return self._apply(previous, after, out)
        self._on_device, self._waiting = {}, set()
        self._sampler = self.runner.window_sampler([r.params for r in rows])
        bucket = self.runner.window_bucket(len(rows))
        self.standby = self.runner.standby_for(bucket)    # continued windows keep the bucket
        if self.standby:     # every row free: the device places the requests, oldest first
            self._put_standby(rows, first, bucket, reset=True)
            state = idle_window_rows(bucket, self.num_planes, self.runner.window_trace_width)
            self._inflight = ([None] * bucket,) + self._launch(state)
        else:
            self._on_device = {tag_of(r): r for r in rows}
            self._inflight = (list(rows),) + self._launch(self._host_rows(rows, first))
        return []

    def room(self) -> int:
        """Fresh requests a window continued from the in-flight one can take: with standby,
        the bucket's rows no unfinished request holds (any number once the bucket is the
        largest: they wait for rows there); else the rows of requests the host has finished,
        and the padding of its row bucket."""
        rows, after, _ = self._inflight
        if self.standby:
            if len(rows) >= self.runner.window_buckets[-1]:
                return self.runner.max_num_seqs
            return len(rows) - len(self._live())
        return sum(r.finished for r in rows) + after.slots.shape[0] - len(rows)

    def prompt_tokens(self) -> int:
        """Prompt tokens a window continued from the in-flight one can carry (mixed prefill;
        0: none, for a row bucket outside ``runner.mixed_buckets``)."""
        return self.runner.prompt_tokens_for(self._inflight[1].slots.shape[0])

    def run_admitting(self, fresh: list[Request], prompt_args: tuple | None = None) -> Callable[[], list[Request]]:
        """Continue the in-flight window's rows from the device with the fresh requests (their
        first heads queued just before): as standby entries, else placed in the rows of
        requests the host has finished, in order (other finished rows idled). Returns the
        read of the previous window (a call that returns the requests it changed): the host
        reads it after queueing more work. prompt_args: the fresh requests' whole prompts
        (``BatchBuilder.prefill``), run in the window's first R passes (mixed prefill); else
        their first heads were queued."""
        previous, after, out = self._inflight
        self._sampler = self.runner.window_sampler([r.params for r in self._live() + list(fresh)])
        if self.standby:
            if prompt_args is not None:
                raise RuntimeError("standby windows carry no prompts (this is a bug)")
            self._put_standby(fresh, [True] * len(fresh), len(previous))
            self._inflight = (previous,) + self._launch(after)
            return lambda: self._apply(previous, after, out)
        bucket = after.slots.shape[0]
        finished = [i for i, r in enumerate(previous) if r.finished]
        places = (finished + list(range(len(previous), bucket)))[:len(fresh)]
        if len(places) < len(fresh):
            raise RuntimeError(f"{len(fresh)} fresh requests for {len(places)} free window rows (this is a bug)")
        rows = list(previous) + [None] * (max(places, default=-1) + 1 - len(previous))
        for i, r in zip(places, fresh):
            rows[i] = r
            self._on_device[tag_of(r)] = r
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
        state = self.runner.window_merge(after, host, replace)
        self._inflight = (rows,) + self._launch(state, prompt)
        return lambda: self._apply(previous, after, out)

    def _launch(self, state, prompt=None):
        """Launch a window from ``state`` with the slots' owners as the host knows them now."""
        owners = np.full(self.runner.max_num_seqs + 1, -1, np.int32)
        for r in self._live():
            owners[r.slot] = tag_of(r)
        return self.runner.window_launch(state, self.batches.block_tables(), self.batches.boundary_tables(),
                                         self._sampler, prompt, owners)

    def _put_standby(self, requests: list[Request], first, bucket: int, reset: bool = False) -> None:
        """Hand requests to the device as standby entries (at their slots) for a window of
        ``bucket`` rows; reset: every other entry emptied (a fresh launch), else the device's
        kept. The entries that surely take a row in its first pass (there are rows for every
        unfinished request: the oldest ``bucket`` of a fresh launch) are not ``_waiting``."""
        n = self.runner.max_num_seqs + 1
        host = idle_window_rows(n, self.num_planes, self.runner.window_trace_width)
        put = np.full(n, reset, bool)
        if requests:
            slots = [r.slot for r in requests]
            for field, values in vars(self._host_rows(requests, first)).items():
                getattr(host, field)[slots] = values
            put[slots] = True
        self.runner.standby_put(host, put)
        for r in requests:
            self._on_device[tag_of(r)] = r
        live = sorted(tag_of(r) for r in self._live())
        if len(live) <= bucket:
            self._waiting.clear()
        else:
            self._waiting |= set(live[bucket:]) if reset else {tag_of(r) for r in requests}

    def _live(self) -> list[Request]:
        return [r for r in self._on_device.values() if not r.finished]

    def _host_rows(self, requests: list[Request], first):
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

    def can_continue(self, scheduler, admission_tried: bool = False) -> bool:
        """Whether the next step may launch from the in-flight window's device state: the same
        requests, all still decoding, no admission possible (or one just tried that admitted
        nothing: the pages are not free yet), and not all of them certain to reach max_tokens
        inside the in-flight window (a window launched behind it would run K passes over
        finished rows, holding back the next request's prefill); a standby entry not yet read
        taking a row may still need one."""
        live = self._live()
        return (self._same_rows_decoding(scheduler)
                and (admission_tried or not scheduler.waiting or not scheduler.free_slots)
                and not all(tag_of(r) not in self._waiting
                            and finishes_within(r, self.num_passes, self.runner.cfg.num_loops) for r in live))

    def only_admission_waits(self, scheduler) -> bool:
        """Whether the in-flight window could continue but for an admission (a request waits
        and a slot is free)."""
        return self._same_rows_decoding(scheduler) and bool(scheduler.waiting) and bool(scheduler.free_slots)

    def _same_rows_decoding(self, scheduler) -> bool:
        """The unfinished requests handed to the device are every running one, all decoding
        (rows the host finished stop in the next window: ``owners``)."""
        live, running = self._live(), scheduler.running
        return (bool(live) and len(live) == len(running) and {id(r) for r in live} == {id(r) for r in running}
                and all(r.status is Status.LOOPING for r in running))

    def drain(self) -> list[Request]:
        """Read the in-flight window now (the host must catch up before another kind of step)."""
        rows, after, out = self._inflight
        self._inflight = None
        return self._apply(rows, after, out)

    def _apply(self, rows: list[Request | None], after_dev, out_dev) -> list[Request]:
        """Replay a window's outputs; take each request's state back. Returns the requests it
        changed (not those that had finished before). With standby, a row's columns before
        its ``swap_col`` are its previous request's, the rest the one that took the row, which
        the row then holds (``rows`` updated in place)."""
        after, out = self.runner.window_read(after_dev, out_dev, len(rows))
        self.steps_by_kind["window_passes"] = self.steps_by_kind.get("window_passes", 0) + int(out.passes)
        self._check_swaps(rows, out)
        now = time.monotonic()
        changed = []
        for i in range(len(rows)):
            count, col = int(out.count[i]), int(out.swap_col[i])
            if col >= 0:
                self._replay(rows[i], out, i, 0, col, now, changed, left=True)
                tag = int(out.swap_tag[i])
                self._waiting.discard(tag)
                rows[i] = self._on_device.get(tag)      # None: finished and forgotten
                self._replay(rows[i], out, i, col, count, now, changed)
            else:
                self._replay(rows[i], out, i, 0, count, now, changed)
            r = rows[i]
            if r is not None and not r.finished:
                if not after.active[i]:
                    raise RuntimeError(f"request {r.request_id!r}: the decode window finished it but the host "
                                       f"stop checks did not (this is a bug)")
                r.status, r.loops_done = Status.LOOPING, int(after.loops_done[i])
                r.exit_remaining, r.exit_triggered = np.float32(after.remaining[i]), bool(after.triggered[i])
        self._on_device = {tag: r for tag, r in self._on_device.items() if not r.finished}
        return changed

    def _check_swaps(self, rows: list[Request | None], out) -> None:
        """Before anything is replayed: no request may hold two rows after the window's swaps
        (its standby entry taken twice), which would give it two rows' tokens and two finishes."""
        held = {}
        for i in range(len(rows)):
            r = self._on_device.get(int(out.swap_tag[i])) if out.swap_col[i] >= 0 else rows[i]
            if r is not None and not r.finished:
                held.setdefault(id(r), (r, []))[1].append(i)
        for r, at in held.values():
            if len(at) > 1:
                raise RuntimeError(f"request {r.request_id!r}: the decode window placed it in rows {at} (its "
                                   f"standby entry was taken twice; the device's window state is inconsistent)")

    def _replay(self, r: Request | None, out, i: int, lo: int, hi: int, now: float, changed: list,
                left: bool = False) -> None:
        """Output columns [lo, hi) of row i through the request's acceptance (stop checks).
        left: the request left the row after them, which only its end on the device does."""
        if r is None or r.finished:     # aborted, or stopped by the host before (its columns dropped)
            return
        changed.append(r)
        for j in range(lo, hi):
            r.exit_depths.append(int(out.depths[i, j]))
            if self.accept_token(r, int(out.tokens[i, j]), out.chosen[i, j], out.top_ids[i, j],
                                 out.top_lp[i, j], now):
                break          # a host-only stop (stop string, or a stop id past the device's width)
        if left and not r.finished:
            raise RuntimeError(f"request {r.request_id!r}: the decode window ended it but the host stop checks "
                               f"did not (this is a bug)")


def finishes_within(r: Request, num_passes: int, num_loops: int) -> bool:
    """Whether a decoding request surely reaches max_tokens within num_passes loop passes from
    its host state: each token takes at most max_loops passes (the current one max_loops -
    loops_done more; a first token still in a window's prompt passes, mixed prefill: R)."""
    first = num_loops if not r.output_token_ids else r.max_loops - r.loops_done
    surely_made = 0 if num_passes < first else 1 + (num_passes - first) // r.max_loops
    return r.params.max_tokens - len(r.output_token_ids) <= surely_made

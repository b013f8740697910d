"""Host side of decode windows: which window runs next, and what a window's outputs mean.

The scheduler asks the planner to plan a window (``WindowStep``) and the engine hands it
each window's outputs to read (``read``: the requests' ``TokenRun``s); it keeps the host's
view of what the device holds: which requests are on the device (by tag), the in-flight
window's rows, and the standby entries not yet seen taking a row.

A window over every decoding request is launched and left running; while the same
unfinished requests are all decoding, no admission is possible and not all of them surely
finish inside the window in flight, the next window is launched from the device's row state
before the host reads the last one (rows whose request the host finished meanwhile stop
there: ``owners``). When only an admission stops that, the window continues with the fresh
requests (``admitting``). In windows of a row bucket that carries no prompts the requests go
to the device as standby entries: free rows take them at the start of any pass, so a row
freed inside a window is refilled in the next pass, and the outputs say which request each
row's columns belong to. In the buckets of mixed prefill the host places the fresh requests
in the rows of finished requests or the bucket's padding. A fresh launch picks the way by its
bucket; continued windows keep it.
"""
from __future__ import annotations

import numpy as np

from rltjax.engine.plan import Chunk, RowMap, RowState, TokenRun, WindowStep
from rltjax.engine.sequence import Request, Status
from rltjax.engine.settings import EngineSettings
from rltjax.engine.window.rows import tag_of
from rltjax.sampling import window_sampler


class WindowPlanner:
    def __init__(self, settings: EngineSettings, vocab_size: int):
        self.s, self.w, self.vocab_size = settings, settings.window, vocab_size
        self.standby = self.w.uses_standby   # the in-flight chain's way of taking requests
        self._rows: RowMap | None = None     # the newest window's rows (None: none in flight)
        self._bucket = 0
        self._unread = 0                     # windows launched and not read
        self._sampler = "truncate"           # the in-flight window's head sampler (continuations keep it)
        self._on_device: dict[int, Request] = {}   # tag -> request handed to the device
        self._waiting: set[int] = set()            # tags of standby entries not yet read taking a row
        spec = self.w.speculative                  # speculative drafts read so far (stats)
        self.spec_drafted = 0
        self.spec_accepted = None if spec is None else np.zeros(spec.num_tokens, np.int64)   # by position

    @property
    def inflight(self) -> bool:
        return self._unread > 0

    def drop(self) -> None:
        """Forget every window (a failure: the device's window state is not used again)."""
        self._rows, self._unread, self._on_device, self._waiting = None, 0, {}, set()

    # -- planning ---------------------------------------------------------------------
    def fresh(self, rows: list[Request], first=None) -> WindowStep:
        """A window over every running request (all decoding), launched from host rows.
        first: per row, whether its first head is queued just before it and not read."""
        self._on_device, self._waiting = {}, set()
        self._sampler = window_sampler([r.params for r in rows], self.vocab_size)
        self._bucket = bucket = self.w.bucket_for(len(rows))
        self.standby = self.w.standby_for(bucket)
        first_ids = frozenset(id(r) for r, f in zip(rows, first or ()) if f)
        if self.standby:     # every row free: the device places the requests, oldest first
            self._enter_standby(rows, bucket, reset=True)
            self._rows = RowMap([None] * bucket)
            return self._step(standby=True, continues=False, entries=tuple(rows), reset_standby=True, first=first_ids)
        self._on_device = {tag_of(r): r for r in rows}
        self._rows = RowMap(rows)
        return self._step(standby=False, continues=False, host_rows=tuple(enumerate(rows)), first=first_ids)

    def continued(self) -> WindowStep:
        """The next window over the in-flight one's rows, from the device's row state."""
        return self._step(standby=self.standby, continues=True)

    def admitting(self, fresh: list[Request], prompt: tuple[Chunk, ...] | None = None) -> WindowStep:
        """The in-flight window's rows continued with the fresh requests: as standby entries,
        else placed in the rows of requests the host has finished, in order (other finished
        rows idled). prompt: their whole prompts, run in the window's first R passes (mixed
        prefill); else their first heads are queued just before it."""
        previous = self._rows
        self._sampler = window_sampler([r.params for r in self._live() + list(fresh)], self.vocab_size)
        first = frozenset(id(r) for r in fresh)
        if self.standby:
            if prompt is not None:
                raise RuntimeError("standby windows carry no prompts (this is a bug)")
            self._enter_standby(fresh, len(previous))
            return self._step(standby=True, continues=True, entries=tuple(fresh), first=first)
        finished = [i for i, r in enumerate(previous) if r.finished]
        places = (finished + list(range(len(previous), self._bucket)))[:len(fresh)]
        if len(places) < len(fresh):
            raise RuntimeError(f"{len(fresh)} fresh requests for {len(places)} free window rows (this is a bug)")
        rows = RowMap(list(previous) + [None] * (max(places, default=-1) + 1 - len(previous)))
        for i, r in zip(places, fresh):
            rows[i] = r
            self._on_device[tag_of(r)] = r
        self._rows = rows
        return self._step(standby=False, continues=True, host_rows=tuple(zip(places, fresh)),
                          replace=tuple(sorted(set(finished + places))), first=first, prompt=prompt,
                          prompt_rows=tuple(places) if prompt is not None else ())

    def _step(self, **fields) -> WindowStep:
        self._unread += 1
        owners = np.full(self.s.max_num_seqs + 1, -1, np.int32)     # each slot's request tag (-1: free)
        for r in self._live():
            owners[r.slot] = tag_of(r)
        return WindowStep(rows=self._rows, bucket=self._bucket, owners=owners, sampler=self._sampler, **fields)

    def _enter_standby(self, requests: list[Request], bucket: int, reset: bool = False) -> None:
        """Requests handed to the device as standby entries for a window of ``bucket`` rows.
        The entries that surely take a row in its first pass (there are rows for every
        unfinished request: the oldest ``bucket`` of a fresh launch) are not ``_waiting``."""
        for r in requests:
            self._on_device[tag_of(r)] = r
        live = sorted(tag_of(r) for r in self._live())
        if len(live) <= bucket:
            self._waiting.clear()
        else:
            self._waiting |= set(live[bucket:]) if reset else {tag_of(r) for r in requests}

    def on_device(self) -> list[Request]:
        """The unfinished requests handed to the device (rows and standby entries)."""
        return self._live()

    def _live(self) -> list[Request]:
        return [r for r in self._on_device.values() if not r.finished]

    # -- what the scheduler asks --------------------------------------------------------
    def room(self) -> int:
        """Fresh requests a window continued from the in-flight one can take: with standby,
        the bucket's rows no unfinished request holds (any number once the bucket is the
        largest: they wait for rows there); else the rows of requests the host has finished,
        and the padding of its row bucket."""
        rows = self._rows
        if self.standby:
            if len(rows) >= self.w.buckets[-1]:
                return self.s.max_num_seqs
            return len(rows) - len(self._live())
        return sum(r.finished for r in rows) + self._bucket - len(rows)

    def prompt_tokens(self) -> int:
        """Prompt tokens a window continued from the in-flight one can carry (0: none)."""
        return self.w.prompt_tokens_for(self._bucket)

    def can_continue(self, running, waiting, free_slots, admission_tried: bool = False) -> bool:
        """Whether the next step may launch from the in-flight window's device state: the same
        requests, all still decoding, no admission possible (or one just tried that admitted
        nothing: the pages are not free yet), and not all of them certain to reach max_tokens
        inside the in-flight window (a window launched behind it would run K passes over
        finished rows, holding back the next request's prefill); a standby entry not yet read
        taking a row may still need one."""
        return (self._same_rows_decoding(running) and (admission_tried or not waiting or not free_slots)
                and not all(tag_of(r) not in self._waiting and self._finishes(r) for r in self._live()))

    def _finishes(self, r: Request) -> bool:
        """Whether the request surely reaches max_tokens inside the window in flight."""
        if self.w.speculative is not None:        # every round makes at least one token
            return r.params.max_tokens - len(r.output_token_ids) <= self.w.speculative.rounds
        return finishes_within(r, self.w.num_passes, self.s.num_loops)

    def only_admission_waits(self, running, waiting, free_slots) -> bool:
        """Whether the in-flight window could continue but for an admission."""
        return self._same_rows_decoding(running) and bool(waiting) and bool(free_slots)

    def _same_rows_decoding(self, running) -> bool:
        """The unfinished requests handed to the device are every running one, all decoding
        (rows the host finished stop in the next window: ``owners``)."""
        live = self._live()
        return (bool(live) and len(live) == len(running) and {id(r) for r in live} == {id(r) for r in running}
                and all(r.status is Status.LOOPING for r in running))

    # -- reading ------------------------------------------------------------------------
    def read(self, step: WindowStep, result) -> list[TokenRun]:
        """A window's outputs as the runs of tokens its requests made, in row order. With
        standby, a row's columns before its ``swap_col`` are its previous request's, the rest
        the one that took the row, which the row then holds (``step.rows`` updated in place)."""
        self._unread -= 1
        rows, (after, out) = step.rows, result
        self._check_swaps(rows, out)
        n = len(rows)
        # Python lists once a window: the host replays them token by token
        tokens, depths = out.tokens[:n].tolist(), out.depths[:n].tolist()
        counts, swap_cols, swap_tags = out.count[:n].tolist(), out.swap_col[:n].tolist(), out.swap_tag[:n].tolist()
        if self.spec_accepted is not None:
            self.spec_drafted += int(out.drafted[:n].sum())
            self.spec_accepted += out.accepted[:n].sum(axis=0)
        runs = []
        for i in range(n):
            count, col = counts[i], swap_cols[i]
            if col >= 0:
                if rows[i] is not None:
                    runs.append(TokenRun(rows[i], tokens[i][:col], depths[i][:col], out, i, 0, left=True))
                self._waiting.discard(swap_tags[i])
                rows[i] = self._on_device.get(swap_tags[i])
                start = col
            else:
                start = 0
            if rows[i] is not None:
                state = RowState(bool(after.active[i]), int(after.loops_done[i]), after.remaining[i],
                                 bool(after.triggered[i]))
                runs.append(TokenRun(rows[i], tokens[i][start:count], depths[i][start:count], out, i, start,
                                     state=state))
        self._on_device = {tag: r for tag, r in self._on_device.items() if not r.finished}
        if not self._unread:
            self._rows = None
        return runs

    def _check_swaps(self, rows: RowMap, out) -> None:
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


def finishes_within(r: Request, num_passes: int, num_loops: int) -> bool:
    """Whether a decoding request surely reaches max_tokens within num_passes loop passes from
    its host state: each token takes at most max_loops passes (the current one max_loops -
    loops_done more; a first token still in a window's prompt passes, mixed prefill: R)."""
    first = num_loops if not r.output_token_ids else r.max_loops - r.loops_done
    surely_made = 0 if num_passes < first else 1 + (num_passes - first) // r.max_loops
    return r.params.max_tokens - len(r.output_token_ids) <= surely_made


def fits_window(chunks: tuple[Chunk, ...], limit: int, alignment: int, free_rows: int) -> bool:
    """Whether prefill chunks can ride the next window: whole prompts, at most ``limit``
    tokens with the alignment padding between them, a row for each."""
    total = 0
    for c in chunks:
        if c.start != 0 or c.length != c.request.prompt_len:
            return False
        total += -total % alignment + c.length
    return 0 < total <= limit and len(chunks) <= free_rows

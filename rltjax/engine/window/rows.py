"""Host-built decode-window rows (numpy ``WindowRows``): requests' rows, idle rows, padding,
and the per-row token-stop ids the device checks."""
from __future__ import annotations

import dataclasses

import numpy as np

from rltjax.engine.window.state import STOP_ID_WIDTH, WindowRows
from rltjax.sampling import split_seed


def tag_of(r) -> int:
    """A request's tag on the device (``WindowRows.tag``): its arrival index, kept in int32."""
    return r.arrival_index & 0x7FFFFFFF


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
                      trace=np.zeros((n, trace_width), np.int32), first=z(bool), tag=np.full(n, -1, np.int32),
                      spec_tokens=z())


def window_rows(requests, *, layered: bool, num_planes: int, trace_width: int, first=None) -> WindowRows:
    """The WindowRows of decoding requests (host numpy): each with its block table per plane
    and its token-stop ids. first: per request, whether its first head is queued on the device
    but not read (its token then comes from ``slot_tokens``; the row starts as it will once
    the host takes that token: one output, the next position)."""
    n = len(requests)
    first = np.zeros(n, bool) if first is None else np.asarray(first, bool)
    arr = lambda f, dtype=np.int32: np.array([f(r) for r in requests], dtype)   # noqa: E731
    seeds = np.array([split_seed(r.seed) for r in requests], np.uint32).reshape(n, 2)
    # trace mode: the recorded depth of every output index (past the end: max_loops)
    trace = np.array([((list(r.trace_depths[:trace_width]) if r.trace_depths else [])
                       + [r.max_loops] * trace_width)[:trace_width] for r in requests], np.int32)
    tables = [r.tables[p if layered else 0] for r in requests for p in range(num_planes)]
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
        tables=np.asarray(tables, np.int32).reshape(n, -1),
        btables=arr(lambda r: r.boundary_table if r.boundary_table is not None else 0),
        stop_ids=stop_id_matrix([r.token_stop_ids for r in requests]),
        trace=trace, first=first, tag=arr(tag_of), spec_tokens=arr(lambda r: r.spec_tokens))


def pad_rows_to(rows: WindowRows, n: int, dummy_slot: int) -> WindowRows:
    """Host rows padded to n (idle rows naming the dummy slot and no request)."""
    fill = dict(slots=dummy_slot, tag=-1)
    return WindowRows(**{f.name: np.pad(getattr(rows, f.name),
                                        [(0, n - len(rows.slots))] + [(0, 0)] * (getattr(rows, f.name).ndim - 1),
                                        constant_values=fill.get(f.name, 0))
                         for f in dataclasses.fields(WindowRows)})


def place(target: WindowRows, at, rows: WindowRows) -> None:
    """Write ``rows`` into ``target`` (host rows, in place) at the indices ``at``."""
    for f in dataclasses.fields(WindowRows):
        getattr(target, f.name)[at] = getattr(rows, f.name)

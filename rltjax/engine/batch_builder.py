"""Host batches for the runner: requests -> the padded-free numpy arrays of one device call.

Owns the translation from request state (positions, planes, block tables) to the
arrays ``ModelRunner`` takes, and the device copies of the block tables (uploaded
again only when the scheduler changed them). Prefill batches start every chunk at a
multiple of the runner's ``prefill_alignment`` (the prefill kernel's query blocks);
the rows in between are padding: position -1 (they read nothing) and the scratch page.
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from rltjax.cache.kv_update import write_through_pages
from rltjax.engine.runner_io import BoundaryRows
from rltjax.engine.scheduler import Scheduler
from rltjax.engine.sequence import Request
from rltjax.sampling import split_seed


class BatchBuilder:
    def __init__(self, scheduler: Scheduler, *, page_size: int, num_loops: int, num_planes: int, layered: bool,
                 prefill_alignment: int, dummy_slot: int):
        self.scheduler = scheduler
        self.page_size = page_size
        self.num_loops = num_loops
        self.num_planes = num_planes
        self.layered = layered
        self.prefill_alignment = prefill_alignment
        self.dummy_slot = dummy_slot
        self._device_tables: dict[int, tuple[int, jax.Array]] = {}

    def on_device(self, tables) -> jax.Array:
        """Block tables on the device, uploaded again only after they changed: the array is
        [max_tables, pages_per_table] (megabytes at long max_model_len), its changes are rare."""
        version, array = self._device_tables.get(id(tables), (None, None))
        if version != tables.version:
            array = jax.device_put(tables.array.copy())   # a copy: the host array mutates in place
            self._device_tables[id(tables)] = (tables.version, array)
        return array

    def block_tables(self) -> jax.Array:
        return self.on_device(self.scheduler.block_tables)

    def boundary_tables(self) -> jax.Array | None:
        tables = self.scheduler.boundary_tables
        return None if tables is None else self.on_device(tables)

    def slot(self, req: Request, plane: int, position: int) -> tuple[int, int]:
        return self.scheduler.block_tables.slot_for(req.tables[plane], position, self.page_size)

    def boundary_rows(self, reqs: Sequence[Request], positions: np.ndarray) -> BoundaryRows | None:
        """Boundary-pool pages, tables and seeds of rows (None when the model has no boundary stages)."""
        tables = self.scheduler.boundary_tables
        if tables is None:
            return None
        return BoundaryRows(
            write_page=np.array([tables.slot_for(r.boundary_table, int(p), self.page_size)[0]
                                 for r, p in zip(reqs, positions)], np.int32),
            row_tables=np.array([r.boundary_table for r in reqs], np.int32),
            seeds=np.array([split_seed(r.seed) for r in reqs], np.uint32).reshape(len(reqs), 2),
            block_tables=self.on_device(tables))

    def prefill(self, chunks: list[tuple[Request, int, int]]) -> tuple:
        """Arguments of ``ModelRunner.prefill`` for chunks (request, start, length). Rows
        between chunks (alignment padding) have position -1 (they read nothing), the scratch
        page and the dummy slot. Built per chunk, not per token: this runs on every admission."""
        R, align = self.num_loops, self.prefill_alignment
        # loop d writes plane d; the last loop also fills planes R..cap-1 (min(d, e) with e = R)
        planes = [d if self.layered else 0 for d in range(max(R, self.num_planes))]
        starts, total = [], 0
        for _, _, n in chunks:
            total += -total % align
            starts.append(total)
            total += n
        tokens = np.zeros(total, np.int32)
        positions = np.full(total, -1, np.int32)
        write_page = np.zeros((len(planes), total), np.int32)
        write_offset = np.zeros(total, np.int32)
        row_tables = np.zeros((R, total), np.int32)
        out_slots = np.full(total, self.dummy_slot, np.int32)
        live_reqs: list[Request] = []
        live = np.zeros(total, bool)
        tables = self.scheduler.block_tables
        for (req, start, n), at in zip(chunks, starts):
            if n <= 0:
                continue
            rows = slice(at, at + n)
            pos = np.arange(start, start + n, dtype=np.int32)
            tokens[rows] = req.prompt_token_ids[start:start + n]
            positions[rows] = pos
            for i, plane in enumerate(planes):
                write_page[i, rows], write_offset[rows] = tables.slots_for(req.tables[plane], pos, self.page_size)
            row_tables[:, rows] = np.array([req.tables[plane] for plane in planes[:R]], np.int32)[:, None]
            if start + n == req.prompt_len:
                out_slots[at + n - 1] = req.slot
            live[rows] = True
            live_reqs += [req] * n
        boundary = self.boundary_rows(live_reqs, positions[live])
        if boundary is not None and len(live_reqs) < total:
            boundary = boundary.scatter(live)
        return (tokens, positions, write_page, write_offset, row_tables, out_slots, self.block_tables(), boundary)

    def head(self, rows: list[Request]) -> tuple:
        """Arguments of ``ModelRunner.head`` / ``head_launch`` for rows awaiting their heads."""
        seeds = np.array([split_seed(r.seed) for r in rows], np.uint32).reshape(len(rows), 2)
        positions = np.array([r.decode_position for r in rows], np.int32)   # where each row's state is
        return (np.array([r.slot for r in rows], np.int32), np.array([r.params.temperature for r in rows], np.float32),
                np.array([r.params.top_k for r in rows], np.int32),
                np.array([r.params.top_p for r in rows], np.float32), seeds[:, 0], seeds[:, 1],
                np.array([len(r.output_token_ids) for r in rows], np.int32), positions,
                self.boundary_rows(rows, positions))

    def loop(self, rows: list[Request]) -> tuple:
        """Arguments of ``ModelRunner.loop`` for one pass over rows at their own depths."""
        planes = [r.loops_done if self.layered else 0 for r in rows]
        positions = np.array([r.decode_position for r in rows], np.int32)
        for r, pl, p in zip(rows, planes, positions):
            self.slot(r, pl, int(p))        # checks the position (every plane's table holds as many pages)
        # [num_planes, N]: each row's K/V goes to its own plane and, written through, to the
        # deeper ones below its cap (page 0 elsewhere: dropped), so an exit needs no copy
        plane_tables = np.array([r.tables[:self.num_planes] for r in rows], np.int32)
        plane_tables = plane_tables.reshape(len(rows), self.num_planes)                       # [N, P]
        caps = np.array([r.max_loops if self.layered else 1 for r in rows])
        write_page = write_through_pages(plane_tables, np.array(planes), caps, positions, np.ones(len(rows), bool),
                                         self.scheduler.block_tables.array, self.page_size)     # [P, N]
        starting = np.array([r.loops_done == 0 for r in rows])
        return (np.array([r.slot for r in rows], np.int32), np.array([r.output_token_ids[-1] for r in rows], np.int32),
                starting, positions, write_page, positions % self.page_size,
                np.array([r.tables[pl] for r, pl in zip(rows, planes)], np.int32), self.block_tables(),
                self.boundary_rows(rows, positions) if starting.any() else None)

"""Host to device: requests -> the padded, typed batch of one device call.

The one place that turns request state (positions, planes, block tables, sampling params)
into the arrays of ``engine.batches``, padded to the call's power-of-two bucket, and keeps
the device copies of the block tables (uploaded again only when the scheduler changed
them). Prefill batches start every chunk at a multiple of ``prefill_alignment`` (the prefill
kernel's query blocks); the rows in between are padding: position -1 (they read nothing),
the scratch page and the dummy slot. Every builder given no requests and a ``size`` returns
an all-padding batch of that bucket: the warm-up's stand-ins.
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from rltjax.cache.kv_update import write_through_pages
from rltjax.cache.paged_kv import PagedMeta
from rltjax.engine.batches import (BoundaryInputs, EmbedBatch, HeadBatch, LoopBatch, PrefillBatch, pad_columns,
                                   pad_rows)
from rltjax.engine.plan import Chunk
from rltjax.engine.sequence import Request
from rltjax.engine.settings import EngineSettings, bucket
from rltjax.engine.window.state import WindowPrompt
from rltjax.sampling import split_seed


class HostBatches:
    def __init__(self, settings: EngineSettings, block_tables, boundary_tables=None):
        """block_tables / boundary_tables: the scheduler's ``BlockTables`` (boundary: models
        with boundary stages only)."""
        self.s = settings
        self.tables = block_tables
        self.btables = boundary_tables
        self._device_tables: dict[int, tuple[int, jax.Array]] = {}

    # -- block tables -------------------------------------------------------------
    def on_device(self, tables) -> jax.Array:
        """Block tables on the device, uploaded again only after they changed: the array is
        [max_tables, pages_per_table] (megabytes at long max_model_len), its changes are rare."""
        version, array = self._device_tables.get(id(tables), (None, None))
        if version != tables.version:
            array = jax.device_put(tables.array.copy())   # a copy: the host array mutates in place
            self._device_tables[id(tables)] = (tables.version, array)
        return array

    def block_tables(self) -> jax.Array:
        return self.on_device(self.tables)

    def boundary_tables(self) -> jax.Array | None:
        return None if self.btables is None else self.on_device(self.btables)

    def rows_bucket(self, n: int) -> int:
        return max(bucket(n), self.s.row_buckets[0])

    def tokens_bucket(self, n: int) -> int:
        return max(bucket(n), self.s.token_buckets[0])

    # -- boundary pool --------------------------------------------------------------
    def boundary(self, reqs: Sequence[Request], positions: np.ndarray, write_offset: np.ndarray,
                 size: int) -> BoundaryInputs | None:
        """Boundary-pool inputs of rows at ``positions`` (request None: padding, scratch page),
        padded to ``size`` rows; None for models without boundary stages."""
        if self.btables is None:
            return None
        n, page_size = len(reqs), self.s.page_size
        write_page, row_tables, seeds = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros((n, 2), np.uint32)
        for i, (r, p) in enumerate(zip(reqs, positions)):
            if r is not None:
                write_page[i] = self.btables.slot_for(r.boundary_table, int(p), page_size)[0]
                row_tables[i], seeds[i] = r.boundary_table, split_seed(r.seed)
        meta = PagedMeta(pad_rows(positions, size), pad_rows(write_page, size), pad_rows(write_offset, size),
                         pad_rows(row_tables, size), pad_rows(positions + 1, size).astype(np.int32),
                         self.boundary_tables())
        return BoundaryInputs(meta, pad_rows(seeds, size))

    # -- batches --------------------------------------------------------------------
    def prefill(self, chunks: Sequence[Chunk], size: int | None = None) -> PrefillBatch:
        """Chunks (request, start, length), each starting at a multiple of the alignment, padded
        to the token bucket (or ``size``)."""
        a = self._prefill_arrays(chunks)
        t = size or self.tokens_bucket(len(a["tokens"]))
        scoring = any(c.request.params.prompt_logprobs is not None for c in chunks)
        return PrefillBatch(
            pad_rows(a["tokens"], t), pad_rows(a["positions"], t), pad_columns(a["write_page"], t),
            pad_rows(a["write_offset"], t), pad_columns(a["row_tables"], t),
            pad_rows(a["positions"] + 1, t).astype(np.int32), self.block_tables(),
            pad_rows(a["out_slots"], t, self.s.dummy_slot),
            self.boundary(a["owners"], a["positions"], a["write_offset"], t),
            pad_rows(self._targets(chunks, len(a["tokens"])), t) if scoring else None)

    def chunk_starts(self, chunks: Sequence[Chunk]) -> list[int]:
        """The batch row each chunk starts at (chunks start at multiples of the alignment)."""
        starts, total = [], 0
        for c in chunks:
            total += -total % self.s.prefill_alignment
            starts.append(total)
            total += c.length
        return starts

    def _targets(self, chunks: Sequence[Chunk], total: int) -> np.ndarray:
        """Each prompt token's next prompt token (0 after a prompt's last), for prompt logprobs."""
        targets = np.zeros(total, np.int32)
        for c, at in zip(chunks, self.chunk_starts(chunks)):
            nxt = c.request.prompt_token_ids[c.start + 1:c.start + c.length + 1]
            targets[at:at + len(nxt)] = nxt
        return targets

    def window_prompt(self, chunks: Sequence[Chunk], size: int, rows: np.ndarray) -> WindowPrompt:
        """Whole prompts riding a window (mixed prefill), padded to the ``size`` tokens its row
        bucket carries (position -1: padding); rows: [bucket] bool, the rows waiting for them."""
        a = self._prefill_arrays(chunks)
        if len(a["tokens"]) > size:
            raise ValueError(f"{len(a['tokens'])} prompt tokens for a window that carries {size} (this is a bug)")
        return WindowPrompt(pad_rows(a["tokens"], size), pad_rows(a["positions"], size, -1),
                            pad_columns(a["write_page"], size), pad_rows(a["write_offset"], size),
                            pad_columns(a["row_tables"], size), pad_rows(a["out_slots"], size, self.s.dummy_slot),
                            np.asarray(rows, bool))

    def _prefill_arrays(self, chunks: Sequence[Chunk]) -> dict:
        """The unpadded arrays of prefill chunks, alignment padding between them. Built per
        chunk, not per token: this runs on every admission."""
        R, planes = self.s.num_loops, self._prefill_planes()
        starts = self.chunk_starts(chunks)
        total = starts[-1] + chunks[-1].length if chunks else 0
        tokens, positions = np.zeros(total, np.int32), np.full(total, -1, np.int32)
        write_page, write_offset = np.zeros((len(planes), total), np.int32), np.zeros(total, np.int32)
        row_tables, out_slots = np.zeros((R, total), np.int32), np.full(total, self.s.dummy_slot, np.int32)
        owners: list[Request | None] = [None] * total
        for c, at in zip(chunks, starts):
            req, rows = c.request, slice(at, at + c.length)
            pos = np.arange(c.start, c.start + c.length, dtype=np.int32)
            tokens[rows], positions[rows] = req.prompt_token_ids[c.start:c.start + c.length], pos
            for i, plane in enumerate(planes):
                write_page[i, rows], write_offset[rows] = self.tables.slots_for(req.tables[plane], pos,
                                                                                self.s.page_size)
            row_tables[:, rows] = np.array([req.tables[plane] for plane in planes[:R]], np.int32)[:, None]
            if c.start + c.length == req.prompt_len:
                out_slots[at + c.length - 1] = req.slot
            owners[rows] = [req] * c.length
        return dict(tokens=tokens, positions=positions, write_page=write_page, write_offset=write_offset,
                    row_tables=row_tables, out_slots=out_slots, owners=owners)

    def _prefill_planes(self) -> list[int]:
        """The plane each prefill loop writes: loop d plane d; the last loop also fills planes
        R..cap-1 (a later query reads a prompt token at min(d, e) with e = R)."""
        return [d if self.s.layered else 0 for d in range(self.s.prefill_write_planes)]

    def loop(self, rows: Sequence[Request], size: int | None = None) -> tuple[LoopBatch, EmbedBatch | None]:
        """One pass over rows at their own depths, and (boundary models) the prelude of the rows
        that start a token there (None when none does)."""
        layered, num_planes, page_size = self.s.layered, self.s.num_planes, self.s.page_size
        planes = np.array([r.loops_done if layered else 0 for r in rows], np.int32)
        positions = np.array([r.decode_position for r in rows], np.int32)
        for r, pl, p in zip(rows, planes, positions):
            self.tables.slot_for(r.tables[pl], int(p), page_size)   # checks the position on every plane's table
        # [num_planes, N]: each row's K/V goes to its own plane and, written through, to the
        # deeper ones below its cap (page 0 elsewhere: dropped), so an exit needs no copy
        plane_tables = np.array([r.tables[:num_planes] for r in rows], np.int32).reshape(len(rows), num_planes)
        caps = np.array([r.max_loops if layered else 1 for r in rows], np.int32)
        write_page = write_through_pages(plane_tables, planes, caps, positions, np.ones(len(rows), bool),
                                         self.tables.array, page_size)
        slots = np.array([r.slot for r in rows], np.int32)
        tokens = np.array([r.current_token for r in rows], np.int32)
        starting = np.array([r.loops_done == 0 for r in rows], bool)
        offset = positions % page_size
        b = size or self.rows_bucket(len(rows))
        embed = None
        if self.btables is not None and starting.any():
            idx = np.flatnonzero(starting)
            e = self.rows_bucket(len(idx))
            embed = EmbedBatch(pad_rows(slots[idx], e, self.s.dummy_slot), pad_rows(tokens[idx], e),
                               self.boundary([rows[i] for i in idx], positions[idx], offset[idx], e))
        batch = LoopBatch(
            pad_rows(slots, b, self.s.dummy_slot), pad_rows(tokens, b),
            # padded rows re-embed token 0 (their writes, page 0 and the dummy slot, are dropped)
            pad_rows(starting, b, True), pad_rows(positions, b), pad_columns(write_page, b), pad_rows(offset, b),
            pad_rows(np.array([r.tables[pl] for r, pl in zip(rows, planes)], np.int32).reshape(-1), b),
            pad_rows(positions + 1, b).astype(np.int32), self.block_tables())
        return batch, embed

    def embed_padding(self, size: int) -> EmbedBatch:
        """An all-padding prelude batch of ``size`` rows (warm-up)."""
        zeros = np.zeros(0, np.int32)
        return EmbedBatch(pad_rows(zeros, size, self.s.dummy_slot), pad_rows(zeros, size),
                          self.boundary([], zeros - 1, zeros, size))

    def head(self, rows: Sequence[Request], size: int | None = None) -> HeadBatch:
        """Heads of rows awaiting them, each sampled with its request's params and key."""
        b = size or self.rows_bucket(len(rows))
        seeds = np.array([split_seed(r.seed) for r in rows], np.uint32).reshape(len(rows), 2)
        positions = np.array([r.decode_position for r in rows], np.int32)   # where each row's state is
        boundary = self.boundary(rows, positions, positions % self.s.page_size, b)
        p = lambda f, dtype, value=0: pad_rows(np.array([f(r) for r in rows], dtype), b, value)   # noqa: E731
        return HeadBatch(p(lambda r: r.slot, np.int32, self.s.dummy_slot), p(lambda r: r.params.temperature, np.float32),
                         p(lambda r: r.params.top_k, np.int32), p(lambda r: r.params.top_p, np.float32, 1.0),
                         pad_rows(seeds[:, 0], b), pad_rows(seeds[:, 1], b),
                         p(lambda r: r.cursor + 1, np.int32), None if boundary is None else boundary.meta)

"""Block tables: per (sequence, depth plane) lists of KV pages, as one int32 array.

A request in the `last_exited` KV layout with R loops owns R tables (plane r
holds the depth-(r+1) K/V of its positions); in the `shared` layout it owns 1.
Row t of `array` lists table t's pages in position order; unused entries are
0, the scratch page, so a kernel reading past a table's end reads harmless
scratch data instead of another request's page.
"""
from __future__ import annotations

from typing import Hashable, Iterable

import numpy as np

from rltjax.cache.allocator import SCRATCH_PAGE


class BlockTableError(RuntimeError):
    """Misuse of the block tables (unknown sequence, table full, ...)."""


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages one plane needs to hold num_tokens positions."""
    if num_tokens < 0 or page_size < 1:
        raise ValueError(f"need num_tokens >= 0 and page_size >= 1, got {num_tokens}, {page_size}")
    return -(-num_tokens // page_size)


class BlockTables:
    def __init__(self, max_tables: int, max_pages_per_table: int):
        if max_tables < 1 or max_pages_per_table < 1:
            raise ValueError("max_tables and max_pages_per_table must be >= 1")
        self.max_tables = max_tables
        self.max_pages_per_table = max_pages_per_table
        self._array = np.full((max_tables, max_pages_per_table), SCRATCH_PAGE, np.int32)
        self._num_pages = np.zeros(max_tables, np.int32)  # pages appended to each table
        self._free_tables: list[int] = list(range(max_tables - 1, -1, -1))  # LIFO, lowest first
        self._in_use = np.zeros(max_tables, bool)  # O(1) check on the per-step slot_for path
        self._tables_of: dict[Hashable, list[int]] = {}
        self.version = 0  # bumped whenever the array changes, so a device copy can be reused until then

    @property
    def array(self) -> np.ndarray:
        """The [max_tables, max_pages_per_table] int32 table array, for upload to the device."""
        return self._array

    @property
    def num_free_tables(self) -> int:
        return len(self._free_tables)

    def tables_of(self, seq_id: Hashable) -> list[int]:
        """seq_id's table indices, plane 0 (depth 1) first."""
        if seq_id not in self._tables_of:
            raise BlockTableError(f"unknown sequence {seq_id!r}: it has no block tables")
        return list(self._tables_of[seq_id])

    def assign(self, seq_id: Hashable, num_planes: int) -> list[int]:
        """Give seq_id one empty table per plane; returns indices in plane order."""
        if seq_id in self._tables_of:
            raise BlockTableError(f"sequence {seq_id!r} already has block tables")
        if num_planes < 1:
            raise ValueError(f"num_planes must be >= 1, got {num_planes}")
        if num_planes > len(self._free_tables):
            raise BlockTableError(f"sequence {seq_id!r} needs {num_planes} table(s) but only "
                                  f"{len(self._free_tables)} are free")
        tables = [self._free_tables.pop() for _ in range(num_planes)]
        self._in_use[tables] = True
        self._tables_of[seq_id] = tables
        return list(tables)

    def append_pages(self, table_idx: int, pages: Iterable[int]) -> None:
        """Extend a table with pages (covering the next positions in order)."""
        self._check_in_use(table_idx)
        pages = list(pages)
        if SCRATCH_PAGE in pages:
            raise BlockTableError(f"cannot append the scratch page 0 to table {table_idx}")
        start = int(self._num_pages[table_idx])
        if start + len(pages) > self.max_pages_per_table:
            raise BlockTableError(f"table {table_idx} holds {start} page(s); appending {len(pages)} "
                                  f"exceeds max_pages_per_table={self.max_pages_per_table}")
        self._array[table_idx, start:start + len(pages)] = pages
        self._num_pages[table_idx] = start + len(pages)
        self.version += 1

    def pages_of(self, table_idx: int) -> list[int]:
        self._check_in_use(table_idx)
        return self._array[table_idx, :self._num_pages[table_idx]].tolist()

    def slot_for(self, table_idx: int, position: int, page_size: int) -> tuple[int, int]:
        """(page, offset within page) where the K/V of `position` lives in this table."""
        self._check_in_use(table_idx)
        page_idx, offset = divmod(position, page_size)
        if position < 0 or page_idx >= self._num_pages[table_idx]:
            self._outside(table_idx, position, page_size)
        return int(self._array[table_idx, page_idx]), offset

    def slots_for(self, table_idx: int, positions: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
        """``slot_for`` of many positions at once (a prompt chunk): ([n] pages, [n] offsets) int32."""
        self._check_in_use(table_idx)
        positions = np.asarray(positions, np.int64)
        page_idx, offsets = np.divmod(positions, page_size)
        if positions.size:
            outside = (positions < 0) | (page_idx >= self._num_pages[table_idx])
            if outside.any():
                self._outside(table_idx, int(positions[np.argmax(outside)]), page_size)
        return self._array[table_idx, page_idx].astype(np.int32), offsets.astype(np.int32)

    def _outside(self, table_idx: int, position: int, page_size: int):
        raise BlockTableError(
            f"position {position} is outside table {table_idx}: it holds "
            f"{self._num_pages[table_idx]} page(s) of {page_size} = "
            f"{self._num_pages[table_idx] * page_size} positions")

    def release(self, seq_id: Hashable) -> list[int]:
        """Drop seq_id's tables, resetting their rows to scratch; returns their indices.

        The pages themselves belong to the PageAllocator; free them there.
        """
        tables = self.tables_of(seq_id)
        del self._tables_of[seq_id]
        self._array[tables] = SCRATCH_PAGE
        self._num_pages[tables] = 0
        self.version += 1
        self._in_use[tables] = False
        self._free_tables.extend(reversed(tables))
        return tables

    def _check_in_use(self, table_idx: int) -> None:
        if not (0 <= table_idx < self.max_tables and self._in_use[table_idx]):
            raise BlockTableError(f"table {table_idx} is not assigned to any sequence")

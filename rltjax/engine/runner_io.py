"""Host-side rows and results of the runner's calls: boundary-pool rows of a batch, and a
loop pass's exit signals (read at once, or one pass late under async scheduling)."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np


@dataclasses.dataclass
class BoundaryRows:
    """Boundary-pool metadata of a call's rows (models with prelude/coda KV), unpadded."""
    write_page: np.ndarray     # [N] int32: page of each row's position in its boundary table
    row_tables: np.ndarray     # [N] int32: each row's boundary table
    seeds: np.ndarray          # [N, 2] uint32: (hi, lo) words of the request seed (initial state)
    block_tables: np.ndarray   # [num_tables, pages_per_table] int32: the boundary pool's tables

    def take(self, idx: np.ndarray) -> "BoundaryRows":
        return BoundaryRows(self.write_page[idx], self.row_tables[idx], self.seeds[idx], self.block_tables)

    def scatter(self, live: np.ndarray) -> "BoundaryRows":
        """These rows placed at the True entries of ``live``; the others are padding
        (scratch page 0, table 0, seed 0)."""
        def spread(a):
            out = np.zeros((len(live),) + a.shape[1:], a.dtype)
            out[live] = a
            return out
        return BoundaryRows(spread(self.write_page), spread(self.row_tables), spread(self.seeds), self.block_tables)


class LoopSignals(NamedTuple):
    """Per-row exit inputs of one loop pass: hazard and score, or the raw signal."""
    hazard: np.ndarray | None
    score: np.ndarray | None
    signal: np.ndarray | None


@dataclasses.dataclass
class PendingSignals:
    """A launched pass's signals on their way to the host (async scheduling)."""
    arrays: tuple
    num_rows: int
    raw_signal: bool

    def read(self) -> LoopSignals:
        signals = [np.asarray(x)[:self.num_rows] for x in self.arrays]
        return LoopSignals(None, None, signals[0]) if self.raw_signal else LoopSignals(*signals, None)

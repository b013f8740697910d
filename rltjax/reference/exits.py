"""Exit rules of DESIGN section 2, one token at a time, written for clarity.

``TokenExit.after_loop(r, prob)`` is called after loop r (1-based) of a
decode token and answers whether r is the token's last loop. ``prob`` is the
float32 sigmoid computed on the device (the gate hazard h_r, or the lookahead
score), so the oracle and the engine share the one transcendental op and all
the rest is float32 arithmetic spelled out here.
"""
from __future__ import annotations

import numpy as np

from rltjax.engine_config import EXIT_MODES

F32 = np.float32
# The reference runs every engine mode (latent_diff included).
REFERENCE_EXIT_MODES = EXIT_MODES


class TokenExit:
    """Exit decision state for one decode token."""

    def __init__(self, mode: str, *, min_loops: int, max_loops: int, threshold: float,
                 trace_depth: int | None = None):
        self.mode = mode
        self.min_loops = min_loops
        self.max_loops = max_loops
        self.q = F32(threshold)
        self.trace_depth = trace_depth
        self.remaining = F32(1)     # ouro modes: prod of (1 - h_r)
        self.triggered = False      # delayed modes: exit after the next loop
        self.cdf_trace: list[float] = []

    @property
    def adaptive(self) -> bool:
        return self.q < F32(1)

    def after_loop(self, r: int, prob) -> bool:
        """prob: hazard sigmoid(gate) (ouro modes), lookahead score (random_lookahead) or
        relative latent change (latent_diff)."""
        if self.mode == "trace":
            return r >= self.trace_depth
        if self.mode in ("ouro", "ouro_delayed"):
            self.remaining = F32(self.remaining * (F32(1) - F32(prob)))
            self.cdf_trace.append(float(F32(1) - self.remaining))
        if r >= self.max_loops:
            return True
        if self.mode == "fixed" or not self.adaptive:
            return False
        if self.triggered:              # delayed modes: this is round r+1 of the trigger
            return True
        if self.mode == "ouro":
            return bool(r >= self.min_loops and F32(1) - self.remaining >= self.q)
        if self.mode == "ouro_delayed":
            self.triggered = bool(r >= self.min_loops and F32(1) - self.remaining >= self.q)
            return False
        if self.mode == "latent_diff":  # prob: relative latent change ||s_r - s_{r-1}|| / ||s_r||
            return bool(r >= self.min_loops and F32(prob) < self.q)
        if self.mode == "random_lookahead":
            self.triggered = bool(r + 1 >= self.min_loops and F32(prob) >= self.q)
            return False
        raise ValueError(f"unknown exit mode {self.mode!r}")

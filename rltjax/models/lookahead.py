"""The ``random_lookahead`` exit head: a frozen, seeded random Linear(h -> 1) (DESIGN section 2).

Its weights come from the seed alone (bias 0, N(0, initializer_range)), independent of any
global random state, so the engine and the reference oracle build the same head.
"""
from __future__ import annotations

import numpy as np


def lookahead_weights(seed: int, hidden_size: int, initializer_range: float) -> np.ndarray:
    """[hidden_size] float32 weights of the frozen lookahead head for this seed."""
    rng = np.random.Generator(np.random.PCG64(seed))
    return (rng.standard_normal(hidden_size) * initializer_range).astype(np.float32)

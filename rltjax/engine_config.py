"""Engine-level options shared by the reference oracle and the engine.

Exit modes and KV layouts are defined by DESIGN section 2; the names here are
the ones users pass (``exit_mode=``, ``kv_layout=``).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

EXIT_MODES = ("ouro", "ouro_delayed", "random_lookahead", "trace", "fixed")
KV_LAYOUTS = ("last_exited", "shared")


class EngineConfigError(ValueError):
    """An invalid engine option; the message names the option."""


@dataclasses.dataclass(frozen=True)
class ExitConfig:
    """How a decode token decides its depth.

    mode: ``ouro`` (cumulative gate hazard, same step), ``ouro_delayed`` (trigger
    at r exits after r+1), ``random_lookahead`` (seeded random Linear(h->1)
    scoring "exit after one more loop"), ``trace`` (replay recorded depths),
    ``fixed`` (always max_loops). A request with exit_threshold 1, or a model
    without an exit signal, runs fixed depth whatever the mode.
    """
    mode: str = "ouro"
    lookahead_seed: int = 0
    depths_by_request: Mapping[str, Sequence[int]] | None = None

    def __post_init__(self) -> None:
        if self.mode not in EXIT_MODES:
            raise EngineConfigError(f"ExitConfig.mode={self.mode!r}: choose one of {EXIT_MODES}")
        if self.mode == "trace" and self.depths_by_request is None:
            raise EngineConfigError("ExitConfig.depths_by_request is required when mode='trace'")
        if not isinstance(self.lookahead_seed, int) or self.lookahead_seed < 0:
            raise EngineConfigError(f"ExitConfig.lookahead_seed={self.lookahead_seed!r}: must be an int >= 0")


def check_kv_layout(kv_layout: str) -> str:
    if kv_layout not in KV_LAYOUTS:
        raise EngineConfigError(f"kv_layout={kv_layout!r}: choose one of {KV_LAYOUTS}")
    return kv_layout


def validate_trace_depths(depths: Sequence[int], *, num_loops: int, min_loops: int,
                          max_loops: int, max_tokens: int, request_id: str) -> list[int]:
    """Trace replay rules: length >= max_tokens, first entry R, others in [min, max]."""
    depths = list(depths)
    where = f"ExitConfig.depths_by_request[{request_id!r}]"
    if len(depths) < max_tokens:
        raise EngineConfigError(f"{where}: {len(depths)} depths recorded, max_tokens needs {max_tokens}")
    if depths[0] != num_loops:
        raise EngineConfigError(f"{where}[0]={depths[0]}: the prefill depth must be R={num_loops}")
    for i, d in enumerate(depths[1:max_tokens], start=1):
        if not isinstance(d, int) or not min_loops <= d <= max_loops:
            raise EngineConfigError(f"{where}[{i}]={d!r}: must be within [min_loops={min_loops}, "
                                    f"max_loops={max_loops}]")
    return depths

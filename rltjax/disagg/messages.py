"""What the coordinator and the workers say to each other (pickled over a local connection).

A request's life: ``Prefill`` to a prefill worker -> its first ``Output`` and ``Ready`` (the
handoff without its pages, which wait on the worker's transfer server under ``uuid``) ->
``Import`` to the chosen decode worker, which pulls the pages and goes on -> ``Output``s until
it finishes. ``Abort`` reaches whichever worker holds it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from rltjax.engine.outputs import RequestOutput
from rltjax.engine.stats import EngineStats
from rltjax.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class Setup:
    model: str
    configs: dict                 # build_engine's keyword arguments
    role: str                     # "prefill" | "decode"
    index: int


@dataclasses.dataclass(frozen=True)
class Hello:
    """A worker is up: where its transfer server listens and what its engine computes."""
    role: str
    index: int
    transfer_address: str
    fingerprint: str
    facts: dict                   # max_model_len, num_pages, num_planes, page_size, max_num_seqs


@dataclasses.dataclass(frozen=True)
class Prefill:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams        # seed drawn by the coordinator


@dataclasses.dataclass(frozen=True)
class Ready:
    """The prompt ran; its pages wait under ``uuid`` (``handoff``'s data is their shapes)."""
    request_id: str
    handoff: Any                  # engine.handoff.Handoff with data = ShapeDtypeStructs
    uuid: int
    nbytes: int
    prefill_seconds: float


@dataclasses.dataclass(frozen=True)
class Import:
    ready: Ready
    transfer_address: str         # the prefill worker's


@dataclasses.dataclass(frozen=True)
class Abort:
    request_id: str


@dataclasses.dataclass(frozen=True)
class Pulled:
    """The decode worker has the pages: the prefill worker may drop its copy."""
    request_id: str


@dataclasses.dataclass(frozen=True)
class Output:
    output: RequestOutput
    transfer_seconds: float | None = None   # set on a decode worker's first output of a request


@dataclasses.dataclass(frozen=True)
class Failed:
    request_id: str
    error: str


@dataclasses.dataclass(frozen=True)
class Stats:
    stats: EngineStats


@dataclasses.dataclass(frozen=True)
class Stop:
    pass

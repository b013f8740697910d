"""What the coordinator and the workers say to each other (pickled over a local connection).

A request's life: ``Hold`` to the decode worker picked for it (pages kept for its prompt) and
``Prefill`` to a prefill worker, which sends a ``Chunk`` (pages waiting on its transfer server
under ``uuid``) as each run of prompt pages completes, passed on as ``PullChunk`` to the decode
worker, which pulls it at once; then its first ``Output`` and ``Ready`` (the handoff of the
remaining pages and slot rows) -> ``Import`` to the decode worker, which pulls the rest, puts
the pages together and goes on -> ``Output``s until it finishes. ``Abort`` reaches whichever
worker holds it.
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
    stream: bool = True           # prefill: announce prompt pages as they complete (else all with the first token)


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
    attempt: int = 1              # which prefill of the request this is (a retry counts up)
    skip_pages: int = 0           # its first pages per plane the decode worker has: not sent


@dataclasses.dataclass(frozen=True)
class Ready:
    """The prompt ran; its pages wait under ``uuid`` (``handoff``'s data is their shapes)."""
    request_id: str
    handoff: Any                  # engine.handoff.Handoff with data = ShapeDtypeStructs
    uuid: int
    nbytes: int
    prefill_seconds: float
    attempt: int = 1              # the ``Prefill`` it answers


@dataclasses.dataclass(frozen=True)
class Hold:
    """Keep pages for a request's first ``positions`` until it is imported (or aborted)."""
    request_id: str
    positions: int
    attempt: int = 1              # the prefill attempt whose pages will come
    prompt_token_ids: tuple = ()  # its prompt, looked up in the decode worker's prefix cache (empty: not)
    seed: int = 0                 # (the prefix key of a model whose prompt KV depends on it)


@dataclasses.dataclass(frozen=True)
class Held:
    """The decode worker holds pages for the request; its first ``cached_pages`` pages per plane
    are in its prefix cache already: the prefill worker does not send them."""
    request_id: str
    attempt: int
    cached_pages: int


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Pages [start, start + num_pages) of every plane of a prompt still running, waiting under
    ``uuid`` (``specs``: their pieces' shapes)."""
    request_id: str
    uuid: int
    start: int
    num_pages: int
    specs: Any
    nbytes: int
    attempt: int = 1


@dataclasses.dataclass(frozen=True)
class PullChunk:
    chunk: Chunk
    transfer_address: str         # the prefill worker's


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
    attempt: int = 0                        # with transfer_seconds: the prefill attempt it imported


@dataclasses.dataclass(frozen=True)
class Failed:
    request_id: str
    error: str
    pull: bool = False            # a decode worker could not pull its pages (the prefill side may be gone)
    attempt: int = 0              # pull: the prefill attempt whose pages they were


@dataclasses.dataclass(frozen=True)
class Stats:
    stats: EngineStats


@dataclasses.dataclass(frozen=True)
class Stop:
    pass

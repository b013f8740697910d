"""A running request moved from one engine to another, exactly: the heart of prefill/decode
disaggregation (a prefill engine runs the prompt and the first head, a decode engine goes on).

``export_running`` copies the request's KV pages (every plane, and the boundary pool's) and
its slot rows with the swap machinery's gather (``engine.swap``), then lets it go on this
engine; ``import_running`` queues it on another engine as if it had been swapped out there,
so admission gives it fresh pages and the swap-in scatters the copy into them. Tokens, exit
depths, logprobs, seed and exit state travel with it: the other engine continues bit for bit
where this one stopped. Both engines must compute the same thing (``Handoff.fingerprint``:
the model's shapes and dtype, KV layout, page size, planes, loop cap), which the import checks.
The export needs nothing of the request in flight: the sending engine steps without decode
windows or async passes (``check_exportable``).
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from rltjax.engine.outputs import RequestOutput
from rltjax.engine.plan import SwapOutStep
from rltjax.engine.sequence import RequestRejectedError, Status
from rltjax.engine.swap import SWAP_CHUNK, SwapData, Swapped, chunks
from rltjax.sampling_params import SamplingParams


@dataclasses.dataclass
class Handoff:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    output_token_ids: list[int]
    exit_depths: list[int]
    logprobs: list | None
    prompt_logprobs: list | None
    loops_done: int
    exit_remaining: float
    exit_triggered: bool
    record: Swapped              # status, positions and pages per plane at the copy
    data: list[SwapData]         # the pages (in ``engine.swap`` pieces) and slot rows, numpy
    fingerprint: str
    start_page: int = 0          # pages per plane sent before (``export_pages``): ``data`` holds the rest

    @property
    def nbytes(self) -> int:
        return sum(int(np.asarray(x).nbytes) for piece in self.data for x in (piece.k, piece.v, piece.bk, piece.bv)
                   if x is not None)


def fingerprint(engine) -> str:
    s = engine.settings
    cfg = engine.cfg
    return (f"{cfg.arch}|{cfg.num_layers}x{cfg.hidden_size}|{cfg.num_kv_heads}x{cfg.head_dim}|{cfg.vocab_size}|"
            f"{engine.runner.kv.k.dtype}|{s.kv_layout}|{s.page_size}|{s.num_planes}|{s.loop_cap}")


def check_exportable(engine) -> None:
    if engine.settings.window is not None or engine.settings.async_scheduling:
        raise ValueError("an exporting engine must step without decode windows or async passes "
                         "(ExecutionConfig(decode_window=0, async_scheduling=False)): a request in a window "
                         "in flight cannot be copied")


def complete_pages(engine, request_id: str) -> int:
    """Pages per plane of the request whose every position has run all its prompt loops."""
    req = engine.requests[str(request_id)]
    return req.num_prefilled // engine.settings.page_size


def export_pages(engine, request_id: str, start: int, end: int) -> list[SwapData]:
    """A copy of pages [start, end) of every plane (and of the boundary pool) of a request
    still here, mid-prompt too (``complete_pages``): streamed while the rest of the prompt runs."""
    check_exportable(engine)
    req = engine.requests[str(request_id)]
    return _gather(engine, req, start, end, trim=True)


def _gather(engine, req, start: int, end: int | None = None, trim: bool = False) -> list[SwapData]:
    """The pages [start, end) of every plane, in ``engine.swap`` pieces; trim: without the
    last piece's padding (what moves between hosts; ``assemble`` pads them again)."""
    core, boundary = engine.scheduler.blocks.pages_of(req)
    pages, bpages = [p for plane in core for p in plane[start:end]], boundary[start:end]
    step = SwapOutStep(req, *chunks(pages, bpages), req.slot, None)
    data = engine.executor.launch(step).read()
    if not trim:
        return data

    def cut(piece, i):       # no page: no array (a zero-byte transfer never completed)
        n, nb = (min(max(total - i * SWAP_CHUNK, 0), SWAP_CHUNK) for total in (len(pages), len(bpages)))
        own = lambda a, m: np.ascontiguousarray(a[:, :, :m]) if m else None      # noqa: E731
        boundary_part = {} if piece.bk is None else dict(bk=own(piece.bk, nb), bv=own(piece.bv, nb))
        return dataclasses.replace(piece, k=own(piece.k, n), v=own(piece.v, n), **boundary_part)
    return [cut(piece, i) for i, piece in enumerate(data)]


def export_running(engine, request_id: str, start_page: int = 0, trim: bool = False) -> Handoff:
    """Copy a running request off ``engine`` (which then forgets it); start_page: pages per
    plane already sent by ``export_pages`` (the copy holds the rest); trim: the copy's pieces
    without their padding (then ``assemble`` it before ``import_running``)."""
    check_exportable(engine)
    req = engine.requests.get(str(request_id))
    if req is None or req.finished or req.status in (Status.WAITING, Status.PREFILLING):
        raise ValueError(f"request {request_id!r} is not running past its prompt")
    blocks = engine.scheduler.blocks
    core, _ = blocks.pages_of(req)
    record = Swapped(req.status, blocks.covered(req), len(core[0]) if core else 0, 0)
    data = _gather(engine, req, start_page, trim=trim)
    handoff = Handoff(req.request_id, list(req.prompt_token_ids), req.params, req.seed, list(req.output_token_ids),
                      list(req.exit_depths), req.logprobs, req.prompt_logprobs, req.loops_done,
                      float(req.exit_remaining), req.exit_triggered, record, data, fingerprint(engine), start_page)
    req.status, req.finish_reason = Status.FINISHED, "handoff"    # its pages and slot go back here
    engine.scheduler.release(req)
    engine.outputs.finish(req, "handoff")
    engine.forget(req.request_id)
    return handoff


def import_running(engine, h: Handoff, cached_pages: int = 0) -> RequestOutput:
    """Queue a handed-off request on ``engine``; it resumes where the other engine stopped.
    cached_pages: its first pages per plane are the prefix blocks ``BlockManager.hold`` kept
    here (``h.data`` holds the rest)."""
    if h.fingerprint != fingerprint(engine):
        raise RequestRejectedError(f"request {h.request_id!r}: handed off by an engine that computes something "
                                   f"else ({h.fingerprint} here {fingerprint(engine)})")
    engine.add_request(h.request_id, {"prompt_token_ids": h.prompt_token_ids},
                       dataclasses.replace(h.params, seed=h.seed))
    req = engine.requests[h.request_id]       # waiting; admission resumes it as a swapped request
    now = time.monotonic()
    for i, token in enumerate(h.output_token_ids):    # detokenizer and stop checks see every token
        entry = h.logprobs[i] if h.logprobs else {}
        engine.outputs.accept(req, token, entry.get(token, 0.0), np.zeros(0, np.int32), np.zeros(0, np.float32), now)
    req.logprobs, req.prompt_logprobs, req.exit_depths = h.logprobs, h.prompt_logprobs, list(h.exit_depths)
    req.num_prefilled = req.num_published = req.prompt_len
    req.loops_done, req.exit_remaining, req.exit_triggered = h.loops_done, np.float32(h.exit_remaining), \
        h.exit_triggered
    req.swapped = dataclasses.replace(h.record, data=h.data, nbytes=0, cached_pages=cached_pages)
    return engine.get_output(h.request_id)


def assemble(h: Handoff, parts: dict[int, tuple[int, list[SwapData]]], num_planes: int,
             first_page: int = 0) -> list[SwapData]:
    """The copy of a handoff's pages [first_page, its last) whose pages before ``h.start_page``
    came ahead (``parts``: start page -> (pages per plane, ``export_pages``' pieces)), in
    ``engine.swap``'s pieces again (host numpy). first_page: the pages the receiving engine's
    prefix cache has (not sent; ``Swapped.cached_pages``)."""
    segments = sorted(parts.items()) + [(h.start_page, (h.record.num_pages - h.start_page, h.data))]
    at = first_page
    for start, (n, _) in segments:
        if start != at:
            raise ValueError(f"request {h.request_id!r}: its pages came with a gap at page {at} (this is a bug)")
        at += n
    segments = [s for s in segments if s[1][0]]
    core = [_per_plane(pieces, n, num_planes) for _, (n, pieces) in segments]
    k, v = (np.concatenate([c[i] for c in core], axis=3) for i in (0, 1))      # [L, Hkv, planes, pages, ...]
    flat = lambda a: a.reshape(a.shape[:2] + (-1,) + a.shape[4:])           # noqa: E731
    last = h.data[0]
    bk = bv = None
    if segments[0][1][1][0].bk is not None:
        bk, bv = (np.concatenate([np.concatenate([x for x in (p.bk if i == 0 else p.bv for p in pieces)
                                                  if x is not None], axis=2)[:, :, :n]
                                  for _, (n, pieces) in segments], axis=2) for i in (0, 1))
    core_pages, bpages = chunks(list(range(k.shape[2] * k.shape[3])), [] if bk is None else list(range(bk.shape[2])))
    pad = lambda a, m: np.pad(a, [(0, 0), (0, 0), (0, m - a.shape[2])] + [(0, 0)] * (a.ndim - 3))   # noqa: E731
    total = len(core_pages) * SWAP_CHUNK
    k, v = pad(flat(k), total), pad(flat(v), total)
    if bk is not None:
        bk, bv = pad(bk, total), pad(bv, total)
    cut = lambda a, i: None if a is None else a[:, :, i * SWAP_CHUNK:(i + 1) * SWAP_CHUNK]     # noqa: E731
    return [SwapData(cut(k, i), cut(v, i), cut(bk, i), cut(bv, i), last.state, last.inject, last.token)
            for i in range(len(core_pages))]


def _per_plane(pieces: list[SwapData], n: int, num_planes: int):
    """Pieces of n pages per plane (plane by plane) -> k, v as [L, Hkv, planes, n, page, Dh]."""
    def one(a):
        a = np.concatenate([x for x in a if x is not None], axis=2)[:, :, :n * num_planes]
        return a.reshape(a.shape[:2] + (num_planes, n) + a.shape[3:])
    return one([p.k for p in pieces]), one([p.v for p in pieces])

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
from rltjax.engine.swap import SwapData, Swapped, chunks
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


def export_running(engine, request_id: str) -> Handoff:
    """Copy a running request off ``engine`` (which then forgets it)."""
    check_exportable(engine)
    req = engine.requests.get(str(request_id))
    if req is None or req.finished or req.status in (Status.WAITING, Status.PREFILLING):
        raise ValueError(f"request {request_id!r} is not running past its prompt")
    blocks = engine.scheduler.blocks
    core, boundary = blocks.pages_of(req)
    record = Swapped(req.status, blocks.covered(req), len(core[0]) if core else 0, 0)
    step = SwapOutStep(req, *chunks([p for plane in core for p in plane], boundary), req.slot, record)
    data = engine.executor.launch(step).read()
    handoff = Handoff(req.request_id, list(req.prompt_token_ids), req.params, req.seed, list(req.output_token_ids),
                      list(req.exit_depths), req.logprobs, req.prompt_logprobs, req.loops_done,
                      float(req.exit_remaining), req.exit_triggered, record, data, fingerprint(engine))
    req.status, req.finish_reason = Status.FINISHED, "handoff"    # its pages and slot go back here
    engine.scheduler.release(req)
    engine.outputs.finish(req, "handoff")
    engine.forget(req.request_id)
    return handoff


def import_running(engine, h: Handoff) -> RequestOutput:
    """Queue a handed-off request on ``engine``; it resumes where the other engine stopped."""
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
    req.swapped = dataclasses.replace(h.record, data=h.data, nbytes=0)
    return engine.get_output(h.request_id)

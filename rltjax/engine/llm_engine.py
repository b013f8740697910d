"""LLMEngine: the streaming interface (add_request / step / abort_request).

Each ``step`` asks the scheduler for one batch, has ``BatchBuilder`` turn it into
arrays, runs it on the device through the runner, and applies the results on the
host: exit decisions after a loop pass, sampled tokens and stop
checks (``OutputProcessor``) after a head. When every running request is decoding,
a step is a device-side decode window (``window_driver`` / ``decode_window``), read
one window late; when fresh prompts' first heads are all that comes before one, the
heads and the window are queued together and the heads read after; when only an
admission stops the window in flight from continuing, the new requests' prefill, first
heads and a window continued from the device are queued before the host reads it.
Step-by-step passes (``loop_passes``) read their exit signals before the next pass, or,
with ``ExecutionConfig.async_scheduling``, one pass late.
"""
from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from rltjax.cache.paged_kv import PagedKV
from rltjax.engine.batch_builder import BatchBuilder
from rltjax.engine.window_config import window_settings
from rltjax.engine.window_driver import WindowDriver
from rltjax.engine.exit_policy import ExitPolicy
from rltjax.engine.exit_trace import model_fingerprint
from rltjax.engine.loop_passes import LoopPasses
from rltjax.engine.mixed_prefill import fits_window
from rltjax.engine.output_processor import OutputProcessor
from rltjax.engine.outputs import RequestOutput
from rltjax.engine.runner import attention_uses_kernel
from rltjax.engine.runner_build import build_runner
from rltjax.engine.scheduler import Scheduler
from rltjax.engine.request_intake import new_request
from rltjax.engine.sequence import Request, RequestRejectedError, Status
from rltjax.engine.executable_store import ExecutableStore
from rltjax.engine.warm_up import WarmUp, warm_up
from rltjax.config_rules import check_combination
from rltjax.engine_config import CacheConfig, ExecutionConfig, ExitConfig, SchedulerConfig
from rltjax.models.base import boundary_kv_layers, loop_limit, signal_kind
from rltjax.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, model, params, kv: PagedKV, *, tokenizer=None, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, exit_config: ExitConfig,
                 execution_config: ExecutionConfig, max_model_len: int, boundary_kv: PagedKV | None = None):
        """boundary_kv: the boundary (prelude/coda) pool, for models with boundary stages."""
        self.cfg = model.cfg
        self.layered = cache_config.kv_layout == "last_exited"
        # the prefill kernel runs where attention does and the KV is layered (chunked prefill)
        prefill_kernel = self.layered and attention_uses_kernel(execution_config.attn_impl, self.cfg, kv)
        scheduler_config = scheduler_config.with_prefill_defaults(prefill_kernel)
        check_combination(cache_config, scheduler_config, exit_config, execution_config)
        self.tokenizer = tokenizer
        self.cache_config = cache_config
        self.exit_config = exit_config
        R = self.cfg.num_loops
        # the most loops a request may ask for
        self.loop_cap = cache_config.checked_loop_cap(R, loop_limit(model), self.cfg.arch)
        self.loop_limit = loop_limit(model)
        self.num_planes = cache_config.num_planes(R)
        self.exit_policy = ExitPolicy(exit_config.mode, self.cfg.has_exit_gate, signal_kind(model))
        windows = window_settings(execution_config, scheduler_config, self.exit_policy.mode, arch=self.cfg.arch,
                                  num_loops=R, has_boundary=boundary_kv_layers(model) > 0, max_model_len=max_model_len,
                                  kv_layout=cache_config.kv_layout)
        self.window_passes = windows.num_passes
        self.runner = build_runner(model, params, kv, scheduler_config=scheduler_config, exit_config=exit_config,
                                   execution_config=execution_config, exit_policy=self.exit_policy, windows=windows,
                                   num_planes=self.num_planes, layered=self.layered, max_model_len=max_model_len,
                                   boundary_kv=boundary_kv)
        if (self.runner.prefill_alignment > 1) != prefill_kernel:
            raise RuntimeError("the prefill budget was picked for another prefill attention path (this is a bug)")
        self.scheduler = Scheduler(scheduler_config, num_pages=kv.num_pages, page_size=cache_config.page_size,
                                   num_planes=self.num_planes, max_model_len=max_model_len,
                                   position_sequential_prefill=not self.layered,
                                   boundary_num_pages=0 if boundary_kv is None else boundary_kv.num_pages,
                                   prefill_alignment=self.runner.prefill_alignment)
        self.eos_token_ids = tuple(tokenizer.eos_token_ids if tokenizer is not None else self.cfg.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.batches = BatchBuilder(self.scheduler, page_size=cache_config.page_size, num_loops=R,
                                    num_planes=self.num_planes, layered=self.layered,
                                    prefill_alignment=self.runner.prefill_alignment, dummy_slot=self.runner.dummy_slot)
        self.outputs = OutputProcessor(tokenizer, self.eos_token_ids)
        self._arrivals = itertools.count()
        self.steps_by_kind: dict[str, int] = {}
        self.compile_seconds = 0.0
        self.warm_up: WarmUp | None = None   # what the start-up compile did (compile_ahead)
        self._fingerprint: str | None = None
        self.passes = LoopPasses(self.runner, self.batches, self.exit_policy,
                                 async_scheduling=execution_config.async_scheduling, requests=self.requests)
        self.windows = None if not self.window_passes else WindowDriver(
            self.runner, self.batches, num_passes=self.window_passes, layered=self.layered, num_planes=self.num_planes,
            token_stop_ids=self.outputs.token_stop_ids, accept_token=self._accept_token,
            steps_by_kind=self.steps_by_kind)
        if execution_config.compile_ahead:
            # the same (device) table arrays the steps pass: jit keys its cache on where inputs live
            cache_dir = execution_config.compilation_cache_dir
            store = (ExecutableStore.open(Path(cache_dir) / "executables")
                     if execution_config.executable_cache and cache_dir else None)
            self.warm_up = warm_up(self.runner, self.batches.block_tables(), self.batches.boundary_tables(),
                                   show_progress=execution_config.show_progress, store=store)
            self.compile_seconds = self.warm_up.seconds

    @property
    def dtype_name(self) -> str:
        return np.dtype(self.runner.params.embed.dtype).name

    def model_fingerprint(self) -> str:
        """Digest of the config and weights (``exit_trace.model_fingerprint``), computed once."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.cfg, self.runner.params)
        return self._fingerprint

    # -- requests -------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int] | Mapping[str, Any],
                    params: SamplingParams | None = None) -> None:
        request_id = str(request_id)
        if request_id in self.requests:
            raise RequestRejectedError(f"request_id {request_id!r} is already in use")
        req = new_request(request_id, prompt, params, tokenizer=self.tokenizer, cfg=self.cfg,
                          loop_limit=self.loop_limit, loop_cap=self.loop_cap, exit_config=self.exit_config,
                          arrivals=self._arrivals)
        why = self.scheduler.never_fits(req)
        if why:
            raise RequestRejectedError(f"request {request_id!r} can never run: {why}")
        self.requests[request_id] = req
        self.outputs.add(req)
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(str(request_id))
        if req is None or req.finished:
            return None
        self._finish(req, "abort")
        return self._output(req)

    def has_unfinished_requests(self) -> bool:
        # every unfinished request is either waiting or running
        return bool(self.scheduler.waiting or self.scheduler.running)

    def get_output(self, request_id: str) -> RequestOutput:
        req = self.requests.get(str(request_id))
        if req is None:
            raise KeyError(f"no request {str(request_id)!r} (never added, or forgotten)")
        return self._output(req)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's bookkeeping (callers that stream outputs); unknown ids
        are ignored. A request still running must be aborted first."""
        req = self.requests.get(str(request_id))
        if req is not None and not req.finished:
            raise ValueError(f"request {str(request_id)!r} is not finished: abort_request it before forget")
        self.requests.pop(str(request_id), None)
        self.outputs.forget(str(request_id))

    # -- one step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.windows is not None and self.windows.inflight and not self.windows.can_continue(self.scheduler):
            self._count("window_read")
            return self._admit_behind_window()
        plan = self.scheduler.schedule()
        window = self.windows is not None and self.windows.takes(plan, self.scheduler.running)
        kind = "window" if window else plan.kind
        self._count(kind)
        if plan.kind == "idle" and self.scheduler.waiting and not self.scheduler.running:
            raise RuntimeError(f"scheduler stalled: {len(self.scheduler.waiting)} waiting request(s) cannot "
                               f"be admitted into an empty engine (this is a bug)")
        affected = (list(self.scheduler.running) if window else plan.rows) or [c[0] for c in plan.chunks]
        try:
            if plan.kind == "prefill":
                self._prefill(plan.chunks)
            elif window:
                self.passes.read_pending()       # async scheduling: the window starts from up-to-date exit state
                if plan.kind == "head":
                    return [self._output(r) for r in self._first_heads_then_window(plan.rows)]
                return [self._output(r) for r in self.windows.run(plan.rows)]
            elif plan.kind == "loop":
                self.passes.run(plan.rows)
            elif plan.kind == "head":
                return [self._output(r) for r in self._head(plan.rows)]
        except Exception as exc:  # a failed batch must not leak pages or wedge other requests
            return self._fail(affected, exc)
        return []

    def _first_heads_then_window(self, heads: list[Request]) -> list[Request]:
        """Fresh prompts' first heads, then a window over every running request queued behind
        them before the host reads the heads: the window starts those requests from the tokens
        the heads left on the device (``slot_tokens``), so the GPU need not wait for the host
        between an admission's head and the next window. Returns the heads' requests."""
        self._count("head")
        launched = self.runner.head_launch(*self.batches.head(heads))
        fresh = {id(r) for r in heads}
        running = list(self.scheduler.running)
        self.windows.run(running, [id(r) in fresh for r in running])
        return self._accept_heads(heads, self.runner.head_read(launched))

    def _admit_behind_window(self) -> list[RequestOutput]:
        """The in-flight window cannot continue: read it, and first queue what the device can
        run meanwhile. When only an admission stopped it, the next window, continued from the
        device with the new requests in the rows of finished ones, is queued before the host
        reads the window in flight. The new prompts run inside that window's first R passes
        when they fit (mixed prefill, ``mixed_prefill``); else their prefill step and first
        heads are queued before it, if the prefill completes every prompt and the window has
        rows for them. Otherwise the host drains the window first. Returns the step's outputs."""
        def drained():
            self._count("window_drain")      # the host catches up before anything else launches
            try:
                return [self._output(r) for r in self.windows.drain()]
            except Exception as exc:         # its outputs cannot be taken: the window's requests error
                return self._fail(list(self.scheduler.running), exc)
        if not self.windows.only_admission_waits(self.scheduler):
            return drained()
        plan = self.scheduler.schedule()     # admits; every running request is in the window
        if plan.kind != "prefill":           # nothing admitted (the pages are not free yet)
            if self.windows.can_continue(self.scheduler, admission_tried=True):
                self._count("window")
                return [self._output(r) for r in self.windows.run(list(self.scheduler.running))]
            return drained()
        fresh = [req for req, _, _ in plan.chunks]
        prompt = None
        left_out = sum(r.status is Status.PREFILLING for r in self.scheduler.running) > len(fresh)
        if not left_out and fits_window(plan.chunks, self.windows.prompt_tokens(),
                                        self.runner.prefill_alignment, self.windows.room()):
            prompt = self.batches.prefill(plan.chunks)
            self._count("mixed_prefill")
        else:
            self._count("prefill")
            try:
                self._prefill(plan.chunks)
            except Exception as exc:
                return self._fail(fresh, exc) + drained()
            fresh = [r for r in self.scheduler.running if r.status is Status.AWAITING_HEAD]
            if any(r.status is Status.PREFILLING for r in self.scheduler.running) or len(fresh) > self.windows.room():
                return drained()
        self.passes.read_pending()
        self._count("window")
        try:
            if prompt is None:
                self._count("head")
                launched = self.runner.head_launch(*self.batches.head(fresh))
            read_previous = self.windows.run_admitting(fresh, prompt)
        except Exception as exc:     # nothing new in flight: the previous window is still whole
            return self._fail(fresh, exc) + (drained() if self.windows.inflight else [])
        for req in fresh if prompt is not None else ():   # as the window has them: the first token looping
            req.num_prefilled = req.prompt_len
            req.start_token()
        self.scheduler.decode_queued()
        changed = []
        try:
            changed = read_previous()
            heads = [] if prompt is not None else self._accept_heads(fresh, self.runner.head_read(launched))
            return [self._output(r) for r in changed + heads]
        except Exception as exc:     # the window in flight ran on from state the host could not take
            return [self._output(r) for r in changed if r.finished] + self._fail(list(self.scheduler.running), exc)

    def _count(self, kind: str) -> None:
        self.steps_by_kind[kind] = self.steps_by_kind.get(kind, 0) + 1

    def _fail(self, affected: list[Request], exc: Exception) -> list[RequestOutput]:
        """A failed batch: its requests finish with the error (all unfinished ones when the
        device state is lost, which is then re-raised); no page leaks, no wedged requests."""
        if self.runner.device_state_lost():
            affected = [r for r in self.requests.values() if not r.finished]
        for req in affected:
            if req.finished:   # finished normally before the failure (a head batch's earlier rows)
                continue
            req.error = f"{type(exc).__name__}: {exc}"
            self._finish(req, "error")
        if self.runner.device_state_lost():
            raise exc
        return [self._output(r) for r in affected]

    def _prefill(self, chunks) -> None:
        R = self.cfg.num_loops
        self.runner.prefill(*self.batches.prefill(chunks))
        for req, start, n in chunks:
            req.num_prefilled = start + n
            if req.num_prefilled == req.prompt_len:
                req.status = Status.AWAITING_HEAD
                req.exit_depths = [R]

    def _head(self, rows: list[Request]) -> list[Request]:
        return self._accept_heads(rows, self.runner.head(*self.batches.head(rows)))

    def _accept_heads(self, rows: list[Request], results) -> list[Request]:
        """Heads' sampled tokens join their requests (stop checks); returns rows."""
        tokens, chosen, top_ids, top_lp = results
        now = time.monotonic()
        for i, r in enumerate(rows):
            self._accept_token(r, int(tokens[i]), chosen[i], top_ids[i], top_lp[i], now)
        return rows

    def _accept_token(self, r: Request, token: int, chosen, top_ids, top_lp, now: float) -> bool:
        """A sampled token joins the request's output; stop checks. Returns whether it finished."""
        finished, reason, stop_reason = self.outputs.accept(r, token, chosen, top_ids, top_lp, now)
        if finished:
            r.stop_reason = stop_reason
            self._finish(r, reason)
        elif len(r.output_token_ids) >= r.params.max_tokens:
            self._finish(r, "length")
        else:
            r.start_token()
        return r.finished

    def _finish(self, req: Request, reason: str) -> None:
        if req.finish_reason is None:
            req.finish_reason = reason
        req.status = Status.FINISHED
        req.finished_time = time.monotonic()
        self.scheduler.release(req)
        self.outputs.finish(req, reason)

    def _output(self, req: Request) -> RequestOutput:
        return self.outputs.output(req)

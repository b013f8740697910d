"""LLMEngine: the streaming interface (add_request / step / abort_request).

``step`` is schedule -> launch -> apply. The scheduler returns a ``Plan`` (a prefill batch,
a loop pass, heads, or a decode window with what comes before it); the executor launches
its steps and hands back pending handles; the engine reads the handles that are due (all of
them, or all but the newest: decode windows and async loop passes are read one step late)
and applies what they hold: exit decisions after a loop pass, sampled tokens and stop checks
(``OutputProcessor``) after heads and windows. Nothing below the engine calls back into it.
"""
from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from rltjax.cache.paged_kv import PagedKV
from rltjax.engine.executable_store import ExecutableStore
from rltjax.engine.executor import Executor, Pending
from rltjax.engine.exit_policy import ExitPolicy
from rltjax.engine.exit_trace import model_fingerprint
from rltjax.engine.host_batches import HostBatches
from rltjax.engine.output_processor import OutputProcessor
from rltjax.engine.outputs import RequestOutput
from rltjax.engine.plan import HeadStep, LoopStep, Plan, PrefillStep, SwapOutStep, TokenRun, WindowStep
from rltjax.engine.request_intake import new_request
from rltjax.engine.runner import ModelRunner
from rltjax.engine.scheduler import Scheduler
from rltjax.engine.stats import EngineStats, scheduler_stats
from rltjax.engine.sequence import Request, RequestRejectedError, Status
from rltjax.engine.settings import EngineSettings
from rltjax.engine.warm_up import WarmUp, warm_up
from rltjax.sampling_params import SamplingParams


log = logging.getLogger(__name__)


class _LaunchFailed(Exception):
    def __init__(self, exc: Exception):
        self.exc = exc


class LLMEngine:
    def __init__(self, model, params, kv: PagedKV, *, settings: EngineSettings, tokenizer=None,
                 boundary_kv: PagedKV | None = None, placement=None):
        """settings: ``engine.settings.resolve_settings``'s; boundary_kv: the boundary
        (prelude/coda) pool, for models with boundary stages."""
        self.settings = settings
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        self.runner = ModelRunner(model, params, kv, boundary_kv, settings, placement)
        self._fingerprint: str | None = None
        self.scheduler = Scheduler(settings, num_pages=kv.num_pages, vocab_size=self.cfg.vocab_size,
                                   boundary_num_pages=0 if boundary_kv is None else boundary_kv.num_pages,
                                   prefix_context=self._prefix_context() if settings.prefix_caching else None,
                                   **self.runner.swap_bytes())
        blocks = self.scheduler.blocks
        self.batches = HostBatches(settings, blocks.block_tables, blocks.boundary_tables)
        self.executor = Executor(self.runner, self.batches, settings)
        self.exit_policy = ExitPolicy(settings.exit_mode)
        self.eos_token_ids = tuple(tokenizer.eos_token_ids if tokenizer is not None else self.cfg.eos_token_ids)
        self.outputs = OutputProcessor(tokenizer, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._pending: list[Pending] = []      # launched, not read yet (oldest first)
        self._finished_now: list[Request] = []   # requests finished in the current step
        self.steps_by_kind: dict[str, int] = {}
        self.compile_seconds = 0.0
        self.warm_up: WarmUp | None = None     # what the start-up compile did (compile_ahead)
        self.replay_mismatches = 0             # recompute replays whose head disagreed with the record
        if settings.compile_ahead:
            store = ExecutableStore.open(Path(settings.store_dir)) if settings.store_dir else None
            self.warm_up = warm_up(self.runner, self.batches, show_progress=settings.show_progress, store=store)
            self.compile_seconds = self.warm_up.seconds
            if self.scheduler.config.preemption_mode == "swap":
                t0 = time.perf_counter()
                self.runner.warm_swaps()
                self.compile_seconds += time.perf_counter() - t0

    @property
    def dtype_name(self) -> str:
        return np.dtype(self.runner.params.embed.dtype).name

    def model_fingerprint(self) -> str:
        """Digest of the config and weights (``exit_trace.model_fingerprint``), computed once."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.cfg, self.runner.params)
        return self._fingerprint

    def _prefix_context(self) -> bytes:
        """What every prompt page's content depends on besides its tokens (the prefix cache's
        root key): the weights, their dtype, the KV layout and planes, R and the page size."""
        s = self.settings
        return (f"{self.model_fingerprint()}|{self.dtype_name}|{s.kv_layout}|{s.num_planes}|{s.num_loops}|"
                f"{s.prefill_write_planes}|{s.page_size}|{s.arch}|{getattr(self.cfg, 'state_init', '')}").encode()

    # -- requests -------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int] | Mapping[str, Any],
                    params: SamplingParams | None = None) -> None:
        request_id = str(request_id)
        if request_id in self.requests:
            raise RequestRejectedError(f"request_id {request_id!r} is already in use")
        req = new_request(request_id, prompt, params, tokenizer=self.tokenizer, cfg=self.cfg, settings=self.settings,
                          arrivals=self._arrivals)
        why = self.scheduler.never_fits(req)
        if why:
            raise RequestRejectedError(f"request {request_id!r} can never run: {why}")
        self.requests[request_id] = req
        self.outputs.add(req)
        req.token_stop_ids = self.outputs.token_stop_ids(request_id)
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

    def stats(self) -> EngineStats:
        """Queue, KV pages, prefix cache and preemptions now (``engine.stats``)."""
        return scheduler_stats(self.scheduler)

    @property
    def windows_in_flight(self) -> int:
        """Decode windows launched on the device and not read yet."""
        return sum(isinstance(p.step, WindowStep) for p in self._pending)

    # -- one step: schedule -> launch -> apply ----------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        for kind in plan.counts:
            self._count(kind)
        self._finished_now: list[Request] = []      # a failure still streams these finishes
        changed: list[Request] = []
        try:
            if plan.settle:             # what the plan builds on must be read first
                changed += self._read(len(self._pending))
            self._launch(plan)
            due = len(self._pending) - (1 if plan.keep_last and self._pending else 0)
            changed += self._read(due)
            self._launched(plan)
        except _LaunchFailed as failed:   # what was in flight before the plan is still whole
            return self._outputs(changed) + self._fail(list(plan.affected), failed.exc) + self._drain()
        except Exception as exc:
            # a read failed: that handle and everything launched after it are lost (this plan's
            # prefill chunks, which leave nothing to read, are not)
            lost = self._in_flight()
            self._forget_in_flight()
            return self._outputs(self._finished_now) + self._fail(lost, exc)
        return self._outputs(changed)

    def _launch(self, plan: Plan) -> None:
        before = len(self._pending)
        try:
            for step in plan.steps:
                pending = self.executor.launch(step)
                if pending is not None:
                    self._pending.append(pending)
                self.scheduler.launched(step)
        except Exception as exc:
            del self._pending[before:]     # this plan's launches: their requests error
            raise _LaunchFailed(exc) from exc

    def _read(self, n: int) -> list[Request]:
        """Read the n oldest pending handles and apply them; returns the requests they changed."""
        changed = []
        for _ in range(n):
            pending = self._pending[0]      # stays in flight until applied: a failure errors its rows
            changed += self._apply(pending, pending.read())
            self._pending.pop(0)
        return changed

    def _drain(self) -> list[RequestOutput]:
        """Read everything in flight (after a failed launch); a failure here errors it all."""
        try:
            changed = self._read(len(self._pending))
        except Exception as exc:
            lost = self._in_flight()
            self._forget_in_flight()
            return self._fail(lost, exc)
        self._forget_in_flight()
        return self._outputs(changed)

    def _forget_in_flight(self) -> None:
        """Nothing launched so far is read again; the next window starts from the host."""
        self._pending.clear()
        if self.scheduler.windows is not None:
            self.scheduler.windows.drop()

    def _in_flight(self) -> list[Request]:
        """Every request whose work is on the device, unread."""
        reqs = [r for p in self._pending for r in getattr(p.step, "rows", ()) if r is not None]
        if self.scheduler.windows is not None:
            reqs += self.scheduler.windows.on_device()
        return reqs

    # -- applying what the device computed ---------------------------------------------
    def _apply(self, pending: Pending, result) -> list[Request]:
        step = pending.step
        if isinstance(step, LoopStep):
            self._apply_signals(pending, result)
            return []
        if isinstance(step, HeadStep):
            return self._accept_heads(list(step.rows), result)
        if isinstance(step, SwapOutStep):
            if step.request.swapped is step.record:     # not aborted meanwhile
                step.record.data = result
            return []
        if isinstance(step, PrefillStep):               # scored: prompt logprobs
            self.outputs.prompt_scores(step.chunks, pending.tags, result)
            return []
        self._count("window_passes", int(result.out.passes))
        return self._apply_runs(self.scheduler.windows.read(step, result))

    def _apply_signals(self, pending: Pending, signals) -> None:
        """A loop pass's exit signals: now (its rows exit or loop on), or one pass late (async)."""
        step = pending.step
        if step.late:
            self.exit_policy.apply_late(pending.tags, signals, lambda r: self.requests.get(r.request_id) is r)
        else:
            self.exit_policy.apply_pass(step.rows, signals)

    def _launched(self, plan: Plan) -> None:
        """An async loop pass, once the older signals are read (``ExitPolicy.launched_late``)."""
        step = plan.steps[-1] if plan.steps else None
        if isinstance(step, LoopStep) and step.late:
            self._pending[-1].tags = self.exit_policy.launched_late(step.rows)

    def _accept_heads(self, rows: list[Request], result) -> list[Request]:
        """Heads' sampled tokens join their requests (stop checks); returns rows."""
        now = time.monotonic()
        for i, r in enumerate(rows):
            self._accept_token(r, int(result.tokens[i]), result.chosen[i], result.top_ids[i], result.top_lp[i], now)
        return rows

    def _apply_runs(self, runs: list[TokenRun]) -> list[Request]:
        """A window's tokens through each request's acceptance (stop checks; a host-only stop,
        a stop string or a stop id past the device's width, drops the tokens after it), then
        the exit state the device left it at."""
        now, changed = time.monotonic(), []
        for run in runs:
            r = run.request
            if r.finished:      # aborted, or stopped by the host before (its tokens dropped)
                continue
            changed.append(r)
            for j, (token, depth) in enumerate(zip(run.tokens, run.depths)):
                r.exit_depths.append(depth)
                if self._accept_token(r, token, *run.logprobs(j), now):
                    break
            if run.left and not r.finished:
                raise RuntimeError(f"request {r.request_id!r}: the decode window ended it but the host stop checks "
                                   f"did not (this is a bug)")
            if run.state is not None and not r.finished:
                if not run.state.active:
                    raise RuntimeError(f"request {r.request_id!r}: the decode window finished it but the host "
                                       f"stop checks did not (this is a bug)")
                r.status, r.loops_done = Status.LOOPING, run.state.loops_done
                r.exit_remaining, r.exit_triggered = np.float32(run.state.remaining), run.state.triggered
        return changed

    def _accept_token(self, r: Request, token: int, chosen, top_ids, top_lp, now: float) -> bool:
        """A sampled token joins the request's output; stop checks. Returns whether it finished."""
        if r.replay_left:
            self._replayed(r, token)
            return False
        finished, reason, stop_reason = self.outputs.accept(r, token, chosen, top_ids, top_lp, now)
        if finished:
            r.stop_reason = stop_reason
            self._finish(r, reason)
        elif len(r.output_token_ids) >= r.params.max_tokens:
            self._finish(r, "length")
        else:
            r.start_token()
        return r.finished

    def _replayed(self, r: Request, token: int) -> None:
        """A recomputed request's head, sampled again with an output's key: the record (streamed) is
        kept. A sampled speculative token came from a round's draw, whose keys depend on the rounds."""
        recorded = r.output_token_ids[r.cursor + 1]
        if token != recorded and not (r.spec_tokens and r.params.temperature > 0):
            self.replay_mismatches += 1
            r.replay_mismatches += 1
            if r.replay_mismatches == 1:   # once a request (the engine counts the rest): bf16 batches round apart
                log.warning(f"request {r.request_id!r}: output {r.cursor + 1} replayed after a preemption sampled "
                            f"{token}, not its record {recorded} (kept); later differences are only counted")
        r.replay_left -= 1
        r.start_token()

    # -- endings ------------------------------------------------------------------------
    def _fail(self, affected: list[Request], exc: Exception) -> list[RequestOutput]:
        """A failed step: its requests finish with the error (every unfinished one when the
        device state is lost, which is then re-raised); no page leaks, no wedged requests."""
        lost = self.runner.device_state_lost()
        if lost:
            self._forget_in_flight()
            affected = [r for r in self.requests.values() if not r.finished]
        failed = []
        for req in dict.fromkeys(affected):
            if req.finished:   # finished normally before the failure (a head batch's earlier rows)
                continue
            req.error = f"{type(exc).__name__}: {exc}"
            self._finish(req, "error")
            failed.append(req)
        if lost:
            if self.scheduler.blocks.cache is not None:
                self.scheduler.blocks.cache.clear()      # the pages it names hold nothing now
            raise exc
        return self._outputs(failed)

    def _finish(self, req: Request, reason: str) -> None:
        self._finished_now.append(req)
        if req.finish_reason is None:
            req.finish_reason = reason
        req.status = Status.FINISHED
        req.finished_time = time.monotonic()
        self.scheduler.release(req)
        self.outputs.finish(req, reason)

    def _count(self, kind: str, n: int = 1) -> None:
        self.steps_by_kind[kind] = self.steps_by_kind.get(kind, 0) + n

    def _outputs(self, reqs) -> list[RequestOutput]:
        return [self._output(r) for r in dict.fromkeys(reqs)]

    def _output(self, req: Request) -> RequestOutput:
        return self.outputs.output(req)

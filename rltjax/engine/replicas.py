"""Data parallelism: several engines, each on its own devices, behind one engine's interface.

``EngineReplicas`` takes what ``LLM`` and the server use of an ``LLMEngine`` (add, step,
abort, outputs, stats) and spreads requests over its replicas: a new request goes to the
least-loaded one (fewest waiting, then the least KV in use, then the fewest running), and
stays there; aborts and outputs go to the replica that holds it. One ``step`` steps every
replica with work; JAX dispatches asynchronously, so one replica's device work runs while
the host schedules the next. Replicas share nothing: their outputs are exactly a single
engine's for the same request.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from rltjax.engine.outputs import RequestOutput
from rltjax.engine.stats import EngineStats


class EngineReplicas:
    def __init__(self, engines: Sequence):
        self.replicas = list(engines)
        first = self.replicas[0]
        self.settings, self.cfg, self.tokenizer = first.settings, first.cfg, first.tokenizer
        self.scheduler = first.scheduler      # the shared facts (max_model_len, pool geometry); not for state
        self._where: dict[str, int] = {}
        self.steps_by_kind: dict[str, int] = {}

    def _load(self, i: int) -> tuple:
        s = self.replicas[i].stats()
        return s.num_waiting, s.kv_cache_usage, s.num_running, i

    def add_request(self, request_id: str, prompt, params=None) -> int:
        """Queue on the least-loaded replica; returns its index."""
        request_id = str(request_id)
        if request_id in self._where:
            from rltjax.engine.llm_engine import RequestRejectedError
            raise RequestRejectedError(f"request_id {request_id!r} is already in use")
        i = min(range(len(self.replicas)), key=self._load)
        self.replicas[i].add_request(request_id, prompt, params)
        self._where[request_id] = i
        return i

    def replica_of(self, request_id: str) -> int | None:
        return self._where.get(request_id)

    def step(self) -> list[RequestOutput]:
        outs, stepped, idle = [], 0, 0
        for engine in self.replicas:
            if not engine.has_unfinished_requests():
                continue
            before = engine.steps_by_kind.get("idle", 0)
            outs += engine.step()
            stepped += 1
            idle += engine.steps_by_kind.get("idle", 0) > before
        if stepped and idle == stepped:          # nothing ran anywhere: the caller may wait
            self.steps_by_kind["idle"] = self.steps_by_kind.get("idle", 0) + 1
        return outs

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.replicas)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        i = self._where.get(request_id)
        return None if i is None else self.replicas[i].abort_request(request_id)

    def get_output(self, request_id: str) -> RequestOutput:
        i = self._where.get(request_id)
        if i is None:
            raise KeyError(f"unknown request_id {request_id!r}")
        return self.replicas[i].get_output(request_id)

    def forget(self, request_id: str) -> None:
        i = self._where.get(request_id)
        if i is not None:
            self.replicas[i].forget(request_id)     # raises for a running request: keep its route
            del self._where[request_id]

    @property
    def requests(self) -> dict:
        return {rid: r for e in self.replicas for rid, r in e.requests.items()}

    def replica_stats(self) -> list[EngineStats]:
        return [e.stats() for e in self.replicas]

    def stats(self) -> EngineStats:
        """The replicas' numbers added up (usage: of all their pages)."""
        each = self.replica_stats()
        return EngineStats(**{f.name: sum(getattr(s, f.name) for s in each)
                              for f in dataclasses.fields(EngineStats)})

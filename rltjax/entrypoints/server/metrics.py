"""Prometheus metrics for the server (vLLM-style names under the ``rltjax:`` prefix).

Latencies are measured from the moment the server queued a request (not from
when the engine admitted it), so TTFT includes queueing, as a client sees it.
Everything is recorded on the engine thread as outputs are handed out;
``prometheus_client`` metrics are thread-safe. Each server gets its own
registry so several servers (tests) can live in one process.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0)
_E2E = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 300.0)

_DEPTHS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)   # loop counts (Ouro: 4; Huginn: up to 64)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = r = CollectorRegistry()
        p = "rltjax:"
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token (from queueing).",
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", buckets=_LATENCY,
                              registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between consecutive output tokens.",
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "End-to-end request latency.", buckets=_E2E,
                             registry=r)
        self.exit_depth = Histogram(p + "exit_depth", "Loop passes each generated token ran before its exit.",
                                    buckets=_DEPTHS, registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests queued for admission.", registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests holding a KV slot.", registry=r)
        self.pages_used = Gauge(p + "kv_cache_pages_used", "KV pages requests hold.", registry=r)
        self.pages_total = Gauge(p + "kv_cache_pages_total", "Usable KV pages.", registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_perc", "Fraction of the usable KV pages requests hold (1 = full).",
                              registry=r)
        self.prefix_queries = Counter(p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Prompt tokens found in the prefix cache.", registry=r)
        self.preemptions = Counter(p + "num_preemptions", "Requests preempted (swapped or recomputed).", registry=r)
        self.spec_drafts = Counter(p + "spec_decode_num_draft_tokens", "Speculative draft tokens made.", registry=r)
        self.spec_accepted = Counter(p + "spec_decode_num_accepted_tokens", "Speculative draft tokens kept.",
                                     registry=r)
        self.spec_accepted_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                         "Speculative draft tokens kept, by their position in a round.", ["position"],
                                         registry=r)
        self._seen = {}     # the engine's running totals at the last update: counters add the difference
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prefilled prompt tokens.", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated (decode) tokens.", registry=r)
        self.finished = Counter(p + "request_success", "Finished requests by finish reason.",
                                ["finished_reason"], registry=r)
        self.rejected = Counter(p + "request_rejected", "Requests refused before queueing, by HTTP status.",
                                ["status"], registry=r)
        # prefill/decode disaggregation: each prompt's prefill on its worker and its pages' pull
        self.stage_seconds = Histogram(p + "disagg_stage_seconds", "Per request: hold (its decode worker holding "
                                       "pages), prefill (on its prefill worker, waiting there included), transfer "
                                       "(after its first token, until the decode worker queued it), first_token.",
                                       ["stage"], buckets=_LATENCY, registry=r)
        self.transfer_bytes = Counter(p + "disagg_transfer_bytes", "KV bytes moved from prefill to decode workers.",
                                      registry=r)
        # data-parallel replicas (one, "0", without --data-parallel-size)
        self.replica_requests = Counter(p + "replica_requests", "Requests queued on each replica.", ["replica"],
                                        registry=r)
        self.replica_running = Gauge(p + "replica_num_requests_running", "Requests holding a KV slot, by replica.",
                                     ["replica"], registry=r)
        self.replica_waiting = Gauge(p + "replica_num_requests_waiting", "Requests queued, by replica.", ["replica"],
                                     registry=r)
        self.replica_pages_used = Gauge(p + "replica_kv_cache_pages_used", "KV pages requests hold, by replica.",
                                        ["replica"], registry=r)

    def observe(self, track, out, now: float) -> None:
        """One output of a tracked request (``track`` keeps its timing state)."""
        new = len(out.token_ids) - track.num_tokens
        if new > 0:
            if track.num_tokens == 0:
                self.ttft.observe(now - track.submitted)
                self.prompt_tokens.inc(len(out.prompt_token_ids))
            elif track.last_token is not None:
                self.itl.observe((now - track.last_token) / new)
            self.generation_tokens.inc(new)
            self.exit_depth_of(out.exit_depths[max(1, track.num_tokens):])
            track.num_tokens, track.last_token = len(out.token_ids), now
        if out.finished:
            self.e2e.observe(now - track.submitted)
            self.finished.labels(out.finish_reason or "unknown").inc()
            first = out.metrics.get("first_token_time")
            if len(out.token_ids) > 1 and first is not None:
                self.tpot.observe((now - first) / (len(out.token_ids) - 1))

    def exit_depth_of(self, depths) -> None:
        for d in depths:   # exit_depths[0] is the prompt's (always R): only decode tokens count
            self.exit_depth.observe(d)

    def observe_stages(self, stages, total_bytes: int) -> None:
        for stage, seconds in stages:
            self.stage_seconds.labels(stage).observe(seconds)
        seen = self._seen.get("transfer_bytes", 0)
        if total_bytes > seen:
            self.transfer_bytes.inc(total_bytes - seen)
        self._seen["transfer_bytes"] = total_bytes

    def set_replicas(self, each) -> None:
        """Each replica's ``EngineStats`` now."""
        for i, s in enumerate(each):
            self.replica_running.labels(str(i)).set(s.num_running)
            self.replica_waiting.labels(str(i)).set(s.num_waiting)
            self.replica_pages_used.labels(str(i)).set(s.kv_pages_used)

    def set_state(self, stats) -> None:
        """The engine's ``EngineStats`` now (data-parallel replicas: added up)."""
        self.waiting.set(stats.num_waiting)
        self.running.set(stats.num_running)
        self.pages_used.set(stats.kv_pages_used)
        self.pages_total.set(stats.kv_pages_total)
        self.kv_usage.set(stats.kv_cache_usage)
        totals = [(self.prefix_queries, "prefix_cache_queries", stats.prefix_cache_queries),
                  (self.prefix_hits, "prefix_cache_hits", stats.prefix_cache_hits),
                  (self.preemptions, "num_preemptions", stats.num_preemptions),
                  (self.spec_drafts, "spec_drafts", stats.spec_draft_tokens),
                  (self.spec_accepted, "spec_accepted", stats.spec_accepted_tokens)]
        totals += [(self.spec_accepted_pos.labels(str(i)), f"spec_pos{i}", n)
                   for i, n in enumerate(stats.spec_accepted_by_position or ())]
        for counter, name, total in totals:
            if total > self._seen.get(name, 0):
                counter.inc(total - self._seen.get(name, 0))
            self._seen[name] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""What the engine's memory manager and queue look like now (``LLMEngine.stats``): the
numbers behind the server's gauges and counters and the benchmarks' hit rate and
preemption count."""
from __future__ import annotations

import dataclasses


class PerPosition(tuple):
    """Counts by a draft's position in its round, added up elementwise (replicas' stats add)."""

    def __add__(self, other):
        if not other:
            return self
        width = max(len(self), len(other))
        pad = lambda t: tuple(t) + (0,) * (width - len(t))      # noqa: E731
        return PerPosition(a + b for a, b in zip(pad(self), pad(other)))

    def __radd__(self, other):
        return self + other


@dataclasses.dataclass(frozen=True)
class EngineStats:
    num_running: int               # requests holding a slot
    num_waiting: int               # queued, preempted ones included
    kv_pages_used: int             # core pages requests hold (cached pages no request uses count as free)
    kv_pages_total: int            # usable core pages
    kv_pages_cached: int           # core pages the prefix cache holds that no request uses (evictable)
    prefix_cache_queries: int      # prompt tokens looked up in the prefix cache (since start)
    prefix_cache_hits: int         # of them, found
    num_preemptions: int           # since start
    num_swapped: int               # of them, swapped to host memory
    num_recomputed: int            # of them, recomputed
    swap_space_used: int           # host bytes swapped requests hold now
    spec_draft_tokens: int = 0     # speculative drafts made (since start)
    spec_accepted_tokens: int = 0  # of them, kept
    spec_accepted_by_position: PerPosition = PerPosition()   # kept drafts by their position in a round

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the usable pages requests hold (vLLM's kv_cache_usage_perc)."""
        return self.kv_pages_used / self.kv_pages_total if self.kv_pages_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def scheduler_stats(scheduler) -> EngineStats:
    blocks, pre = scheduler.blocks, scheduler.preemptor
    cache = blocks.cache
    stats = cache.stats if cache is not None else None
    return EngineStats(
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
        kv_pages_used=blocks.num_used_pages, kv_pages_total=blocks.usable_pages,
        kv_pages_cached=cache.num_evictable_pages if cache is not None else 0,
        prefix_cache_queries=stats.queries if stats else 0, prefix_cache_hits=stats.hits if stats else 0,
        num_preemptions=pre.num_preemptions, num_swapped=pre.num_swapped, num_recomputed=pre.num_recomputed,
        swap_space_used=pre.swap_space.used, **spec_stats(scheduler.windows))


def spec_stats(windows) -> dict:
    """The speculative drafts a window planner has read (none without speculation)."""
    if windows is None or windows.spec_accepted is None:
        return {}
    by_position = PerPosition(int(n) for n in windows.spec_accepted)
    return dict(spec_draft_tokens=windows.spec_drafted, spec_accepted_tokens=sum(by_position),
                spec_accepted_by_position=by_position)

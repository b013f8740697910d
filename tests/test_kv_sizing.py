"""KV pool sizing: bytes per token and page (``rltjax.cache.sizing``), and the memory plan
(``rltjax.engine.memory_plan``): by pages, by bytes, or from device memory after the
largest step's measured temporaries."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from rltjax.cache.sizing import KVSizingError, allocate_paged_kv, bytes_per_page, kv_bytes_per_token_per_plane
from rltjax.checkpoints.loader import load_checkpoint
from rltjax.engine.memory_plan import RESERVE_BYTES, measure_peak, plan_memory
from rltjax.engine_config import CacheConfig

from engine_helpers import compile_events, make_engine

TINY = Path(__file__).parent / "fixtures" / "ouro-tiny"


def tiny():
    return load_checkpoint(TINY, dtype="float32")


class FakeDevice:
    platform = "gpu"

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_sizing():
    cfg = tiny().cfg                                  # L=2, Hkv=4, Dh=16
    assert kv_bytes_per_token_per_plane(cfg, jnp.float32) == 2 * 4 * 16 * 2 * 4
    assert kv_bytes_per_token_per_plane(cfg, jnp.bfloat16) == 2 * 4 * 16 * 2 * 2
    assert bytes_per_page(cfg, 16, jnp.bfloat16) == 16 * 512
    kv = allocate_paged_kv(cfg, 5, 8, jnp.bfloat16)
    assert kv.k.shape == kv.v.shape == (2, 4, 5, 8, 16) and kv.k.dtype == jnp.bfloat16
    assert not np.asarray(kv.k, np.float32).any()


@dataclasses.dataclass
class Settings:
    num_planes: int = 4
    max_num_seqs: int = 3
    max_model_len: int = 100


def plan(cache, device=None, peak=0):
    ckpt = tiny()
    calls = []
    result = plan_memory(cache, Settings(), ckpt.cfg, ckpt.params, jnp.float32, boundary_layers=0,
                         measure=lambda: calls.append(1) or peak, device=device)
    return result, calls


def test_memory_plan_by_pages_bytes_and_fallback():
    page = bytes_per_page(tiny().cfg, 16, jnp.float32)
    p, calls = plan(CacheConfig(num_pages=77))
    assert (p.num_pages, p.source, p.tokens, calls) == (77, "num_pages", 76 // 4 * 16, [])
    p, _ = plan(CacheConfig(kv_cache_memory_bytes=10 * page + 5))
    assert (p.num_pages, p.source) == (10, "kv_cache_memory_bytes")
    with pytest.raises(KVSizingError, match="kv_cache_memory_bytes"):
        plan(CacheConfig(kv_cache_memory_bytes=page))
    p, calls = plan(CacheConfig(), device=FakeDevice(None))        # no statistics: max_num_seqs full requests
    assert (p.num_pages, p.source, calls) == (1 + 3 * 4 * 7, "max_num_seqs", [])
    assert p.weights == sum(int(x.nbytes) for x in __import__("jax").tree.leaves(tiny().params))
    assert "memory plan" in p.line() and "tokens of context" in p.line()


def test_memory_plan_from_device_memory_charges_the_measured_peak():
    page = bytes_per_page(tiny().cfg, 16, jnp.float32)
    free, peak = 2**32, 2**30
    device = FakeDevice({"bytes_limit": free + 2**20, "bytes_in_use": 2**20})
    p, calls = plan(CacheConfig(gpu_memory_utilization=0.5), device=device, peak=peak)
    reserve = max(RESERVE_BYTES, peak // 4)
    assert calls == [1] and p.source == "measured" and (p.peak, p.reserve, p.device_free) == (peak, reserve, free)
    assert p.num_pages == (free // 2 - peak - reserve) // page
    with pytest.raises(KVSizingError, match="gpu-memory-utilization"):
        plan(CacheConfig(gpu_memory_utilization=0.1), device=device, peak=peak)


def test_measured_peak_covers_the_largest_head_and_is_kept(tmp_path):
    """XLA's memory analysis of the largest programs, against a 2-page pool: at least the
    largest head's float32 logits; a second measurement reads the kept value."""
    engine = make_engine(max_num_seqs=4, decode_window=2)
    s, cfg, params = engine.settings, engine.cfg, engine.runner.params
    compiles = []
    for _ in range(2):
        with compile_events() as events:
            compiles.append(measure_peak(engine.runner.model, params, s, cfg, jnp.float32, boundary_layers=0,
                                         store_dir=str(tmp_path)))
        compiles.append(sum("backend_compile" in e for e in events))
    peak, first, again, second = compiles
    assert peak >= max(s.row_buckets) * cfg.vocab_size * 4
    assert (tmp_path / "step_peaks.pkl").is_file()
    # prefill, loop, head and window programs compiled once (the pools' zeros compile each time)
    assert again == peak and first - second >= 4

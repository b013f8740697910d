"""KV pool sizing (rltjax.cache.sizing): bytes per token and page, pages for a memory budget,
and the errors that ask for an explicit num_pages."""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rltjax.checkpoints.loader import load_checkpoint
from rltjax.cache.sizing import (KVSizingError, allocate_paged_kv, bytes_per_page,
                                 kv_bytes_per_token_per_plane, num_pages_for_memory)

TINY = Path(__file__).parent / "fixtures" / "ouro-tiny"


def tiny_cfg():
    return load_checkpoint(TINY, dtype="float32").cfg


class FakeDevice:
    platform = "gpu"

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_sizing():
    cfg = tiny_cfg()                                  # L=2, Hkv=4, Dh=16
    assert kv_bytes_per_token_per_plane(cfg, jnp.float32) == 2 * 4 * 16 * 2 * 4
    assert kv_bytes_per_token_per_plane(cfg, jnp.bfloat16) == 2 * 4 * 16 * 2 * 2
    assert bytes_per_page(cfg, 16, jnp.bfloat16) == 16 * 512
    dev = FakeDevice({"bytes_limit": 10_000_000, "bytes_in_use": 2_000_000})
    assert num_pages_for_memory(cfg, 16, jnp.bfloat16, 0.5, dev) == 4_000_000 // (16 * 512)
    with pytest.raises(KVSizingError, match="num_pages"):
        num_pages_for_memory(cfg, 16, jnp.bfloat16, 0.9, FakeDevice(None))
    with pytest.raises(KVSizingError, match="at least 2"):
        num_pages_for_memory(cfg, 16, jnp.bfloat16, 0.9, FakeDevice({"bytes_limit": 10, "bytes_in_use": 0}))
    kv = allocate_paged_kv(cfg, 5, 8, jnp.bfloat16)
    assert kv.k.shape == kv.v.shape == (2, 4, 5, 8, 16) and kv.k.dtype == jnp.bfloat16
    assert not np.asarray(kv.k, np.float32).any()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU reports no memory statistics")
def test_sizing_on_cpu_asks_for_explicit_num_pages():
    with pytest.raises(KVSizingError, match="explicit num_pages"):
        num_pages_for_memory(tiny_cfg(), 16, jnp.float32, 0.9)

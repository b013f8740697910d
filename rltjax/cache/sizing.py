"""How many KV pages fit on a device, and allocating the pool.

A page holds ``page_size`` tokens of one plane for all layers and heads:
bytes_per_page = L * Hkv * page_size * Dh * 2 (K and V) * itemsize.
Page 0 is the scratch page (see paged_kv), so a pool of P pages serves
P - 1 pages of live tokens.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rltjax.cache.paged_kv import PagedKV


class KVSizingError(ValueError):
    pass


def kv_bytes_per_token_per_plane(cfg, dtype) -> int:
    """K and V of one token at one plane, over all layers and KV heads."""
    return cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * jnp.dtype(dtype).itemsize


def bytes_per_page(cfg, page_size: int, dtype) -> int:
    return page_size * kv_bytes_per_token_per_plane(cfg, dtype)


def num_pages_for_memory(cfg, page_size: int, dtype, fraction: float, device=None) -> int:
    """Pages that fit in ``fraction`` of the device's free memory (scratch page included).

    Call after the weights are loaded and a warm-up step has run, so
    ``bytes_in_use`` already covers weights, activations and compiled
    workspace; free = bytes_limit - bytes_in_use.
    """
    if not 0.0 < fraction <= 1.0:
        raise KVSizingError(f"fraction={fraction!r}: must be in (0, 1]")
    device = device if device is not None else jax.devices()[0]
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats or "bytes_in_use" not in stats:
        raise KVSizingError(
            f"device {device} ({device.platform}) reports no memory statistics, so the KV pool cannot "
            "be sized from free memory; pass an explicit num_pages instead")
    free = int(stats["bytes_limit"]) - int(stats["bytes_in_use"])
    pages = int(free * fraction) // bytes_per_page(cfg, page_size, dtype)
    if pages < 2:
        raise KVSizingError(
            f"only {max(free, 0)} free bytes on {device} (fraction {fraction}): room for {pages} KV pages of "
            f"{bytes_per_page(cfg, page_size, dtype)} bytes; need at least 2 (page 0 is scratch)")
    return pages


def allocate_paged_kv(cfg, num_pages: int, page_size: int, dtype, device=None) -> PagedKV:
    """A zeroed pool [L, Hkv, num_pages, page_size, Dh] for K and V, created on the device.

    Zeros are produced by a jitted computation, so no host buffer of the pool's
    size is ever built or transferred.
    """
    if num_pages < 2:
        raise KVSizingError(f"num_pages={num_pages}: need at least 2 (page 0 is scratch)")
    shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
    device = device if device is not None else jax.devices()[0]
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=jax.sharding.SingleDeviceSharding(device))
    return PagedKV(k=zeros(), v=zeros())

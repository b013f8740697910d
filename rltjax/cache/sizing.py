"""How many KV pages fit on a device, and allocating the pool.

A page holds ``page_size`` tokens of one plane for all layers and heads:
bytes_per_page = L * Hkv * page_size * Dh * 2 (K and V) * itemsize.
Page 0 is the scratch page (see paged_kv), so a pool of P pages serves
P - 1 pages of live tokens.

Models with boundary stages (Huginn) have a second pool of P + K layers and one
plane; ``boundary_num_pages`` sizes it in proportion to the core pool so that it
never limits admission (``engine.memory_plan`` charges each core page its share).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rltjax.cache.paged_kv import PagedKV


class KVSizingError(ValueError):
    pass


def kv_bytes_per_token_per_plane(cfg, dtype, num_layers: int | None = None) -> int:
    """K and V of one token at one plane, over all layers (default: the core's) and KV heads."""
    layers = cfg.num_layers if num_layers is None else num_layers
    return layers * cfg.num_kv_heads * cfg.head_dim * 2 * jnp.dtype(dtype).itemsize


def bytes_per_page(cfg, page_size: int, dtype, num_layers: int | None = None) -> int:
    return page_size * kv_bytes_per_token_per_plane(cfg, dtype, num_layers)


def boundary_num_pages(num_pages: int, num_planes: int) -> int:
    """Boundary pool size for a core pool of ``num_pages``: a request holds n pages per core
    plane and n boundary pages, so (num_pages - 1) // num_planes usable pages always suffice."""
    return 1 + max(1, (num_pages - 1) // num_planes)


def allocate_paged_kv(cfg, num_pages: int, page_size: int, dtype, device=None,
                      num_layers: int | None = None, sharding=None) -> PagedKV:
    """A zeroed pool [L, Hkv, num_pages, page_size, Dh] for K and V, created on the device
    (L = num_layers, default the core's; the boundary pool passes P + K).

    Zeros are produced by a jitted computation, so no host buffer of the pool's
    size is ever built or transferred.
    """
    if num_pages < 2:
        raise KVSizingError(f"num_pages={num_pages}: need at least 2 (page 0 is scratch)")
    shape = (cfg.num_layers if num_layers is None else num_layers, cfg.num_kv_heads, num_pages, page_size,
             cfg.head_dim)
    if sharding is None:    # one device (a tensor-parallel engine passes its KV-head sharding)
        sharding = jax.sharding.SingleDeviceSharding(device if device is not None else jax.devices()[0])
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return PagedKV(k=zeros(), v=zeros())

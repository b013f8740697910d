"""Launch rules of the Mosaic GPU decode attention kernel (``kernels.paged_attention_mosaic``):
what it takes, its query columns, block size and pipeline depth, by one rule (``mosaic_launch``)
that the kernel and the dispatcher both apply."""
from __future__ import annotations

import dataclasses
import math

from rltjax.kernels.mosaic_common import DTYPES, SMEM_LIMIT, TILE

BLOCK_KEYS = 64                         # keys a block: wgmma's M for the scores
NEWEST_ROWS = 64                        # the newest key's tile: wgmma's least M (8 rows loaded)
MAX_COLUMNS = 64                        # query rows a block computes (wgmma's N)
SM_SMEM = SMEM_LIMIT + 1024             # an SM's shared memory, 1 KB of it reserved a block


def query_columns(num_heads: int, group: int) -> int:
    """C: the 8-aligned run of flattened query rows that holds every group (c0 + group <= C)."""
    aligned = math.gcd(math.gcd(num_heads, group), 8)
    return -(-(8 - aligned + group) // 8) * 8


def smem_bytes(columns: int, block_k: int, head_dim: int, steps: int, *, fused: bool = False,
               itemsize: int = 2) -> int:
    """A block's SMEM: K and V slots, the q tile, p, the output tile (float32), barriers and,
    fused, the newest key's K and V tiles and their staging rows."""
    slots = 2 * steps * block_k * head_dim * itemsize
    newest = 2 * (NEWEST_ROWS + 1) * head_dim * itemsize if fused else 0
    return slots + newest + columns * (head_dim + block_k) * itemsize + columns * (head_dim + 1) * 4 + 1024


def default_depth(columns: int, block_k: int, head_dim: int, *, fused: bool) -> int:
    """K/V slots: the most (up to 3) that keep two blocks an SM (latency hiding across blocks)."""
    for steps in (3, 2):
        if 2 * (smem_bytes(columns, block_k, head_dim, steps, fused=fused) + 1024) <= SM_SMEM:
            return steps
    return 1


@dataclasses.dataclass(frozen=True)
class MosaicLaunch:
    pages_per_block: int
    depth: int                          # K/V slots
    unsupported: str | None             # why the kernel cannot take the operands (None: it can)


def mosaic_launch(q, k_pages, *, pages_per_block: int | None = None, max_concurrent_steps: int | None = None,
                  fused: bool = False) -> MosaicLaunch:
    """The kernel's launch for q [N, H, Dh] and a pool [..., Hkv, P, S, Dh] (shapes suffice),
    defaults filled in: BLOCK_KEYS keys a block and ``default_depth`` slots; fused: with the
    newest key's tiles."""
    num_heads, head_dim = q.shape[-2:]
    num_kv, page_size = k_pages.shape[-4], k_pages.shape[-2]
    ppb = pages_per_block or max(1, BLOCK_KEYS // page_size)
    columns = query_columns(num_heads, num_heads // num_kv)
    depth = max_concurrent_steps or default_depth(columns, ppb * page_size, head_dim, fused=fused)
    return MosaicLaunch(ppb, depth, _unsupported(q, k_pages, ppb, depth, fused))


def _unsupported(q, k_pages, pages_per_block: int, max_concurrent_steps: int, fused: bool) -> str | None:
    num_heads, head_dim = q.shape[-2:]
    num_kv, page_size = k_pages.shape[-4], k_pages.shape[-2]
    if q.dtype not in DTYPES or k_pages.dtype != q.dtype:
        return f"q and the pools must share a dtype, bfloat16 or float16; got {q.dtype}, {k_pages.dtype}"
    if head_dim % TILE or not TILE <= head_dim <= 256:
        return f"head_dim must be a multiple of {TILE} in {TILE}..256, got {head_dim}"
    if page_size % 8:
        return f"page_size must be a multiple of 8 (TMA tiles), got {page_size}"
    block_k = pages_per_block * page_size
    if block_k % TILE or block_k > 256:
        return f"pages_per_block * page_size = {block_k} keys must be a multiple of {TILE} up to 256 (wgmma's M)"
    if (cols := query_columns(num_heads, num_heads // num_kv)) > MAX_COLUMNS:
        return f"{cols} query columns a KV head (group {num_heads // num_kv}): the kernel takes up to {MAX_COLUMNS}"
    if (need := smem_bytes(cols, block_k, head_dim, max_concurrent_steps, fused=fused)) > SMEM_LIMIT:
        return f"{need} bytes of shared memory asked for, over the {SMEM_LIMIT} a block has"
    return None

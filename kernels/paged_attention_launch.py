"""Launch defaults of the decode attention kernel (``kernels.paged_attention_pallas``), tuned on an
H200 (bf16, 16 KV heads x 128, page 16) with scripts/bench_attention.py and, for the fused
decode kernel at 32-64 rows, a sweep of blocks x warps x stages x splits at the engine's
Ouro-1.4B shapes (docs/performance.md, "Kernels")."""
from __future__ import annotations

from typing import NamedTuple

from rltjax.kernels.triton_common import is_pow2, next_pow2

TARGET_BLOCK_TOKENS = 64        # keys per inner iteration (default pages_per_block), Dh <= 128
SPLIT_TOKENS = 512              # default num_splits: about one split per this many keys ...
MIN_PROGRAMS = 1024             # ... raised until the grid has this many programs (132 SMs)
MAX_SPLITS = 32
# The fused decode kernel on the elementwise path (G == 1) at the shapes swept (128-wide
# heads, up to WIDE_MAX_PLANES write planes) for wide batches and tables of at most
# WIDE_MAX_KEYS keys: (at least these rows, keys per block, warps, stages, splits), the most
# rows first. Smaller blocks and, at 64 rows, one warp a program keep more programs on each SM:
# 80.7 against 91.5 us a layer at 64 rows x 512 keys (table capacity 768), 50.5 against 53.5
# at 32 rows. At capacity 2048 the same launches lost 9.5% on ShareGPT at 32 streams (2
# splits where the general rule takes 4), so larger tables keep the general defaults.
WIDE_DECODE = ((64, 32, 1, 3, 2), (32, 32, 4, 3, 2))
WIDE_MAX_KEYS = 1024
WIDE_MAX_PLANES = 4             # Ouro's loops; Huginn (Dh 96, up to 32+ planes) was not swept


class Launch(NamedTuple):
    pages_per_block: int
    num_splits: int | None         # None: default_num_splits for the block size in use
    num_warps: int
    num_stages: int


def default_pages_per_block(page_size: int, pages_per_table: int, head_dim: int,
                            target: int | None = None) -> int:
    if target is None:
        target = TARGET_BLOCK_TOKENS if head_dim <= 128 else TARGET_BLOCK_TOKENS // 2
    ppb = max(1, target // page_size)
    ppb = min(ppb, next_pow2(pages_per_table))
    return max(ppb, next_pow2(max(1, 16 // page_size)))   # block_k >= 16 for tl.dot


def most_splits(pages_per_table: int, pages_per_block: int) -> int:
    """The most splits a default launch takes: each keeps >= 2 blocks of a full table."""
    blocks = -(-pages_per_table // pages_per_block)
    return max(1, min(MAX_SPLITS, blocks // 2))


def default_num_splits(num_rows: int, num_kv_heads: int, pages_per_table: int,
                       pages_per_block: int, page_size: int) -> int:
    """One split per ~SPLIT_TOKENS keys of table capacity, more while the grid has fewer
    than MIN_PROGRAMS programs, up to ``most_splits``. (Splits divide each row's own length
    at run time.)"""
    most = most_splits(pages_per_table, pages_per_block)
    splits = next_pow2(max(1, (pages_per_table * page_size) // SPLIT_TOKENS))
    while splits < most and num_rows * num_kv_heads * splits < MIN_PROGRAMS:
        splits *= 2
    return int(max(1, min(splits, most)))


def default_launch(num_rows: int, page_size: int, pages_per_table: int, head_dim: int, *,
                   elementwise: bool, write_planes: int) -> Launch:
    """The kernel's defaults for a call (write_planes: 0 for the kernel without the write);
    ``num_splits`` None: default_num_splits for the block size in use."""
    wide = (elementwise and head_dim == 128 and 0 < write_planes <= WIDE_MAX_PLANES
            and pages_per_table * page_size <= WIDE_MAX_KEYS)
    for rows, keys, warps, stages, splits in WIDE_DECODE if wide else ():
        if num_rows >= rows:
            ppb = default_pages_per_block(page_size, pages_per_table, head_dim, keys)
            return Launch(ppb, min(splits, most_splits(pages_per_table, ppb)), warps, stages)
    return Launch(default_pages_per_block(page_size, pages_per_table, head_dim), None,
                  4 if head_dim <= 128 else 8, 2)


def resolve_launch(num_rows: int, num_kv_heads: int, page_size: int, pages_per_table: int, head_dim: int, *,
                   elementwise: bool, write_planes: int, pages_per_block: int | None = None,
                   num_splits: int | None = None, num_warps: int | None = None,
                   num_stages: int | None = None) -> Launch:
    """The launch a call runs (every field set): each field a caller gives replaces
    ``default_launch``'s; splits follow default_num_splits for a pages_per_block other than
    the default launch's. Raises ValueError for a block or split count the kernel cannot take."""
    launch = default_launch(num_rows, page_size, pages_per_table, head_dim, elementwise=elementwise,
                            write_planes=write_planes)
    ppb = launch.pages_per_block if pages_per_block is None else pages_per_block
    if not is_pow2(ppb) or ppb * page_size < 16:                         # tl.dot: N, K >= 16
        raise ValueError(f"pages_per_block must be a power of two with pages_per_block * "
                         f"page_size >= 16, got {ppb}")
    if num_splits is None:
        own = launch.num_splits is not None and ppb == launch.pages_per_block
        num_splits = launch.num_splits if own else default_num_splits(num_rows, num_kv_heads, pages_per_table,
                                                                      ppb, page_size)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return Launch(ppb, num_splits, launch.num_warps if num_warps is None else num_warps,
                  launch.num_stages if num_stages is None else num_stages)

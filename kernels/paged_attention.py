"""Paged attention decode: the one public entry point, validated, dispatching by impl.

Layout and semantics: `kernels.paged_attention_ref` (the oracle). impl:
  "xla"    the pure-XLA reference (any backend, any shapes);
  "pallas" the Pallas Triton kernel (`kernels.paged_attention_pallas`); interpret=True runs it on CPU;
  "auto"   pallas on GPU when the shapes are kernel-supported, xla otherwise.
Two entry points: ``paged_attention`` (any rows; the decode kernel, one program per
row) and ``paged_attention_write`` (the same, each row first writing its new K/V, optionally
after rotate-half RoPE of q and k: one kernel for a decode layer's RoPE, write and
read). Prefill chunks read through ``kernels.prefill_attention``, which shares this
module's validation.
Kernel-supported: page_size a power of two in 8..128, head_dim a multiple of 16 in
64..256 (non-powers of two such as 96 run as power-of-two column chunks, 64 + 32),
q/k/v in bfloat16, float16 or float32.
backend (for impl "pallas"): "triton" (the kernel above) or "mosaic", the Pallas Mosaic GPU
port for Hopper (``kernels.paged_attention_mosaic``: bfloat16/float16, head_dim a multiple of
64, pages of a multiple of 8 keys, RoPE applied by XLA before it), which runs what it takes;
Triton runs the rest. Only the "pallas" branch differs between them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rltjax.kernels import BACKENDS
from rltjax.kernels.paged_attention_mosaic_launch import mosaic_launch
from rltjax.kernels.paged_attention_ref import paged_attention_ref, paged_write_ref, rope_rotate_half_ref
from rltjax.kernels.triton_common import kernel_rope_supported

KERNEL_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def fail(arg: str, msg: str):
    raise ValueError(f"paged_attention: {arg}: {msg}")


def _check_index(arg: str, x, ndim: int):
    if x.ndim != ndim:
        fail(arg, f"expected {ndim}-D, got shape {x.shape}")
    if x.dtype != jnp.int32:
        fail(arg, f"expected int32, got {x.dtype}")


def kernel_unsupported(q, k_pages) -> str | None:
    """Why the kernel cannot take these shapes/dtypes (None when it can)."""
    page_size, head_dim = k_pages.shape[-2], q.shape[2]
    if not (8 <= page_size <= 128 and page_size & (page_size - 1) == 0):
        return f"page_size (k_pages.shape[2]) must be a power of two in 8..128, got {page_size}"
    if not (64 <= head_dim <= 256 and head_dim % 16 == 0):
        return f"head_dim must be a multiple of 16 in 64..256 for the kernel, got {head_dim}"
    if q.dtype not in KERNEL_DTYPES:
        return f"kernel dtypes are bfloat16/float16/float32, got {q.dtype}"
    return None


def resolve_impl(impl: str, q, k_pages) -> str:
    why_not = kernel_unsupported(q, k_pages)
    if impl == "pallas" and why_not:
        fail("page_size" if "page_size" in why_not else "head_dim" if "head_dim" in why_not
              else "q", why_not)
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" and not why_not else "xla"
    return impl


def validate(q, k_pages, v_pages, block_tables, row_tables, lengths, layer, impl: str,
             backend: str = "triton") -> None:
    if impl not in ("auto", "xla", "pallas"):
        fail("impl", f"expected 'auto', 'xla' or 'pallas', got {impl!r}")
    if backend not in BACKENDS:
        fail("backend", f"expected one of {BACKENDS}, got {backend!r}")
    if q.ndim != 3:
        fail("q", f"expected [N, H, Dh], got shape {q.shape}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        fail("q", f"expected a floating dtype, got {q.dtype}")
    n, num_heads, head_dim = q.shape
    if k_pages.ndim not in (4, 5):
        fail("k_pages", f"expected [Hkv, num_pages, page_size, Dh] or [L, Hkv, num_pages, page_size, Dh], "
              f"got shape {k_pages.shape}")
    if (k_pages.ndim == 5) != (layer is not None):
        fail("layer", "give a layer index exactly when k_pages is the stacked 5-D pool")
    if v_pages.shape != k_pages.shape:
        fail("v_pages", f"shape {v_pages.shape} differs from k_pages {k_pages.shape}")
    if k_pages.dtype != q.dtype:
        fail("k_pages", f"dtype {k_pages.dtype} differs from q's {q.dtype}")
    if v_pages.dtype != q.dtype:
        fail("v_pages", f"dtype {v_pages.dtype} differs from q's {q.dtype}")
    num_kv, _, _, head_dim_kv = k_pages.shape[-4:]
    if head_dim_kv != head_dim:
        fail("k_pages", f"head_dim {head_dim_kv} differs from q's {head_dim}")
    if num_kv < 1 or num_heads % num_kv:
        fail("q", f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv} (GQA)")
    _check_index("block_tables", block_tables, 2)
    _check_index("row_tables", row_tables, 1)
    _check_index("lengths", lengths, 1)
    if row_tables.shape[0] != n:
        fail("row_tables", f"expected [{n}] (one per row of q), got {row_tables.shape}")
    if lengths.shape[0] != n:
        fail("lengths", f"expected [{n}] (one per row of q), got {lengths.shape}")


def check_launch(pages_per_block: int | None, num_splits: int | None) -> None:
    if pages_per_block is not None and (pages_per_block < 1 or pages_per_block & (pages_per_block - 1)):
        fail("pages_per_block", f"expected a power of two, got {pages_per_block}")
    if num_splits is not None and num_splits < 1:
        fail("num_splits", f"expected >= 1, got {num_splits}")


def on_mosaic(backend: str, q, k_pages, pages_per_block: int | None, fused: bool) -> bool:
    """Whether the "pallas" branch runs the Mosaic GPU kernel for these operands (fused: with
    the write, whose tiles need more shared memory)."""
    return backend == "mosaic" and mosaic_launch(q, k_pages, pages_per_block=pages_per_block,
                                                 fused=fused).unsupported is None


def kernel_probe(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype):
    """(q, one layer's pool) shapes of a one-row decode call at a model's shapes: what the
    support checks read."""
    return (jax.ShapeDtypeStruct((1, num_heads, head_dim), dtype),
            jax.ShapeDtypeStruct((num_kv_heads, 1, page_size, head_dim), dtype))


def decode_kernel(backend: str, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype) -> str:
    """Which kernel the "pallas" branch runs for the engine's decode calls (the fused write) at
    a model's shapes: "mosaic" or "triton"."""
    q, k = kernel_probe(num_heads, num_kv_heads, head_dim, page_size, dtype)
    return "mosaic" if on_mosaic(backend, q, k, None, fused=True) else "triton"


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    block_tables: jax.Array, row_tables: jax.Array, lengths: jax.Array, *,
                    layer: jax.Array | int | None = None, impl: str = "auto",
                    interpret: bool = False, scale: float | None = None,
                    pages_per_block: int | None = None, num_splits: int | None = None,
                    backend: str = "triton") -> jax.Array:
    """Attention of each query row over its paged KV: returns [N, H, Dh] in q's dtype.

    k_pages/v_pages: one layer's [Hkv, P, S, Dh] pool, or the stacked [L, Hkv, P, S, Dh]
    pool together with ``layer`` (int32 scalar, may be traced), read in place.
    """
    validate(q, k_pages, v_pages, block_tables, row_tables, lengths, layer, impl, backend)
    check_launch(pages_per_block, num_splits)

    impl = resolve_impl(impl, q, k_pages)
    if impl == "xla":
        return paged_attention_ref(q, k_pages, v_pages, block_tables, row_tables, lengths,
                                   layer=layer, scale=scale)
    if pages_per_block is not None and pages_per_block * k_pages.shape[-2] < 16:
        fail("pages_per_block", f"pages_per_block * page_size must be >= 16, got "
              f"{pages_per_block} * {k_pages.shape[-2]}")
    if on_mosaic(backend, q, k_pages, pages_per_block, fused=False):
        from rltjax.kernels.paged_attention_mosaic import paged_attention_mosaic
        return paged_attention_mosaic(q, k_pages, v_pages, block_tables, row_tables, lengths, layer=layer,
                                      scale=scale, pages_per_block=pages_per_block, num_splits=num_splits,
                                      interpret=interpret)
    from rltjax.kernels.paged_attention_pallas import paged_attention_pallas
    return paged_attention_pallas(q, k_pages, v_pages, block_tables, row_tables, lengths,
                                  layer=layer, scale=scale, pages_per_block=pages_per_block,
                                  num_splits=num_splits, interpret=interpret)


def merge_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """[N, H, Dh], [N, Hkv, Dh] x 2 -> [N, H + 2 Hkv, Dh], concatenated flat: when q, k, v are
    adjacent column slices of one projection's output (the engine's fused q | k | v weight,
    RoPE in the kernel), XLA folds the concatenate back into that output, no copy. (Where
    XLA transforms q or k first, e.g. Huginn's bias and interleaved RoPE, one copy remains.)"""
    n, head_dim = q.shape[0], q.shape[-1]
    return jnp.concatenate([x.reshape(n, -1) for x in (q, k, v)], axis=1).reshape(n, -1, head_dim)


def check_new_kv(q, k_new, v_new, k_pages, write_page, write_offset, rope) -> None:
    """``paged_attention_write``'s arguments beyond ``paged_attention``'s."""
    n, _, head_dim = q.shape
    kv_shape = (n, k_pages.shape[-4], head_dim)
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if x.shape != kv_shape:
            fail(name, f"expected [N, Hkv, Dh] = {list(kv_shape)}, got shape {x.shape}")
        if x.dtype != q.dtype:
            fail(name, f"dtype {x.dtype} differs from q's {q.dtype}")
    if (write_page.ndim not in (1, 2) or write_page.shape[-1] != n or write_page.dtype != jnp.int32
            or write_page.size == 0):
        fail("write_page", f"expected int32 [{n}] or [M >= 1, {n}], got {write_page.dtype} {write_page.shape}")
    _check_index("write_offset", write_offset, 1)
    if write_offset.shape[0] != n:
        fail("write_offset", f"expected [{n}] (one per row of q), got {write_offset.shape}")
    if rope is not None:
        if head_dim % 2 or len(rope) != 2 or any(
                x.shape != (n, head_dim // 2) or x.dtype != jnp.float32 for x in rope):
            fail("rope", f"expected (cos, sin), float32 [{n}, {head_dim // 2}] each, and an even head_dim; got "
                  f"head_dim {head_dim}, {[(str(x.dtype), x.shape) for x in rope]}")


def paged_attention_write(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_pages: jax.Array,
                          v_pages: jax.Array, block_tables: jax.Array, row_tables: jax.Array,
                          lengths: jax.Array, write_page: jax.Array, write_offset: jax.Array, *,
                          layer: jax.Array | int | None = None, impl: str = "auto",
                          interpret: bool = False, scale: float | None = None,
                          pages_per_block: int | None = None, num_splits: int | None = None,
                          rope: tuple[jax.Array, jax.Array] | None = None, num_warps: int | None = None,
                          num_stages: int | None = None, backend: str = "triton"
                          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each row writes its new K/V (``paged_write_ref``), then attends as ``paged_attention``
    -> (out [N, H, Dh], k_pages, v_pages). Donate the pools: they are updated in place.

    rope = (cos, sin) [N, Dh / 2] float32: q and k_new are rotated first
    (``rope_rotate_half_ref``); the kernel does it in registers (power-of-two head_dim; XLA
    rotates other sizes first). The kernel reads q | k | v as one [N, H + 2 Hkv, Dh] array,
    concatenated here (free when they are slices of one projection, else one small copy).

    pages_per_block, num_splits, num_warps, num_stages: the kernel's launch (None: its
    default, ``kernels.paged_attention_launch.default_launch``); num_warps and num_stages are
    the Triton kernel's. backend "mosaic": the Mosaic GPU kernel where it takes the operands,
    q and k_new rotated by XLA before it.

    Precondition for the kernels (decode, where it holds by construction): a row with
    length > 0 writes its key at position lengths - 1 of its own table (row_tables); both
    kernels take that key from k_new / v_new instead of reading it back from the pool.
    """
    validate(q, k_pages, v_pages, block_tables, row_tables, lengths, layer, impl, backend)
    check_launch(pages_per_block, num_splits)
    check_new_kv(q, k_new, v_new, k_pages, write_page, write_offset, rope)
    head_dim = q.shape[2]
    impl = resolve_impl(impl, q, k_pages)
    mosaic = impl == "pallas" and on_mosaic(backend, q, k_pages, pages_per_block, fused=True)
    if rope is not None and (impl == "xla" or mosaic or not kernel_rope_supported(head_dim)):
        q, k_new = rope_rotate_half_ref(q, *rope), rope_rotate_half_ref(k_new, *rope)
        rope = None
    if impl == "xla":
        k_pages, v_pages = paged_write_ref(k_pages, v_pages, k_new, v_new, write_page, write_offset, layer=layer)
        out = paged_attention_ref(q, k_pages, v_pages, block_tables, row_tables, lengths, layer=layer, scale=scale)
        return out, k_pages, v_pages
    if mosaic:
        from rltjax.kernels.paged_attention_mosaic import paged_attention_mosaic
        return paged_attention_mosaic(q, k_pages, v_pages, block_tables, row_tables, lengths, layer=layer,
                                      scale=scale, pages_per_block=pages_per_block, num_splits=num_splits,
                                      interpret=interpret, new_kv=(k_new, v_new, write_page, write_offset))
    from rltjax.kernels.paged_attention_pallas import paged_attention_pallas
    qkv = merge_qkv(q, k_new, v_new)
    return paged_attention_pallas(qkv, k_pages, v_pages, block_tables, row_tables, lengths, layer=layer,
                                  scale=scale, pages_per_block=pages_per_block, num_splits=num_splits,
                                  num_warps=num_warps, num_stages=num_stages, interpret=interpret,
                                  new_kv=(write_page, write_offset, rope))

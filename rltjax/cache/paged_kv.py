"""Paged K/V for the engine: one page pool for every layer, plane and sequence.

Layout
  kv.k, kv.v:    [L, Hkv, num_pages, page_size, Dh]. All layers are stacked so
                 the whole pool is one (donated) jit argument; per layer the
                 slice kv.k[layer] is exactly the layout of
                 ``kernels.paged_attention_ref`` (head-major pages).
  page 0:        scratch. Padded rows' writes and the write-through pages a
                 row does not write (page 0) are dropped, so static batch shapes
                 never touch live pages. The allocator must never hand out page 0.
  block tables:  [num_tables, pages_per_table] int32, one table per
                 (sequence, plane). The pool itself is shared by all planes:
                 a plane is only a set of tables. ``last_exited`` keeps one plane
                 per depth up to the loop cap (R, or CacheConfig.max_loops above
                 it) per request (plane d-1 serves queries at depth d);
                 ``shared`` keeps one plane (1 table) that every loop overwrites.
                 Boundary KV (Huginn's prelude/coda) is a second PagedKV of P + K
                 layers with one plane and its own block tables.
  a slot:        (page, offset) = (table[pos // page_size], pos % page_size).

Read rule (DESIGN section 2). ``last_exited``: a query at depth d reads an
earlier token of exit depth e at plane min(d, e); we get that by writing through
(``kv_update``: a row at loop d writes plane d - 1 and every deeper plane below its
cap, so after its last loop e the deeper planes hold its depth-e entry; prompt
tokens, depth R, are written to planes R..cap by their last loop), so attention
itself never branches on depth and an exit needs no copy. ``shared``: one plane, read as is.

Within a layer every row writes its K/V before any row attends (one scatter,
then one attention), so a row sees itself and a prefill chunk of consecutive
positions is causal within itself. Decode rows (each its request's one newest
token) read no other row's write, so on the Pallas path their write and read are
one kernel (``kernels.paged_attention.paged_attention_write``), which also rotates q and
k (rotate-half RoPE) from the projections' output. For ``shared`` a chunk is only correct if
its positions are at their final loop, hence shared prefill is position-
sequential per request (different requests may share a batch).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from rltjax.cache.kv_update import write_kv
from rltjax.kernels.paged_attention import paged_attention, paged_attention_write
from rltjax.kernels.prefill_attention import paged_prefill_attention
from rltjax.kernels.residual_norm import kernel_unsupported as norm_unsupported, residual_norm
from rltjax.kernels.skinny_matmul import MAX_ROWS, gated_unsupported, gated_up, kernel_unsupported, skinny_matmul

# "auto" runs a decode head on the kernel up to this many rows: on an H200 the kernel streams
# Ouro's lm_head about as fast as XLA's GEMM there (48.4 against 47.6 us at 8 rows; slower from 32)
# and skips it on passes where no row exits (scripts/bench_skinny.py)
HEAD_KERNEL_ROWS = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKV:
    k: jax.Array  # [L, Hkv, num_pages, page_size, Dh]
    v: jax.Array  # [L, Hkv, num_pages, page_size, Dh]

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedMeta:
    """Per-pass row metadata (all int32). Padded rows: write_page 0, lengths 0."""
    positions: jax.Array      # [N] RoPE position of each row
    write_page: jax.Array     # [N] physical page each row writes (padded rows -> 0); [M, N]: M pages per row
    write_offset: jax.Array   # [N] offset in that page
    row_tables: jax.Array     # [N] block table each row reads: its (sequence, plane)
    lengths: jax.Array        # [N] keys 0..length-1 visible (position + 1; 0 for padding)
    block_tables: jax.Array   # [num_tables, pages_per_table]


# on a tensor-parallel mesh: queries and new keys [N, H, Dh] by heads, pools [L, Hkv, ...] by KV heads
_HEADS, _POOL = P(None, "tp", None), P(None, "tp")

@dataclasses.dataclass(frozen=True)
class PagedKVBackend:
    """KVBackend (rltjax.models.base) over PagedKV / PagedMeta.

    attn_impl: "xla" | "pallas" | "auto", passed to kernels.paged_attention;
    interpret runs the Pallas kernels in interpret mode (CPU tests).
    prefill_block_q: > 0 reads through the prefill kernel (``paged_prefill_attention``):
    the rows must come in aligned blocks of this many rows that share a table.
    matmul_impl: the projections of batches of at most ``kernels.skinny_matmul.MAX_ROWS``
    rows: "xla" (XLA's dot), "pallas" (all of them on the weight-streaming kernel) or
    "auto" (on a GPU, decode batches whose weight shape [K, N] is in ``kernel_shapes`` run on
    the kernel, up to its MAX_ROWS; the rest XLA's dot). Larger batches use XLA's dot. (The
    engine's prefill backend always says "xla".)
    kernel_shapes: for "auto", the weight shapes the kernel beats XLA at (the runner
    names the attention projections: q|k|v and o; ``kernels.skinny_matmul``).
    head_shapes: for "auto", the lm_head shapes [D, V] whose heads of up to HEAD_KERNEL_ROWS
    rows ``head_matmul`` puts on the kernel (the runner names Ouro's, K <= 2048).
    fused_kernels: for "auto", the kernels that take a neighbouring step into themselves run
    on decode batches (up to MAX_ROWS, at every shape they support): a SwiGLU MLP's pair
    (``gated_up``: both products and the activation in one kernel), and any projection whose
    consumer adds split-K partial sums itself (``matmul(partial_sums=True)``, where the
    residual-norm kernel runs: Ouro's down, and o, which kernel_shapes names anyway), on the
    split kernel with no reduction kernel after it. The runner sets it where attention runs on
    the Pallas kernels. (On an H200 in isolation at 8 rows, o with the norm took 6.76 us in two
    K splits against 7.57 in one pass, and down with the norm 10.30 on the split kernel against
    11.20 for XLA's GEMM, its reduction and the norm: scripts/bench_mlp.py.)
    kernel_backend: the decode kernels' backend: "triton" or "mosaic" (Mosaic GPU where its
    kernels take the operands, Triton for the rest: the projections, ``kernels.skinny_matmul``,
    and decode attention, ``kernels.paged_attention``).
    num_splits: the decode attention kernel's key splits per row: None (its default per
    batch), an int, or per decode row bucket ((rows, splits), ...) (a {rows: splits} mapping
    is taken too) with the default for the buckets not named.
    decode_rows: the caller promises every row is the newest token of its own request and
    writes its K/V at its position in the table it reads (lengths - 1), so no row reads
    another's write of this call: ``write_attend`` may then fuse the write into the
    attention kernel. Off by default: prefill chunks (consecutive positions of one request
    read each other's writes) would race in the fused kernel.
    """
    attn_impl: str = "xla"
    interpret: bool = False
    prefill_block_q: int = 0
    matmul_impl: str = "xla"
    decode_rows: bool = False
    kernel_shapes: tuple[tuple[int, int], ...] = ()
    head_shapes: tuple[tuple[int, int], ...] = ()
    fused_kernels: bool = False
    kernel_backend: str = "triton"
    num_splits: int | tuple[tuple[int, int], ...] | None = None
    mesh: Any = None          # a tensor-parallel mesh (axis "tp"): the attention kernels run per device

    def __post_init__(self):
        if isinstance(self.num_splits, Mapping):      # hashable: the backend is a static jit argument
            object.__setattr__(self, "num_splits", tuple(sorted(self.num_splits.items())))

    def splits_for(self, rows: int) -> int | None:
        """The decode kernel's key splits for a batch of ``rows`` rows (None: its default)."""
        if isinstance(self.num_splits, tuple):
            return dict(self.num_splits).get(rows)
        return self.num_splits

    def matmul(self, x, w, layer, partial_sums: bool = False):
        """partial_sums: the consumer is ``residual_norm``, which adds up split-K partial sums
        itself; the kernel path then hands them on unreduced ([S, N, N'])."""
        # partial sums pay only where the norm kernel adds them (XLA would add them first)
        summed_in_norm = partial_sums and self.fused_kernels and self.norm_fuses(
            jax.ShapeDtypeStruct((x.shape[0], w.shape[-1]), x.dtype))
        on_kernel = tuple(w.shape[-2:]) in self.kernel_shapes or summed_in_norm
        impl = self._impl(x, w, kernel_unsupported, on_kernel)
        partial_sums = partial_sums and impl == "pallas"
        return skinny_matmul(x, w, layer, impl=impl, interpret=self.interpret, partial_sums=partial_sums,
                             backend=self.kernel_backend)

    def head_matmul(self, x, w, needed=None):
        """A decode head's x [N, D] @ lm_head [D, V] -> [N, V] float32 logits (the product
        rounded to x's dtype), on the kernel for "pallas" and, for "auto", for up to
        HEAD_KERNEL_ROWS rows of a head in head_shapes; the kernel writes them as float32
        (no conversion kernel after it). ``needed``: None (always computed) or a traced bool,
        whether any row keeps the logits; where it is false the kernel returns zeros without
        streaming the weight."""
        auto_shape = tuple(w.shape[-2:]) in self.head_shapes and x.shape[0] <= HEAD_KERNEL_ROWS
        impl = self._impl(x, w, kernel_unsupported, auto_shape)
        if impl == "xla":
            return (x @ w).astype(jnp.float32)
        skip = None if needed is None else jnp.logical_not(needed)
        return skinny_matmul(x, w, impl=impl, interpret=self.interpret, skip=skip, widen=True,
                             backend=self.kernel_backend)

    def gated_up(self, x, w_gate, w_up, layer):
        """silu(x @ w_gate) * (x @ w_up) [N, F]: a SwiGLU MLP's activation, one kernel on the
        kernel path (``kernels.skinny_matmul.gated_up``)."""
        impl = self._impl(x, w_gate, gated_unsupported, self.fused_kernels)
        return gated_up(x, w_gate, w_up, layer, impl=impl, interpret=self.interpret, backend=self.kernel_backend)

    def _impl(self, x, w, auto_unsupported, auto_shape: bool) -> str:
        """"pallas" or "xla" for a projection of x by w under ``matmul_impl`` ("auto" also asks
        ``auto_unsupported``: the kernel's rows, shapes and dtypes, and the gate | up kernel's
        one pass over K)."""
        if self.matmul_impl == "pallas" and x.shape[0] <= MAX_ROWS:
            if why_not := kernel_unsupported(x, w):
                raise ValueError(f"ExecutionConfig.matmul_impl='pallas': a [{x.shape[1]}, {w.shape[-1]}] projection "
                                 f"cannot run on the kernel: {why_not} (use matmul_impl='xla' or 'auto')")
            return "pallas"
        auto = (self.matmul_impl == "auto" and self.decode_rows and auto_shape
                and jax.default_backend() == "gpu" and not auto_unsupported(x, w))
        return "pallas" if auto else "xla"

    @property
    def fuses_decode(self) -> bool:
        """Decode rows through the fused kernels (write + RoPE + attention, residual-norm)."""
        return self.decode_rows and not self.prefill_block_q

    def norm_fuses(self, x, *weights) -> bool:
        """Whether ``residual_norm`` of x [N, D] (and these weights) takes the one-kernel path."""
        return self.fuses_decode and not norm_unsupported(x, *weights)

    def residual_norm(self, x, y, post_weight, next_weight, eps):
        """One kernel for decode rows (``attn_impl``'s choice of Pallas), XLA otherwise."""
        impl = self.attn_impl if self.norm_fuses(x, post_weight, next_weight) else "xla"
        return residual_norm(x, y, post_weight, next_weight, eps, impl=impl, interpret=self.interpret)

    def write(self, kv: PagedKV, layer, k, v, meta: PagedMeta) -> PagedKV:
        return write_kv(kv, layer, k, v, meta.write_page, meta.write_offset)

    def write_attend(self, kv: PagedKV, layer, q, k, v, meta: PagedMeta, rope=None):
        """``rope``, ``write``, then ``attend`` -> (out, kv). Decode rows (``decode_rows``) run
        as one kernel, which also applies a rotate-half ``rope``."""
        fused = self.fuses_decode
        rope_in_kernel = fused and rope is not None and not rope.interleaved
        if rope is not None and not rope_in_kernel:
            q, k = rope(q), rope(k)
        if not fused:
            kv = self.write(kv, layer, k, v, meta)
            return self.attend(kv, layer, q, meta), kv
        cos_sin = (rope.cos, rope.sin) if rope_in_kernel else None

        def kernel(q, k, v, k_pages, v_pages, tables, rows, lengths, page, offset, layer, cos_sin):
            return paged_attention_write(q, k, v, k_pages, v_pages, tables, rows, lengths, page, offset, layer=layer,
                                         impl=self.attn_impl, interpret=self.interpret, rope=cos_sin,
                                         num_splits=self.splits_for(q.shape[0]), backend=self.kernel_backend)
        heads, pool, whole = _HEADS, _POOL, P()
        out, k_pages, v_pages = self._per_device(
            kernel, (heads, heads, heads, pool, pool, whole, whole, whole, whole, whole, whole, whole),
            (heads, pool, pool), q, k, v, kv.k, kv.v, meta.block_tables, meta.row_tables, meta.lengths,
            meta.write_page, meta.write_offset, layer, cos_sin)
        return out, type(kv)(k_pages, v_pages)

    def _per_device(self, fn, in_specs, out_specs, *args):
        """``fn(*args)``; on a tensor-parallel mesh each device runs it on its own heads (the
        pools split by KV heads, queries by heads, the rest whole): a kernel is one custom call
        that XLA's partitioner cannot split, and would gather the whole pool onto every device."""
        if self.mesh is None:
            return fn(*args)
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)

    def attend(self, kv: PagedKV, layer, q, meta: PagedMeta):
        # The stacked pool goes in whole with the layer index: slicing kv.k[layer] here
        # would make XLA copy one layer's pool per layer per pass for the kernel call.
        args = (q, kv.k, kv.v, meta.block_tables, meta.row_tables, meta.lengths, layer)

        def kernel(q, k_pages, v_pages, tables, rows, lengths, layer):
            if self.prefill_block_q:
                return paged_prefill_attention(q, k_pages, v_pages, tables, rows, lengths, layer=layer,
                                               impl=self.attn_impl, interpret=self.interpret,
                                               block_q=self.prefill_block_q)
            return paged_attention(q, k_pages, v_pages, tables, rows, lengths, layer=layer, impl=self.attn_impl,
                                   interpret=self.interpret, num_splits=self.splits_for(q.shape[0]),
                                   backend=self.kernel_backend)
        if self.attn_impl == "xla":     # plain XLA: the partitioner splits it like any other op
            return kernel(*args)
        whole = P()
        return self._per_device(kernel, (_HEADS, _POOL, _POOL, whole, whole, whole, whole), _HEADS, *args)

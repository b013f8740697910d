"""ModelRunner: owns the device state and runs the engine's batches on it.

Host batches (numpy) are padded to power-of-two row and token buckets and handed to
the jitted steps of ``device_steps`` (prefill, embed, loop, head) and
``decode_window`` (its calls in ``window_calls``). Models with boundary stages (Huginn)
add a second pool for the prelude/coda KV (one plane, P + K layers) and a per-slot
``inject`` buffer (the prelude output e that every loop reads); their prelude runs in its own call
(``embed_step``) for the rows that start a token, and their coda writes the boundary
KV in ``head_step`` (and for every prompt row in ``prefill_step``). Plain models pass
``None`` for all of it, so their compiled functions are unchanged. A handful of
executables serve every batch; ``rltjax.engine.warm_up`` compiles all of them at
start-up (XLA's persistent cache makes later start-ups fast) and the engine never
compiles in steady state.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kernels.paged_attention import DEFAULT_BLOCK_Q, kernel_unsupported
from kernels.skinny_matmul import MAX_ROWS, SINGLE_PASS_MAX_K
from rltjax.cache.paged_kv import PagedKV, PagedKVBackend, PagedMeta
from rltjax.engine.device_steps import DeviceSteps
from rltjax.engine.runner_io import BoundaryRows, PendingSignals
from rltjax.engine.scheduler import prefill_batch_bound
from rltjax.engine.host_rows import idle_window_rows
from rltjax.engine.window_calls import WindowCalls
from rltjax.engine.window_config import prompt_tokens_by_bucket
from rltjax.jit_options import engine_options
from rltjax.models.base import boundary_kv_layers
from rltjax.models.layers import split_layer_stacks

NUM_TOP_LOGPROBS = 20
MIN_TOKEN_BUCKET = 32   # prefill token counts pad to >= this: fewer executables, negligible padding
MIN_ROW_BUCKET = 8      # loop/head/window rows pad to >= this: a pass is weight-bound, 8 rows cost as 1
PREFILL_BLOCK_Q = DEFAULT_BLOCK_Q   # prefill-kernel query rows: chunks start at multiples of it


def bucket(n: int) -> int:
    """Smallest power of two >= n."""
    return 1 << max(0, (n - 1).bit_length())


def buckets_up_to(limit: int, smallest: int = 1) -> list[int]:
    """Powers of two from ``smallest`` (capped at bucket(limit)) up to bucket(limit)."""
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    top = bucket(limit)
    return [x for x in out if x >= min(smallest, top)] + [top]


def attention_uses_kernel(attn_impl: str, cfg, kv: PagedKV) -> bool:
    """Whether paged attention runs on the Pallas kernels ("auto": on a GPU, where they take
    the model's shapes)."""
    probe = jax.ShapeDtypeStruct((1, cfg.num_heads, cfg.head_dim), kv.k.dtype)
    return attn_impl == "pallas" or (attn_impl == "auto" and jax.default_backend() == "gpu"
                                     and kernel_unsupported(probe, kv.k) is None)


def auto_matmul_shapes(cfg) -> tuple[tuple[int, int], ...]:
    """matmul_impl "auto"'s kernel shapes (``PagedKVBackend.kernel_shapes``): the fused q|k|v and
    the o projection, with K up to the kernel's one pass (o may still split K in two where its
    consumer adds partial sums), the regime it beat XLA in on an H200 (Ouro's shapes; none for
    Nanbeige's or Huginn's wider K). The
    runner passes them only where attention runs on the Pallas kernels (attn_impl "xla", or
    "auto" off a GPU, keeps every projection on XLA's dot)."""
    shapes = ((cfg.hidden_size, cfg.q_width + 2 * cfg.kv_width), (cfg.q_width, cfg.hidden_size))
    return tuple(shape for shape in shapes if shape[0] <= SINGLE_PASS_MAX_K)


def auto_head_shapes(cfg) -> tuple[tuple[int, int], ...]:
    """matmul_impl "auto"'s heads on the kernel (``PagedKVBackend.head_shapes``): the lm_head
    where K <= the kernel's one pass (Ouro's), which a decode window's head at few rows skips on
    passes where no row exits; passed where ``auto_matmul_shapes`` are."""
    return ((cfg.hidden_size, cfg.vocab_size),) if cfg.hidden_size <= SINGLE_PASS_MAX_K else ()


def decode_projections_on_kernels(cfg, attention_on_kernel: bool, matmul_impl: str, max_num_seqs: int) -> bool:
    """Whether the decode projections (q|k|v, o, the MLP; heads of up to HEAD_KERNEL_ROWS)
    run on the engine's kernels rather than XLA's dot at every decode batch: Ouro's shapes
    under matmul_impl auto or pallas, where attention runs on the Pallas kernels, and at most
    the kernels' MAX_ROWS requests. ``jit_options.KERNEL_DECODE_OPTIONS`` then apply (measured
    up to 64 rows; the larger heads stay on XLA's dot, measured at 32 rows)."""
    return (attention_on_kernel and matmul_impl != "xla" and max_num_seqs <= MAX_ROWS
            and len(auto_matmul_shapes(cfg)) == 2 and bool(auto_head_shapes(cfg)))


class ModelRunner(WindowCalls):
    def __init__(self, model, params, kv: PagedKV, *, max_num_seqs: int, max_num_batched_tokens: int,
                 attn_impl: str, lookahead_w: np.ndarray, num_planes: int, matmul_impl: str = "auto",
                 attn_num_splits=None,
                 boundary_kv: PagedKV | None = None, xla_options: tuple = (),
                 prefill_write_planes: int | None = None, raw_signal: bool = False, interpret: bool = False,
                 chunked_prefill: bool = True, window_spec: dict | None = None, window_trace_width: int = 1,
                 max_prefill_chunk: int | None = None, mixed_prefill: tuple[tuple[int, int], ...] = (),
                 window_rows: int | None = None):
        """boundary_kv: the boundary pool, exactly when the model has boundary stages.
        prefill_write_planes: core planes a prompt row writes (R, or the loop cap when the
        last_exited planes reach beyond R). raw_signal: loop passes return the raw signal.
        chunked_prefill: prefill batches hold multi-token chunks (last_exited); then, when the
        Pallas kernels run, prefill reads through the prefill kernel and ``prefill_alignment``
        says where chunks must start (multiples of PREFILL_BLOCK_Q; 1 = anywhere).
        num_planes: block-table planes per request; a loop step's rows write [num_planes, N]
        pages (``kv_update.write_plane_mask``: own plane and deeper ones, else page 0).
        window_spec: decode windows' static settings (num_passes, mode, layered),
        None when the engine runs none. window_trace_width: width of a window's depth-trace rows
        (``window_config.trace_width``). max_prefill_chunk: the longest chunk the scheduler gives
        one request (``scheduler.max_prefill_chunk``; None: the token budget) bounds the prefill
        buckets with max_num_seqs. mixed_prefill: (rows, T) steps, ascending: windows of at
        least `rows` rows may carry whole prompts of up to T tokens (alignment padding
        included; the last step a bucket reaches) in their first R passes
        (``mixed_prefill.WindowPrompt``); one executable per mixed bucket and sampler. Each T is
        capped at the largest prefill bucket (no admission holds more); windows below the first
        step carry none (``mixed_buckets``, ``prompt_tokens_for``). window_rows: the largest row
        bucket a window runs (a power of two; None: every request's); windows that carry no
        prompts take their requests as standby entries (``standby``) and the requests beyond
        the rows wait there, prefilled, for the next free row."""
        self.model = model
        # Prefill and decode windows loop on the device (fori_loop over loops, while_loop over
        # passes), where XLA:GPU copies every layer slice of a stacked weight before its matmul
        # (on an H200 the copies cost prefill as much as its GEMMs), and a loop step copied
        # ~0.6 ms of them: every step reads per-layer arrays. One copy of the weights is kept,
        # split here unless the caller split them already (``build_engine`` does, before the KV
        # pool is sized, so the stacked copy is gone by then).
        self.params = split_layer_stacks(params)
        self.kv = kv
        self.cfg = model.cfg
        self.has_boundary = boundary_kv_layers(model) > 0
        if self.has_boundary != (boundary_kv is not None):
            raise ValueError(f"{self.cfg.arch}: boundary_kv must be given exactly when the model has boundary "
                             f"stages ({boundary_kv_layers(model)} boundary KV layers)")
        self.bkv = boundary_kv
        # loop, head, embed steps and windows: one row per request (the fused decode write holds)
        uses_kernel = attention_uses_kernel(attn_impl, self.cfg, kv)
        # xla_options: (name, value) pairs; a GPU adds its defaults (``jit_options.engine_options``)
        on_kernels = decode_projections_on_kernels(self.cfg, uses_kernel, matmul_impl, max_num_seqs)
        self.steps = DeviceSteps.build(engine_options(xla_options, jax.default_backend(), on_kernels))
        self.backend = PagedKVBackend(attn_impl=attn_impl, interpret=interpret, matmul_impl=matmul_impl,
                                      decode_rows=True, num_splits=attn_num_splits,
                                      kernel_shapes=auto_matmul_shapes(self.cfg) if uses_kernel else (),
                                      head_shapes=auto_head_shapes(self.cfg) if uses_kernel else (),
                                      fused_kernels=uses_kernel)
        self.prefill_alignment = PREFILL_BLOCK_Q if chunked_prefill and uses_kernel else 1
        # prefill is compute-bound: its projections stay on XLA's dot whatever matmul_impl says
        self.prefill_backend = dataclasses.replace(self.backend, matmul_impl="xla", decode_rows=False,
                                                   prefill_block_q=PREFILL_BLOCK_Q if self.prefill_alignment > 1 else 0)
        self.max_num_seqs = max_num_seqs
        self.dummy_slot = max_num_seqs
        self.slot_state = jnp.zeros((max_num_seqs + 1, self.cfg.hidden_size), params.embed.dtype)
        self.slot_inject = jnp.zeros_like(self.slot_state) if self.has_boundary else None
        self.slot_tokens = jnp.zeros((max_num_seqs + 1,), jnp.int32)   # each slot's last head token
        # Commit every array that calls replace with their outputs to one device now: jit keys
        # its cache on placement, and outputs are committed, so an uncommitted first input would
        # make the warm-up compile a variant that steady state never uses.
        self.device = device = jax.devices()[0]
        self.kv, self.slot_state, self.slot_inject, self.bkv, self.slot_tokens = jax.device_put(
            (self.kv, self.slot_state, self.slot_inject, self.bkv, self.slot_tokens), device)
        self.lookahead_w = jnp.asarray(lookahead_w, jnp.float32)
        self.num_top = min(NUM_TOP_LOGPROBS, self.cfg.vocab_size)
        self.prefill_write_planes = prefill_write_planes or self.cfg.num_loops
        self.raw_signal = raw_signal
        self.window_spec = window_spec
        self.window_trace_width = window_trace_width
        self.row_buckets = buckets_up_to(max_num_seqs, MIN_ROW_BUCKET)
        self.window_buckets = [b for b in self.row_buckets if window_rows is None or b <= window_rows]
        # aligned prefill batches stay within the budget (one chunk when budget < alignment), and
        # within max_num_seqs chunks: no bucket is compiled that no batch can reach
        most_tokens = prefill_batch_bound(max_num_batched_tokens, max_num_seqs,
                                          max_prefill_chunk or max_num_batched_tokens, self.prefill_alignment)
        self.token_buckets = buckets_up_to(most_tokens, MIN_TOKEN_BUCKET)
        # no prefill batch is larger than the top token bucket: nor is a window's prompt part
        self._prompt_tokens = {} if window_spec is None else prompt_tokens_by_bucket(
            mixed_prefill, self.window_buckets, self.token_buckets[-1])
        self.mixed_buckets = tuple(sorted(self._prompt_tokens))
        self.num_planes = num_planes
        # windows without a prompt part place their requests on the device (standby entries)
        self.uses_standby = any(self.standby_for(b) for b in self.window_buckets)
        self.standby = None
        if self.uses_standby:
            self.standby = jax.device_put(idle_window_rows(max_num_seqs + 1, num_planes, window_trace_width), device)
        # entries wait past a window's start only when its rows cannot hold every request: the
        # swap then runs every pass, else once a window (in every pass it cost the fixed-depth
        # bench_cdb run 0.9% on an H200)
        self.swap_every_pass = self.uses_standby and self.window_buckets[-1] < max_num_seqs

    def standby_for(self, bucket: int) -> bool:
        """Whether windows of this row bucket take their requests as standby entries (the
        buckets that carry no prompts: ``mixed_buckets``)."""
        return self.window_spec is not None and bucket not in self.mixed_buckets

    def prompt_tokens_for(self, bucket: int) -> int:
        """Prompt tokens a window of this row bucket can carry (0: none)."""
        return self._prompt_tokens.get(bucket, 0)

    def window_bucket(self, n: int) -> int:
        """The row bucket of a window over n requests (at most the largest window bucket)."""
        return min(self._rows_bucket(n), self.window_buckets[-1])

    def _rows_bucket(self, n: int) -> int:
        return max(bucket(n), self.row_buckets[0])

    def _tokens_bucket(self, n: int) -> int:
        return max(bucket(n), self.token_buckets[0])

    def device_state_lost(self) -> bool:
        """Whether a failed call consumed (donated) a KV pool: nothing on the device is usable."""
        return self.kv.k.is_deleted() or (self.bkv is not None and self.bkv.k.is_deleted())

    def _bmeta(self, boundary: BoundaryRows | None, positions, write_offset, pad: int):
        """Padded (boundary PagedMeta, seeds) of a call; (None, None) for plain models."""
        if boundary is None:
            return None, None
        meta = PagedMeta(np.pad(positions, (0, pad)), np.pad(boundary.write_page, (0, pad)),
                         np.pad(write_offset, (0, pad)), np.pad(boundary.row_tables, (0, pad)),
                         np.pad(positions + 1, (0, pad)).astype(np.int32), boundary.block_tables)
        return meta, np.pad(boundary.seeds, ((0, pad), (0, 0)))

    # -- calls (numpy in, numpy out) ------------------------------------------------
    def prefill(self, tokens, positions, write_page, write_offset, row_tables, out_slots, block_tables,
                boundary: BoundaryRows | None = None):
        t = self._tokens_bucket(len(tokens))
        pad = t - len(tokens)
        lengths = np.pad(positions + 1, (0, pad))
        bmeta, seeds = self._bmeta(boundary, positions, write_offset, pad)
        self.kv, self.slot_state, self.bkv = self.steps.prefill(
            self.params, self.kv, self.slot_state, np.pad(tokens, (0, pad)), np.pad(positions, (0, pad)),
            np.pad(write_page, ((0, 0), (0, pad))), np.pad(write_offset, (0, pad)),
            np.pad(row_tables, ((0, 0), (0, pad))), lengths.astype(np.int32), block_tables,
            np.pad(out_slots, (0, pad), constant_values=self.dummy_slot), self.bkv, bmeta, seeds,
            model=self.model, backend=self.prefill_backend, num_loops=self.cfg.num_loops)

    def embed(self, slots, tokens, positions, write_offset, boundary: BoundaryRows):
        """Boundary models: the prelude of the rows starting a token (fills their slots)."""
        b = self._rows_bucket(len(slots))
        pad = b - len(slots)
        bmeta, seeds = self._bmeta(boundary, positions, write_offset, pad)
        self.bkv, self.slot_state, self.slot_inject = self.steps.embed(
            self.params, self.bkv, self.slot_state, self.slot_inject,
            np.pad(slots, (0, pad), constant_values=self.dummy_slot), np.pad(tokens, (0, pad)), seeds, bmeta,
            model=self.model, backend=self.backend)

    def loop(self, slots, tokens, starting, positions, write_page, write_offset, row_tables, block_tables,
             boundary: BoundaryRows | None = None, fetch: bool = True):
        """One loop pass. Boundary models run the prelude of the starting rows first. Returns its
        LoopSignals, or with fetch=False the PendingSignals (device copies under way)."""
        if self.has_boundary and np.any(starting):
            idx = np.flatnonzero(starting)
            self.embed(slots[idx], tokens[idx], positions[idx], write_offset[idx], boundary.take(idx))
        b = self._rows_bucket(len(slots))
        pad = b - len(slots)
        self.kv, self.slot_state, signals = self.steps.loop(
            self.params, self.kv, self.slot_state, self.lookahead_w,
            np.pad(slots, (0, pad), constant_values=self.dummy_slot), np.pad(tokens, (0, pad)),
            # padded rows re-embed token 0 (their writes, page 0 and the dummy slot, are dropped)
            np.pad(starting, (0, pad), constant_values=True), np.pad(positions, (0, pad)),
            np.pad(write_page, ((0, 0), (0, pad))),
            np.pad(write_offset, (0, pad)), np.pad(row_tables, (0, pad)),
            np.pad(positions + 1, (0, pad)).astype(np.int32), block_tables, self.slot_inject,
            model=self.model, backend=self.backend, raw_signal=self.raw_signal)
        n = len(slots)
        if not fetch:           # async scheduling: start the copies now, read them a pass later
            for x in signals:
                x.copy_to_host_async()
            return PendingSignals(signals, n, self.raw_signal)
        return PendingSignals(signals, n, self.raw_signal).read()

    def head(self, *args, **kwargs):
        """``head_launch`` then ``head_read``: (tokens, chosen, top_ids, top_lp) as numpy."""
        return self.head_read(self.head_launch(*args, **kwargs))

    def head_launch(self, slots, temperature, top_k, top_p, seed_hi, seed_lo, output_index, positions=None,
                    boundary: BoundaryRows | None = None):
        """Launch the heads of rows; returns (device outputs, n), copies to the host started.
        The tokens also land in their slots of ``slot_tokens`` for a window launched next.
        positions (each row's state position) and boundary: needed by boundary models only."""
        b = self._rows_bucket(len(slots))
        pad = b - len(slots)
        bmeta, _ = self._bmeta(boundary, positions, positions % self.kv.page_size if boundary else None, pad)
        out, self.slot_tokens, self.bkv = self.steps.head(
            self.params, self.slot_state, self.slot_tokens, np.pad(slots, (0, pad), constant_values=self.dummy_slot),
            np.pad(temperature, (0, pad)), np.pad(top_k, (0, pad)), np.pad(top_p, (0, pad), constant_values=1.0),
            np.pad(seed_hi, (0, pad)), np.pad(seed_lo, (0, pad)), np.pad(output_index, (0, pad)), self.bkv, bmeta,
            model=self.model, backend=self.backend, num_top=self.num_top)
        for leaf in out:
            leaf.copy_to_host_async()
        return out, len(slots)

    @staticmethod
    def head_read(launched) -> tuple[np.ndarray, ...]:
        out, n = launched
        return tuple(np.asarray(x)[:n] for x in out)

    def padding_boundary_rows(self, n: int, boundary_block_tables) -> BoundaryRows | None:
        """Boundary rows of n all-padding rows (warm-up calls); None for plain models."""
        if not self.has_boundary:
            return None
        zeros = np.zeros(n, np.int32)
        return BoundaryRows(zeros, zeros, np.zeros((n, 2), np.uint32), boundary_block_tables)

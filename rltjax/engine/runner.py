"""ModelRunner: the device state and the calls that run typed batches on it.

The runner owns what lives on the device: the weights (per-layer copies), the paged KV pool,
the per-slot buffers (each slot's loop state, the last head's token, and for models with
boundary stages the boundary pool and the per-slot prelude output), and the standby entries
of decode windows. Each call takes one padded batch (``engine.batches``, built by
``host_batches``), runs its jitted step (``device_steps``; decode windows:
``window.program``), replaces the donated state with the step's outputs and returns a
pending handle whose host copies are already under way; ``read()`` gives numpy. The
engine's executables are compiled ahead by ``warm_up`` and never in steady state.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rltjax.cache.paged_kv import PagedKV
from rltjax.engine import swap
from rltjax.engine.batches import EmbedBatch, HeadBatch, LoopBatch, PrefillBatch
from rltjax.engine.device_steps import DeviceSteps
from rltjax.engine.settings import EngineSettings
from rltjax.engine.window.program import WindowInputs, WindowSpec, WindowState
from rltjax.engine.window.rows import idle_window_rows
from rltjax.engine.window.state import RowsRead, WindowOutputs, WindowPrompt, WindowRows
from rltjax.models.layers import split_layer_stacks
from rltjax.parallel import Placement
from rltjax.models.lookahead import lookahead_weights
from rltjax.sampling import SAMPLERS


class LoopSignals(NamedTuple):
    """Per-row exit inputs of one loop pass: hazard and score, or the raw signal."""
    hazard: np.ndarray | None
    score: np.ndarray | None
    signal: np.ndarray | None


class HeadResult(NamedTuple):
    tokens: np.ndarray        # [n] int32
    chosen: np.ndarray        # [n] f32 logprob of the sampled token
    top_ids: np.ndarray       # [n, T] int32
    top_lp: np.ndarray        # [n, T] f32


class PromptScores(NamedTuple):
    """Prompt logprobs of a prefill batch's tokens [n], each for the prompt token after it."""
    chosen: np.ndarray        # [n] f32
    top_ids: np.ndarray       # [n, T] int32
    top_lp: np.ndarray        # [n, T] f32


class WindowResult(NamedTuple):
    after: RowsRead           # the rows' exit state after the window (numpy, [n])
    out: WindowOutputs        # its outputs (numpy, [n, K])


@dataclasses.dataclass
class DeviceRead:
    """Device arrays on their way to the host (copies started); ``read`` cuts them to the
    call's real rows and wraps them in their result type."""
    arrays: object
    num_rows: int | None          # None: the arrays are read whole
    wrap: object

    def read(self):
        def cut(a):
            return np.asarray(a)[:self.num_rows] if np.ndim(a) and self.num_rows is not None else np.asarray(a)
        return self.wrap(jax.tree.map(cut, self.arrays))


def _started(tree):
    for leaf in jax.tree.leaves(tree):
        leaf.copy_to_host_async()
    return tree


class ModelRunner:
    def __init__(self, model, params, kv: PagedKV, bkv: PagedKV | None, settings: EngineSettings,
                 placement: Placement | None = None):
        """bkv: the boundary pool, exactly when the model has boundary stages; placement: the
        engine's devices (default: the first device)."""
        if settings.has_boundary != (bkv is not None):
            raise ValueError(f"{settings.arch}: the boundary pool must be given exactly when the model has boundary "
                             f"stages (this is a bug)")
        self.s = settings
        self.model = model
        # Prefill and decode windows loop on the device, where XLA:GPU copies every layer slice
        # of a stacked weight before its matmul (on an H200 the copies cost prefill as much as
        # its GEMMs); one per-layer copy of the weights is kept, split here unless the caller
        # split them already (``build_engine`` does, before the KV pool is sized).
        self.placement = placement or Placement.default()
        self.params = self.placement.put_params(split_layer_stacks(params))
        self.steps = DeviceSteps.build(settings.xla_options)
        slots = settings.max_num_seqs + 1
        slot_state = jnp.zeros((slots, model.cfg.hidden_size), params.embed.dtype)
        # Commit every array that calls replace with their outputs to one device now: jit keys
        # its cache on placement, and outputs are committed, so an uncommitted first input would
        # make the warm-up compile a variant that steady state never uses.
        self.device = self.placement.replicated       # small state: whole on every device of a mesh
        self.kv, self.bkv = jax.device_put((kv, bkv), self.placement.kv)
        self.slot_state, self.slot_inject, self.slot_tokens = jax.device_put(
            (slot_state, jnp.zeros_like(slot_state) if bkv is not None else None,
             jnp.zeros((slots,), jnp.int32)), self.device)
        self.lookahead_w = jnp.asarray(lookahead_weights(settings.exit_config.lookahead_seed, model.cfg.hidden_size,
                                                         model.cfg.initializer_range), jnp.float32)
        w = settings.window
        self._specs: dict[str, WindowSpec] = {}
        self.standby = None
        if w is not None and w.uses_standby:
            self.standby = jax.device_put(idle_window_rows(slots, settings.num_planes, w.trace_width), self.device)

    def swap_bytes(self) -> dict:
        """Bytes of one core page, one boundary page and one slot's rows (swap's host budget)."""
        page = 2 * self.kv.k.nbytes // self.kv.num_pages
        bpage = 0 if self.bkv is None else 2 * self.bkv.k.nbytes // self.bkv.num_pages
        row = self.slot_state.nbytes // self.slot_state.shape[0]       # arithmetic: indexing would compile
        slot = row * (1 if self.slot_inject is None else 2) + self.slot_tokens.dtype.itemsize
        return dict(page_bytes=page, boundary_page_bytes=bpage, slot_bytes=slot)

    def device_state_lost(self) -> bool:
        """Whether a failed call consumed (donated) a KV pool: nothing on the device is usable."""
        return self.kv.k.is_deleted() or (self.bkv is not None and self.bkv.k.is_deleted())

    # -- steps ------------------------------------------------------------------------
    def prefill(self, batch: PrefillBatch, num_rows: int | None = None) -> DeviceRead | None:
        """Prompt chunks; with ``batch.targets``, their prompt logprobs on their way."""
        scoring = batch.targets is not None
        self.kv, self.slot_state, self.bkv, scores = self.steps.prefill(
            self.params, self.kv, self.slot_state, self.bkv, batch, model=self.model,
            backend=self.s.prefill_backend, num_loops=self.s.num_loops, num_top=self.s.num_top if scoring else 0)
        return DeviceRead(_started(scores), num_rows, lambda a: PromptScores(*a)) if scoring else None

    def embed(self, batch: EmbedBatch) -> None:
        """Boundary models: the prelude of the rows starting a token (fills their slots)."""
        self.bkv, self.slot_state, self.slot_inject = self.steps.embed(
            self.params, self.bkv, self.slot_state, self.slot_inject, batch, model=self.model,
            backend=self.s.decode_backend)

    def loop(self, batch: LoopBatch, num_rows: int) -> DeviceRead:
        """One loop pass; its signals (hazard and score, or the raw signal) on their way."""
        self.kv, self.slot_state, signals = self.steps.loop(
            self.params, self.kv, self.slot_state, self.slot_inject, self.lookahead_w, batch, model=self.model,
            backend=self.s.decode_backend, raw_signal=self.s.raw_signal)
        raw = self.s.raw_signal
        wrap = (lambda a: LoopSignals(None, None, a[0])) if raw else (lambda a: LoopSignals(a[0], a[1], None))
        return DeviceRead(_started(signals), num_rows, wrap)

    def head(self, batch: HeadBatch, num_rows: int) -> DeviceRead:
        """Heads of rows; the tokens also land in their slots of ``slot_tokens`` for a window
        launched next."""
        out, self.slot_tokens, self.bkv = self.steps.head(
            self.params, self.slot_state, self.slot_tokens, self.bkv, batch, model=self.model,
            backend=self.s.decode_backend, num_top=self.s.num_top)
        return DeviceRead(_started(out), num_rows, lambda a: HeadResult(*a))

    # -- swap preemption (``engine.swap``) ----------------------------------------------
    def swap_out(self, pages: list[np.ndarray], boundary_pages: list[np.ndarray], slot: int) -> DeviceRead:
        """A request's pages (in pieces) and slot rows, copied; the host copies on their way."""
        slot = np.int32(slot)
        data = [swap.swap_out(self.kv, self.bkv, self.slot_state, self.slot_inject, self.slot_tokens,
                              *jax.device_put((p, b, slot), self.device)) for p, b in zip(pages, boundary_pages)]
        return DeviceRead(_started(data), None, lambda a: a)   # whole: nothing to cut

    def swap_in(self, pages: list[np.ndarray], boundary_pages: list[np.ndarray], slot: int, data: list) -> None:
        """Host copies written into (fresh) pages and a slot, piece by piece."""
        slot = jax.device_put(np.int32(slot), self.device)
        for p, b, piece in zip(pages, boundary_pages, data):
            p, b, piece = jax.device_put((p, b, piece), self.device)
            self.kv, self.bkv, self.slot_state, self.slot_inject, self.slot_tokens = swap.swap_in(
                self.kv, self.bkv, self.slot_state, self.slot_inject, self.slot_tokens, p, b, slot, piece)

    def warm_swaps(self) -> None:
        """Compile both copies (one piece size), without running them: no device buffer at start-up."""
        pages, slot = jnp.zeros(swap.SWAP_CHUNK, jnp.int32), jnp.int32(self.s.dummy_slot)
        pages, slot = jax.device_put((pages, slot), self.device)
        args = (self.kv, self.bkv, self.slot_state, self.slot_inject, self.slot_tokens, pages, pages, slot)
        out = swap.swap_out.lower(*args).compile()
        piece = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), out.out_info)
        swap.swap_in.lower(*args, piece).compile()

    # -- decode windows -----------------------------------------------------------------
    def window(self, rows: WindowRows, block_tables, boundary_tables, owners: np.ndarray, sampler: str,
               prompt: WindowPrompt | None = None) -> tuple[WindowRows, DeviceRead]:
        """Launch a window (``window.program``) over ``rows``: host rows (numpy, padded to a
        window bucket) or the rows a launched window left (device). owners: [max_num_seqs + 1]
        each slot's request tag. Returns its rows after it (on the device, for a window
        continued from them) and its results on their way (the outputs and ``RowsRead``)."""
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler={sampler!r}: must be one of {SAMPLERS}")
        if isinstance(rows.slots, np.ndarray):
            # committed, like the device rows a continued window gets: one executable for both
            # (uncommitted host rows compiled a second variant at the first continued window)
            rows = jax.device_put(rows, self.device)
        bucket = rows.slots.shape[0]
        standby = self.standby if self.s.window.standby_for(bucket) else None
        inputs = WindowInputs(rows, block_tables, self.lookahead_w, boundary_tables, self.slot_tokens,
                              jax.device_put(np.asarray(owners, np.int32), self.device),
                              None if prompt is None else jax.device_put(prompt, self.device), standby)
        state, after, out, new_standby = self.steps.window(
            self.params, WindowState(self.kv, self.slot_state, self.bkv, self.slot_inject), inputs,
            spec=self.window_spec(sampler))
        self.kv, self.slot_state, self.bkv, self.slot_inject = state.kv, state.slot_state, state.bkv, state.slot_inject
        if standby is not None:
            self.standby = new_standby
        return after, DeviceRead(_started((RowsRead.of(after), out)), bucket, lambda a: WindowResult(*a))

    def window_spec(self, sampler: str) -> WindowSpec:
        """The static settings of this engine's windows with this head sampler (one object per
        sampler: jit hashes it at every launch)."""
        if sampler not in self._specs:
            w = self.s.window
            self._specs[sampler] = WindowSpec(
                self.model, self.s.decode_backend, self.s.prefill_backend, w.num_passes, self.s.exit_mode,
                self.s.layered, self.s.dummy_slot, w.fixed_trip, sampler,
                self.s.num_top if sampler == "truncate" else 0, w.swap_every_pass, w.speculative)
        return self._specs[sampler]

    def merge_rows(self, after: WindowRows, host: WindowRows, replace: np.ndarray) -> WindowRows:
        """Rows for a window continued from ``after`` (device rows of the same padded length)
        with the rows where ``replace`` is set taken from ``host``; nothing is read."""
        host, replace = jax.device_put((host, np.asarray(replace, bool)), self.device)
        return self.steps.merge_rows(after, host, replace)

    def standby_put(self, host: WindowRows, put: np.ndarray) -> None:
        """Standby entries from the host: entry s (the request in slot s) taken from ``host``
        ([max_num_seqs + 1] rows) where ``put`` is set, the device's kept elsewhere."""
        host, put = jax.device_put((host, np.asarray(put, bool)), self.device)
        self.standby = self.steps.merge_rows(self.standby, host, put)

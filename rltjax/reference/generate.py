"""The dense reference: one request, token by token, loop by loop.

Slow on purpose. Every rule of DESIGN section 2 is a visible line here:
prompt tokens run all R loops; output token 0 comes from the last prompt
token's head at depth R; a sampled token enters the KV only when its own
loops run; each later token's depth comes from its exit rule; reads follow
the KV layout's plane rule (``read_planes_for``). This is the oracle the
batched engine is tested against.

Models with boundary KV (Huginn) run through ``stages.BoundaryStages``: the
prelude and coda write their own one-plane KV, and every token's coda runs
(prompt tokens included). Such models may allow ``max_loops`` above R
(``loop_limit``); prompt tokens still run R loops.
"""
from __future__ import annotations

import dataclasses
import secrets
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rltjax.engine_config import EngineConfigError, ExitConfig, check_kv_layout, validate_trace_depths
from rltjax.models.base import boundary_kv_layers, loop_limit, signal_kind
from rltjax.reference.dense_kv import DenseKVBackend, DenseMeta, empty_kv, read_planes_for
from rltjax.models.lookahead import lookahead_weights
from rltjax.reference.exits import REFERENCE_EXIT_MODES, TokenExit
from rltjax.reference.stages import BoundaryFns, BoundaryStages, PlainStages
from rltjax.sampling import sample_one, token_logprobs
from rltjax.sampling_params import SamplingParams, SamplingParamsError


@dataclasses.dataclass
class ReferenceOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    exit_depths: list[int]             # exit_depths[0] = R (prefill)
    finish_reason: str                 # "stop" | "length"
    logprobs: list[dict[int, float]] | None
    loop_probs: list[list[float]]      # per output token: the exit prob seen after each loop
    prompt_states: np.ndarray | None = None   # [R, S, D] normed state after each loop
    prompt_gate_logits: np.ndarray | None = None  # [R, S]
    logits: list[np.ndarray] | None = None    # per output token: the [V] f32 logits it was sampled from


def _capacity(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


class ReferenceModel:
    """Wraps a model (embed/loop/head) and its params for dense, one-request runs."""

    def __init__(self, model: Any, params: Any, *, kv_layout: str = "last_exited",
                 exit_config: ExitConfig | None = None, exit_mode: str | None = None):
        """exit_mode overrides exit_config.mode ("latent_diff" needs a model whose loop
        signal is the relative latent change)."""
        self.model = model
        self.cfg = model.cfg
        self.params = params
        self.kv_layout = check_kv_layout(kv_layout)
        self.exit_config = exit_config or ExitConfig()
        self.exit_mode = exit_mode or self.exit_config.mode
        if self.exit_mode not in REFERENCE_EXIT_MODES:
            raise EngineConfigError(f"exit_mode={self.exit_mode!r}: choose one of {REFERENCE_EXIT_MODES}")
        if self.exit_mode == "latent_diff" and signal_kind(model) != "latent_diff":
            raise EngineConfigError(f"exit_mode='latent_diff' needs a model whose loop signal is the "
                                    f"latent change; {self.cfg.arch} gives {signal_kind(model)!r}")
        backend = DenseKVBackend()
        w = lookahead_weights(self.exit_config.lookahead_seed, self.cfg.hidden_size,
                              self.cfg.initializer_range)

        def loop_step(params, state, inject, kv, meta):
            state, kv, signal = model.loop(params, state, inject, kv, meta, backend)
            hazard = jax.nn.sigmoid(signal)
            score = jax.nn.sigmoid(state.astype(jnp.float32) @ jnp.asarray(w))
            return state, kv, signal, hazard, score

        self._embed = jax.jit(lambda params, tokens: model.embed(params, tokens)[0])
        self._loop = jax.jit(loop_step, donate_argnums=(3,))
        self._head = jax.jit(lambda params, state: model.head(params, state))
        self._bfns = BoundaryFns(model, backend) if boundary_kv_layers(model) else None

    @property
    def dtype(self):
        return self.params.embed.dtype

    def _run_token(self, kv, stages, token: int, position: int, depth_rule, exit_depths: np.ndarray,
                   capacity: int, record: list | None = None):
        """All loops of one token. depth_rule(r, hazard, score, signal) -> True when r is the last loop."""
        state, inject = stages.embed(token, position)
        r = 0
        while True:
            r += 1
            planes = read_planes_for(self.kv_layout, r, position, exit_depths, capacity)
            meta = DenseMeta(positions=jnp.int32([position]),
                             write_plane=jnp.int32([0 if self.kv_layout == "shared" else r - 1]),
                             read_planes=jnp.asarray(planes)[None],
                             lengths=jnp.int32([position + 1]))
            state, kv, signal, hazard, score = self._loop(self.params, state, inject, kv, meta)
            if record is not None:
                record.append((np.asarray(state[0], np.float32), float(signal[0])))
            if depth_rule(r, float(hazard[0]), float(score[0]), float(signal[0])):
                exit_depths[position] = r
                return state, kv

    def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None, *,
                 request_id: str = "0", eos_token_ids: Sequence[int] | None = None,
                 record_prompt: bool = False, record_logits: bool = False) -> ReferenceOutput:
        sp = params or SamplingParams()
        cfg = self.cfg
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise SamplingParamsError("prompt is empty: at least one token is required")
        if any(not 0 <= t < cfg.vocab_size for t in prompt):
            raise SamplingParamsError(f"prompt token ids must be in [0, {cfg.vocab_size})")
        if len(prompt) + sp.max_tokens > cfg.max_position:
            raise SamplingParamsError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({sp.max_tokens}) exceeds the model's "
                f"{cfg.max_position} positions")
        sp.token_vocab_check(cfg.vocab_size)
        # A model may allow max_loops above R (Huginn); unset max_loops still means R.
        min_loops, max_loops = sp.resolved_loops(
            cfg.num_loops if sp.max_loops is None else loop_limit(self.model))
        mode = self.exit_mode
        if not cfg.has_exit_gate and mode in ("ouro", "ouro_delayed"):
            mode = "fixed"
        trace = None
        if mode == "trace":
            trace = validate_trace_depths(
                self.exit_config.depths_by_request.get(request_id, ()), num_loops=cfg.num_loops,
                min_loops=min_loops, max_loops=max_loops, max_tokens=sp.max_tokens, request_id=request_id)
        seed = sp.seed if sp.seed is not None else secrets.randbits(63)
        eos = set(cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
        stop_ids = set(sp.stop_token_ids)

        capacity = _capacity(len(prompt) + sp.max_tokens)
        num_planes = max(cfg.num_loops, max_loops) if self.kv_layout == "last_exited" else 1
        kv = empty_kv(cfg.num_layers, num_planes, capacity, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        exit_depths = np.zeros(capacity, np.int32)
        stages = BoundaryStages(self, capacity, seed) if self._bfns else PlainStages(self)

        records: list[list] = []
        for pos, tok in enumerate(prompt):
            record = [] if record_prompt else None
            state, kv = self._run_token(kv, stages, tok, pos, lambda r, *_: r >= cfg.num_loops,
                                        exit_depths, capacity, record)
            records.append(record)
            if stages.prompt_heads and pos < len(prompt) - 1:
                stages.head(state, pos)          # the coda's KV at this position
        state_pos = len(prompt) - 1

        out_ids: list[int] = []
        depths = [cfg.num_loops]
        loop_probs: list[list[float]] = [[]]
        logprobs: list[dict[int, float]] | None = [] if sp.logprobs is not None else None
        finish = "length"
        all_logits: list[np.ndarray] = []
        while True:
            logits = stages.head(state, state_pos)                      # [1, V] f32
            if record_logits:
                all_logits.append(np.asarray(logits[0]))
            token = sample_one(np.asarray(logits[0]), temperature=sp.temperature, top_k=sp.top_k,
                               top_p=sp.top_p, seed=seed, output_index=len(out_ids))
            out_ids.append(token)
            if logprobs is not None:
                chosen, top_ids, top_lp = token_logprobs(logits, jnp.int32([token]), sp.logprobs)
                entry = {int(i): float(lp) for i, lp in zip(top_ids[0], top_lp[0])}
                entry[token] = float(chosen[0])
                logprobs.append(entry)
            if (token in eos and not sp.ignore_eos) or token in stop_ids:
                finish = "stop"
                break
            if len(out_ids) >= sp.max_tokens:
                break
            # The token just sampled runs its own loops now, at the next position.
            i = len(out_ids)
            rule = TokenExit(mode, min_loops=min_loops, max_loops=max_loops, threshold=sp.exit_threshold,
                             trace_depth=trace[i] if trace else None)
            probs: list[float] = []

            def depth_rule(r, hazard, score, signal, rule=rule, probs=probs):
                prob = {"random_lookahead": score, "latent_diff": signal}.get(mode, hazard)
                probs.append(prob)
                return rule.after_loop(r, prob)

            state_pos = len(prompt) + i - 1
            state, kv = self._run_token(kv, stages, token, state_pos, depth_rule, exit_depths, capacity)
            depths.append(int(exit_depths[len(prompt) + i - 1]))
            loop_probs.append(probs)

        out = ReferenceOutput(prompt, out_ids, depths, finish, logprobs, loop_probs)
        out.logits = all_logits if record_logits else None
        if record_prompt:
            out.prompt_states = np.stack([[s for s, _ in rec] for rec in records], axis=1)
            out.prompt_gate_logits = np.array([[g for _, g in rec] for rec in records]).T
        return out

"""The engine with the Pallas kernels (interpret mode on CPU) equals the dense oracle: decode
rows through the decode kernel and their projections through the weight-streaming matmul
kernel, prefill chunks through the prefill kernel, laid out in aligned query blocks with
padding rows between chunks (the layout the GPU runs)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from rltjax.checkpoints.random_init import random_checkpoint
from engine_helpers import assert_all_pages_free, check_equal, run_workload
from rltjax.engine.settings import PREFILL_BLOCK_Q
from rltjax.engine_config import CacheConfig, ExecutionConfig, ExitConfig, SchedulerConfig
from rltjax.entrypoints.llm import build_engine
from rltjax.models.base import get_model
from rltjax.presets import preset_config
from rltjax.reference.generate import ReferenceModel
from rltjax.sampling_params import SamplingParams

# head_dim 64: the smallest the kernels take
SMALL = {"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2, "hidden_size": 128,
         "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64,
         "vocab_size": 256, "max_position_embeddings": 256}


@pytest.fixture(scope="module")
def small_ouro():
    cfg = preset_config("ouro-1.4b", SMALL)
    params = random_checkpoint(cfg, seed=1, dtype="float32")
    # Norm weights other than ones, each its own: the fused residual-norm kernel must apply
    # the right one of the two it takes (the final norm runs in the last layer's kernel).
    rng = np.random.default_rng(2)
    norms = {f: jnp.asarray(rng.uniform(0.5, 1.5, getattr(params.layers, f).shape), jnp.float32)
             for f in ("attn_norm", "attn_post_norm", "mlp_norm", "mlp_post_norm")}
    final_norm = jnp.asarray(rng.uniform(0.5, 1.5, params.norm.shape), jnp.float32)   # the last kernel's
    return cfg, dataclasses.replace(params, norm=final_norm,
                                    layers=dataclasses.replace(params.layers, **norms))


def greedy_pair_matches_oracle(engine, cfg, params, *, seed, prompt_lens):
    """Two greedy requests of these prompt lengths, arriving together, equal the dense oracle."""
    rng = np.random.default_rng(seed)
    arrivals = [(0, f"r{i}", rng.integers(3, cfg.vocab_size, n).tolist(),
                 SamplingParams(max_tokens=4, temperature=0.0, exit_threshold=0.5, ignore_eos=True, logprobs=1))
                for i, n in enumerate(prompt_lens)]
    outputs = run_workload(engine, arrivals)
    ref = ReferenceModel(get_model(cfg), params, kv_layout="last_exited", exit_config=ExitConfig(mode="ouro"))
    for _, rid, prompt, sp in arrivals:
        check_equal(outputs[rid], ref.generate(prompt, sp, request_id=rid))


def test_kernel_engine_matches_reference_with_aligned_prefill(small_ouro):
    cfg, params = small_ouro
    engine = build_engine(
        None, params=params, cfg=cfg,
        cache_config=CacheConfig(kv_layout="last_exited", page_size=8),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=80, prefill_chunk_size=20),
        exit_config=ExitConfig(mode="ouro"),
        execution_config=ExecutionConfig(attn_impl="pallas", matmul_impl="pallas", interpret=True,
                                         compile_ahead=False,
                                         compilation_cache_dir=None, show_progress=False))
    assert engine.settings.prefill_alignment == PREFILL_BLOCK_Q and engine.settings.decode_backend.matmul_impl == "pallas"
    assert engine.settings.prefill_backend.matmul_impl == "xla"        # prefill projections stay on XLA
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (37, 5, 23, 16)]
    arrivals = [(step, f"r{i}", p, SamplingParams(max_tokens=5, temperature=t, seed=i, exit_threshold=0.5,
                                                   ignore_eos=True, logprobs=2))
                for i, (step, p, t) in enumerate(zip((0, 0, 1, 3), prompts, (0.0, 1.0, 0.0, 0.7)))]
    seen = []
    real_prefill = engine.runner.prefill

    def spy(batch):
        seen.append(batch.positions[:np.flatnonzero(batch.lengths)[-1] + 1].copy())   # without the bucket's padding
        return real_prefill(batch)

    engine.runner.prefill = spy
    outputs = run_workload(engine, arrivals)
    ref = ReferenceModel(get_model(cfg), params, kv_layout="last_exited", exit_config=ExitConfig(mode="ouro"))
    for _, rid, prompt, sp in arrivals:
        check_equal(outputs[rid], ref.generate(prompt, sp, request_id=rid))
    assert_all_pages_free(engine)
    # some batch held two chunks with padding between them, each chunk starting aligned
    padded = [pos for pos in seen if np.any(pos < 0) and np.any(pos[np.flatnonzero(pos < 0)[-1] + 1:] >= 0)]
    assert padded, "no prefill batch exercised the alignment padding"
    for pos in seen:
        starts = [i for i in range(len(pos)) if pos[i] >= 0 and (i == 0 or pos[i - 1] != pos[i] - 1)]
        assert all(i % PREFILL_BLOCK_Q == 0 for i in starts)
        assert len(pos) <= 80


def test_auto_matmul_and_set_splits(small_ouro, monkeypatch):
    """matmul_impl "auto" as on a GPU: the decode rows' q|k|v, o and down projections (and only
    those shapes) go through the weight-streaming kernel, the gate | up pair through its fused kernel; attn_num_splits reaches the decode
    attention kernel (per row bucket: max_num_seqs 2 gives one, of 2 rows); the engine still
    equals the oracle."""
    import jax
    from rltjax.kernels import paged_attention_pallas, skinny_matmul as sm
    cfg, params = small_ouro
    shapes, splits, skips = [], [], []
    real, real_gated = sm.skinny_matmul_pallas, sm.gated_up_pallas

    def spy(x, w, layer, skip=None, **k):
        shapes.append(w.shape[1:])
        if skip is not None:        # the head's flag, traced: recorded as each pass runs
            jax.debug.callback(lambda s: skips.append(int(s[0])), skip)
        return real(x, w, layer, skip, **k)

    monkeypatch.setattr(sm, "skinny_matmul_pallas", spy)
    monkeypatch.setattr(sm, "gated_up_pallas", lambda x, w, *a, **k: shapes.append(("gated",) + w.shape[1:])
                        or real_gated(x, w, *a, **k))
    from rltjax.cache.paged_kv import PagedKVBackend
    summed, real_matmul = {}, PagedKVBackend.matmul
    monkeypatch.setattr(PagedKVBackend, "matmul", lambda self, x, w, layer, partial_sums=False: summed.update(
        {w.shape[-2:]: partial_sums}) or real_matmul(self, x, w, layer, partial_sums))
    real_attention = paged_attention_pallas.paged_attention_pallas
    monkeypatch.setattr(paged_attention_pallas, "paged_attention_pallas",
                        lambda *a, **k: splits.append(k["num_splits"]) or real_attention(*a, **k))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")       # the interpret flag still runs them on CPU
    engine = build_engine(
        None, params=params, cfg=cfg, cache_config=CacheConfig(kv_layout="last_exited", page_size=8),
        scheduler_config=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, prefill_chunk_size=32),
        exit_config=ExitConfig(mode="ouro"),
        execution_config=ExecutionConfig(attn_impl="pallas", matmul_impl="auto", attn_num_splits={2: 3, 64: 1},
                                         interpret=True, compile_ahead=False, compilation_cache_dir=None,
                                         show_progress=False))
    greedy_pair_matches_oracle(engine, cfg, params, seed=5, prompt_lens=(11, 6))
    D, qkv = cfg.hidden_size, cfg.q_width + 2 * cfg.kv_width
    # the MLP's gate | up with its activation in one kernel, down (partial sums into the norm)
    F = cfg.intermediate_size
    # and the heads (few rows: on the kernel), which the windows skip on passes where no row exits
    assert set(shapes) == {(D, qkv), (cfg.q_width, D), ("gated", D, F), (F, D), (D, cfg.vocab_size)}
    assert {0, 1} <= set(skips), skips
    # o and down hand their output to the residual-norm kernel, which may take partial sums
    assert summed == {(D, qkv): False, (cfg.q_width, D): True, (F, D): True}
    assert splits and set(splits) == {3}
    assert_all_pages_free(engine)


def test_auto_matmul_stays_on_xla_where_attention_does(small_ouro, monkeypatch):
    """attn_impl "xla" keeps every Pallas kernel out, the projections' too, even on a GPU."""
    import jax
    from rltjax.kernels import skinny_matmul as sm
    cfg, params = small_ouro
    calls = []
    monkeypatch.setattr(sm, "skinny_matmul_pallas", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(sm, "gated_up_pallas", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    engine = build_engine(
        None, params=params, cfg=cfg, cache_config=CacheConfig(kv_layout="last_exited", page_size=8),
        scheduler_config=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, prefill_chunk_size=32),
        exit_config=ExitConfig(mode="ouro"),
        execution_config=ExecutionConfig(attn_impl="xla", matmul_impl="auto", compile_ahead=False,
                                         compilation_cache_dir=None, show_progress=False))
    assert engine.settings.decode_backend.kernel_shapes == ()
    outputs = run_workload(engine, [(0, "r0", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0,
                                                                        ignore_eos=True))])
    assert len(outputs["r0"].token_ids) == 3 and calls == []


@pytest.mark.parametrize("matmul_impl, max_num_seqs, cublas_only", [("auto", 2, True), ("xla", 2, False),
                                                                   ("auto", 128, False)])
def test_gpu_steps_compile_without_triton_gemms_where_decode_runs_on_the_kernels(small_ouro, monkeypatch,
                                                                                 matmul_impl, max_num_seqs, cublas_only):
    """On a GPU the runner's steps carry KERNEL_DECODE_OPTIONS exactly where its decode
    projections run on the kernels (not under matmul_impl xla, nor past the kernels' 64 rows),
    beside the remat pass turned off everywhere. Built only: nothing compiles."""
    import jax
    from rltjax.jit_options import jit_kwargs_of
    cfg, params = small_ouro
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    engine = build_engine(
        None, params=params, cfg=cfg, cache_config=CacheConfig(kv_layout="last_exited", page_size=8, num_pages=64),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=128, prefill_chunk_size=32),
        exit_config=ExitConfig(mode="ouro"),
        execution_config=ExecutionConfig(attn_impl="pallas", matmul_impl=matmul_impl, interpret=True,
                                         compile_ahead=False, compilation_cache_dir=None, show_progress=False))
    for step in engine.runner.steps:
        options = jit_kwargs_of(step)["compiler_options"]
        assert options["xla_disable_hlo_passes"] == "rematerialization"
        assert ("xla_gpu_enable_triton_gemm" in options) == cublas_only
        assert options.get("xla_gpu_enable_triton_gemm", False) is False


def test_speculative_rounds_on_the_kernels_match_reference(small_ouro):
    """Speculative rounds with every Pallas kernel (interpret mode): drafts through the fused
    decode kernels, the verify batch (several rows of one request) through the separate write
    and the decode attention kernel; greedy output equals the oracle at fixed depth."""
    from rltjax.engine_config import SpeculativeConfig
    cfg, params = small_ouro
    engine = build_engine(
        None, params=params, cfg=cfg, cache_config=CacheConfig(kv_layout="last_exited", page_size=8),
        scheduler_config=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, prefill_chunk_size=32),
        exit_config=ExitConfig(mode="fixed"), speculative_config=SpeculativeConfig(2, 2),
        execution_config=ExecutionConfig(attn_impl="pallas", matmul_impl="pallas", interpret=True, decode_window=4,
                                         compile_ahead=False, compilation_cache_dir=None, show_progress=False))
    rng = np.random.default_rng(3)
    arrivals = [(i, f"r{i}", rng.integers(3, cfg.vocab_size, n).tolist(),
                 SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, logprobs=1))
                for i, n in enumerate((9, 14))]
    outputs = run_workload(engine, arrivals)
    ref = ReferenceModel(get_model(cfg), params, kv_layout="last_exited", exit_config=ExitConfig(mode="fixed"))
    for _, rid, prompt, sp in arrivals:
        check_equal(outputs[rid], ref.generate(prompt, sp, request_id=rid))
    assert engine.stats().spec_draft_tokens > 0
    assert_all_pages_free(engine)

"""On the GPU, the engine as it is served equals the dense oracle: decode windows (fixed
trip; and with mixed prefill, prompts in the windows' first passes) over the Pallas Triton
kernels, admissions mid-run (first heads queued with the next window), a request its first
token ends, adaptive exits (K/V written through to deeper planes). float32, matmuls at full
precision (no TF32), compared up to the oracle's near-ties (``near_ties``). Skipped without a
GPU; run it on the device machine whenever the runner, the windows or the KV writes change."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from rltjax.checkpoints.random_init import random_checkpoint
from engine_helpers import assert_all_pages_free, run_workload, wrap_reads
from near_ties import check_equal_before_ties
from rltjax.engine.plan import WindowStep
from rltjax.engine_config import CacheConfig, ExecutionConfig, ExitConfig, SchedulerConfig
from rltjax.entrypoints.llm import build_engine
from rltjax.models.base import get_model
from rltjax.presets import preset_config
from rltjax.reference.generate import ReferenceModel
from rltjax.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

# head_dim 64: the smallest the kernels take
SMALL = {"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2, "hidden_size": 128,
         "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64,
         "vocab_size": 256, "max_position_embeddings": 256}


def gpu_engine(cfg, params, exit_config, *, max_num_seqs=4, **execution):
    """The engine as served (attn_impl auto: the Pallas kernels), float32 weights. A fixed pool
    (not 90% of free memory): the tests' engines share one process, and a pool sized from
    free memory left the fifth too little room for a window's buffers (out of memory)."""
    engine = build_engine(
        None, params=params, cfg=cfg, cache_config=CacheConfig(kv_layout="last_exited", page_size=8, num_pages=4096),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, prefill_chunk_size=32),
        exit_config=exit_config,
        execution_config=ExecutionConfig(compilation_cache_dir=None, show_progress=False, **execution))
    assert engine.settings.prefill_alignment > 1      # attn_impl auto picked the Pallas kernels
    return engine


def check_against_oracle(cfg, params, exit_config, arrivals, outputs):
    """Each output equals the oracle's up to the oracle's first near-tie (``near_ties``: this
    process's autotuned GEMMs round differently from the oracle's); ties must stay rare."""
    ref = ReferenceModel(get_model(cfg), params, kv_layout="last_exited", exit_config=exit_config)
    compared = total = 0
    for _, rid, prompt, sp in arrivals:
        want = ref.generate(prompt, sp, request_id=rid, record_logits=True)
        compared += check_equal_before_ties(outputs[rid], want, sp, exit_mode=exit_config.mode)
        total += len(want.token_ids)
    assert compared >= 0.9 * total, f"only {compared} of {total} tokens compared: near-ties are not rare"


def workload(cfg, n: int, seed: int = 0):
    """n requests: mixed prompt lengths, greedy and sampled, some with top logprobs, arriving
    over the first steps."""
    rng = np.random.default_rng(seed)
    lengths = [37, 5, 23, 16, 9] * (n // 5 + 1)
    arrivals = []
    for i in range(n):
        prompt = rng.integers(3, cfg.vocab_size, lengths[i]).tolist()
        params = SamplingParams(max_tokens=int(rng.integers(1, 13)), temperature=(0.0, 1.0, 0.0, 0.7)[i % 4], seed=i,
                                exit_threshold=0.5, ignore_eos=True, logprobs=2 if i % 2 else None)
        arrivals.append((int(rng.integers(0, 10)), f"r{i}", prompt, params))
    return arrivals


@pytest.mark.parametrize("window_trip, mixed_prefill_tokens", [("fixed", 0), ("early_stop", 0), ("fixed", 64)])
def test_served_engine_matches_reference_on_gpu(window_trip, mixed_prefill_tokens):
    cfg = preset_config("ouro-1.4b", SMALL)
    params = random_checkpoint(cfg, seed=1, dtype="float32")
    exit_config = ExitConfig(mode="ouro_delayed")
    with jax.default_matmul_precision("highest"):
        engine = gpu_engine(cfg, params, exit_config, decode_window=6 if mixed_prefill_tokens else 4,
                            window_trip=window_trip, mixed_prefill_tokens=mixed_prefill_tokens)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (37, 5, 23, 16, 9)]
        lengths, temps, steps = (9, 6, 1, 12, 7), (0.0, 1.0, 0.0, 0.7, 0.0), (0, 0, 2, 5, 9)
        arrivals = [(step, f"r{i}", p, SamplingParams(max_tokens=n, temperature=t, seed=i, exit_threshold=0.5,
                                                       ignore_eos=True, logprobs=2 if i % 2 else None))
                    for i, (step, p, n, t) in enumerate(zip(steps, prompts, lengths, temps))]
        outputs = run_workload(engine, arrivals)
        check_against_oracle(cfg, params, exit_config, arrivals, outputs)
    assert engine.steps_by_kind.get("window", 0) > 0, engine.steps_by_kind
    assert (engine.steps_by_kind.get("mixed_prefill", 0) > 0) == (mixed_prefill_tokens > 0), engine.steps_by_kind
    assert_all_pages_free(engine)


@pytest.mark.parametrize("window_trip", ["fixed", "early_stop"])
def test_standby_entries_match_reference_on_gpu(window_trip):
    """12 admitted requests through 8 window rows: the 4 beyond them wait as standby entries,
    which free rows take on the device (a swap inside a window). Outputs equal the oracle's."""
    cfg = preset_config("ouro-1.4b", SMALL)
    params = random_checkpoint(cfg, seed=2, dtype="float32")
    exit_config = ExitConfig(mode="ouro_delayed")
    arrivals = workload(cfg, 20)
    with jax.default_matmul_precision("highest"):
        engine = gpu_engine(cfg, params, exit_config, max_num_seqs=12, decode_window=4, window_trip=window_trip,
                            decode_window_rows=8)
        swaps = []

        def recording(read, step):
            def recording_read():
                got = read()
                swaps.append(np.asarray(got.out.swap_col)[:len(step.rows)])
                return got
            return recording_read
        wrap_reads(engine, WindowStep, recording)
        outputs = run_workload(engine, arrivals)
        check_against_oracle(cfg, params, exit_config, arrivals, outputs)
    assert any((s > 0).any() for s in swaps), "no row took a standby entry inside a window"
    assert_all_pages_free(engine)


def test_auto_mixed_prefill_matches_reference_on_gpu(monkeypatch):
    """``mixed_prefill_tokens=None`` with mixed windows from 16 rows (32 in the engine): a few
    requests in 8-row windows take standby entries, a burst moves them to 16-row windows whose
    admissions carry prompts. Outputs equal the oracle's."""
    from rltjax.engine import settings as engine_settings
    monkeypatch.setattr(engine_settings, "AUTO_MIXED_PREFILL", ((16, 128),))
    cfg = preset_config("ouro-1.4b", SMALL)
    params = random_checkpoint(cfg, seed=3, dtype="float32")
    exit_config = ExitConfig(mode="ouro_delayed")
    arrivals = [(0 if i < 3 else 12 if i < 6 else 30, rid, prompt, sp)
                for i, (_, rid, prompt, sp) in enumerate(workload(cfg, 24, seed=3))]
    with jax.default_matmul_precision("highest"):
        engine = gpu_engine(cfg, params, exit_config, max_num_seqs=16, decode_window=6, window_trip="fixed",
                            mixed_prefill_tokens=None)
        assert engine.settings.window.mixed_buckets == (16,) and engine.settings.window.standby_for(8)
        calls, put = [], engine.runner.standby_put
        engine.runner.standby_put = lambda *a: calls.append(1) or put(*a)
        outputs = run_workload(engine, arrivals)
        check_against_oracle(cfg, params, exit_config, arrivals, outputs)
    assert calls and engine.steps_by_kind.get("mixed_prefill", 0) > 0, engine.steps_by_kind
    assert_all_pages_free(engine)


@pytest.mark.parametrize("window_trip", ["fixed", "early_stop"])
def test_speculative_rounds_match_reference_on_gpu(window_trip):
    """Self-speculative rounds on the kernels (drafts through the fused decode kernels, the
    verify batch through the write and the decode attention kernel): greedy requests that
    speculate and sampled ones that opt out (plain decoding's keys) equal the oracle at fixed
    depth."""
    import dataclasses

    from rltjax.engine_config import SpeculativeConfig
    cfg = preset_config("ouro-1.4b", SMALL)
    params = random_checkpoint(cfg, seed=4, dtype="float32")
    exit_config = ExitConfig(mode="fixed")
    arrivals = [(step, rid, prompt, dataclasses.replace(sp, num_speculative_tokens=None if sp.temperature == 0 else 0))
                for step, rid, prompt, sp in workload(cfg, 10, seed=4)]
    with jax.default_matmul_precision("highest"):
        engine = build_engine(
            None, params=params, cfg=cfg,
            cache_config=CacheConfig(kv_layout="last_exited", page_size=8, num_pages=4096),
            scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=32),
            exit_config=exit_config, speculative_config=SpeculativeConfig(3, 2),
            execution_config=ExecutionConfig(compilation_cache_dir=None, show_progress=False, decode_window=4,
                                             window_trip=window_trip))
        outputs = run_workload(engine, arrivals)
        check_against_oracle(cfg, params, exit_config, arrivals, outputs)
    assert engine.stats().spec_draft_tokens > 0
    assert_all_pages_free(engine)

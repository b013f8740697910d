"""The decode kernels' backend choice (ExecutionConfig.kernel_backend): "mosaic" routes every
decode projection the Mosaic GPU kernels take (q|k|v, o and down as partial sums, the gate | up
pair, the head with its skip flag) and decode attention with its fused write to them and the rest
to the Triton kernels, with the same results (Mosaic GPU interpret mode on CPU); "mosaic" is
refused on a GPU that is not Hopper, and where no decode kernel runs."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import assert_all_pages_free, run_workload
from rltjax.checkpoints.random_init import random_checkpoint
from rltjax.engine.settings import decode_kernel_backend
from rltjax.engine_config import CacheConfig, EngineConfigError, ExecutionConfig, ExitConfig, SchedulerConfig
from rltjax.entrypoints.llm import build_engine
from rltjax.kernels import paged_attention_mosaic as pam
from rltjax.kernels import skinny_matmul as sm
from rltjax.presets import preset_config
from rltjax.sampling_params import SamplingParams
from test_skinny_mosaic import operands

# 64-multiples throughout: the Mosaic kernels' tiles
SMALL = {"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2, "hidden_size": 128,
         "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64,
         "vocab_size": 256, "max_position_embeddings": 256}


pytestmark = pytest.mark.usefixtures("fresh_mosaic_interpreter")


def f32(a):
    return np.asarray(a, np.float32)


@pytest.fixture
def mosaic_calls(monkeypatch):
    """The Mosaic kernels' calls: (kernel, k_splits) each."""
    calls, real, real_gated = [], sm.skinny_matmul_mosaic, sm.gated_up_mosaic
    monkeypatch.setattr(sm, "skinny_matmul_mosaic",
                        lambda *a, **k: calls.append(("skinny", k["k_splits"])) or real(*a, **k))
    monkeypatch.setattr(sm, "gated_up_mosaic", lambda *a, **k: calls.append(("gated", 1)) or real_gated(*a, **k))
    return calls


@pytest.mark.parametrize("m", [3, 8])
def test_mosaic_backend_forms_equal_the_reference(m, mosaic_calls):
    """Whole products, partial sums, a skipped and a widened head, and the gate | up pair, each
    on the Mosaic kernel (spied) at its config's K splits."""
    x, w = operands(m, 256, 128)
    layer = jnp.int32(1)
    ref = sm.skinny_matmul_ref(x, w, layer)
    run = lambda **kw: sm.skinny_matmul(x, w, layer, impl="pallas", interpret=True, backend="mosaic", **kw)  # noqa
    np.testing.assert_allclose(f32(run()), f32(ref), rtol=1e-2, atol=1e-2)
    parts = run(partial_sums=True)
    splits = sm.mosaic_config(m, 256, 128, partial_sums=True)["k_splits"]
    assert parts.dtype == jnp.float32 and parts.shape == (splits, m, 128) and splits > 1
    np.testing.assert_allclose(f32(parts.sum(0)), f32(ref), rtol=1e-2, atol=1e-2)
    head = sm.skinny_matmul(x, w[1], impl="pallas", interpret=True, backend="mosaic", widen=True,
                            skip=jnp.bool_(False))
    assert head.dtype == jnp.float32
    np.testing.assert_array_equal(f32(head), f32(head.astype(jnp.bfloat16)))      # rounded to bf16 first
    np.testing.assert_allclose(f32(head), f32(ref), rtol=1e-2, atol=1e-2)
    skipped = sm.skinny_matmul(x, w[1], impl="pallas", interpret=True, backend="mosaic", widen=True,
                               skip=jnp.bool_(True))
    assert skipped.dtype == jnp.float32 and not np.asarray(skipped).any()
    wg, wu = operands(m, 256, 128, seed=1)[1], operands(m, 256, 128, seed=2)[1]
    gated = sm.gated_up(x, wg, wu, layer, impl="pallas", interpret=True, backend="mosaic")
    np.testing.assert_allclose(f32(gated), f32(sm.gated_up_ref(x, wg, wu, layer)), rtol=2e-2, atol=2e-2)
    assert mosaic_calls == [("skinny", 1), ("skinny", splits), ("skinny", 1), ("skinny", 1), ("gated", 1)]


def test_mosaic_whole_product_past_one_pass_is_split_and_summed(mosaic_calls):
    """K > SINGLE_PASS_MAX_K: K splits (at most MAX_PARTIAL_SUMS) that XLA adds up, for a
    projection and for each half of the gate | up pair."""
    k = sm.SINGLE_PASS_MAX_K + 256       # 18 steps of 128: split in 6
    x, w = operands(2, k, 64, layers=1)
    out = sm.skinny_matmul(x, w, jnp.int32(0), impl="pallas", interpret=True, backend="mosaic")
    assert out.shape == (2, 64) and out.dtype == jnp.bfloat16
    np.testing.assert_allclose(f32(out), f32(sm.skinny_matmul_ref(x, w, 0)), rtol=1e-2, atol=1e-2)
    (kind, splits), = mosaic_calls
    assert kind == "skinny" and 1 < splits <= sm.MAX_PARTIAL_SUMS
    # the gate | up pair past one pass: each product split on the Mosaic kernel, the activation after
    wu = operands(2, k, 64, layers=1, seed=3)[1]
    gated = sm.gated_up(x, w, wu, jnp.int32(0), impl="pallas", interpret=True, backend="mosaic")
    np.testing.assert_allclose(f32(gated), f32(sm.gated_up_ref(x, w, wu, 0)), rtol=2e-2, atol=2e-2)
    assert mosaic_calls[1:] == [("skinny", splits)] * 2


def test_named_tiles_stay_on_triton(mosaic_calls):
    """Tiles named by the caller are the Triton kernel's: the Mosaic kernel does not run."""
    x, w = operands(4, 256, 128)
    out = sm.skinny_matmul(x, w, jnp.int32(0), impl="pallas", interpret=True, backend="mosaic", block_n=32)
    np.testing.assert_allclose(f32(out), f32(sm.skinny_matmul_ref(x, w, 0)), rtol=1e-2, atol=1e-2)
    assert mosaic_calls == []


def test_operands_mosaic_does_not_take_run_on_triton(monkeypatch):
    """float32 weights and a 96-wide N are not the Mosaic kernel's: the Triton kernel runs them."""
    calls = []
    monkeypatch.setattr(sm, "skinny_matmul_mosaic", lambda *a, **k: calls.append("mosaic"))
    for dtype, n in ((jnp.float32, 128), (jnp.bfloat16, 96)):
        x, w = operands(4, 128, n, dtype=dtype)
        out = sm.skinny_matmul(x, w, jnp.int32(0), impl="pallas", interpret=True, backend="mosaic")
        np.testing.assert_allclose(f32(out), f32(sm.skinny_matmul_ref(x, w, 0)), rtol=1e-2, atol=1e-2)
    assert calls == []
    with pytest.raises(ValueError, match="backend"):
        sm.skinny_matmul(x, w, jnp.int32(0), impl="pallas", backend="cuda")


def test_backend_resolution_and_errors(monkeypatch):
    from types import SimpleNamespace
    assert decode_kernel_backend("mosaic", "cpu") == "mosaic"      # interpret mode
    assert decode_kernel_backend("triton", "gpu") == "triton"
    monkeypatch.setattr(jax, "devices", lambda *a: [SimpleNamespace(compute_capability="9.0")])
    assert decode_kernel_backend("mosaic", "gpu") == "mosaic"
    monkeypatch.setattr(jax, "devices", lambda *a: [SimpleNamespace(compute_capability="8.0")])
    with pytest.raises(EngineConfigError, match=r"Hopper .*this one is 8\.0.*'triton'"):
        decode_kernel_backend("mosaic", "gpu")
    with pytest.raises(EngineConfigError, match="kernel_backend"):
        ExecutionConfig(kernel_backend="auto")


@pytest.mark.parametrize("execution, tp, match", [
    (dict(attn_impl="xla", matmul_impl="xla"), 1, "attn_impl='xla' .* matmul_impl='xla'"),
    (dict(attn_impl="xla", matmul_impl="auto"), 1, "matmul_impl='auto' the projections"),  # auto follows attention
    (dict(attn_impl="xla", matmul_impl="auto"), 2, "tensor_parallel_size=2 the projections"),
    (dict(attn_impl="xla", matmul_impl="pallas"), 1, None),    # the projections on Mosaic GPU
    (dict(attn_impl="auto", matmul_impl="xla"), 1, None),      # decode attention on Mosaic GPU
    (dict(attn_impl="pallas", matmul_impl="auto"), 2, None)])  # attention per device
def test_mosaic_where_no_decode_kernel_runs_is_refused(execution, tp, match):
    from rltjax.engine.rules import RuleInputs, check_rules
    from rltjax.engine_config import CacheConfig as Cache
    inputs = RuleInputs(cache=Cache(), scheduler=SchedulerConfig(), exit=ExitConfig(),
                        execution=ExecutionConfig(kernel_backend="mosaic", **execution), arch="ouro", num_loops=4,
                        loop_limit=4, signal_kind="gate", has_boundary=False, window_passes=8, fixed_trip=True,
                        tensor_parallel=tp)
    if match is None:
        check_rules(inputs)
    else:
        with pytest.raises(EngineConfigError, match=match):
            check_rules(inputs)
    check_rules(dataclasses.replace(inputs, execution=ExecutionConfig(kernel_backend="triton", **execution)))


def greedy_outputs(params, cfg, backend):
    engine = build_engine(
        None, params=params, cfg=cfg, cache_config=CacheConfig(kv_layout="last_exited", page_size=8),
        scheduler_config=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, prefill_chunk_size=32),
        exit_config=ExitConfig(mode="ouro"),
        execution_config=ExecutionConfig(attn_impl="pallas", matmul_impl="pallas", kernel_backend=backend,
                                         interpret=True, compile_ahead=False, compilation_cache_dir=None,
                                         show_progress=False))
    rng = np.random.default_rng(5)
    arrivals = [(0, f"r{i}", rng.integers(3, cfg.vocab_size, n).tolist(),
                 SamplingParams(max_tokens=3, temperature=0.0, exit_threshold=0.5, ignore_eos=True, logprobs=1))
                for i, n in enumerate((11, 6))]
    outputs = run_workload(engine, arrivals)
    assert_all_pages_free(engine)
    return outputs


def test_engine_on_mosaic_kernels_equals_triton_kernels(monkeypatch):
    """A bf16 engine whose every decode projection and decode attention (with its fused write)
    runs on the Mosaic kernels (spied: the shapes each kernel saw) makes the Triton-kernel
    engine's tokens and exit depths, logprobs within bf16 rounding (the two sum in different
    orders)."""
    cfg = preset_config("ouro-1.4b", SMALL)
    params = random_checkpoint(cfg, seed=1, dtype="bfloat16")
    seen, real, real_gated = set(), sm.skinny_matmul_mosaic, sm.gated_up_mosaic
    real_attn = pam.paged_attention_mosaic
    monkeypatch.setattr(pam, "paged_attention_mosaic",
                        lambda *a, **k: seen.add(("attention", k.get("new_kv") is not None)) or real_attn(*a, **k))
    monkeypatch.setattr(sm, "skinny_matmul_mosaic", lambda x, w, *a, **k: seen.add(w.shape[-2:]) or real(x, w, *a, **k))
    monkeypatch.setattr(sm, "gated_up_mosaic",
                        lambda x, w, *a, **k: seen.add(("gated",) + w.shape[-2:]) or real_gated(x, w, *a, **k))
    mosaic = greedy_outputs(params, cfg, "mosaic")
    D, F = cfg.hidden_size, cfg.intermediate_size
    assert seen == {(D, cfg.q_width + 2 * cfg.kv_width), (cfg.q_width, D), ("gated", D, F), (F, D),
                    (D, cfg.vocab_size), ("attention", True)}
    triton = greedy_outputs(params, cfg, "triton")
    for rid, out in triton.items():
        got = mosaic[rid]
        assert got.token_ids == out.token_ids and got.exit_depths == out.exit_depths, rid
        np.testing.assert_allclose([lp[t] for lp, t in zip(got.logprobs, got.token_ids)],
                                   [lp[t] for lp, t in zip(out.logprobs, out.token_ids)], atol=5e-2)


def test_cli_flag_reaches_the_config():
    import argparse
    from rltjax.entrypoints.engine_args import add_engine_arguments, configs_from_args
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert configs_from_args(p.parse_args([]))["execution_config"].kernel_backend == "triton"
    flags = p.parse_args(["--kernel-backend", "mosaic"])
    assert configs_from_args(flags)["execution_config"].kernel_backend == "mosaic"


@pytest.mark.parametrize("execution, want", [
    (dict(attn_impl="pallas", matmul_impl="auto", kernel_backend="mosaic"), "mosaic"),
    (dict(attn_impl="pallas", matmul_impl="auto"), "triton"),
    (dict(attn_impl="pallas", matmul_impl="xla"), "xla"),
    (dict(attn_impl="xla", matmul_impl="pallas"), "mixed")])
def test_benchmarks_record_what_the_projections_ran_on(execution, want, monkeypatch):
    """benchmarks.startup.projection_kernels reads the resolved settings: the backend where every
    decode projection runs on the kernels (Ouro's shapes, attention on the kernels), "xla" where
    none does, "mixed" where matmul_impl pallas runs them at shapes "auto" would not."""
    from benchmarks.startup import projection_kernels
    from rltjax.engine.settings import resolve_settings
    from rltjax.models.base import get_model
    from types import SimpleNamespace
    monkeypatch.setattr(jax, "devices", lambda *a: [SimpleNamespace(compute_capability="9.0")])    # a Hopper GPU
    cfg = preset_config("ouro-1.4b", SMALL)
    settings = resolve_settings(get_model(cfg), cache=CacheConfig(), scheduler=SchedulerConfig(max_num_seqs=8),
                                exit_config=ExitConfig(), execution=ExecutionConfig(interpret=True, **execution),
                                max_model_len=64, kv_dtype="bfloat16", platform="gpu")
    assert projection_kernels(settings) == want
    assert settings.prefill_backend.kernel_backend == "triton"      # prefill never compiles per choice


@pytest.mark.parametrize("execution, kv_dtype, want", [
    (dict(attn_impl="xla", matmul_impl="pallas", kernel_backend="mosaic"), "bfloat16", "xla"),
    (dict(attn_impl="pallas", kernel_backend="mosaic"), "bfloat16", "mosaic"),
    (dict(attn_impl="pallas", kernel_backend="mosaic"), "float32", "triton"),
    (dict(attn_impl="pallas"), "bfloat16", "triton")])
def test_settings_record_what_decode_attention_runs_on(execution, kv_dtype, want, monkeypatch):
    """EngineSettings.attention_kernel (what benchmarks record as attention_kernels): XLA where
    attention is off the kernels, else the kernel the dispatcher picks at Ouro-1.4B's shapes
    (Mosaic GPU takes 16-bit KV only)."""
    from rltjax.engine.settings import resolve_settings
    from rltjax.models.base import get_model
    from types import SimpleNamespace
    monkeypatch.setattr(jax, "devices", lambda *a: [SimpleNamespace(compute_capability="9.0")])    # a Hopper GPU
    settings = resolve_settings(get_model(preset_config("ouro-1.4b")), cache=CacheConfig(),
                                scheduler=SchedulerConfig(max_num_seqs=8), exit_config=ExitConfig(),
                                execution=ExecutionConfig(interpret=True, **execution), max_model_len=64,
                                kv_dtype=kv_dtype, platform="gpu")
    assert settings.attention_kernel == want

"""The Mosaic GPU weight-streaming projection kernel and its gate | up pair: in Mosaic GPU interpret
mode on CPU against a float64 numpy product (row counts that are and are not multiples of 8, K
splits, the skip flag, widen's float32 output) and ``gated_up_ref``; their shape checks and default
tiles; lowered for an H100-class GPU (sm_90: wgmma, TMA) at Ouro-1.4B's shapes without a GPU; and,
on a GPU, compiled against XLA's dot and the Triton kernels."""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from rltjax.kernels.skinny_matmul import gated_up, gated_up_ref, skinny_matmul, skinny_matmul_ref
from rltjax.kernels.skinny_common import MAX_PARTIAL_SUMS
from rltjax.kernels.skinny_matmul_pallas import choose_splits
from rltjax.kernels.skinny_matmul_mosaic import (MIN_BLOCKS, SMEM_LIMIT, gated_mosaic_config, gated_mosaic_unsupported,
                                                 gated_up_mosaic, mosaic_config, mosaic_unsupported, smem_bytes,
                                                 skinny_matmul_mosaic)

TOL = 8e-3          # bf16 output vs float64: float32 accumulation, one rounding (tests/test_skinny_matmul.py)
STEP = 2.0 ** -7    # a bf16 step: gate | up vs gated_up_ref within two (tests/test_mlp_kernels.py)
sd = jax.ShapeDtypeStruct


pytestmark = pytest.mark.usefixtures("fresh_mosaic_interpreter")


def rel_err(out, x, w):
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    return np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)


def operands(m, k=256, n=128, layers=2, dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((layers, k, n)) / np.sqrt(k), dtype)
    return x, w


@pytest.mark.parametrize("m, splits, depth", [(1, 1, 4), (3, 1, 2), (8, 2, 3), (16, 1, 4), (16, 4, 2), (64, 1, 3)])
def test_interpret_matches_float64_product(m, splits, depth):
    """Layer 1 of 2 (a traced index); splits > 1: float32 partial sums [S, M, N]."""
    x, w = operands(m)
    fn = jax.jit(lambda x, w, layer: skinny_matmul_mosaic(x, w, layer, block_n=64, block_k=64, k_splits=splits,
                                                         max_concurrent_steps=depth, interpret=True))
    out = fn(x, w, jnp.int32(1))
    if splits == 1:
        assert out.shape == (m, 128) and out.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(skinny_matmul_ref(x, w, 1), np.float32),
                                   rtol=1e-2, atol=1e-2)
    else:
        assert out.shape == (splits, m, 128) and out.dtype == jnp.float32
        out = out.sum(axis=0)
    assert rel_err(out, x, w[1]) < TOL


def test_interpret_float16_plain_weight_and_no_races():
    """A [K, N] weight (no layer axis), float16, 128-wide tiles; the interpreter's race detector
    (TMA copies against SMEM reads) finds nothing."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    x, w = operands(8, k=512, n=256, dtype=jnp.float16, seed=3)
    out = skinny_matmul_mosaic(x, w[0], None, block_n=128, block_k=128, max_concurrent_steps=3,
                               interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert out.dtype == jnp.float16 and rel_err(out, x, w[0]) < TOL
    assert not gpu_callbacks.get_races().races_found


def test_skip_writes_zeros_without_reading_the_weight():
    x, w = operands(4, seed=5)
    fn = jax.jit(lambda x, w, skip: skinny_matmul_mosaic(x, w, 1, skip, block_n=64, block_k=64, interpret=True))
    assert rel_err(fn(x, w, jnp.bool_(False)), x, w[1]) < TOL
    out = fn(x, w.at[1, 5, 7].set(jnp.nan), jnp.bool_(True))
    assert out.shape == (4, 128)
    np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)


def test_widen_stores_the_rounded_product_as_float32():
    """widen: the bf16 product, exactly, in a float32 output; skipped, float32 zeros."""
    x, w = operands(5, seed=7)
    fn = jax.jit(lambda x, w, skip, widen: skinny_matmul_mosaic(x, w, 1, skip, block_n=64, block_k=64, widen=widen,
                                                                interpret=True), static_argnums=3)
    out = fn(x, w, jnp.bool_(False), True)
    assert out.shape == (5, 128) and out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(fn(x, w, jnp.bool_(False), False).astype(jnp.float32)))
    zeros = fn(x, w.at[1, 5, 7].set(jnp.nan), jnp.bool_(True), True)
    assert zeros.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(zeros), 0.0)
    with pytest.raises(ValueError, match="widen is for whole products"):
        skinny_matmul_mosaic(x, w, 1, block_n=64, block_k=64, k_splits=2, widen=True, interpret=True)


def gated_operands(m, k=256, f=128, layers=2, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    wg, wu = (jnp.asarray(rng.standard_normal((layers, k, f)) / np.sqrt(k), jnp.bfloat16) for _ in range(2))
    return x, wg, wu


def assert_gated_close(out, ref):
    """The Triton gated kernel's bound (tests/test_mlp_kernels.py): within two bf16 steps."""
    ref = np.asarray(ref, np.float32)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=2 * STEP, atol=2 * STEP * np.abs(ref).max())


@pytest.mark.parametrize("m, block_k, depth", [(1, 128, 4), (8, 64, 3), (16, 128, 2)])
def test_gated_interpret_matches_reference(m, block_k, depth):
    """Layer 1 of 2 (traced), two or four K steps: silu(gate) * up rounded as gated_up_ref."""
    x, wg, wu = gated_operands(m, seed=m)
    fn = jax.jit(lambda x, g, u, layer: gated_up_mosaic(x, g, u, layer, block_n=64, block_k=block_k,
                                                        max_concurrent_steps=depth, interpret=True))
    out = fn(x, wg, wu, jnp.int32(1))
    assert out.shape == (m, 128) and out.dtype == jnp.bfloat16
    assert_gated_close(out, gated_up_ref(x, wg, wu, 1))


def test_gated_plain_weights_and_no_races():
    """[K, F] weights (no layer axis); the race detector finds no TMA copy against an SMEM read (it
    runs wgmma synchronously: the wait's group count is checked in the lowered module below)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    x, wg, wu = gated_operands(8, k=512, seed=4)
    out = gated_up_mosaic(x, wg[0], wu[0], None, block_n=64, block_k=64, max_concurrent_steps=3,
                          interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert_gated_close(out, gated_up_ref(x, wg[0], wu[0]))
    assert not gpu_callbacks.get_races().races_found


@pytest.mark.parametrize("x, w, kw, match", [
    (sd((65, 256), jnp.bfloat16), sd((256, 128), jnp.bfloat16), {}, "65 rows"),
    (sd((8, 256), jnp.float32), sd((256, 128), jnp.float32), {}, "bfloat16 or float16"),
    (sd((8, 256), jnp.bfloat16), sd((256, 128), jnp.float16), {}, "share a dtype"),
    (sd((8, 256), jnp.bfloat16), sd((256, 128), jnp.bfloat16), dict(block_n=32), "multiples of 64"),
    (sd((8, 256), jnp.bfloat16), sd((256, 96), jnp.bfloat16), {}, "N=96"),
    (sd((8, 192), jnp.bfloat16), sd((192, 128), jnp.bfloat16), dict(k_splits=2), "K=192"),
    (sd((64, 2048), jnp.bfloat16), sd((2048, 6144), jnp.bfloat16), dict(block_k=256, max_concurrent_steps=4),
     "shared memory"),
])
def test_unsupported_shapes_are_named(x, w, kw, match):
    assert match in mosaic_unsupported(x, w, **kw)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(functools.partial(skinny_matmul_mosaic, **{**dict(block_n=64, block_k=64), **kw}), x, w, 0)


def test_default_config():
    # Ouro-1.4B's q|k|v at 8 rows: one pass, 64 x 128 tiles (96 blocks), 6 slots
    assert mosaic_config(8, 2048, 6144) == dict(block_n=64, block_k=128, k_splits=1, max_concurrent_steps=6)
    # down (K = 5632, 44 steps): 4 splits -> 128 blocks; partial sums of o likewise
    assert mosaic_config(8, 5632, 2048)["k_splits"] == 4 and mosaic_config(8, 2048, 2048, True)["k_splits"] == 4
    for m in (1, 8, 16, 32, 64):
        for k, n in ((2048, 6144), (2048, 2048), (5632, 2048), (2048, 49152)):
            cfg = mosaic_config(m, k, n)
            assert mosaic_unsupported(sd((m, k), jnp.bfloat16), sd((k, n), jnp.bfloat16), **cfg) is None
            assert smem_bytes(m, cfg["block_n"], cfg["block_k"], cfg["max_concurrent_steps"]) <= SMEM_LIMIT
    # a narrow product over a long K would want 128 splits (one a 128-deep step) for MIN_BLOCKS blocks: capped at
    # MAX_PARTIAL_SUMS, a divisor of its K steps (the consumer holds every partial sum)
    assert choose_splits(16384, 64, 64, 128, MIN_BLOCKS) == 128 and MAX_PARTIAL_SUMS == 8
    assert mosaic_config(8, 16384, 64)["k_splits"] == 8
    assert mosaic_config(8, 4608, 64, True)["k_splits"] == 6       # 36 steps: 8 does not divide them, 6 does


@pytest.mark.parametrize("kw, match", [
    (dict(block_n=256), "256 registers"),                    # two 256 x 64 accumulators
    (dict(block_k=256, max_concurrent_steps=3), "shared memory"),
    (dict(block_n=96), "multiples of 64"),
])
def test_gated_unsupported_is_named(kw, match):
    x, w = sd((64, 2048), jnp.bfloat16), sd((24, 2048, 5632), jnp.bfloat16)
    kw = {**dict(block_n=64, block_k=128), **kw}
    assert match in gated_mosaic_unsupported(x, w, **kw)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(functools.partial(gated_up_mosaic, **kw), x, w, w, 0)
    with pytest.raises(ValueError, match="share a shape"):
        jax.eval_shape(functools.partial(gated_up_mosaic, block_n=64, block_k=128), x, w,
                       sd((24, 2048, 128), jnp.bfloat16), 0)


def test_gated_default_config():
    """Two weight tiles a slot: Ouro's pair gets 5 slots up to 16 rows, 4 at 32-64 (48 KB each)."""
    assert [gated_mosaic_config(m, 2048, 5632)["max_concurrent_steps"] for m in (1, 8, 16, 32, 64)] == [5, 5, 5, 4, 4]
    for m in (1, 8, 16, 32, 64):
        cfg = gated_mosaic_config(m, 2048, 5632)
        assert cfg["block_n"] == 64 and cfg["block_k"] == 128
        assert gated_mosaic_unsupported(sd((m, 2048), jnp.bfloat16), sd((2048, 5632), jnp.bfloat16), **cfg) is None
        assert smem_bytes(m, 64, 128, cfg["max_concurrent_steps"], weights=2) <= SMEM_LIMIT


@pytest.fixture
def lower_to_mosaic(monkeypatch):
    """``lower(fn, *shape_dtype_structs)`` -> (HLO text, the Mosaic GPU module's text) of the
    (last) kernel in ``jax.jit(fn)``, lowered for CUDA on any host. Without a GPU Mosaic GPU
    targets compute capability 9.0 (``mosaic_gpu.utils._infer_arch``), what an H100 / H200
    reports; the module's checks (layout inference, wgmma operand layouts, TMA tiling, shared
    memory against 227 KB) run here, PTX assembly does not."""
    from jax._src.pallas.mosaic_gpu import pallas_call_registration as reg
    seen = []
    orig = reg.lowering.lower_unpipelined_jaxpr_to_module

    def spy(*a, **k):
        res = orig(*a, **k)
        seen.append(str(res.module.operation))
        return res
    monkeypatch.setattr(reg.lowering, "lower_unpipelined_jaxpr_to_module", spy)

    def lower(fn, *args):
        hlo = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        return hlo, seen[-1]
    return lower


@pytest.mark.parametrize("m, k, n, partial_sums, skip", [
    (8, 2048, 6144, False, False),      # q|k|v
    (8, 5632, 2048, True, False),       # down, split-K partial sums
    (64, 2048, 6144, False, False),
    (64, 5632, 2048, True, False),
    (1, 2048, 2048, False, False),      # o, one row
    (8, 2048, 49152, False, True),      # the head, skippable
])
def test_lowers_for_hopper_at_ouro_shapes(lower_to_mosaic, m, k, n, partial_sums, skip):
    cfg = mosaic_config(m, k, n, partial_sums)
    args = [sd((m, k), jnp.bfloat16), sd((24, k, n), jnp.bfloat16), sd((), jnp.int32)] + ([sd((), jnp.bool_)] * skip)
    hlo, module = lower_to_mosaic(functools.partial(skinny_matmul_mosaic, **cfg), *args)
    assert "mosaic_gpu.arch_major = 9 : i32" in module and "mosaic_gpu.arch_minor = 0 : i32" in module
    n_rows = max(8, m)
    assert f"wgmma.mma_async.sync.aligned.m64n{n_rows}k16.f32.bf16.bf16" in module     # rows are wgmma's N
    assert "cp.async.bulk.tensor.shared.cluster.global" in module                        # TMA loads
    assert re.search(r"cp\.async\.bulk\.(tensor\.)?global\.shared", module)           # TMA store (1 row: plain bulk)
    # the layer's weight is indexed in the kernel: XLA neither slices nor pads anything
    for op in ("stablehlo.dynamic_slice", "stablehlo.slice", "stablehlo.pad", "stablehlo.gather"):
        assert op not in hlo
    want = (cfg["k_splits"], m, n) if cfg["k_splits"] > 1 else (m, n)
    assert jax.eval_shape(functools.partial(skinny_matmul_mosaic, **cfg), *args).shape == want


@pytest.mark.parametrize("m", [8, 64])
def test_gated_lowers_for_hopper_at_ouro_shapes(lower_to_mosaic, m):
    """Ouro-1.4B's gate | up pair: two wgmmas a step, three TMA streams, one bf16 store."""
    bf = jnp.bfloat16
    args = sd((m, 2048), bf), sd((24, 2048, 5632), bf), sd((24, 2048, 5632), bf), sd((), jnp.int32)
    fn = functools.partial(gated_up_mosaic, **gated_mosaic_config(m, 2048, 5632))
    hlo, module = lower_to_mosaic(fn, *args)
    assert "mosaic_gpu.arch_major = 9 : i32" in module
    assert f"wgmma.mma_async.sync.aligned.m64n{m}k16.f32.bf16.bf16" in module
    # a step's two wgmmas are two groups: the wait leaves those in flight, the step before's done
    assert module.count("wgmma.commit_group.sync.aligned") == 2 and "wgmma.wait_group.sync.aligned 2;" in module
    assert "cp.async.bulk.tensor.shared.cluster.global" in module
    assert re.search(r"cp\.async\.bulk\.(tensor\.)?global\.shared", module)
    for op in ("stablehlo.dynamic_slice", "stablehlo.slice", "stablehlo.pad", "stablehlo.gather"):
        assert op not in hlo
    out = jax.eval_shape(fn, *args)
    assert out.shape == (m, 5632) and out.dtype == bf


def test_widen_skip_lowers_for_hopper_at_the_head(lower_to_mosaic):
    """The decode head: [8, 2048] @ [1, 2048, 49152], skippable, float32 logits from the kernel."""
    fn = functools.partial(skinny_matmul_mosaic, widen=True, **mosaic_config(8, 2048, 49152))
    args = sd((8, 2048), jnp.bfloat16), sd((1, 2048, 49152), jnp.bfloat16), sd((), jnp.int32), sd((), jnp.bool_)
    hlo, module = lower_to_mosaic(fn, *args)
    assert "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16" in module
    # the kernel's own output is float32, and no conversion follows it
    assert re.search(r"stablehlo\.custom_call @mosaic_gpu.*-> tensor<8x49152xf32>", hlo)
    assert "stablehlo.convert" not in hlo.split("stablehlo.custom_call")[-1]
    out = jax.eval_shape(fn, *args)
    assert out.shape == (8, 49152) and out.dtype == jnp.float32


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 32, 64])
@pytest.mark.parametrize("k, n, partial_sums", [(2048, 2048, False), (2048, 6144, False), (2048, 5632, False),
                                                (5632, 2048, True), (2048, 49152, False)])
def test_compiled_kernel_on_gpu(m, k, n, partial_sums):
    """Against float64, XLA's dot and the Triton kernel, layer 2 of 3."""
    rng = np.random.default_rng(m + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, k, n)) / np.sqrt(k), jnp.bfloat16)
    cfg = mosaic_config(m, k, n, partial_sums)
    out = jax.jit(lambda x, w, layer: skinny_matmul_mosaic(x, w, layer, **cfg))(x, w, jnp.int32(2))
    if cfg["k_splits"] > 1:
        out = out.sum(axis=0).astype(x.dtype)
    assert out.shape == (m, n) and rel_err(out, x, w[2]) < TOL
    for other in (skinny_matmul_ref(x, w, 2), jax.jit(lambda x, w: skinny_matmul(x, w, 2, impl="pallas"))(x, w)):
        diff = np.linalg.norm(np.asarray(out, np.float64) - np.asarray(other, np.float64))
        assert diff / np.linalg.norm(np.asarray(other, np.float64)) < TOL


@pytest.mark.gpu
def test_compiled_skip_on_gpu():
    x, w = operands(8, k=2048, n=49152, layers=1, seed=9)
    fn = jax.jit(lambda x, w, skip: skinny_matmul_mosaic(x, w, 0, skip, **mosaic_config(8, 2048, 49152)))
    assert rel_err(fn(x, w, jnp.bool_(False)), x, w[0]) < TOL
    np.testing.assert_array_equal(np.asarray(fn(x, w, jnp.bool_(True)), np.float32), 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 32, 64])
def test_compiled_gated_on_gpu(m):
    """Ouro's gate | up at its config, layer 1 of 2: against gated_up_ref and the Triton kernel."""
    x, wg, wu = gated_operands(m, k=2048, f=5632, seed=m)
    out = jax.jit(lambda *a: gated_up_mosaic(*a, **gated_mosaic_config(m, 2048, 5632)))(x, wg, wu, jnp.int32(1))
    assert out.shape == (m, 5632) and out.dtype == jnp.bfloat16
    assert_gated_close(out, gated_up_ref(x, wg, wu, 1))
    assert_gated_close(out, jax.jit(lambda *a: gated_up(*a, 1, impl="pallas"))(x, wg, wu))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
def test_compiled_widen_on_gpu(m):
    """The head's logits: the bf16 product exactly, as float32; near XLA's; skipped, zeros."""
    x, w = operands(m, k=2048, n=49152, layers=1, seed=11)
    cfg = mosaic_config(m, 2048, 49152)
    fn = jax.jit(lambda x, w, skip, widen: skinny_matmul_mosaic(x, w, 0, skip, widen=widen, **cfg), static_argnums=3)
    out = fn(x, w, jnp.bool_(False), True)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(fn(x, w, jnp.bool_(False), False).astype(jnp.float32)))
    ref = np.asarray(skinny_matmul_ref(x, w, 0), np.float64)
    assert np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref) < TOL
    np.testing.assert_array_equal(np.asarray(fn(x, w, jnp.bool_(True), True)), 0.0)

"""The weight-streaming projection kernel (interpret mode on CPU) against a float64 numpy
product: row counts 1..64, stacked and plain weights, block sizes and K splits; the entry
point's validation; the engine backend's choice of path; the kernel lowered to Triton
without a GPU (rows below the 16-row dot tile replicated in registers, no padding copy,
one split writing the output dtype); and, on a GPU, the compiled kernel at Ouro-1.4B's
shapes."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from rltjax.kernels.skinny_matmul_pallas import choose_splits, skinny_matmul_pallas
from rltjax.kernels.skinny_matmul import MAX_ROWS, fit_block, kernel_config, skinny_matmul, skinny_matmul_ref

# relative Frobenius error vs float64: float32 accumulation, then rounding to the output dtype
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 8e-3}


def rel_err(out, x, w):
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    return np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, MAX_ROWS), k_blocks=st.integers(1, 6), n_blocks=st.integers(1, 4),
       block_k=st.sampled_from([16, 32, 64]), block_n=st.sampled_from([16, 32]),
       num_layers=st.sampled_from([0, 3]), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
       split_index=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_kernel_matches_float64_product(m, k_blocks, n_blocks, block_k, block_n, num_layers, dtype,
                                        split_index, seed):
    rng = np.random.default_rng(seed)
    k, n = k_blocks * block_k, n_blocks * block_n
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w_shape = (num_layers, k, n) if num_layers else (k, n)
    w = jnp.asarray(rng.standard_normal(w_shape) / np.sqrt(k), dtype)
    layer = int(rng.integers(num_layers)) if num_layers else None
    divisors = [s for s in range(1, k_blocks + 1) if k_blocks % s == 0]
    splits = divisors[split_index % len(divisors)]
    out = skinny_matmul(x, w, layer, impl="pallas", interpret=True, block_n=block_n, block_k=block_k,
                        k_splits=splits)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, x, w[layer] if num_layers else w) < TOL[dtype]


def test_default_blocks_fit_any_multiple_of_16():
    assert fit_block(5632, 256) == 256 and fit_block(2048, 128) == 128 and fit_block(96, 128) == 32
    assert fit_block(48, 256) == 16 and fit_block(40, 256) is None
    # splits: the smallest divisor of K / block_k giving >= MIN_PROGRAMS (256) programs; at 64 x 128
    # blocks Ouro-1.4B's down (5632 x 2048): 11 (8 does not divide 44)
    assert choose_splits(5632, 2048, 64, 128) == 11 and choose_splits(2048, 49152, 64, 128) == 1
    assert choose_splits(256, 64, 64, 128) == 2          # fewer K blocks than it wants: one step each
    # K <= 2048: one pass, narrow tiles (16 columns: 128 programs at N = 2048); longer K is split
    assert kernel_config(8, 2048, 2048) == dict(block_n=16, block_k=256, k_splits=1, num_warps=2, num_stages=5)
    assert kernel_config(1, 2048, 6144)["block_n"] == 32 and kernel_config(1, 2048, 6144)["k_splits"] == 1
    # down (K > 2048): 4 splits of 32 x 128 blocks, 2 warps, 4 stages at every bucket
    assert kernel_config(8, 5632, 2048) == dict(block_n=32, block_k=128, k_splits=4, num_warps=2, num_stages=4)
    assert kernel_config(64, 5632, 2048)["num_stages"] == 4
    assert kernel_config(64, 5632, 2048, itemsize=4)["num_stages"] == 4   # 48 KB a stage
    # from 32 rows wider tiles, with the stages that fit shared memory (64 x 256 at 64 rows: 3)
    assert kernel_config(32, 2048, 6144) == dict(block_n=64, block_k=256, k_splits=1, num_warps=4, num_stages=4)
    assert kernel_config(64, 2048, 6144)["num_stages"] == 3 and kernel_config(64, 2048, 2048)["num_stages"] == 4
    # a head (N >= WIDE_N) up to 16 rows: 64 x 128 tiles, 4 warps, 3 stages; from 32 rows the general rule
    assert kernel_config(8, 2048, 49152) == dict(block_n=64, block_k=128, k_splits=1, num_warps=4, num_stages=3)
    assert kernel_config(32, 2048, 49152) == kernel_config(32, 2048, 6144)
    # a consumer that adds partial sums (o into the norm): two K splits of 32 x 256 tiles
    assert kernel_config(8, 2048, 2048, partial_sums=True) == dict(block_n=32, block_k=256, k_splits=2,
                                                                   num_warps=4, num_stages=4)
    # ... unless K takes an odd number of steps (768 = 3 x 256): the one-pass config, one split
    assert kernel_config(8, 768, 2048, partial_sums=True) == kernel_config(8, 768, 2048)
    assert kernel_config(8, 2048, 2048, block_k=2048, partial_sums=True)["k_splits"] == 1
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 96)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((96, 48)), jnp.float32)
    assert rel_err(skinny_matmul(x, w, impl="pallas", interpret=True), x, w) < TOL[jnp.float32]


def test_default_is_xla_and_equals_the_reference():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2, 64, 32)), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(skinny_matmul(x, w, 1)), np.asarray(skinny_matmul_ref(x, w, 1)))


@pytest.mark.parametrize("x_shape, w_shape, layer, kw, match", [
    ((4, 64), (2, 64, 32), None, {}, "needs layer="),
    ((4, 64), (64, 32), 0, {}, "must not get it"),
    ((4, 48), (64, 32), None, {}, "x has K=48 but w has K=64"),
    ((4, 64, 1), (64, 32), None, {}, r"x must be \[M, K\]"),
    ((MAX_ROWS + 1, 64), (64, 32), None, dict(impl="pallas"), "at most 64"),
    ((4, 40), (40, 32), None, dict(impl="pallas"), "K=40 must be a multiple of 16"),
    ((4, 64), (64, 40), None, dict(impl="pallas"), "N=40 must be a multiple of 16"),
    ((4, 64), (64, 32), None, dict(impl="pallas", block_k=8), "block_k=8: blocks must be at least 16"),
    ((4, 64), (64, 32), None, dict(impl="triton"), "choose one of"),
    ((4, 64), (64, 32), None, dict(impl="pallas", block_k=16, k_splits=3), "k_splits=3 must divide"),
    ((4, 96), (96, 32), None, dict(impl="pallas", block_k=64, k_splits=2), r"K / block_k = 96 / 32 = 3"),
    ((4, 64), (64, 32), None, dict(impl="pallas", k_splits=0), "k_splits=0 must be >= 1"),
])
def test_bad_calls_are_named(x_shape, w_shape, layer, kw, match):
    with pytest.raises(ValueError, match=match):
        skinny_matmul(jnp.ones(x_shape, jnp.float32), jnp.ones(w_shape, jnp.float32), layer,
                      interpret=True, **kw)


@pytest.mark.parametrize("impl, splits", [("pallas", 1), ("pallas", 2), ("xla", None)])
def test_skip_gives_zeros_and_else_the_product(impl, splits):
    """skip, a traced bool: true gives zeros whatever the weight holds (the kernel does not
    stream it), false the product."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2, 64, 48)) / 8, jnp.float32)
    fn = jax.jit(lambda x, w, skip: skinny_matmul(x, w, 1, impl=impl, interpret=True, block_k=16,
                                                  k_splits=splits, skip=skip))
    assert rel_err(fn(x, w, jnp.bool_(False)), x, w[1]) < TOL[jnp.float32]
    for weight in (w, w.at[1, 5, 7].set(jnp.nan)):
        out = fn(x, weight, jnp.bool_(True))
        assert out.shape == (3, 48) and out.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(out), 0.0)


@pytest.mark.parametrize("kw, match", [
    (dict(skip=jnp.zeros((1,), bool)), r"skip: expected a bool scalar, got bool \(1,\)"),
    (dict(skip=jnp.int32(1)), "skip: expected a bool scalar, got int32"),
    (dict(skip=jnp.bool_(True), partial_sums=True), "skip is for whole products"),
])
def test_bad_skip_is_named(kw, match):
    with pytest.raises(ValueError, match=match):
        skinny_matmul(jnp.ones((4, 64), jnp.float32), jnp.ones((64, 32), jnp.float32), impl="pallas",
                      interpret=True, **kw)


def test_skip_lowers_to_a_branch_around_the_stream(lower_to_triton):
    sd = jax.ShapeDtypeStruct
    fn = lambda x, w, skip: skinny_matmul(x, w, impl="pallas", skip=skip)    # noqa: E731
    ir = lower_to_triton(fn, sd((8, 2048), jnp.bfloat16), sd((2048, 49152), jnp.bfloat16), sd((), jnp.bool_))
    assert "tensor<128x64xbf16>" in ir                  # the head's 128 x 64 weight tiles
    # the stream (its dot) sits inside the first branch; the second writes zeros
    assert ir.index("scf.if") < ir.index("tt.dot") < ir.rindex("scf.if")


def test_mixed_dtypes_are_refused_by_the_kernel():
    with pytest.raises(ValueError, match="x is float32 but w is bfloat16"):
        skinny_matmul(jnp.ones((4, 64), jnp.float32), jnp.ones((64, 32), jnp.bfloat16), impl="pallas",
                      interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16, 32, 64])
@pytest.mark.parametrize("k, n", [(2048, 2048), (2048, 6144), (2048, 5632), (5632, 2048), (2048, 49152)])
def test_compiled_kernel_on_gpu(m, k, n):
    rng = np.random.default_rng(m + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, k, n)) / np.sqrt(k), jnp.bfloat16)
    out = jax.jit(lambda x, w: skinny_matmul(x, w, 2, impl="pallas"))(x, w)
    assert rel_err(out, x, w[2]) < TOL[jnp.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
def test_compiled_head_kernel_skips_on_gpu(m):
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, 2048)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2048, 49152)) / np.sqrt(2048), jnp.bfloat16)
    fn = jax.jit(lambda x, w, skip: skinny_matmul(x, w, impl="pallas", skip=skip))
    assert rel_err(fn(x, w, jnp.bool_(False)), x, w) < TOL[jnp.bfloat16]
    np.testing.assert_array_equal(np.asarray(fn(x, w, jnp.bool_(True)), np.float32), 0.0)


def test_engine_backend_names_the_setting_when_the_kernel_cannot_run():
    from rltjax.cache.paged_kv import PagedKVBackend
    backend = PagedKVBackend(matmul_impl="pallas", interpret=True)
    x, w = jnp.ones((4, 40), jnp.float32), jnp.ones((2, 40, 32), jnp.float32)
    with pytest.raises(ValueError, match=r"matmul_impl='pallas': a \[40, 32\] projection .*K=40 .*matmul_impl='xla'"):
        backend.matmul(x, w, 1)
    big = jnp.ones((MAX_ROWS + 1, 40), jnp.float32)          # beyond the kernel's rows: XLA's dot
    np.testing.assert_array_equal(np.asarray(backend.matmul(big, w, 1)), np.asarray(skinny_matmul_ref(big, w, 1)))


@pytest.mark.parametrize("rows", [1, 8, 16])
def test_lowers_to_triton_without_padding(lower_to_triton, rows):
    """Few rows go in as they are (no XLA pad: the kernel replicates them up to the 16-row
    dot tile); one split stores [rows, N] in x's dtype, so nothing runs after the kernel."""
    sd = jax.ShapeDtypeStruct
    fn = lambda x, w: skinny_matmul(x, w, impl="pallas")                  # noqa: E731
    args = sd((rows, 2048), jnp.bfloat16), sd((2048, 2048), jnp.bfloat16)
    ir = lower_to_triton(fn, *args)
    assert "tt.dot" in ir and "tensor<16x256xbf16>" in ir       # the 16-row tile, block_k 256
    assert jax.eval_shape(fn, *args).shape == (rows, 2048)
    hlo = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.pad" not in hlo and "stablehlo.reduce" not in hlo and "stablehlo.convert" not in hlo


def test_backend_auto_takes_the_kernel_for_its_shapes_on_gpu(monkeypatch):
    """matmul_impl "auto": the kernel for decode rows up to its MAX_ROWS whose weight shape
    is one of kernel_shapes, on a GPU; XLA's dot for anything else."""
    from rltjax.kernels import skinny_matmul as sm
    from rltjax.cache.paged_kv import PagedKVBackend
    rng = np.random.default_rng(4)
    w = jnp.asarray(rng.standard_normal((2, 256, 64)) / 16, jnp.float32)
    x = jnp.asarray(rng.standard_normal((8, 256)), jnp.float32)
    edge = jnp.asarray(rng.standard_normal((MAX_ROWS, 256)), jnp.float32)
    big = jnp.asarray(rng.standard_normal((MAX_ROWS + 1, 256)), jnp.float32)
    calls = []
    real = sm.skinny_matmul_pallas
    monkeypatch.setattr(sm, "skinny_matmul_pallas", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    auto = PagedKVBackend(attn_impl="pallas", matmul_impl="auto", decode_rows=True, interpret=True,
                          kernel_shapes=((256, 64),))
    want = skinny_matmul_ref(x, w, 1)
    np.testing.assert_array_equal(np.asarray(auto.matmul(x, w, 1)), np.asarray(want))    # CPU: XLA's dot
    assert calls == []
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert rel_err(auto.matmul(x, w, 1), x, w[1]) < TOL[jnp.float32] and calls == [(8, 256)]
    assert rel_err(auto.matmul(edge, w, 1), edge, w[1]) < TOL[jnp.float32] and calls[-1] == (MAX_ROWS, 256)
    del calls[1:]
    for backend, rows in ((auto, big), (dataclasses.replace(auto, kernel_shapes=((64, 256),)), x),
                          (dataclasses.replace(auto, decode_rows=False), x),
                          (dataclasses.replace(auto, matmul_impl="xla"), x)):
        np.testing.assert_array_equal(np.asarray(backend.matmul(rows, w, 1)), np.asarray(skinny_matmul_ref(rows, w, 1)))
    assert calls == [(8, 256)]


def test_backend_head_on_the_kernel_at_few_rows_skipped_when_no_row_keeps_it(monkeypatch):
    """head_matmul under "auto" on a GPU: the kernel for decode batches of up to HEAD_KERNEL_ROWS
    rows where head_shapes names the head, zeros where no row needs the logits; XLA's dot
    otherwise (more rows, another shape, a CPU). "pallas" takes the kernel up to MAX_ROWS."""
    from rltjax.kernels import skinny_matmul as sm
    from rltjax.cache.paged_kv import HEAD_KERNEL_ROWS, PagedKVBackend
    rng = np.random.default_rng(6)
    w = jnp.asarray(rng.standard_normal((256, 512)) / 16, jnp.float32)
    few = jnp.asarray(rng.standard_normal((HEAD_KERNEL_ROWS, 256)), jnp.float32)
    more = jnp.asarray(rng.standard_normal((2 * HEAD_KERNEL_ROWS, 256)), jnp.float32)
    calls = []
    real = sm.skinny_matmul_pallas
    monkeypatch.setattr(sm, "skinny_matmul_pallas", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    auto = PagedKVBackend(attn_impl="pallas", matmul_impl="auto", decode_rows=True, interpret=True,
                          head_shapes=((256, 512),))
    yes, no = jnp.bool_(True), jnp.bool_(False)
    np.testing.assert_array_equal(np.asarray(auto.head_matmul(few, w, no)), np.asarray(few @ w))   # CPU: XLA
    assert calls == []
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert rel_err(auto.head_matmul(few, w, yes), few, w) < TOL[jnp.float32]
    np.testing.assert_array_equal(np.asarray(auto.head_matmul(few, w, no)), 0.0)
    assert calls == [(HEAD_KERNEL_ROWS, 256)] * 2
    assert rel_err(auto.head_matmul(few, w), few, w) < TOL[jnp.float32] and len(calls) == 3   # None: computed
    # head_shapes route heads only: a layer projection of the same shape stays on XLA's dot
    np.testing.assert_array_equal(np.asarray(auto.matmul(few, w[None], 0)), np.asarray(skinny_matmul_ref(few, w)))
    for backend, x in ((auto, more), (dataclasses.replace(auto, head_shapes=()), few),
                       (dataclasses.replace(auto, decode_rows=False), few)):
        np.testing.assert_array_equal(np.asarray(backend.head_matmul(x, w, no)), np.asarray(x @ w))
    assert len(calls) == 3
    pallas = dataclasses.replace(auto, matmul_impl="pallas", head_shapes=())
    np.testing.assert_array_equal(np.asarray(pallas.head_matmul(more, w, no)), 0.0)
    assert calls[-1] == (2 * HEAD_KERNEL_ROWS, 256)


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_widen_gives_the_rounded_product_as_float32(impl, splits):
    """widen: the bf16 product exactly, stored as float32 (a head's logits); skipped: zeros."""
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((3, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((128, 64)) / 11, jnp.bfloat16)
    kw = dict(impl=impl, interpret=True) | (dict(block_n=16, block_k=32, k_splits=splits) if impl == "pallas" else {})
    plain, wide = skinny_matmul(x, w, **kw), skinny_matmul(x, w, widen=True, **kw)
    assert plain.dtype == jnp.bfloat16 and wide.dtype == jnp.float32 and wide.shape == (3, 64)
    np.testing.assert_array_equal(np.asarray(wide), np.asarray(plain.astype(jnp.float32)))
    assert rel_err(wide, x, w) < TOL[jnp.bfloat16]
    skipped = skinny_matmul(x, w, skip=jnp.bool_(True), widen=True, **kw)
    assert skipped.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(skipped), 0.0)
    with pytest.raises(ValueError, match="widen"):
        skinny_matmul(x, w, widen=True, partial_sums=True, **kw)


def test_zero_rows_and_unpadded_kernel_calls():
    w = jnp.ones((64, 32), jnp.float32)
    out = skinny_matmul(jnp.ones((0, 64), jnp.float32), w, impl="pallas", interpret=True)
    assert out.shape == (0, 32) and out.dtype == jnp.float32
    with pytest.raises(ValueError, match="3 rows; the kernel takes a power of two"):
        skinny_matmul_pallas(jnp.ones((3, 64), jnp.float32), w[None], jnp.zeros((1,), jnp.int32), block_n=16,
                             block_k=16, interpret=True)


def test_auto_shapes_per_preset():
    """The runner names Ouro's attention projections and head (K <= 2048) for "auto" and nothing
    for Nanbeige's or Huginn's wider K."""
    from rltjax.engine.settings import auto_head_shapes, auto_matmul_shapes
    from rltjax.presets import preset_config
    assert auto_matmul_shapes(preset_config("ouro-1.4b")) == ((2048, 6144), (2048, 2048))
    assert auto_head_shapes(preset_config("ouro-1.4b")) == ((2048, 49152),)
    for name in ("nanbeige4.2-3b", "huginn-0125"):
        assert auto_matmul_shapes(preset_config(name)) == () and auto_head_shapes(preset_config(name)) == ()


def test_decode_projections_on_kernels_per_preset():
    """Only Ouro's shapes, with attention on the Pallas kernels, matmul_impl auto or pallas and
    at most 64 requests, run the decode projections on the kernels (and so compile with
    KERNEL_DECODE_OPTIONS)."""
    from rltjax.engine.settings import decode_projections_on_kernels
    from rltjax.presets import preset_config
    for name in ("ouro-1.4b", "ouro-2.6b"):
        cfg = preset_config(name)
        assert decode_projections_on_kernels(cfg, True, "auto", 64) and decode_projections_on_kernels(cfg, True, "pallas", 8)
        assert not decode_projections_on_kernels(cfg, True, "xla", 64)
        assert not decode_projections_on_kernels(cfg, False, "auto", 64)
        assert not decode_projections_on_kernels(cfg, True, "auto", 128)     # 128-row batches run on XLA's dot
    for name in ("nanbeige4.2-3b", "huginn-0125"):
        assert not decode_projections_on_kernels(preset_config(name), True, "auto", 64)

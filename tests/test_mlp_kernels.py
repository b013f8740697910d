"""A SwiGLU MLP on the decode kernels: the gate | up pair with its activation in one kernel
(``gated_up``) and down's split-K partial sums handed to the residual-norm kernel unreduced
(``skinny_matmul(partial_sums=True)`` -> ``residual_norm``). Interpret mode against float64
numpy formulas and the XLA references, lowered to Triton without a GPU, the engine
backend's choice of path, and on a GPU the compiled kernels at Ouro-1.4B's shapes."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from rltjax.kernels.residual_norm import residual_norm, residual_norm_ref, sum_partials
from rltjax.kernels.skinny_matmul import MAX_ROWS, gated_config, gated_up, gated_up_ref, skinny_matmul, skinny_matmul_ref

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1.2e-2}     # relative Frobenius error vs float64
EPS = 1e-6


def silu_mul64(x, wg, wu):
    g, u = (np.asarray(x, np.float64) @ np.asarray(w, np.float64) for w in (wg, wu))
    return g / (1 + np.exp(-g)) * u


def rel(got, want):
    got = np.asarray(got, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, MAX_ROWS), k_blocks=st.integers(1, 4), f_blocks=st.integers(1, 3),
       block_k=st.sampled_from([16, 32]), block_n=st.sampled_from([16, 32]), num_layers=st.sampled_from([0, 3]),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16]), seed=st.integers(0, 2**16))
def test_gated_up_matches_float64(m, k_blocks, f_blocks, block_k, block_n, num_layers, dtype, seed):
    rng = np.random.default_rng(seed)
    k, f = k_blocks * block_k, f_blocks * block_n
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    shape = (num_layers, k, f) if num_layers else (k, f)
    wg, wu = (jnp.asarray(rng.standard_normal(shape) / np.sqrt(k), dtype) for _ in range(2))
    layer = int(rng.integers(num_layers)) if num_layers else None
    pick = (lambda w: w[layer]) if num_layers else (lambda w: w)       # noqa: E731
    out = gated_up(x, wg, wu, layer, impl="pallas", interpret=True, block_n=block_n, block_k=block_k)
    assert out.shape == (m, f) and out.dtype == dtype
    want = silu_mul64(x, pick(wg), pick(wu))
    assert rel(out, want) < TOL[dtype]
    ref = gated_up_ref(x, wg, wu, layer)
    assert rel(ref, want) < TOL[dtype]                                  # the XLA path's formula too
    # and the two round alike: within two steps of the dtype of each other (the products'
    # float32 sums differ in order, which can move a rounded product by one step)
    step = 2.0 ** -7 if dtype == jnp.bfloat16 else 2.0 ** -20
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=2 * step,
                               atol=2 * step * float(np.max(np.abs(np.asarray(ref, np.float32)))))


def _dot_lhs(fn, *args):
    """The lhs operand (a jaxpr var) of each dot_general that ``fn(*args)`` traces to."""
    return [eqn.invars[0] for eqn in jax.make_jaxpr(fn)(*args).jaxpr.eqns if eqn.primitive.name == "dot_general"]


def test_gate_and_up_dots_do_not_share_x():
    """The gate and up products take x through different values (the up one through a
    barrier): two dots sharing an operand are what XLA:GPU's dot merger merges, by
    concatenating the two weights on every call."""
    from rltjax.models.layers import swiglu
    x, wg, wu, wd = jnp.ones((8, 32)), jnp.ones((32, 64)), jnp.ones((32, 64)), jnp.ones((64, 32))
    gate_up = _dot_lhs(gated_up_ref, x, wg, wu)
    assert len(gate_up) == 2 and gate_up[0] is not gate_up[1]
    mlp = _dot_lhs(lambda *a: swiglu(a[0], jnp.dot, *a[1:]), x, wg, wu, wd)
    assert len(mlp) == 3 and mlp[0] is not mlp[1]


def test_gated_up_validation():
    x, w = jnp.ones((4, 64), jnp.float32), jnp.ones((64, 32), jnp.float32)
    with pytest.raises(ValueError, match="share a shape and dtype"):
        gated_up(x, w, jnp.ones((64, 48), jnp.float32))
    with pytest.raises(ValueError, match="needs layer="):
        gated_up(x, w[None], w[None])
    with pytest.raises(ValueError, match="x is float32 but w is bfloat16"):
        gated_up(x, w.astype(jnp.bfloat16), w.astype(jnp.bfloat16), impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="K=40 must be a multiple of 16"):
        gated_up(jnp.ones((4, 40), jnp.float32), jnp.ones((40, 32), jnp.float32),
                 jnp.ones((40, 32), jnp.float32), impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="at most 64"):
        gated_up(jnp.ones((MAX_ROWS + 1, 64), jnp.float32), w, w, impl="pallas", interpret=True)
    assert gated_up(jnp.ones((0, 64), jnp.float32), w, w, impl="pallas", interpret=True).shape == (0, 32)
    assert gated_config(8, 2048, 5632)["block_n"] == 64
    # four warps at every row count (two at <= 8 rows were 1.3 us slower at 8 rows on an H200)
    assert {gated_config(m, 2048, 5632)["num_warps"] for m in (1, 2, 8, 16, 64)} == {4}
    # the measured bf16 config up to 64 rows; float32 tiles get fewer stages (shared memory)
    assert [gated_config(m, 2048, 5632)["num_stages"] for m in (1, 16, 32, 64)] == [4, 4, 4, 4]
    assert [gated_config(m, 2048, 5632, itemsize=4)["num_stages"] for m in (32, 64)] == [3, 2]


def test_gated_up_beyond_one_pass_runs_on_the_split_kernel():
    """impl "pallas" with K past the pair kernel's single pass: the two products on the split
    kernel, the activation in XLA, the same formula."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((4, 4096)), jnp.float32)
    wg, wu = (jnp.asarray(rng.standard_normal((4096, 32)) / 64, jnp.float32) for _ in range(2))
    out = gated_up(x, wg, wu, impl="pallas", interpret=True)
    assert rel(out, silu_mul64(x, wg, wu)) < TOL[jnp.float32]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 9), splits=st.sampled_from([1, 2, 4]), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
       seed=st.integers(0, 2**16))
def test_partial_sums_through_the_residual_norm(m, splits, dtype, seed):
    """down's K-split sums, unreduced, into the norm: the same (x_new, h) as the reduced
    product through it, and both the float64 product's up to the dtype's rounding."""
    rng = np.random.default_rng(seed)
    k, d = 128, 64
    act = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, d)) / np.sqrt(k), dtype)
    x = jnp.asarray(rng.standard_normal((m, d)) * 3, dtype)
    w1, w2 = (jnp.asarray(rng.uniform(0.5, 2, d), dtype) for _ in range(2))
    parts = skinny_matmul(act, w, impl="pallas", interpret=True, block_n=16, block_k=32, k_splits=splits,
                          partial_sums=True)
    assert parts.shape == (splits, m, d) and parts.dtype == (jnp.float32 if splits > 1 else dtype)
    y = sum_partials(parts, dtype)
    assert rel(y, np.asarray(act, np.float64) @ np.asarray(w, np.float64)) < TOL[dtype]
    # against the reduced product through the norm (the split kernel's sums added by XLA)
    reduced = skinny_matmul(act, w, impl="pallas", interpret=True, block_n=16, block_k=32, k_splits=splits)
    want = residual_norm_ref(x, reduced, w1, w2, EPS)
    step = 2.0 ** -7 if dtype == jnp.bfloat16 else 2.0 ** -20     # sums in another order
    for impl, kw in (("xla", {}), ("pallas", dict(interpret=True))):
        for g, r in zip(residual_norm(x, parts, w1, w2, EPS, impl=impl, **kw), want):
            assert g.dtype == dtype and g.shape == (m, d)
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=2 * step,
                                       atol=2 * step)
    # the XLA path of the projection hands its product on as one "partial sum"
    plain = skinny_matmul(act, w, partial_sums=True)
    assert plain.shape == (1, m, d) and plain.dtype == dtype
    np.testing.assert_array_equal(np.asarray(plain[0], np.float32), np.asarray(skinny_matmul_ref(act, w), np.float32))


def test_partial_sums_are_at_most_eight():
    """The default split count is capped for a consumer that holds every partial sum: 4096 / 128
    = 32 K blocks would split 32 ways for 256 programs; partial sums take 8."""
    x = jnp.ones((8, 4096), jnp.float32)
    w = jnp.ones((4096, 64), jnp.float32) / 4096
    assert skinny_matmul(x, w, impl="pallas", interpret=True, partial_sums=True).shape == (8, 8, 64)
    with pytest.raises(ValueError, match="at most 8 K splits.*k_splits=16"):
        skinny_matmul(x, w, impl="pallas", interpret=True, partial_sums=True, k_splits=16)


def test_single_pass_partial_sums_split_in_two():
    """K <= 2048 (o's shape): a consumer of partial sums gets two K splits by default, whose
    float32 sum is the product; K with a single block_k step keeps one."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((3, 512)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((512, 64)) / np.sqrt(512), jnp.float32)
    parts = skinny_matmul(x, w, impl="pallas", interpret=True, partial_sums=True)
    assert parts.shape == (2, 3, 64) and parts.dtype == jnp.float32
    assert rel(parts.sum(0), np.asarray(x, np.float64) @ np.asarray(w, np.float64)) < TOL[jnp.float32]
    one = skinny_matmul(x[:, :256], w[:256], impl="pallas", interpret=True, partial_sums=True)
    assert one.shape == (1, 3, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16, 32, 64])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_o_partial_sums_compile_on_gpu(m, dtype):
    """Ouro's o (2048 x 2048) into the norm at every decode bucket: two splits' partial sums."""
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, 2048)), dtype)
    w = jnp.asarray(rng.standard_normal((2, 2048, 2048)) / np.sqrt(2048), dtype)
    parts = jax.jit(lambda x, w: skinny_matmul(x, w, 1, impl="pallas", partial_sums=True))(x, w)
    assert parts.shape == (2, m, 2048)
    assert rel(parts.sum(0), np.asarray(x, np.float64) @ np.asarray(w[1], np.float64)) < TOL[dtype]


def test_partial_sums_are_validated():
    x = jnp.ones((4, 64), jnp.bfloat16)
    w = jnp.ones((64,), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"partial sums in float32 or x's dtype"):
        residual_norm(x, jnp.ones((2, 4, 64), jnp.float16), w, w, EPS, impl="xla")
    with pytest.raises(ValueError, match=r"\[S, N, D\]"):
        residual_norm(x, jnp.ones((2, 3, 64), jnp.float32), w, w, EPS, impl="xla")


def test_both_kernels_lower_to_triton(lower_to_triton):
    sd = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    ir = lower_to_triton(lambda x, g, u: gated_up(x, g, u, impl="pallas"), sd((8, 2048), bf), sd((2048, 5632), bf),
                         sd((2048, 5632), bf))
    # two products a K step and one (masked 16-row) store: no activation kernel after it
    assert ir.count("tt.dot") == 2 and ir.count("tt.store") == 1
    hlo = jax.jit(lambda x, g, u: gated_up(x, g, u, impl="pallas")).trace(
        sd((8, 2048), bf), sd((2048, 5632), bf), sd((2048, 5632), bf)).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.logistic" not in hlo and "stablehlo.multiply" not in hlo
    # the norm reads its S = 4 partial sums, x and both weights before its first reduction
    ir = lower_to_triton(lambda x, y, a, b: residual_norm(x, y, a, b, EPS, impl="pallas"), sd((8, 2048), bf),
                         sd((4, 8, 2048), jnp.float32), sd((2048,), bf), sd((2048,), bf))
    lines = ir.splitlines()
    first_reduce = next(i for i, line in enumerate(lines) if "tt.reduce" in line)
    assert sum("tt.load" in line for line in lines[:first_reduce]) == 4 + 3, ir


def test_backend_runs_the_mlp_on_the_kernels_where_auto_says(monkeypatch):
    """Under "auto" on a GPU with fused_kernels, decode rows up to MAX_ROWS: gated_up
    on its kernel, and down (a shape not in kernel_shapes) on the split kernel where its
    consumer takes partial sums, handed on unreduced; asked for a plain product, XLA's dot.
    Under "pallas" the same split kernel either way. Otherwise XLA."""
    from rltjax.kernels import skinny_matmul as sm
    from rltjax.cache.paged_kv import PagedKVBackend
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
    wg, wu = (jnp.asarray(rng.standard_normal((2, 64, 256)) / 8, jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((2, 4096, 64)) / 64, jnp.float32)   # K > 2048: split
    act = jnp.asarray(rng.standard_normal((8, 4096)), jnp.float32)
    calls = []
    real_gated, real_split = sm.gated_up_pallas, sm.skinny_matmul_pallas
    monkeypatch.setattr(sm, "gated_up_pallas", lambda *a, **k: calls.append(("gated", a[0].shape[0]))
                        or real_gated(*a, **k))
    monkeypatch.setattr(sm, "skinny_matmul_pallas", lambda *a, **k: calls.append(("split", a[0].shape[0]))
                        or real_split(*a, **k))
    auto = PagedKVBackend(attn_impl="pallas", matmul_impl="auto", decode_rows=True, interpret=True, fused_kernels=True)
    assert auto.gated_up(x, wg, wu, 1).shape == (8, 256) and auto.matmul(act, wd, 1, partial_sums=True).ndim == 2
    assert calls == []                                                  # CPU: XLA's dot
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    np.testing.assert_allclose(np.asarray(auto.gated_up(x, wg, wu, 1)), silu_mul64(x, wg[1], wu[1]), rtol=2e-4,
                               atol=2e-5)
    edge = jnp.asarray(rng.standard_normal((MAX_ROWS, 64)), jnp.float32)
    auto.gated_up(edge, wg, wu, 1)
    assert calls == [("gated", 8), ("gated", MAX_ROWS)]
    want = np.asarray(act, np.float64) @ np.asarray(wd[1], np.float64)
    np.testing.assert_array_equal(np.asarray(auto.matmul(act, wd, 1)), np.asarray(skinny_matmul_ref(act, wd, 1)))
    assert len(calls) == 2                                              # a plain product: XLA's dot
    for backend in (auto, dataclasses.replace(auto, matmul_impl="pallas")):
        parts = backend.matmul(act, wd, 1, partial_sums=True)
        assert calls[-1] == ("split", 8) and parts.ndim == 3 and parts.shape[1:] == (8, 64)
        np.testing.assert_allclose(np.asarray(parts.sum(0)), want, rtol=1e-4, atol=1e-4)
    del calls[:]
    big = jnp.ones((MAX_ROWS + 1, 64), jnp.float32)
    for backend, rows in ((auto, big), (dataclasses.replace(auto, decode_rows=False), x),
                          (dataclasses.replace(auto, matmul_impl="xla"), x),
                          (dataclasses.replace(auto, fused_kernels=False), x)):
        np.testing.assert_array_equal(np.asarray(backend.gated_up(rows, wg, wu, 1)),
                                      np.asarray(gated_up_ref(rows, wg, wu, 1)))
    # partial sums go to the split kernel only where the norm kernel adds them up
    big_act = jnp.ones((MAX_ROWS + 1, 4096), jnp.float32)
    odd_d = jnp.asarray(rng.standard_normal((2, 4096, 48)) / 64, jnp.float32)    # D = 48: no norm kernel
    for backend, rows, w in ((auto, big_act, wd), (auto, act, odd_d),
                             (dataclasses.replace(auto, fused_kernels=False), act, wd),
                             (dataclasses.replace(auto, decode_rows=False), act, wd),
                             (dataclasses.replace(auto, prefill_block_q=32), act, wd),
                             (dataclasses.replace(auto, matmul_impl="xla"), act, wd)):
        assert backend.matmul(rows, w, 1, partial_sums=True).ndim == 2
    assert calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("m, dtype", [(1, jnp.float32), (32, jnp.float32)])
def test_gated_float32_compiles_on_gpu(m, dtype):
    """float32 tiles are twice the bytes: the config's stages must still fit shared memory."""
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, 2048)), dtype)
    wg, wu = (jnp.asarray(rng.standard_normal((2048, 5632)) / 45, dtype) for _ in range(2))
    got = jax.jit(lambda *a: gated_up(*a, impl="pallas"))(x, wg, wu)
    assert rel(got, silu_mul64(x, wg, wu)) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16, 32, 64])
def test_compiled_on_gpu(m):
    rng = np.random.default_rng(m)
    bf = jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((m, 2048)), bf)
    wg, wu = (jnp.asarray(rng.standard_normal((2, 2048, 5632)) / 45, bf) for _ in range(2))
    got = jax.jit(lambda *a: gated_up(*a, 1, impl="pallas"))(x, wg, wu)
    assert rel(got, silu_mul64(x, wg[1], wu[1])) < TOL[bf]
    act = jnp.asarray(rng.standard_normal((m, 5632)), bf)
    wd = jnp.asarray(rng.standard_normal((2, 5632, 2048)) / 75, bf)
    res = jnp.asarray(rng.standard_normal((m, 2048)), bf)
    w1 = jnp.ones((2048,), bf)
    fused = jax.jit(lambda a, w, r: residual_norm(r, skinny_matmul(a, w, 1, impl="pallas", partial_sums=True), w1,
                                                  w1, EPS, impl="pallas"))(act, wd, res)
    parts = jax.jit(lambda a, w: skinny_matmul(a, w, 1, impl="pallas", partial_sums=True))(act, wd)
    want = residual_norm_ref(res, sum_partials(parts, bf), w1, w1, EPS)
    for g, r in zip(fused, want):      # up to one bf16 step: the row sums' order is XLA's there
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=2.0 ** -7,
                                   atol=2.0 ** -7)

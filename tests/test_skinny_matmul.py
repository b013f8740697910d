"""The weight-streaming projection kernel (interpret mode on CPU) against a float64 numpy
product: row counts 1..64, stacked and plain weights, block sizes and K splits; the entry
point's validation; and, on a GPU, the compiled kernel at Ouro-1.4B's shapes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kernels.pallas_skinny import choose_splits, padded_rows
from kernels.skinny_matmul import MAX_ROWS, fit_block, skinny_matmul, skinny_matmul_ref

# relative Frobenius error vs float64: float32 accumulation, then rounding to the output dtype
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 8e-3}


def rel_err(out, x, w):
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    return np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
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
    assert padded_rows(1) == 16 and padded_rows(17) == 32 and padded_rows(64) == 64
    # splits rise towards MIN_PROGRAMS, capped at K / block_k (2048 x 2048 at 128 x 256: 8)
    assert choose_splits(2048, 2048, 128, 256) == 8 and choose_splits(2048, 2048, 128, 128) == 16
    assert choose_splits(5632, 2048, 128, 256) == 22 and choose_splits(2048, 49152, 128, 256) == 1
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
])
def test_bad_calls_are_named(x_shape, w_shape, layer, kw, match):
    with pytest.raises(ValueError, match=match):
        skinny_matmul(jnp.ones(x_shape, jnp.float32), jnp.ones(w_shape, jnp.float32), layer,
                      interpret=True, **kw)


def test_mixed_dtypes_are_refused_by_the_kernel():
    with pytest.raises(ValueError, match="x is float32 but w is bfloat16"):
        skinny_matmul(jnp.ones((4, 64), jnp.float32), jnp.ones((64, 32), jnp.bfloat16), impl="pallas",
                      interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 32, 64])
@pytest.mark.parametrize("k, n", [(2048, 2048), (2048, 5632), (5632, 2048), (2048, 49152)])
def test_compiled_kernel_on_gpu(m, k, n):
    rng = np.random.default_rng(m + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, k, n)) / np.sqrt(k), jnp.bfloat16)
    out = jax.jit(lambda x, w: skinny_matmul(x, w, 2, impl="pallas"))(x, w)
    assert rel_err(out, x, w[2]) < TOL[jnp.bfloat16]


def test_engine_backend_names_the_setting_when_the_kernel_cannot_run():
    from rltjax.cache.paged_kv import PagedKVBackend
    backend = PagedKVBackend(matmul_impl="pallas", interpret=True)
    x, w = jnp.ones((4, 40), jnp.float32), jnp.ones((2, 40, 32), jnp.float32)
    with pytest.raises(ValueError, match=r"matmul_impl='pallas': a \[40, 32\] projection .*K=40 .*matmul_impl='xla'"):
        backend.matmul(x, w, 1)
    big = jnp.ones((MAX_ROWS + 1, 40), jnp.float32)          # beyond the kernel's rows: XLA's dot
    np.testing.assert_array_equal(np.asarray(backend.matmul(big, w, 1)), np.asarray(skinny_matmul_ref(big, w, 1)))

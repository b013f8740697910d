"""``residual_norm`` (a sandwich layer's residual add + the next pre-norm in one kernel)
against its pure-XLA reference in interpret mode, against a float64 formula, lowered to
Triton without a GPU, and compiled on the GPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from rltjax.kernels.residual_norm import residual_norm, residual_norm_ref

EPS = 1e-6


def make_case(rng, n, dim, dtype):
    x = rng.standard_normal((n, dim)) * 3
    y = rng.standard_normal((n, dim)) * rng.uniform(0.01, 10, (n, 1))      # rows of any scale
    w1, w2 = (rng.uniform(0.5, 2.0, dim) for _ in range(2))
    return tuple(jnp.asarray(a, dtype) for a in (x, y, w1, w2))


def assert_close_ulp(got, want, dtype):
    """Equal up to one rounding of the dtype: the row sums' order differs from XLA's, which
    can move an rsqrt by an ulp of float32 and, rarely, a rounded element by one step."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    step = 2.0 ** -7 if dtype == jnp.bfloat16 else 2.0 ** -20
    np.testing.assert_allclose(got, want, rtol=step, atol=step)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 9), dim=st.sampled_from([64, 256, 2048]),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_kernel_matches_reference(seed, n, dim, dtype):
    case = make_case(np.random.default_rng(seed), n, dim, dtype)
    got = residual_norm(*case, EPS, impl="pallas", interpret=True)
    want = residual_norm(*case, EPS, impl="xla")
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == dtype and g.shape == w.shape
        assert_close_ulp(g, w, dtype)


def test_reference_is_the_sandwich_formula():
    """Both paths against float64 numpy: x + w1 * y / rms(y), then w2 * that / rms(that)."""
    x, y, w1, w2 = make_case(np.random.default_rng(1), 5, 128, jnp.float32)
    x64, y64, w164, w264 = (np.asarray(a, np.float64) for a in (x, y, w1, w2))
    rms = lambda a: np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + EPS)     # noqa: E731
    x_new = x64 + w164 * y64 / rms(y64)
    h = w264 * x_new / rms(x_new)
    for impl, kw in (("xla", {}), ("pallas", dict(interpret=True))):
        got_x, got_h = residual_norm(x, y, w1, w2, EPS, impl=impl, **kw)
        np.testing.assert_allclose(np.asarray(got_x), x_new, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got_h), h, rtol=1e-5, atol=1e-5)


def test_validation_and_fallback(monkeypatch):
    x, y, w1, w2 = make_case(np.random.default_rng(2), 3, 96, jnp.float32)
    with pytest.raises(ValueError, match="power of two"):                    # 96: XLA only
        residual_norm(x, y, w1, w2, EPS, impl="pallas", interpret=True)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")               # "auto" as on a GPU
    for got, want in zip(residual_norm(x, y, w1, w2, EPS, impl="auto"), residual_norm_ref(x, y, w1, w2, EPS)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))     # fell back to XLA
    monkeypatch.undo()
    with pytest.raises(ValueError, match="post_weight"):
        residual_norm(x, y, w1[:5], w2, EPS, impl="xla")
    with pytest.raises(ValueError, match="x, y"):
        residual_norm(x, y[:2], w1, w2, EPS, impl="xla")
    with pytest.raises(ValueError, match="dtype"):
        residual_norm(x[:, :64], y[:, :64], w1[:64].astype(jnp.bfloat16), w2[:64], EPS, impl="pallas")
    empty = jnp.zeros((0, 64), jnp.float32)
    out = residual_norm(empty, empty, w1[:64], w2[:64], EPS, impl="pallas", interpret=True)
    assert all(o.shape == (0, 64) for o in out)


@pytest.mark.parametrize("dim, dtype", [(2048, jnp.bfloat16), (4096, jnp.float32)])
def test_lowers_to_triton(lower_to_triton, dim, dtype):
    sd = jax.ShapeDtypeStruct
    ir = lower_to_triton(lambda *a: residual_norm(*a, EPS, impl="pallas"), sd((8, dim), dtype),
                         sd((8, dim), dtype), sd((dim,), dtype), sd((dim,), dtype))
    assert "tt.func" in ir and ir.count("tt.store") == 2 and "tt.reduce" in ir
    # the four input reads (x, y and both weights) are issued before the first reduction,
    # whose barrier no later load can move above: they wait for memory together, not one
    # after another (the loads after it are the stores' own, on the output pointers)
    lines = ir.splitlines()
    first_reduce = next(i for i, line in enumerate(lines) if "tt.reduce" in line)
    assert sum("tt.load" in line for line in lines[:first_reduce]) == 4, ir


@pytest.mark.gpu
@pytest.mark.parametrize("n, dim, dtype", [(1, 2048, jnp.bfloat16), (64, 2048, jnp.bfloat16),
                                           (7, 4096, jnp.float32)])
def test_compiled_on_gpu(n, dim, dtype):
    case = make_case(np.random.default_rng(n), n, dim, dtype)
    got = jax.jit(lambda *a: residual_norm(*a, EPS, impl="pallas"))(*case)
    want = jax.jit(lambda *a: residual_norm_ref(*a, EPS))(*case)
    for g, w in zip(got, want):
        assert_close_ulp(g, w, dtype)

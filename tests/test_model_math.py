"""The models' own numerics (``rltjax.models.layers``) and the kernels' references
(``rltjax.kernels``) are separate code, one for the model files and one for the kernels'
oracles; they must stay the same function, bit for bit, or a kernel would be tested against
math the models do not run."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rltjax.kernels.paged_attention_ref import rope_rotate_half_ref
from rltjax.kernels.residual_norm import rms_norm as kernel_rms_norm
from rltjax.kernels.skinny_matmul import silu_mul as kernel_silu_mul
from rltjax.models.layers import rms_norm, rope_rotate_half, silu_mul


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_model_math_equals_the_kernel_references(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 3, 64)) * 3, dtype)
    w = jnp.asarray(rng.uniform(0.5, 1.5, 64), dtype)
    cos, sin = (jnp.asarray(f(rng.uniform(0, 6, (5, 32))), jnp.float32) for f in (np.cos, np.sin))
    pairs = [(rms_norm(x, w, 1e-6), kernel_rms_norm(x, w, 1e-6)),
             (silu_mul(x, x[::-1]), kernel_silu_mul(x, x[::-1])),
             (rope_rotate_half(x, cos, sin), rope_rotate_half_ref(x, cos, sin)),
             (jax.jit(rope_rotate_half)(x, cos, sin), jax.jit(rope_rotate_half_ref)(x, cos, sin))]
    for ours, kernels in pairs:
        assert ours.dtype == kernels.dtype
        np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(kernels, np.float32))

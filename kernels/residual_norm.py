"""A sandwich layer's residual add and the next pre-norm, in one kernel.

    x_new = x + rms_norm(y, post_weight)       x, y: [N, D] -> x_new [N, D]
    h     = rms_norm(x_new, next_weight)                    -> h [N, D]

y may also come as [S, N, D] partial sums (a split-K projection's, unreduced:
``kernels.skinny_matmul``'s ``partial_sums``): y is then their sum in float32, in order,
rounded to x's dtype, and the kernel adds them up as it reads them, in place of a
reduction kernel between the two.

``rms_norm`` is the models' (upstream) numerics: normalise in float32, cast to the
activation dtype, then scale by the weight in that dtype. Ouro runs this twice a layer
(after attention: the MLP's pre-norm; after the MLP: the next layer's, or the model's
final norm); XLA runs it as two kernels (the add and its reduction, then the next
norm), this kernel as one: one program per row reads y and x once, keeps them in
registers, and writes x_new and h.

impl: "xla" (the reference below, any shapes and backends), "pallas" (the Triton
kernel; ``interpret=True`` runs it on CPU), "auto" (pallas on GPU when supported).
Kernel-supported: D a power of two in 64..16384, bfloat16 / float16 / float32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from rltjax.kernels.triton_common import is_pow2

KERNEL_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """[..., D] -> [..., D]; normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


def sum_partials(y: jax.Array, dtype) -> jax.Array:
    """[S, N, D] partial sums -> [N, D]: added in float32 in order, rounded once to dtype."""
    total = y[0].astype(jnp.float32)
    for part in y[1:]:
        total = total + part.astype(jnp.float32)
    return total.astype(dtype)


def residual_norm_ref(x, y, post_weight, next_weight, eps: float):
    """The pure-XLA path and the kernel's oracle -> (x_new, h). y [N, D] or [S, N, D] partials."""
    if y.ndim == 3:
        y = sum_partials(y, x.dtype)
    # x_new is materialised (a barrier): left to itself XLA fused chains of adds and norms
    # across layers into the next norm's kernel and recomputed them there (3-5 us kernels
    # instead of ~1.5 us on an H200).
    x = jax.lax.optimization_barrier(x + rms_norm(y, post_weight, eps))
    return x, rms_norm(x, next_weight, eps)


def _kernel(x_ref, y_ref, post_ref, next_ref, x_out_ref, h_ref, *, eps: float):
    row = pl.program_id(0)
    dtype, dim = x_ref.dtype, x_ref.shape[-1]
    f32 = jnp.float32
    # Every load is issued first: a load after a reduction's barrier cannot be moved above
    # it, so loaded where they are used the four reads would wait on each other in turn.
    if len(y_ref.shape) == 3:     # partial sums: all S read up front, then added in order
        parts = [plgpu.load(y_ref.at[jnp.int32(s), row, :]) for s in range(y_ref.shape[0])]
    else:
        parts = [plgpu.load(y_ref.at[row, :])]
    x = plgpu.load(x_ref.at[row, :])
    post_w, next_w = plgpu.load(post_ref), plgpu.load(next_ref)
    y = parts[0].astype(f32)
    for part in parts[1:]:
        y = y + part.astype(f32)
    y = y.astype(dtype)

    def norm(v32, weight):     # rms_norm: float32 terms, rounded where the reference rounds
        unit = (v32 * jax.lax.rsqrt(jnp.sum(v32 * v32) / dim + eps)).astype(dtype)
        return (weight.astype(f32) * unit.astype(f32)).astype(dtype)

    branch = norm(y.astype(f32), post_w)
    x_new = (x.astype(f32) + branch.astype(f32)).astype(dtype)
    plgpu.store(x_out_ref.at[row, :], x_new)
    plgpu.store(h_ref.at[row, :], norm(x_new.astype(f32), next_w))


def kernel_unsupported(x, *weights) -> str | None:
    dim = x.shape[-1]
    if any(w.dtype != x.dtype for w in weights):
        return f"the norm weights must be in the activations' dtype {x.dtype}, got {[str(w.dtype) for w in weights]}"
    if not (64 <= dim <= 16384 and is_pow2(dim)):
        return f"the hidden size must be a power of two in 64..16384 for the kernel, got {dim}"
    if x.dtype not in KERNEL_DTYPES:
        return f"kernel dtypes are bfloat16/float16/float32, got {x.dtype}"
    return None


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _residual_norm_pallas(x, y, post_weight, next_weight, *, eps: float, interpret: bool = False):
    n, dim = x.shape
    whole = lambda shape: pl.BlockSpec(shape, lambda r: (0,) * len(shape))   # noqa: E731
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps),
        grid=(n,),
        in_specs=[whole(x.shape), whole(y.shape), whole((dim,)), whole((dim,))],
        out_specs=[whole(x.shape), whole(x.shape)],
        out_shape=[out, out],
        compiler_params=plgpu.CompilerParams(num_warps=4 if dim <= 4096 else 8, num_stages=1),
        interpret=interpret,
        name="rlt_residual_norm",
    )(x, y, post_weight, next_weight)


def residual_norm(x: jax.Array, y: jax.Array, post_weight: jax.Array, next_weight: jax.Array,
                  eps: float, *, impl: str = "auto", interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(x + rms_norm(y, post_weight), rms_norm(of that, next_weight)): x [N, D], y [N, D] or
    [S, N, D] partial sums (float32 or x's dtype; their in-order float32 sum is y), weights [D]."""
    if impl not in ("auto", "xla", "pallas"):
        raise ValueError(f"residual_norm: impl: expected 'auto', 'xla' or 'pallas', got {impl!r}")
    partials = y.ndim == 3 and y.shape[1:] == x.shape and y.dtype in (x.dtype, jnp.float32) and y.shape[0] >= 1
    if x.ndim != 2 or not (partials or (y.shape == x.shape and y.dtype == x.dtype)):
        raise ValueError(f"residual_norm: x, y: expected one [N, D] shape and dtype (or y as [S, N, D] "
                         f"partial sums in float32 or x's dtype), got {x.dtype} {x.shape} and {y.dtype} {y.shape}")
    for name, w in (("post_weight", post_weight), ("next_weight", next_weight)):
        if w.shape != x.shape[-1:]:
            raise ValueError(f"residual_norm: {name}: expected [{x.shape[-1]}], got {w.shape}")
    why_not = kernel_unsupported(x, post_weight, next_weight)
    if impl == "pallas" and why_not:
        raise ValueError(f"residual_norm: impl='pallas': {why_not}")
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" and not why_not else "xla"
    if impl == "xla" or x.shape[0] == 0:
        return residual_norm_ref(x, y, post_weight, next_weight, eps)
    return _residual_norm_pallas(x, y, post_weight, next_weight, eps=float(eps), interpret=interpret)

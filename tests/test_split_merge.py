"""The key splits merged inside a kernel (``kernels.split_merge.merge_last_split``) against the
XLA combine (``combine_splits``) in interpret mode, and the merging decode kernel's GPU ops in
its lowered Triton IR (the fused kernel's outputs with ``merge_splits``:
tests/test_paged_attention_write.py)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.experimental import pallas as pl

from kernels.split_merge import combine_splits, merge_last_split
from kernels.triton_common import head_dim_chunks

NEG = float("-inf")


def merge_in_a_kernel(o, lse, counts, dtype):
    """Grid (row, head, split): each program stores its split's given partial, then
    merge_last_split. -> (merged [N, H, Dh], the counter after the call)."""
    num_splits, n, heads, head_dim = o.shape

    def kernel(o_in, lse_in, counts_in, o_ref, lse_ref, out_ref, count_ref):
        row, head, split = (pl.program_id(i) for i in range(3))
        o_ref[split, row, head, :] = o_in[split, row, head, :]
        lse_ref[split, row, head] = lse_in[split, row, head]
        merge_last_split(out_ref, count_ref, o_ref, lse_ref, row, head, num_splits,
                         head_dim_chunks(head_dim), interpret=True)

    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    shapes = [jax.ShapeDtypeStruct(o.shape, jnp.float32), jax.ShapeDtypeStruct(lse.shape, jnp.float32),
              jax.ShapeDtypeStruct((n, heads, head_dim), dtype), jax.ShapeDtypeStruct(counts.shape, jnp.int32)]
    outs = pl.pallas_call(kernel, grid=(n, heads, num_splits), in_specs=[whole(a.shape) for a in (o, lse, counts)],
                          out_specs=[whole(s.shape) for s in shapes], out_shape=shapes,
                          input_output_aliases={2: 3}, interpret=True)(o, lse, counts)
    return outs[2], outs[3]


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1), num_splits=st.integers(2, 6), head_dim=st.sampled_from([32, 96]))
def test_the_last_split_merges_as_combine_splits_and_resets_its_counter(seed, num_splits, head_dim):
    """Partials with empty splits (lse -inf) and an empty (row, head) (every split -inf): the
    merge equals combine_splits bit for bit, and every counter is back at 0."""
    rng = np.random.default_rng(seed)
    n, heads = 3, 2
    o = rng.standard_normal((num_splits, n, heads, head_dim)).astype(np.float32)
    lse = rng.standard_normal((num_splits, n, heads)).astype(np.float32) * 4
    lse[rng.random(lse.shape) < 0.3] = NEG
    lse[:, 0, 1] = NEG
    o[np.isneginf(lse)] = 0.0
    merged, counts = merge_in_a_kernel(jnp.asarray(o), jnp.asarray(lse), jnp.zeros((n, heads), jnp.int32),
                                       jnp.float32)
    want = combine_splits(jnp.asarray(o), jnp.asarray(lse), jnp.float32)
    np.testing.assert_array_equal(np.asarray(merged), np.asarray(want))
    assert not np.asarray(merged)[0, 1].any()
    np.testing.assert_array_equal(np.asarray(counts), 0)


def test_merged_kernel_lowers_with_a_barrier_atomics_and_volatile_loads(lower_to_triton):
    """On the GPU path: a CTA barrier before the counter's acq_rel (GPU scope) atomic, and the
    partials read back with volatile loads; the kernel's name says it merges."""
    sd = jax.ShapeDtypeStruct
    rows, pool = 8, sd((2, 16, 64, 16, 128), jnp.bfloat16)
    args = (sd((rows, 48, 128), jnp.bfloat16), pool, pool, sd((rows, 48), jnp.int32), sd((rows,), jnp.int32),
            sd((rows,), jnp.int32), sd((4, rows), jnp.int32), sd((rows,), jnp.int32))
    from kernels.pallas_triton import paged_attention_pallas
    fn = functools.partial(lambda merge, *a: paged_attention_pallas(
        *a[:6], layer=jnp.int32(1), new_kv=(a[6], a[7], None), num_splits=6, merge_splits=merge), True)
    ir = lower_to_triton(fn, *args)
    assert ir.count("gpu.barrier") == 1
    atomics = [line for line in ir.splitlines() if "tt.atomic_rmw" in line]
    assert len(atomics) == 2 and all("add, acq_rel, gpu" in line for line in atomics)
    assert ir.count("isVolatile = true") == 2
    assert "_s6_m" in ir
    assert "gpu.barrier" not in lower_to_triton(functools.partial(fn.func, False), *args)

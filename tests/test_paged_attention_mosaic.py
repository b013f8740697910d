"""The Mosaic GPU decode attention kernel (``kernels.paged_attention_mosaic``) against the XLA
oracle (``paged_attention_ref``, ``paged_write_ref``): in Mosaic GPU interpret mode on CPU over
MHA and GQA groups, key splits, page sizes, empty and full rows, and the fused write (pools
equal bit for bit); behind ``kernels.paged_attention``'s backend argument (RoPE by XLA first,
Triton for what it does not take); lowered for an H100-class GPU (sm_90: wgmma, TMA) at
Ouro-1.4B's shapes without a GPU; and, on a GPU, compiled against the Triton kernel."""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from rltjax.kernels import paged_attention_mosaic as pam
from rltjax.kernels import paged_attention_mosaic_launch as launch
from rltjax.kernels.paged_attention import decode_kernel, paged_attention, paged_attention_write
from rltjax.kernels.paged_attention_ref import paged_attention_ref
from test_paged_attention_write import assert_pools_match, make_decode_case, rope_for

pytestmark = pytest.mark.usefixtures("fresh_mosaic_interpreter")
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3}
sd = jax.ShapeDtypeStruct


def f32(a):
    return np.asarray(a, np.float32)


def case_for(seed, *, group=1, num_kv=2, page_size=16, head_dim=64, dtype=jnp.bfloat16, n=3, pages_per_table=8,
             planes=2, lengths=None):
    return make_decode_case(np.random.default_rng(seed), num_kv=num_kv, group=group, page_size=page_size,
                            head_dim=head_dim, dtype=dtype, n=n, pages_per_table=pages_per_table,
                            num_writes=planes, lengths=lengths)


def attend(case, layer=1, **kw):
    """(the kernel's out, the oracle's) of the read-only kernel on the case's pools."""
    q, _, _, k, v, tables, rows, lengths = case[:8]
    out = jax.jit(lambda q, k, v, layer: pam.paged_attention_mosaic(q, k, v, tables, rows, lengths, layer=layer,
                                                                    interpret=True, **kw))(q, k, v, jnp.int32(layer))
    return out, paged_attention_ref(q, k, v, tables, rows, lengths, layer=layer)


@pytest.mark.parametrize("group, num_kv, page_size, head_dim, splits, dtype", [
    (1, 2, 16, 64, 1, jnp.bfloat16),       # MHA (Ouro, Huginn): one query column of 8 used
    (1, 4, 16, 128, 2, jnp.bfloat16),      # Ouro's head_dim, split keys
    (2, 2, 8, 64, 3, jnp.float16),         # GQA, 8-key pages (8 a block)
    (3, 2, 16, 64, 1, jnp.bfloat16),       # a group that straddles 8-row runs: 16 columns
    (8, 1, 16, 64, 2, jnp.bfloat16),       # a group filling its 8 columns
])
def test_interpret_matches_oracle(group, num_kv, page_size, head_dim, splits, dtype):
    """Rows of 0, 1, a page, a page + 1, capacity - 1 and capacity keys; tables of 4 blocks, so
    a full row's keys span two or more splits and their merge is exercised."""
    cap = 4 * 64
    lengths = [0, 1, page_size, page_size + 1, cap - 1, cap]
    case = case_for(group * 10 + splits, group=group, num_kv=num_kv, page_size=page_size, head_dim=head_dim,
                    dtype=dtype, n=6, pages_per_table=cap // page_size, lengths=lengths)
    out, ref = attend(case, num_splits=splits)
    assert out.shape == ref.shape and out.dtype == dtype
    np.testing.assert_allclose(f32(out), f32(ref), atol=TOL[dtype], rtol=TOL[dtype])
    assert np.all(f32(out)[0] == 0)            # row 0 (table 0) has no keys: zeros


def test_partials_and_a_single_layer_pool():
    """return_partials gives each split's normalized output and log-sum-exp (a split past the
    row's keys: lse -inf); a 4-D pool is one layer."""
    case = case_for(4, n=2, lengths=[70, 5])
    q, _, _, k, v, tables, rows, lengths = case[:8]
    o, lse = pam.paged_attention_mosaic(q, k[1], v[1], tables, rows, lengths, num_splits=2, return_partials=True,
                                        interpret=True)
    assert o.shape == (2, 2, 2, 64) and lse.shape == (2, 2, 2)
    assert np.isneginf(f32(lse[1, 1])).all() and np.isfinite(f32(lse[:, 0])).all()
    from rltjax.kernels.split_merge import combine_splits
    np.testing.assert_allclose(f32(combine_splits(o, lse, q.dtype)),
                               f32(paged_attention_ref(q, k[1], v[1], tables, rows, lengths)), atol=2e-2)


@pytest.mark.parametrize("splits, planes", [(1, 1), (2, 3), (3, 2)])
def test_fused_write_matches_write_then_attend(splits, planes):
    """Every row stores its new K/V on each write plane (page 0: dropped) and attends over the pool
    below it plus the new key folded in from k_new / v_new. Pools equal the oracle's bit for bit."""
    case = case_for(20 + splits, n=6, planes=planes, pages_per_table=6)
    run = jax.jit(lambda k, v: paged_attention_write(*case[:3], k, v, *case[5:], layer=jnp.int32(1), impl="pallas",
                                                     backend="mosaic", num_splits=splits, interpret=True),
                  donate_argnums=(0, 1))
    ref_out, ref_k, ref_v = paged_attention_write(*case, layer=1, impl="xla")
    out, k, v = run(jnp.array(case[3]), jnp.array(case[4]))
    np.testing.assert_allclose(f32(out), f32(ref_out), atol=2e-2, rtol=2e-2)
    assert_pools_match(k, v, ref_k, ref_v, jnp.bfloat16, rotated=False)


def test_fused_write_has_no_races():
    """The interpreter's race detector (TMA stores against other blocks' loads) finds none: split 0
    stores each row's newest K/V, and no block uses that slot's pool value (split 0 folds the newest
    key in from k_new / v_new). Row lengths put the newest key in either split's blocks."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax.experimental.pallas import mosaic_gpu as plgpu
    q, k_new, v_new, k, v, tables, rows, lengths, page, offset = case_for(5, n=4, pages_per_table=6,
                                                                          lengths=[70, 33, 96, 17])
    out, _, _ = pam.paged_attention_mosaic(q, k, v, tables, rows, lengths, layer=1, num_splits=2,
                                           new_kv=(k_new, v_new, page, offset),
                                           interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not gpu_callbacks.get_races().races_found
    assert np.isfinite(f32(out)).all()


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1), group=st.sampled_from([1, 2, 4]), splits=st.integers(1, 3),
       page_size=st.sampled_from([8, 16, 32]), rope=st.booleans())
def test_random_decode_batches(seed, group, splits, page_size, rope):
    """Random lengths and tables through the dispatcher, RoPE rotated by XLA first."""
    case = case_for(seed, group=group, page_size=page_size, n=4, pages_per_table=4)
    cos_sin = rope_for(case, 64) if rope else None
    out, k, v = paged_attention_write(*case, layer=0, impl="pallas", backend="mosaic", num_splits=splits,
                                      rope=cos_sin, interpret=True)
    ref_out, ref_k, ref_v = paged_attention_write(*case, layer=0, impl="xla", rope=cos_sin)
    np.testing.assert_allclose(f32(out), f32(ref_out), atol=2e-2, rtol=2e-2)
    assert_pools_match(k, v, ref_k, ref_v, jnp.bfloat16, rotated=False)


def test_dispatch_runs_mosaic_where_it_takes_the_operands(monkeypatch):
    calls, real = [], pam.paged_attention_mosaic
    monkeypatch.setattr(pam, "paged_attention_mosaic", lambda *a, **k: calls.append(k.get("new_kv") is not None)
                        or real(*a, **k))
    case = case_for(3)
    q, _, _, k, v, tables, rows, lengths = case[:8]
    out = paged_attention(q, k, v, tables, rows, lengths, layer=1, impl="pallas", backend="mosaic", interpret=True)
    np.testing.assert_allclose(f32(out), f32(paged_attention_ref(q, k, v, tables, rows, lengths, layer=1)), atol=2e-2)
    paged_attention_write(*case, layer=1, impl="pallas", backend="mosaic", interpret=True)
    assert calls == [False, True]
    wide = case_for(3, head_dim=96)                    # not a multiple of 64: the Triton kernel
    paged_attention(*wide[:1], *wide[3:8], layer=1, impl="pallas", backend="mosaic", interpret=True)
    paged_attention(q, k, v, tables, rows, lengths, layer=1, impl="xla", backend="mosaic")
    assert calls == [False, True]
    assert decode_kernel("mosaic", 16, 16, 128, 16, jnp.bfloat16) == "mosaic"            # Ouro-1.4B
    assert decode_kernel("mosaic", 64, 1, 256, 16, jnp.bfloat16) == "triton"      # the fused tiles do not fit
    assert decode_kernel("mosaic", 16, 16, 128, 16, jnp.float32) == "triton"
    assert decode_kernel("triton", 16, 16, 128, 16, jnp.bfloat16) == "triton"
    with pytest.raises(ValueError, match="backend"):
        paged_attention(q, k, v, tables, rows, lengths, layer=1, impl="pallas", backend="cuda")
    for bad, match in ((dict(num_splits=0), "num_splits"), (dict(pages_per_block=3), "pages_per_block")):
        with pytest.raises(ValueError, match=match):        # checked on the write path too
            paged_attention_write(*case, layer=1, impl="pallas", backend="mosaic", interpret=True, **bad)


def test_query_columns_hold_every_group():
    """The 8-aligned run a block loads holds its whole group, for every head count and group."""
    for heads in range(1, 33):
        for group in (g for g in range(1, heads + 1) if heads % g == 0):
            cols = launch.query_columns(heads, group)
            assert cols % 8 == 0 and cols <= 8 + -(-group // 8) * 8
            firsts = [row * heads + kvh * group for row in range(9) for kvh in range(heads // group)]
            assert max(f % 8 + group for f in firsts) <= cols, (heads, group)


def test_unsupported_operands_are_named():
    """mosaic_launch fills in the defaults (64-key blocks; slots keeping two blocks an SM: 3, or
    2 with the fused write's tiles at Ouro's shapes) and names what the kernel does not take."""
    q, k = sd((1, 16, 128), jnp.bfloat16), sd((16, 8, 16, 128), jnp.bfloat16)
    assert launch.mosaic_launch(q, k) == launch.MosaicLaunch(4, 3, None)
    assert launch.mosaic_launch(q, k, fused=True) == launch.MosaicLaunch(4, 2, None)
    why = lambda q, k, **kw: launch.mosaic_launch(q, k, **kw).unsupported  # noqa: E731
    assert "dtype" in why(sd((1, 16, 128), jnp.float32), sd((16, 8, 16, 128), jnp.float32))
    assert "head_dim" in why(sd((1, 16, 96), jnp.bfloat16), sd((16, 8, 16, 96), jnp.bfloat16))
    assert "page_size" in why(q, sd((16, 8, 12, 128), jnp.bfloat16))
    assert "wgmma" in why(q, k, pages_per_block=2)
    assert "shared memory" in why(q, k, pages_per_block=16, max_concurrent_steps=4)
    # a group of 64 heads of 256: the read-only kernel fits one slot, the fused one's tiles do not
    wide_q, wide_k = sd((1, 64, 256), jnp.bfloat16), sd((1, 8, 16, 256), jnp.bfloat16)
    assert launch.mosaic_launch(wide_q, wide_k) == launch.MosaicLaunch(4, 1, None)
    assert "shared memory" in why(wide_q, wide_k, fused=True)


@pytest.fixture
def lower_to_mosaic(monkeypatch):
    """(HLO text, the Mosaic GPU module's text) of the kernel lowered for CUDA on any host (sm_90)."""
    from jax._src.pallas.mosaic_gpu import pallas_call_registration as reg
    seen, orig = [], reg.lowering.lower_unpipelined_jaxpr_to_module
    monkeypatch.setattr(reg.lowering, "lower_unpipelined_jaxpr_to_module",
                        lambda *a, **k: seen.append(res := orig(*a, **k)) or res)

    def lower(fn, *args, donate=()):
        hlo = jax.jit(fn, donate_argnums=donate).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        return hlo, str(seen[-1].module.operation)
    return lower


@pytest.mark.parametrize("rows, splits", [(1, 4), (8, 2), (64, 1)])
def test_lowers_for_hopper_at_ouro_shapes(lower_to_mosaic, rows, splits):
    """The fused kernel at Ouro-1.4B's decode shapes (24 layers, 16 x 128 heads, 16-key pages,
    4 write planes): wgmma m64n8k16 (keys x 8 query columns), TMA loads and stores, the pools
    aliased in place; XLA pads, slices and gathers nothing."""
    pool = sd((24, 16, 4096, 16, 128), jnp.bfloat16)
    args = [sd((rows, 16, 128), jnp.bfloat16), sd((rows, 16, 128), jnp.bfloat16), sd((rows, 16, 128), jnp.bfloat16),
            pool, pool, sd((rows, 128), jnp.int32), sd((rows,), jnp.int32), sd((rows,), jnp.int32),
            sd((4, rows), jnp.int32), sd((rows,), jnp.int32), sd((), jnp.int32)]
    fn = functools.partial(lambda *a, **kw: paged_attention_write(*a[:10], layer=a[10], **kw), impl="pallas",
                           backend="mosaic", num_splits=splits)
    hlo, module = lower_to_mosaic(fn, *args, donate=(3, 4))
    assert "mosaic_gpu.arch_major = 9 : i32" in module
    wgmma = set(re.findall(r"wgmma\.mma_async[.a-z0-9]*", module))
    assert wgmma == {"wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16"}
    assert "cp.async.bulk.tensor.shared.cluster.global" in module                    # TMA loads (pages, q)
    assert re.search(r"cp\.async\.bulk\.(tensor\.)?global\.shared", module)        # TMA stores (write, out)
    assert "output_operand_aliases" in hlo
    for op in ("stablehlo.pad", "stablehlo.gather", "stablehlo.scatter", "stablehlo.dynamic_slice"):
        assert op not in hlo


@pytest.mark.gpu
@pytest.mark.parametrize("rows, splits, rope", [(1, None, True), (8, None, True), (32, 2, True), (64, None, False)])
def test_compiled_on_gpu_matches_triton_and_oracle(rows, splits, rope):
    """Ouro-1.4B's decode shapes compiled on a Hopper GPU, pools donated: the Mosaic kernel's
    output within bf16 rounding of the Triton kernel's and the oracle's, pools bit for bit."""
    rng = np.random.default_rng(rows)
    case = make_decode_case(rng, num_kv=16, group=1, page_size=16, head_dim=128, dtype=jnp.bfloat16, n=rows,
                            pages_per_table=64, num_writes=4, num_layers=3,
                            lengths=np.r_[[1, 16, 1024], rng.integers(1, 1025, rows)][:rows])
    cos_sin = rope_for(case, 128) if rope else None
    ref_out, ref_k, ref_v = paged_attention_write(*case, layer=2, impl="xla", rope=cos_sin)

    def run(backend):
        fn = jax.jit(lambda k, v, layer: paged_attention_write(*case[:3], k, v, *case[5:], layer=layer, impl="pallas",
                                                                rope=cos_sin, num_splits=splits, backend=backend),
                     donate_argnums=(0, 1))
        return fn(jnp.array(case[3]), jnp.array(case[4]), jnp.int32(2))
    out, k, v = run("mosaic")
    triton_out = run("triton")[0]
    np.testing.assert_allclose(f32(out), f32(ref_out), atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(f32(out), f32(triton_out), atol=2e-2, rtol=2e-2)
    assert_pools_match(k, v, ref_k, ref_v, jnp.bfloat16, rotated=False)

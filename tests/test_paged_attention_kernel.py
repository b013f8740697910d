"""The Pallas Triton paged-attention kernel equals the XLA reference (interpret mode on CPU,
compiled on GPU), the wrapper validates its arguments, and the kernel lowers to Triton IR
(with 64-bit addressing for pools beyond 2**32 bytes) without a GPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from rltjax.kernels.paged_attention import paged_attention
from rltjax.kernels.paged_attention_ref import paged_attention_ref
from rltjax.kernels.paged_attention_pallas import paged_attention_pallas
from rltjax.kernels.split_merge import combine_splits
from rltjax.kernels.triton_common import head_dim_chunks

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
N_ROWS, N_TABLES, PAGES_PER_TABLE = 6, 4, 4        # fixed so interpret-mode compiles are reused


def make_case(rng, *, num_kv, group, page_size, head_dim, dtype, num_pages=None,
              n=N_ROWS, num_tables=N_TABLES, pages_per_table=PAGES_PER_TABLE, lengths=None):
    """Random pools; tables are random permutations of physical pages and share pages
    (table t+1 reuses a prefix of table t, as planes of one sequence would); rows pick
    tables at random (several rows of one sequence read different planes)."""
    num_pages = num_pages or pages_per_table * num_tables
    shape = (num_kv, num_pages, page_size, head_dim)
    k = jnp.asarray(rng.standard_normal(shape), dtype)
    v = jnp.asarray(rng.standard_normal(shape), dtype)
    q = jnp.asarray(rng.standard_normal((n, num_kv * group, head_dim)), dtype)
    tables = np.stack([rng.permutation(num_pages)[:pages_per_table] for _ in range(num_tables)])
    for t in range(1, num_tables):
        shared = rng.integers(0, pages_per_table + 1)
        tables[t, :shared] = tables[t - 1, :shared]
    cap = pages_per_table * page_size
    if lengths is None:
        special = [0, 1, page_size, page_size + 1, cap - 1, cap, 2 * page_size - 1]
        lengths = [int(rng.choice(special)) if rng.random() < 0.6 else int(rng.integers(0, cap + 1))
                   for _ in range(n)]
    return (q, k, v, jnp.asarray(tables, jnp.int32),
            jnp.asarray(rng.integers(0, num_tables, n), jnp.int32), jnp.asarray(lengths, jnp.int32))


def assert_close(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=TOL[dtype], rtol=TOL[dtype])


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1), num_kv=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 2, 4, 6, 8]), page_size=st.sampled_from([8, 16, 32]),
       head_dim=st.sampled_from([64, 128]), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
       num_splits=st.integers(1, 4), ppb_log2=st.integers(0, 2))
def test_kernel_matches_reference(seed, num_kv, group, page_size, head_dim, dtype, num_splits,
                                  ppb_log2):
    pages_per_block = max(1 << ppb_log2, 16 // page_size)
    case = make_case(np.random.default_rng(seed), num_kv=num_kv, group=group,
                     page_size=page_size, head_dim=head_dim, dtype=dtype)
    out = paged_attention(*case, impl="pallas", interpret=True, num_splits=num_splits,
                          pages_per_block=pages_per_block)
    assert_close(out, paged_attention_ref(*case), dtype)


@pytest.mark.parametrize("use_dot", [False, True])
def test_edge_lengths(use_dot):
    """Lengths 0 (zeros out), 1, page boundaries, full table, and past the table's capacity
    (clamped to it, as in the reference); more splits than blocks; -1 entries past the length."""
    page_size, ppt = 8, PAGES_PER_TABLE
    cap = page_size * ppt
    lengths = [0, 1, page_size, page_size + 1, cap, cap + 5]
    case = list(make_case(np.random.default_rng(0), num_kv=2, group=1, page_size=page_size,
                          head_dim=64, dtype=jnp.float32, lengths=lengths))
    tables = np.asarray(case[3]).copy()
    tables[:, ppt // 2:] = -1                      # unused tail entries of short tables
    tables[0] = np.asarray(case[3])[0]             # table 0 stays full
    case[3] = jnp.asarray(tables)
    case[4] = jnp.asarray([1, 0, 2, 3, 0, 0], jnp.int32)   # rows 0..3 fit in half a table
    out = paged_attention_pallas(*case, interpret=True, num_splits=4, pages_per_block=2,
                                 use_dot=use_dot)
    ref = paged_attention_ref(*case)
    assert_close(out, ref, jnp.float32)
    assert not np.any(np.asarray(out[0]))           # length 0: zeros


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_stacked_pool_reads_the_traced_layer_in_place(impl):
    """[L, Hkv, P, S, Dh] + a traced layer index == the 4-D call on that layer's pool."""
    rng = np.random.default_rng(5)
    layers = [make_case(rng, num_kv=2, group=1, page_size=8, head_dim=64, dtype=jnp.float32)
              for _ in range(3)]
    q, _, _, tables, rows, lengths = layers[0]
    k = jnp.stack([c[1] for c in layers])
    v = jnp.stack([c[2] for c in layers])
    run = jax.jit(lambda layer: paged_attention(q, k, v, tables, rows, lengths, layer=layer,
                                                impl=impl, interpret=True))
    for layer in range(3):
        ref = paged_attention_ref(q, k[layer], v[layer], tables, rows, lengths)
        assert_close(run(jnp.int32(layer)), ref, jnp.float32)
    with pytest.raises(ValueError, match="layer"):
        paged_attention(q, k, v, tables, rows, lengths)
    with pytest.raises(ValueError, match="layer"):
        paged_attention(q, k[0], v[0], tables, rows, lengths, layer=0)


def test_head_dim_96_runs_as_chunks():
    assert head_dim_chunks(96) == ((0, 64), (64, 32))
    assert head_dim_chunks(128) == ((0, 128),)
    case = make_case(np.random.default_rng(1), num_kv=2, group=2, page_size=16, head_dim=96,
                     dtype=jnp.float32)
    out = paged_attention(*case, impl="pallas", interpret=True, num_splits=2)
    assert_close(out, paged_attention_ref(*case), jnp.float32)


def test_partials_combine_and_custom_scale():
    case = make_case(np.random.default_rng(2), num_kv=1, group=4, page_size=16, head_dim=64,
                     dtype=jnp.float32)
    o, lse = paged_attention_pallas(*case, interpret=True, num_splits=3, pages_per_block=1,
                                    return_partials=True, scale=0.3)
    assert o.shape == (3, N_ROWS, 4, 64) and lse.shape == (3, N_ROWS, 4)
    zero_rows = np.asarray(case[5]) == 0
    assert np.all(np.isneginf(np.asarray(lse)[:, zero_rows]))
    assert_close(combine_splits(o, lse, jnp.float32), paged_attention_ref(*case, scale=0.3),
                 jnp.float32)


def test_auto_is_xla_on_cpu():
    case = make_case(np.random.default_rng(3), num_kv=2, group=1, page_size=16, head_dim=64,
                     dtype=jnp.float32)
    if jax.default_backend() != "gpu":
        np.testing.assert_array_equal(paged_attention(*case), paged_attention_ref(*case))


# --------------------------------------------------------------------------- validation
def _valid():
    return dict(zip(("q", "k_pages", "v_pages", "block_tables", "row_tables", "lengths"),
                    make_case(np.random.default_rng(4), num_kv=2, group=2, page_size=16,
                              head_dim=64, dtype=jnp.float32)))


@pytest.mark.parametrize("arg, change, kw", [
    ("q", lambda a: a["q"][0], {}),
    ("q", lambda a: a["q"].astype(jnp.int32), {}),
    ("q", lambda a: a["q"][:, :3], {}),                                  # 3 heads over 2 kv heads
    ("k_pages", lambda a: a["k_pages"][0], {}),
    ("k_pages", lambda a: a["k_pages"].astype(jnp.bfloat16), {}),
    ("k_pages", lambda a: a["k_pages"][..., :32], {}),
    ("v_pages", lambda a: a["v_pages"][:, :-1], {}),
    ("v_pages", lambda a: a["v_pages"].astype(jnp.bfloat16), {}),
    ("block_tables", lambda a: a["block_tables"].astype(jnp.int16), {}),
    ("block_tables", lambda a: a["block_tables"][0], {}),
    ("row_tables", lambda a: a["row_tables"][:-1], {}),
    ("row_tables", lambda a: a["row_tables"].astype(jnp.uint32), {}),
    ("lengths", lambda a: a["lengths"][:, None], {}),
    ("lengths", lambda a: a["lengths"][:2], {}),
    ("lengths", lambda a: a["lengths"].astype(jnp.float32), {}),
    ("impl", None, {"impl": "cuda"}),
    ("pages_per_block", None, {"pages_per_block": 3}),
    ("pages_per_block", None, {"pages_per_block": 0}),
    ("num_splits", None, {"num_splits": 0}),
])
def test_validation_names_the_argument(arg, change, kw):
    a = _valid()
    if change is not None:
        a[arg if arg in a else "q"] = change(a)
    with pytest.raises(ValueError, match=arg):
        paged_attention(**a, **{"impl": "xla", **kw})


def test_kernel_only_limits():
    rng = np.random.default_rng(5)
    for page_size, head_dim, arg in [(4, 64, "page_size"), (256, 64, "page_size"),
                                     (12, 64, "page_size"), (16, 32, "head_dim"),
                                     (16, 512, "head_dim"), (16, 72, "head_dim")]:
        case = make_case(rng, num_kv=1, group=1, page_size=page_size, head_dim=head_dim,
                         dtype=jnp.float32, num_pages=4, pages_per_table=2)
        paged_attention(*case, impl="xla")                                # the reference: any
        with pytest.raises(ValueError, match=arg):
            paged_attention(*case, impl="pallas", interpret=True)
    case = make_case(rng, num_kv=1, group=2, page_size=8, head_dim=64, dtype=jnp.float32)
    with pytest.raises(ValueError, match="pages_per_block"):              # 8 keys < tl.dot's 16
        paged_attention(*case, impl="pallas", interpret=True, pages_per_block=1)


# ------------------------------------------------------------- Triton lowering, no GPU needed
@pytest.fixture
def triton_ir(lower_to_triton):
    """Lowers the kernel for an H100-class GPU on any host and returns its Triton IR text."""
    def lower(n, heads, num_kv, head_dim, page_size, num_pages, dtype, num_writes=0, rope=False, **kw):
        sd = jax.ShapeDtypeStruct
        pool = sd((num_kv, num_pages, page_size, head_dim), dtype)
        q_heads = heads + 2 * num_kv if num_writes else heads    # the fused write reads q | k | v
        args = (sd((n, q_heads, head_dim), dtype), pool, pool, sd((n, 64), jnp.int32),
                sd((n,), jnp.int32), sd((n,), jnp.int32))
        if num_writes:     # the fused write (paged_attention_write): pages, offsets, RoPE cos / sin
            cos_sin = (sd((n, head_dim // 2), jnp.float32),) * 2 if rope else None
            args += ((sd((num_writes, n), jnp.int32), sd((n,), jnp.int32), cos_sin),)
        return lower_to_triton(lambda *a: paged_attention_pallas(*a[:6], new_kv=a[6] if num_writes else None,
                                                                 **kw), *args)
    return lower


@pytest.mark.parametrize("heads, num_kv, head_dim, page_size, dtype, kw", [
    (16, 16, 128, 16, jnp.bfloat16, {}),                                   # Ouro-1.4B
    (16, 16, 128, 16, jnp.bfloat16, dict(use_dot=True, num_splits=4)),
    (48, 8, 128, 8, jnp.bfloat16, dict(pages_per_block=2, num_splits=2)),  # GQA 6, page 8
    (32, 4, 256, 128, jnp.float32, dict(num_splits=1)),
    (8, 4, 96, 32, jnp.bfloat16, {}),
    (16, 16, 128, 16, jnp.bfloat16, dict(num_writes=4)),                   # fused write-through
    (16, 16, 128, 16, jnp.bfloat16, dict(num_writes=3)),                   # planes padded to 4
    (55, 55, 96, 16, jnp.bfloat16, dict(num_writes=32)),                   # Huginn-like: 32 planes
    (48, 8, 128, 8, jnp.bfloat16, dict(num_writes=1, pages_per_block=2, num_splits=1)),
    (16, 16, 128, 16, jnp.bfloat16, dict(num_writes=2, rope=True)),        # + RoPE (Ouro decode)
    (48, 8, 64, 8, jnp.bfloat16, dict(num_writes=1, rope=True, pages_per_block=2)),
])
def test_lowers_to_triton(triton_ir, heads, num_kv, head_dim, page_size, dtype, kw):
    ir = triton_ir(8, heads, num_kv, head_dim, page_size, 256, dtype, **kw)
    assert "tt.func" in ir and "scf.for" in ir
    if kw.get("num_writes"):    # the stores sit under the split-0 guard, with no loop over the
        assert "tt.store" in ir and "scf.if" in ir      # planes: one loop, the keys' blocks
        assert ir.count("scf.for") == 1


@pytest.mark.parametrize("rows, pages_per_table, launch", [
    (64, 48, "_ppb2_s2"),     # the 64-row launch of a 768-key table (kernels.paged_attention_launch)
    (32, 48, "_ppb2_s2"),
    (8, 48, "_ppb4_s6"),      # the general defaults
    (64, 128, "_ppb4_s4"),    # a 2,048-key table: the general defaults
])
def test_default_launch_reaches_the_kernel(lower_to_triton, rows, pages_per_table, launch):
    """paged_attention_pallas launches default_launch's blocks and splits (in the kernel's
    name), and its warps and stages (in the lowered call's Triton config)."""
    sd = jax.ShapeDtypeStruct
    pool = sd((2, 16, 64, 16, 128), jnp.bfloat16)
    args = (sd((rows, 48, 128), jnp.bfloat16), pool, pool, sd((rows, pages_per_table), jnp.int32),
            sd((rows,), jnp.int32), sd((rows,), jnp.int32), sd((4, rows), jnp.int32), sd((rows,), jnp.int32))
    fn = lambda *a: paged_attention_pallas(*a[:6], layer=jnp.int32(1), new_kv=(a[6], a[7], None))  # noqa: E731
    assert f"rlt_paged_attention_write_g1{launch}" in lower_to_triton(fn, *args)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    warps, stages = (1, 3) if rows == 64 and pages_per_table == 48 else (4, 3) if rows == 32 else (4, 2)
    assert f"num_warps = {warps}" in text and f"num_stages = {stages}" in text, text[-600:]


def test_large_pool_uses_64bit_offsets(triton_ir):
    """A pool of 2**33 bf16 elements per K/V (16 GiB): K/V pointer offsets must be i64."""
    big = triton_ir(4, 16, 16, 128, 16, 2**22, jnp.bfloat16, num_splits=2)
    small = triton_ir(4, 16, 16, 128, 16, 2**10, jnp.bfloat16, num_splits=2)
    assert "x!tt.ptr<bf16>>, tensor<" in big
    assert "xi64>" in big and "8589934592" in big        # head stride 2**22 * 16 * 128
    assert "xi64>" not in small


# --------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("heads, num_kv, head_dim, page_size, dtype, kw", [
    (16, 16, 128, 16, jnp.bfloat16, {}),                                   # Ouro-1.4B, realistic
    (16, 16, 128, 16, jnp.bfloat16, dict(num_splits=1)),
    (32, 8, 128, 16, jnp.bfloat16, {}),
    (48, 8, 64, 8, jnp.float32, dict(pages_per_block=4)),
    (16, 2, 256, 32, jnp.bfloat16, dict(num_splits=3)),
    (16, 4, 96, 16, jnp.bfloat16, {}),
])
def test_compiled_kernel_on_gpu(heads, num_kv, head_dim, page_size, dtype, kw):
    batch, context = 32, 2048
    rng = np.random.default_rng(6)
    ppt = context // page_size
    case = make_case(rng, num_kv=num_kv, group=heads // num_kv, page_size=page_size,
                     head_dim=head_dim, dtype=dtype, n=batch, num_tables=batch,
                     pages_per_table=ppt, num_pages=batch * ppt + 3,
                     lengths=rng.integers(0, context + 1, batch).tolist())
    case = case[:5] + (case[5].at[:4].set(jnp.asarray([0, 1, context, page_size], jnp.int32)),)
    out = paged_attention(*case, impl="pallas", **kw)
    with jax.default_matmul_precision("highest"):    # XLA:GPU's default f32 dot is TF32
        ref = paged_attention_ref(*case)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=tol, rtol=tol)
    assert not np.any(np.asarray(out[0]))


@pytest.mark.gpu
def test_stacked_pool_beyond_int32_elements_on_gpu():
    """A 24-layer pool of more than 2**31 elements: the last layer is read in place."""
    num_layers, num_kv, page_size, head_dim, num_pages = 24, 16, 16, 128, 4096 + 64
    assert num_layers * num_kv * num_pages * page_size * head_dim > 2**31
    rng = np.random.default_rng(8)
    shape = (num_layers, num_kv, num_pages, page_size, head_dim)
    layer_shape = shape[1:]
    k = jnp.zeros(shape, jnp.bfloat16).at[num_layers - 1].set(
        jax.random.normal(jax.random.key(1), layer_shape, jnp.bfloat16))
    v = jnp.zeros(shape, jnp.bfloat16).at[num_layers - 1].set(
        jax.random.normal(jax.random.key(2), layer_shape, jnp.bfloat16))
    batch, ppt = 8, 64
    tables = np.stack([rng.permutation(num_pages)[:ppt] for _ in range(batch)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((batch, num_kv, head_dim)), jnp.bfloat16)
    lengths = jnp.asarray(rng.integers(1, ppt * page_size + 1, batch), jnp.int32)
    rows = jnp.arange(batch, dtype=jnp.int32)
    out = paged_attention(q, k, v, jnp.asarray(tables), rows, lengths, layer=jnp.int32(num_layers - 1),
                          impl="pallas")
    with jax.default_matmul_precision("highest"):
        ref = paged_attention_ref(q, k[num_layers - 1], v[num_layers - 1], jnp.asarray(tables), rows, lengths)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2, rtol=2e-2)

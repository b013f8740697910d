"""``paged_attention_write``: the fused decode kernel (each row stores its new K/V, then
attends with that key taken from registers) equals the XLA path (``paged_write_ref`` then
``paged_attention_ref``) in interpret mode on CPU and compiled on the GPU: the same
outputs, and pools equal bit for bit (keys the kernel rotated itself, RoPE: within one
ulp), including write-through to several pages per row, padded rows (page 0: nothing
written), GQA, head_dim 96 and split-K."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from rltjax.kernels.paged_attention_launch import Launch, default_launch, resolve_launch
from rltjax.kernels.paged_attention import merge_qkv, paged_attention_write
from rltjax.models.layers import rope_cos_sin

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def make_decode_case(rng, *, num_kv, group, page_size, head_dim, dtype, n, pages_per_table,
                     num_writes, num_layers=2, lengths=None):
    """Decode rows: row i reads table i and writes its key at position length - 1 there,
    plus num_writes - 1 more pages at the same block of tables no row reads (the deeper
    planes of write-through). Tables own disjoint pages; page 0 is scratch."""
    num_tables = n * num_writes
    num_pages = num_tables * pages_per_table + 1
    pages = rng.permutation(np.arange(1, num_pages)).reshape(num_tables, pages_per_table)
    shape = (num_layers, num_kv, num_pages, page_size, head_dim)
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))))     # on the device: GPU-sized pools
    k, v = (jax.random.normal(key, shape, dtype) for key in keys)
    q = jnp.asarray(rng.standard_normal((n, num_kv * group, head_dim)), dtype)
    k_new, v_new = (jnp.asarray(rng.standard_normal((n, num_kv, head_dim)), dtype) for _ in range(2))
    cap = pages_per_table * page_size
    if lengths is None:
        lengths = rng.choice([0, 1, page_size, page_size + 1, cap - 1, cap, int(rng.integers(1, cap + 1))], n)
    lengths = np.asarray(lengths, np.int32)
    pos = np.maximum(lengths - 1, 0)
    rows = np.arange(n)
    write_page = np.stack([np.where(lengths > 0, pages[rows + m * n, pos // page_size], 0)
                           for m in range(num_writes)]).astype(np.int32)
    return (q, k_new, v_new, k, v, jnp.asarray(pages, jnp.int32), jnp.asarray(rows, jnp.int32),
            jnp.asarray(lengths), jnp.asarray(write_page), jnp.asarray(pos % page_size, jnp.int32))


def rope_for(case, head_dim):
    """(cos, sin) at each row's position (length - 1), a long-context theta."""
    return rope_cos_sin(jnp.maximum(case[7] - 1, 0) * 37, head_dim, 1e6)


def check(case, dtype, layer, rope=None, **kw):
    out, k, v = paged_attention_write(*case, layer=layer, impl="pallas", rope=rope, **kw)
    ref_out, ref_k, ref_v = paged_attention_write(*case, layer=layer, impl="xla", rope=rope)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                               atol=TOL[dtype], rtol=TOL[dtype])
    assert_pools_match(k, v, ref_k, ref_v, dtype, rope is not None)
    return out, k


def assert_pools_match(k, v, ref_k, ref_v, dtype, rotated: bool):
    """V bit for bit; K too, unless the kernel rotated it: its float32 terms may contract
    differently (FMA), so a 16-bit key may land one rounding step away, and a float32 one
    within float32 epsilon of the operands (|x| ~ 1: cancellation makes it absolute)."""
    np.testing.assert_array_equal(np.asarray(v, np.float32), np.asarray(ref_v, np.float32))
    if not rotated:
        np.testing.assert_array_equal(np.asarray(k, np.float32), np.asarray(ref_k, np.float32))
    elif dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(k), np.asarray(ref_k), rtol=0, atol=2.0 ** -20)
    else:                        # ordered integer codes: adjacent floats differ by 1
        def codes(a):
            bits = np.asarray(jax.lax.bitcast_convert_type(a, jnp.int16), np.int32)
            return np.where(bits < 0, -(bits & 0x7FFF), bits)
        assert np.abs(codes(k) - codes(ref_k)).max() <= 1


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1), group=st.sampled_from([1, 2, 4]),
       page_size=st.sampled_from([8, 16]), head_dim=st.sampled_from([64, 96]),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16]), num_splits=st.integers(1, 3),
       num_writes=st.integers(1, 3), layer=st.integers(0, 1), rope=st.booleans())
def test_fused_write_matches_write_then_attend(seed, group, page_size, head_dim, dtype, num_splits,
                                               num_writes, layer, rope):
    """With rope, q and k are rotated first: in the kernel for head_dim 64, in XLA for 96."""
    case = make_decode_case(np.random.default_rng(seed), num_kv=2, group=group, page_size=page_size,
                            head_dim=head_dim, dtype=dtype, n=5, pages_per_table=4, num_writes=num_writes)
    check(case, dtype, jnp.int32(layer), rope_for(case, head_dim) if rope else None, interpret=True,
          num_splits=num_splits, pages_per_block=max(1, 16 // page_size))


def test_rope_in_kernel_is_rotate_half():
    """The kernel's rotation against the dense formula in float64 (not the shared reference):
    out of a length-1 row is its new value; its stored key is k rotated by its own angle."""
    rng = np.random.default_rng(11)
    case = make_decode_case(rng, num_kv=2, group=2, page_size=8, head_dim=64, dtype=jnp.float32, n=3,
                            pages_per_table=2, num_writes=1, lengths=[1, 5, 16])
    pos = np.array([0, 4, 15]) * 37
    angles = pos[:, None] * (1e6 ** -(np.arange(0, 64, 2) / 64))[None, :]
    out, k, _ = paged_attention_write(*case, layer=jnp.int32(0), impl="pallas", interpret=True,
                                      rope=rope_for(case, 64))
    lo, hi = np.asarray(case[1], np.float64)[..., :32], np.asarray(case[1], np.float64)[..., 32:]
    c, s = np.cos(angles)[:, None], np.sin(angles)[:, None]
    want = np.concatenate([lo * c - hi * s, hi * c + lo * s], axis=-1)          # [N, Hkv, Dh]
    pages, offsets = np.asarray(case[8][0]), np.asarray(case[9])
    got = np.asarray(k)[0][:, pages, offsets].transpose(1, 0, 2)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)      # float32 angles at ~500
    np.testing.assert_allclose(np.asarray(out[0]), np.repeat(np.asarray(case[2][0]), 2, axis=0), rtol=1e-6)


def test_merged_qkv_of_one_projection_is_not_copied():
    """q, k, v split from one projection's output: the kernel's q | k | v operand is that
    output again, with no concatenate left after XLA's simplification (the shaped
    [N, H, Dh] concatenate would keep one, a copy kernel per layer on the GPU)."""
    n, heads, num_kv, head_dim = 4, 6, 2, 64

    def split_merge(x):                                                  # x: [N, (H + 2 Hkv) Dh]
        q, k, v = jnp.split(x, [heads * head_dim, (heads + num_kv) * head_dim], axis=-1)
        return merge_qkv(q.reshape(n, heads, head_dim), k.reshape(n, num_kv, head_dim),
                         v.reshape(n, num_kv, head_dim))
    x = jnp.arange(n * (heads + 2 * num_kv) * head_dim, dtype=jnp.float32).reshape(n, -1)
    np.testing.assert_array_equal(np.asarray(split_merge(x)), np.asarray(x).reshape(n, -1, head_dim))
    hlo = jax.jit(split_merge).lower(x).compile().as_text()
    assert "concatenate" not in hlo and "slice" not in hlo

    def shaped(x):                                                       # the contrast
        q, k, v = jnp.split(x, [heads * head_dim, (heads + num_kv) * head_dim], axis=-1)
        return jnp.concatenate([q.reshape(n, heads, head_dim), k.reshape(n, num_kv, head_dim),
                                v.reshape(n, num_kv, head_dim)], axis=1)
    assert "concatenate" in jax.jit(shaped).lower(x).compile().as_text()


def test_padded_rows_write_nothing_and_read_zeros():
    """Length 0 with page 0 (a padded row): no store lands, the output row is zeros; a row
    of length 1 sees only its own new key (output = its new value)."""
    case = make_decode_case(np.random.default_rng(3), num_kv=2, group=1, page_size=8, head_dim=64,
                            dtype=jnp.float32, n=3, pages_per_table=2, num_writes=2, lengths=[0, 1, 9])
    out, k = check(case, jnp.float32, jnp.int32(1), interpret=True, num_splits=2, pages_per_block=2)
    assert not np.any(np.asarray(out[0]))
    np.testing.assert_allclose(np.asarray(out[1]), np.asarray(case[2][1]), rtol=1e-6)
    changed = np.any(np.asarray(k) != np.asarray(case[3]), axis=(0, 1, 3, 4))     # [num_pages]
    assert not changed[0] and set(np.flatnonzero(changed)) <= set(np.asarray(case[8]).ravel())


def test_launch_defaults():
    """The fused decode kernel's launch by rows (kernels.paged_attention_launch.WIDE_DECODE): the
    H200 sweep's picks at 32 and 64+ rows on the elementwise path for the swept shapes (128-wide
    heads, up to 4 write planes) and tables of up to 1,024 keys; the general defaults below 32
    rows, for larger tables, more planes, other head sizes, GQA (tl.dot) and for the kernel
    without the write."""
    def launch(rows, ppt=48, head_dim=128, elementwise=True, write_planes=4):
        return default_launch(rows, 16, ppt, head_dim, elementwise=elementwise, write_planes=write_planes)
    assert launch(64) == launch(128, ppt=64) == launch(64, write_planes=1) == Launch(2, 2, 1, 3)
    assert launch(32) == Launch(2, 2, 4, 3)                       # 32-key blocks, 2 splits; 4 warps
    assert launch(64, ppt=2) == Launch(2, 1, 1, 3)                # a 2-page table: one split
    general = Launch(4, None, 4, 2)
    assert launch(16) == launch(1) == launch(64, ppt=65) == general     # 1,040 keys: too large
    assert launch(64, write_planes=5) == launch(64, head_dim=64) == general
    assert launch(64, elementwise=False) == launch(64, write_planes=0) == general
    assert launch(64, head_dim=256).num_warps == 8                # Dh 256: the general path
    # resolve_launch: the call's launch, each given field replacing the default's
    resolve = lambda rows, **kw: resolve_launch(rows, 16, 16, 48, 128, elementwise=True, write_planes=4, **kw)  # noqa: E731
    assert resolve(64) == Launch(2, 2, 1, 3) and resolve(8) == Launch(4, 6, 4, 2)      # 8 rows: 6 splits
    assert resolve(64, pages_per_block=4) == Launch(4, 1, 1, 3)    # another block: the general rule's splits
    assert resolve(64, num_splits=3, num_warps=2, num_stages=4) == Launch(2, 3, 2, 4)
    for bad in (dict(num_splits=0), dict(pages_per_block=3), dict(pages_per_block=0)):
        with pytest.raises(ValueError, match="num_splits|pages_per_block"):
            resolve(8, **bad)


def test_live_rows_skip_their_shallower_planes():
    """A live row reads its own plane's table and writes from that plane down (write_plane_mask):
    page 0 on the planes above it stores nothing, and its own and the deeper pages get the key,
    as on the XLA path."""
    n = 4
    case = list(make_decode_case(np.random.default_rng(5), num_kv=2, group=1, page_size=8, head_dim=64,
                                 dtype=jnp.float32, n=n, pages_per_table=3, num_writes=3, lengths=[5, 9, 17, 24]))
    write_page = np.asarray(case[8]).copy()                       # plane m of row r: table r + m n
    write_page[0, 1] = 0                                          # row 1 on plane 1: planes 1-2
    write_page[:2, 2] = 0                                         # row 2 on plane 2: plane 2 only
    case[8] = jnp.asarray(write_page)
    case[6] = jnp.asarray([0, 1 + n, 2 + 2 * n, 3], jnp.int32)   # the tables the rows read
    _, k = check(case, jnp.float32, jnp.int32(0), interpret=True, num_splits=2, pages_per_block=2)
    changed = np.any(np.asarray(k) != np.asarray(case[3]), axis=(0, 1, 3, 4))       # [num_pages]
    assert set(np.flatnonzero(changed)) == set(write_page[write_page != 0].ravel())


def test_validation():
    case = list(make_decode_case(np.random.default_rng(4), num_kv=2, group=1, page_size=8, head_dim=64,
                                 dtype=jnp.float32, n=3, pages_per_table=2, num_writes=1))
    bad = [(1, "k_new", case[1][:, :1]), (8, "write_page", case[8].astype(jnp.float32)),
           (8, r"write_page: expected int32 \[3\] or \[M >= 1, 3\], got int32 \(0, 3\)", case[8][:0]),
           (9, "write_offset", case[9][:2])]
    for index, match, value in bad:
        args = list(case)
        args[index] = value
        with pytest.raises(ValueError, match=match):
            paged_attention_write(*args, layer=0, impl="xla")


@pytest.mark.gpu
@pytest.mark.parametrize("group, head_dim, dtype, kw", [
    (1, 128, jnp.bfloat16, {}),                        # Ouro-1.4B
    (1, 128, jnp.bfloat16, dict(num_splits=1)),
    (4, 128, jnp.bfloat16, {}),
    (2, 96, jnp.float32, dict(num_splits=3)),
    (1, 128, jnp.bfloat16, dict(rope=True)),            # Ouro-1.4B as the engine runs it
    (1, 128, jnp.bfloat16, dict(rope=True, rows=64)),   # its 64-row launch (one warp a program)
    (4, 64, jnp.float32, dict(rope=True, num_splits=2)),
    (1, 96, jnp.bfloat16, dict(rows=8, planes=32)),     # Huginn-like: 96-wide heads, 32 write planes
])
def test_compiled_fused_write_on_gpu(group, head_dim, dtype, kw):
    """Realistic decode shapes, the pools donated into a jit (updated in place)."""
    kw = dict(kw)
    rows, planes = kw.pop("rows", 32), kw.pop("planes", 3)
    rng = np.random.default_rng(7)
    case = make_decode_case(rng, num_kv=16 // group, group=group, page_size=16, head_dim=head_dim,
                            dtype=dtype, n=rows, pages_per_table=64, num_writes=planes, num_layers=3,
                            lengths=np.r_[[0, 1, 16, 1024], rng.integers(1, 1025, rows - 4)])
    rope = rope_for(case, head_dim) if kw.pop("rope", False) else None
    with jax.default_matmul_precision("highest"):
        ref_out, ref_k, ref_v = paged_attention_write(*case, layer=jnp.int32(2), impl="xla", rope=rope)
    run = jax.jit(lambda k, v, layer: paged_attention_write(*case[:3], k, v, *case[5:], layer=layer,
                                                             impl="pallas", rope=rope, **kw), donate_argnums=(0, 1))
    out, k, v = run(jnp.array(case[3]), jnp.array(case[4]), jnp.int32(2))
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), atol=tol, rtol=tol)
    assert_pools_match(k, v, ref_k, ref_v, dtype, rope is not None)

"""A decode window's per-pass bookkeeping against plain numpy: output columns written with
``WindowOutputs.put`` (out-of-range columns dropped, negative ones too) and the device's
stop check ``ends_request``."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from rltjax.engine.window.state import STOP_ID_WIDTH, WindowOutputs, WindowRows, ends_request


def _outputs(rng, b, k, t):
    return WindowOutputs(tokens=rng.integers(0, 99, (b, k)).astype(np.int32),
                         depths=rng.integers(0, 9, (b, k)).astype(np.int32),
                         chosen=rng.standard_normal((b, k)).astype(np.float32),
                         top_ids=rng.integers(0, 99, (b, k, t)).astype(np.int32),
                         top_lp=rng.standard_normal((b, k, t)).astype(np.float32),
                         count=rng.integers(0, 5, b).astype(np.int32), passes=np.int32(3),
                         swap_col=np.full(b, -1, np.int32), swap_tag=np.full(b, -1, np.int32),
                         drafted=np.zeros(b, np.int32), accepted=np.zeros((b, 0), np.int32))


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 6), k=st.integers(1, 5), t=st.sampled_from([0, 2]), seed=st.integers(0, 2**31 - 1),
       scalar_depth=st.booleans())
def test_put_writes_each_rows_column_and_drops_out_of_range(b, k, t, seed, scalar_depth):
    rng = np.random.default_rng(seed)
    old = _outputs(rng, b, k, t)
    at = rng.integers(-2, k + 2, b).astype(np.int32)
    tok, chosen = rng.integers(0, 99, b).astype(np.int32), rng.standard_normal(b).astype(np.float32)
    depth = 7 if scalar_depth else rng.integers(0, 9, b).astype(np.int32)
    top_ids, top_lp = rng.integers(0, 99, (b, t)).astype(np.int32), rng.standard_normal((b, t)).astype(np.float32)
    made = rng.random(b) < 0.5
    got = jax_tree_numpy(old.put(jnp.asarray(at), jnp.asarray(tok), depth, jnp.asarray(chosen), jnp.asarray(top_ids),
                                 jnp.asarray(top_lp), jnp.asarray(made)))
    want = {f.name: np.array(getattr(old, f.name)) for f in dataclasses.fields(WindowOutputs)}
    for i in range(b):
        if 0 <= at[i] < k:
            want["tokens"][i, at[i]], want["chosen"][i, at[i]] = tok[i], chosen[i]
            want["depths"][i, at[i]] = depth if scalar_depth else depth[i]
            want["top_ids"][i, at[i]], want["top_lp"][i, at[i]] = top_ids[i], top_lp[i]
    want["count"] = old.count + made
    for name, value in want.items():
        np.testing.assert_array_equal(getattr(got, name), value, err_msg=name)


def jax_tree_numpy(out: WindowOutputs) -> WindowOutputs:
    return WindowOutputs(**{f.name: np.asarray(getattr(out, f.name)) for f in dataclasses.fields(WindowOutputs)})


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_ends_request_is_a_stop_id_or_max_tokens(b, seed):
    rng = np.random.default_rng(seed)
    stop_ids = np.where(rng.random((b, STOP_ID_WIDTH)) < 0.5, rng.integers(0, 6, (b, STOP_ID_WIDTH)), -1)
    tokens, num_out, max_tokens = rng.integers(0, 6, b), rng.integers(0, 5, b), rng.integers(1, 5, b)
    fields = {f.name: np.zeros(b, np.int32) for f in dataclasses.fields(WindowRows)}
    rows = WindowRows(**{**fields, "stop_ids": jnp.asarray(stop_ids, jnp.int32),
                         "max_tokens": jnp.asarray(max_tokens, jnp.int32)})
    got = np.asarray(ends_request(rows, jnp.asarray(tokens, jnp.int32), jnp.asarray(num_out, jnp.int32)))
    want = [(tokens[i] in stop_ids[i]) or num_out[i] >= max_tokens[i] for i in range(b)]
    np.testing.assert_array_equal(got, want)

"""Hand-checked cases for every exit rule of DESIGN section 2 (reference TokenExit)."""
from __future__ import annotations

import numpy as np
import pytest

from rltjax.reference.dense_kv import read_planes_for
from rltjax.models.lookahead import lookahead_weights
from rltjax.reference.exits import TokenExit


def exit_depth(mode, probs, *, min_loops=1, max_loops=4, q=0.5, trace_depth=None):
    rule = TokenExit(mode, min_loops=min_loops, max_loops=max_loops, threshold=q, trace_depth=trace_depth)
    for r, p in enumerate(probs, start=1):
        if rule.after_loop(r, p):
            return r
    raise AssertionError("rule never exited within the given loops")


def test_cumulative_hazard_example_from_the_issue():
    # hazards 0.3, 0.3 -> cumulative 0.3, 0.51
    rule = TokenExit("ouro", min_loops=2, max_loops=4, threshold=0.5)
    assert rule.after_loop(1, 0.3) is False
    assert rule.after_loop(2, 0.3) is True
    np.testing.assert_allclose(rule.cdf_trace, [0.3, 0.51], rtol=1e-6)
    assert exit_depth("ouro", [0.3, 0.3, 0.3, 0.3], min_loops=2, q=0.5) == 2
    assert exit_depth("ouro_delayed", [0.3, 0.3, 0.3, 0.3], min_loops=2, q=0.5) == 3


def test_hazards_below_min_loops_still_accumulate():
    # 1 - (1-0.6)(1-0) = 0.6 >= 0.5 at r=2 because r=1 counted although below min_loops
    assert exit_depth("ouro", [0.6, 0.0, 0.0, 0.0], min_loops=2, q=0.5) == 2
    assert exit_depth("ouro", [0.6, 0.0, 0.0, 0.0], min_loops=1, q=0.5) == 1
    assert exit_depth("ouro_delayed", [0.6, 0.0, 0.0, 0.0], min_loops=1, q=0.5) == 2


def test_max_loops_caps_every_mode():
    for mode in ("ouro", "ouro_delayed", "random_lookahead", "fixed"):
        assert exit_depth(mode, [0.0] * 4, max_loops=3, q=0.9) == 3
    # a delayed trigger at max_loops cannot run one more loop
    assert exit_depth("ouro_delayed", [0.0, 0.0, 0.99, 0.0], max_loops=3, q=0.5) == 3


def test_threshold_one_never_exits_early_even_at_hazard_one():
    assert exit_depth("ouro", [1.0, 1.0, 1.0, 1.0], q=1.0) == 4
    assert exit_depth("random_lookahead", [1.0, 1.0, 1.0, 1.0], q=1.0) == 4


def test_threshold_zero_exits_at_min_loops():
    assert exit_depth("ouro", [0.0] * 4, min_loops=2, q=0.0) == 2
    assert exit_depth("ouro_delayed", [0.0] * 4, min_loops=2, q=0.0) == 3


def test_random_lookahead_is_a_direct_score_not_cumulative():
    # 0.45 twice would be cumulative 0.6975 >= 0.6, but lookahead compares each score alone
    assert exit_depth("random_lookahead", [0.45, 0.45, 0.45, 0.45], q=0.6) == 4
    assert exit_depth("random_lookahead", [0.45, 0.7, 0.0, 0.0], q=0.6) == 3
    # trigger at r needs r+1 >= min_loops: with min_loops=3 a trigger at r=1 does not count
    assert exit_depth("random_lookahead", [0.9, 0.0, 0.0, 0.0], min_loops=3, q=0.6) == 4
    assert exit_depth("random_lookahead", [0.9, 0.9, 0.0, 0.0], min_loops=3, q=0.6) == 3
    assert exit_depth("random_lookahead", [0.9, 0.0, 0.0, 0.0], min_loops=1, q=0.6) == 2


def test_trace_and_fixed():
    assert exit_depth("trace", [0.99] * 4, trace_depth=3) == 3
    assert exit_depth("trace", [0.0] * 4, trace_depth=1) == 1
    assert exit_depth("fixed", [0.99] * 4, max_loops=2, q=0.1) == 2


def test_lookahead_weights_depend_only_on_seed():
    np.random.seed(123)
    a = lookahead_weights(7, 64, 0.02)
    np.random.seed(999)
    b = lookahead_weights(7, 64, 0.02)
    assert a.dtype == np.float32 and np.array_equal(a, b)
    assert not np.array_equal(a, lookahead_weights(8, 64, 0.02))
    assert 0.01 < a.std() < 0.03


def test_read_planes_last_exited_min_of_depth_and_exit():
    exits = np.array([4, 2, 3, 0, 0, 0], np.int32)  # positions 0..2 finished; query at position 3
    assert read_planes_for("last_exited", 3, 3, exits, 6)[:4].tolist() == [2, 1, 2, 2]
    assert read_planes_for("last_exited", 1, 3, exits, 6)[:4].tolist() == [0, 0, 0, 0]
    assert read_planes_for("last_exited", 4, 3, exits, 6)[:4].tolist() == [3, 1, 2, 3]


def test_read_planes_shared_single_plane():
    exits = np.array([4, 2, 3, 0], np.int32)
    assert read_planes_for("shared", 3, 3, exits, 4).tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("mode", ["nonsense"])
def test_unknown_mode_is_an_error(mode):
    with pytest.raises(ValueError, match="nonsense"):
        exit_depth(mode, [0.9] * 4, q=0.5)

"""The engine's own exit rules (``EXIT_RULES`` and ``ExitPolicy``), hand-checked at the edges
of DESIGN section 2: a value equal to the threshold, q = 0, q = 1, min_loops and max_loops.

The same rule functions run on the host (numpy, ``ExitPolicy``) and inside decode windows
(jax arrays, traced), so each case runs on both. The reference oracle's ``TokenExit`` has
its own tests (``test_exit_rules.py``); these pin the engine's copy, which no oracle
comparison reaches when a change affects both paths alike."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rltjax.engine.exit_policy import EXIT_RULES, ExitPolicy
from rltjax.engine.sequence import Request
from rltjax.sampling_params import SamplingParams

F32 = np.float32

# (mode, r, min_loops, max_loops, q, cdf, score, signal, triggered) -> (exit_now, trigger)
CASES = [
    # ouro: exit when r >= min_loops and the cumulative probability reaches q (>=, not >)
    ("ouro", 2, 2, 4, 0.5, 0.5, 0.0, 0.0, False, (True, False)),
    ("ouro", 2, 2, 4, 0.5, np.nextafter(F32(0.5), F32(0)), 0.0, 0.0, False, (False, False)),
    ("ouro", 1, 2, 4, 0.5, 1.0, 0.0, 0.0, False, (False, False)),        # below min_loops
    ("ouro", 2, 2, 4, 0.0, 0.0, 0.0, 0.0, False, (True, False)),         # q = 0: exit at min_loops
    ("ouro", 1, 2, 4, 0.0, 0.0, 0.0, 0.0, False, (False, False)),        # ... not before it
    ("ouro", 3, 1, 4, 1.0, 1.0, 0.0, 0.0, False, (False, False)),        # q = 1 never exits early
    ("ouro", 4, 1, 4, 1.0, 0.0, 0.0, 0.0, False, (True, False)),         # max_loops always exits
    ("ouro", 3, 1, 3, 0.9, 0.0, 0.0, 0.0, False, (True, False)),
    # ouro_delayed: the same test sets a trigger; the exit comes one loop later
    ("ouro_delayed", 2, 2, 4, 0.5, 0.5, 0.0, 0.0, False, (False, True)),
    ("ouro_delayed", 2, 2, 4, 0.5, np.nextafter(F32(0.5), F32(0)), 0.0, 0.0, False, (False, False)),
    ("ouro_delayed", 1, 2, 4, 0.5, 1.0, 0.0, 0.0, False, (False, False)),
    ("ouro_delayed", 2, 2, 4, 0.0, 0.0, 0.0, 0.0, False, (False, True)),
    ("ouro_delayed", 3, 2, 4, 0.5, 0.0, 0.0, 0.0, True, (True, False)),   # triggered: exits now
    ("ouro_delayed", 3, 1, 4, 1.0, 1.0, 0.0, 0.0, False, (False, False)),
    ("ouro_delayed", 4, 1, 4, 0.5, 1.0, 0.0, 0.0, False, (True, False)),  # max_loops: no trigger left
    # random_lookahead: the score alone, trigger at r when r + 1 >= min_loops
    ("random_lookahead", 1, 2, 4, 0.6, 0.0, 0.6, 0.0, False, (False, True)),
    ("random_lookahead", 1, 3, 4, 0.6, 0.0, 0.9, 0.0, False, (False, False)),
    ("random_lookahead", 1, 2, 4, 0.6, 0.0, np.nextafter(F32(0.6), F32(0)), 0.0, False, (False, False)),
    ("random_lookahead", 2, 1, 4, 0.6, 0.99, 0.0, 0.0, False, (False, False)),   # cdf is not its input
    ("random_lookahead", 2, 1, 4, 1.0, 0.0, 1.0, 0.0, False, (False, False)),
    ("random_lookahead", 2, 1, 4, 0.6, 0.0, 0.0, 0.0, True, (True, False)),
    # fixed: max_loops only
    ("fixed", 3, 1, 4, 0.0, 1.0, 1.0, 0.0, False, (False, False)),
    ("fixed", 4, 1, 4, 0.0, 1.0, 1.0, 0.0, False, (True, False)),
    # latent_diff: exit when the latent change drops below q (strictly)
    ("latent_diff", 2, 2, 8, 0.1, 0.0, 0.0, 0.05, False, (True, False)),
    ("latent_diff", 2, 2, 8, 0.1, 0.0, 0.0, 0.1, False, (False, False)),
    ("latent_diff", 1, 2, 8, 0.1, 0.0, 0.0, 0.0, False, (False, False)),
    ("latent_diff", 3, 1, 8, 1.0, 0.0, 0.0, 0.0, False, (False, False)),
]


def _arrays(xp, case):
    mode, r, lo, hi, q, cdf, score, signal, triggered, _ = case
    ints = lambda v: xp.asarray([v], xp.int32)                 # noqa: E731
    f32 = lambda v: xp.asarray([v], xp.float32)                # noqa: E731
    return (ints(r), ints(lo), ints(hi), f32(q), f32(cdf), f32(score), f32(signal), xp.asarray([triggered]))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-r{c[1]}-lo{c[2]}-q{c[4]}")
def test_engine_rule_on_numpy_and_jax(case):
    mode, want = case[0], case[-1]
    _, rule = EXIT_RULES[mode]
    got_np = rule(*_arrays(np, case))
    got_jax = jax.jit(rule)(*_arrays(jnp, case))
    for got in (got_np, got_jax):
        assert (bool(np.asarray(got[0])[0]), bool(np.asarray(got[1])[0])) == want


def _request(q: float, min_loops: int, max_loops: int = 4) -> Request:
    params = SamplingParams(exit_threshold=q, min_loops=min_loops, max_loops=max_loops)
    return Request("r", [1], params, seed=0, arrival_index=0, min_loops=min_loops, max_loops=max_loops)


def _depth(policy: ExitPolicy, hazards, q: float, min_loops: int, max_loops: int = 4) -> int:
    """Loops one token runs under ``policy`` with these per-loop hazards (host ExitPolicy)."""
    row = _request(q, min_loops, max_loops)
    for r, h in enumerate(hazards, start=1):
        row.loops_done = r
        if policy.after_pass([row], np.array([h], F32), np.array([h], F32))[0]:
            return r
    raise AssertionError("no exit")


def test_exit_policy_cumulative_hazard_reaches_q_exactly():
    ouro = ExitPolicy("ouro")
    # 1 - (1 - 0.5)(1 - 0.5) = 0.75 == q at loop 2 (exact in float32)
    assert _depth(ouro, [0.5, 0.5, 0.5, 0.5], q=0.75, min_loops=1) == 2
    assert _depth(ouro, [0.5, 0.5, 0.5, 0.5], q=0.8, min_loops=1) == 3
    # hazards below min_loops still accumulate: 0.75 already reached when loop 3 is allowed
    assert _depth(ouro, [0.5, 0.5, 0.0, 0.0], q=0.75, min_loops=3) == 3
    assert _depth(ouro, [0.0, 0.0, 0.0, 0.0], q=0.0, min_loops=2) == 2
    assert _depth(ouro, [1.0, 1.0, 1.0, 1.0], q=1.0, min_loops=1) == 4
    delayed = ExitPolicy("ouro_delayed")
    assert _depth(delayed, [0.5, 0.5, 0.5, 0.5], q=0.75, min_loops=1) == 3
    assert _depth(delayed, [0.0, 0.0, 0.0, 0.0], q=0.0, min_loops=2) == 3


def test_exit_policy_lookahead_and_gateless_models():
    lookahead = ExitPolicy("random_lookahead")
    assert _depth(lookahead, [0.6, 0.0, 0.0, 0.0], q=0.6, min_loops=1) == 2
    assert _depth(lookahead, [0.6, 0.0, 0.0, 0.0], q=0.6, min_loops=3) == 4
    # without a learned gate, the ouro modes run fixed depth (max_loops): the settings resolve it
    from conftest import load_fixture
    from rltjax.engine.settings import resolve_settings
    from rltjax.engine_config import CacheConfig, ExecutionConfig, ExitConfig, SchedulerConfig
    from rltjax.models.base import get_model
    for name, want in (("nanbeige-tiny", "fixed"), ("ouro-tiny", "ouro")):
        ckpt = load_fixture(name)
        settings = resolve_settings(get_model(ckpt.cfg), cache=CacheConfig(), scheduler=SchedulerConfig(),
                                    exit_config=ExitConfig(mode="ouro"), execution=ExecutionConfig(),
                                    max_model_len=64, kv_dtype="float32")
        assert settings.exit_mode == want
    gateless = ExitPolicy("fixed")
    assert _depth(gateless, [1.0, 1.0, 1.0], q=0.0, min_loops=1, max_loops=3) == 3

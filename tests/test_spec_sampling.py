"""The speculative rejection sampler keeps the target distribution: over many seeded rounds on
a small vocabulary, the first token a round emits is distributed as the target's sampler at that
position, and so is the second (given the first draft was kept), for several temperature /
top-k / top-p settings (chi-square); tokens the target's top-k / top-p removes never appear."""
from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from rltjax.engine.window import spec_accept
from rltjax.sampling import sampler_for

V, K, ROWS = 6, 3, 6000


def _rows(temperature, top_k, top_p):
    seeds = np.arange(ROWS, dtype=np.uint64) * 7919 + 3
    full = lambda v, dt: jnp.full((ROWS,), v, dt)          # noqa: E731
    return types.SimpleNamespace(temperature=full(temperature, jnp.float32), top_k=full(top_k, jnp.int32),
                                 top_p=full(top_p, jnp.float32), seed_hi=jnp.asarray(seeds >> 32, jnp.uint32),
                                 seed_lo=jnp.asarray(seeds & 0xFFFFFFFF, jnp.uint32))


def _round(rows, sampler, target_logits, draft_logits, index0=5):
    """K drafts drawn from fixed per-position draft logits, judged against fixed target logits."""
    drafts, q = [], []
    for j in range(K):
        lg = jnp.broadcast_to(draft_logits[j], (ROWS, V))
        drafts.append(spec_accept.draft_tokens(lg, rows, jnp.full((ROWS,), index0 + j, jnp.int32), sampler))
        q.append(spec_accept.probs(lg, rows, sampler))
    target = jnp.broadcast_to(target_logits, (ROWS, K + 1, V))
    tokens, accepted = spec_accept.accept(target, jnp.stack(drafts, 1), jnp.stack(q, 1),
                                          jnp.full((ROWS,), K, jnp.int32), rows, jnp.full((ROWS,), index0, jnp.int32),
                                          sampler)
    return np.asarray(tokens), np.asarray(accepted)


def _check(counts, want):
    """counts [V] of draws against probabilities want [V]: zero-probability tokens never drawn,
    the rest pass a chi-square test at 1e-3."""
    assert counts[want == 0].sum() == 0
    keep = want > 0
    if keep.sum() < 2:
        assert counts[keep].sum() == counts.sum()
        return
    want = want.astype(np.float64)
    expected = want[keep] / want[keep].sum() * counts.sum()
    assert stats.chisquare(counts[keep].astype(np.float64), expected).pvalue > 1e-3, (counts, expected)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 4, 1.0), (1.0, 0, 0.8),
                                                     (0.9, 3, 0.9)])
def test_emitted_tokens_follow_the_target_distribution(temperature, top_k, top_p):
    rng = np.random.default_rng(int(temperature * 10) + top_k)
    target_logits = jnp.asarray(rng.normal(0, 1.2, (K + 1, V)), jnp.float32)
    draft_logits = jnp.asarray(rng.normal(0, 1.2, (K, V)), jnp.float32)     # a different distribution
    rows = _rows(temperature, top_k, top_p)
    sampler = sampler_for([temperature], [top_k], [top_p], V)
    tokens, accepted = _round(rows, sampler, target_logits, draft_logits)
    p = np.asarray(spec_accept.probs(jnp.broadcast_to(target_logits, (ROWS, K + 1, V)), rows, sampler)[0])
    _check(np.bincount(tokens[:, 0], minlength=V), p[0])
    second = accepted >= 1
    assert 0.05 < second.mean() < 0.98          # both branches ran many times
    _check(np.bincount(tokens[second, 1], minlength=V), p[1])


def test_a_draft_equal_to_the_target_is_always_kept():
    logits = jnp.asarray(np.random.default_rng(0).normal(0, 1, (K + 1, V)), jnp.float32)
    rows = _rows(0.8, 0, 1.0)
    _, accepted = _round(rows, "draw", logits, logits[:K])
    assert (accepted == K).all()

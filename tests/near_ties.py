"""Oracle comparison that stops at the oracle's near-ties, for runs whose float32 rounding
differs from the oracle's run to run.

On the GPU, XLA autotunes each process's GEMM algorithms, so the engine's float32 sums round
differently from one process to the next (by ~1e-6). Where the oracle's decision was within
``eps`` of flipping (an exit cdf at the threshold, a sampled token whose draw changes under a
logit perturbation of ``eps``, a top-logprob set whose last member is within ``eps`` of the
next), the engine may rightly decide the other way, and everything after depends on that
decision. Everything before the first such tie must be equal exactly (logprobs to 1e-5).
"""
from __future__ import annotations

import numpy as np

from engine_helpers import check_equal, check_logprobs
from rltjax.sampling import sample_one

F32 = np.float32


def exit_is_near_tie(probs, threshold: float, min_loops: int, eps: float) -> bool:
    """probs: the hazards h_1..h_r the oracle saw for one token (ouro modes). True when the
    cdf 1 - prod(1 - h) came within eps of the threshold at a loop where it could exit."""
    remaining = F32(1)
    for r, prob in enumerate(probs, start=1):
        remaining = F32(remaining * (F32(1) - F32(prob)))
        if r >= min_loops and abs(float(F32(1) - remaining) - threshold) < eps:
            return True
    return False


def sample_is_near_tie(logits, sp, output_index: int, seed: int, eps: float, draws: int = 4) -> bool:
    """True when ``eps`` of logit noise changes the sampled token, or (with logprobs) when the
    top-``sp.logprobs`` set's last member is within eps of the next logit."""
    logits = np.asarray(logits, np.float32)
    if sp.logprobs:
        top = np.sort(logits)[::-1]
        if top[sp.logprobs - 1] - top[sp.logprobs] < eps:
            return True
    if sp.temperature <= 0:
        top2 = np.sort(logits)[-2:]
        return bool(top2[1] - top2[0] < eps)
    kwargs = dict(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, seed=seed, output_index=output_index)
    want = sample_one(logits, **kwargs)
    rng = np.random.default_rng(output_index)
    return any(sample_one(logits + rng.uniform(-eps, eps, logits.shape).astype(np.float32), **kwargs) != want
               for _ in range(draws))


def first_near_tie(ref, sp, *, exit_mode: str, eps: float = 1e-4) -> int:
    """Index of the first output token the oracle's run ``ref`` (generated with
    ``record_logits=True`` and an explicit ``sp.seed``) does not pin down; len(ref.token_ids)
    when none. Token i's depth comes from loop_probs[i] (the loops that made its state) and its
    value from logits[i]. Every loop counts as one that could exit (min_loops 1): a tie
    at a loop that could not exit only shortens the comparison."""
    if ref.logits is None:
        raise ValueError("the oracle's run needs record_logits=True")
    if sp.seed is None:
        raise ValueError("a sampled request needs an explicit seed to be re-drawn")
    for i, logits in enumerate(ref.logits):
        if exit_mode in ("ouro", "ouro_delayed") and sp.exit_threshold < 1 and exit_is_near_tie(
                ref.loop_probs[i], sp.exit_threshold, 1, eps):
            return i
        if sample_is_near_tie(logits, sp, i, sp.seed, eps):
            return i
    return len(ref.token_ids)


def check_equal_before_ties(out, ref, sp, *, exit_mode: str, eps: float = 1e-4) -> int:
    """The engine's output equals the oracle's up to the first near-tie; returns how many
    output tokens were compared."""
    n = first_near_tie(ref, sp, exit_mode=exit_mode, eps=eps)
    if n == len(ref.token_ids):
        check_equal(out, ref)
        return n
    assert out.error is None
    assert out.token_ids[:n] == ref.token_ids[:n]
    assert out.exit_depths[:n] == ref.exit_depths[:n]
    if ref.logprobs is not None:
        check_logprobs(out.logprobs[:n], ref.logprobs[:n])
    return n

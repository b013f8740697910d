"""Self-speculative decoding's arithmetic: how often a shallow draft agrees with full depth,
and the acceptance at which a round of K drafts pays.

A round (``rltjax.engine.window.speculative``) runs its first position and its K drafts one
after another at d loops each, with a head on the first K (each samples the next draft), then
verifies the K + 1 positions in one batch of the remaining D - d loops and their heads. Where
decode is memory-bound, a verify pass over K + 1 positions costs about one pass (the weights
are streamed once). In units of one loop pass, with h = one head's cost:
    round = (K + 1) * d + K * h + (D - d) + h,   plain decoding = D + h per token.
With each draft accepted independently with probability a (greedy), a round yields
E = (1 - a^(K+1)) / (1 - a) tokens (the accepted drafts and the target's own token).
Break-even: E(a) * (D + h) = round. ``scripts/spec_acceptance.py`` prints both.
"""
from __future__ import annotations


def expected_tokens(a: float, k: int) -> float:
    """Tokens a round of k drafts yields when each draft is accepted with probability a."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def round_cost(k: int, d: int, depth: int, head: float) -> float:
    """A round's cost in loop passes: k + 1 positions of d loops, k draft heads, one verify of
    depth - d loops over the k + 1 positions, and their heads (one batch)."""
    return (k + 1) * d + k * head + (depth - d) + head


def break_even(k: int, d: int, depth: int, head: float) -> float:
    """The acceptance rate at which a round of k drafts costs what plain decoding of its
    tokens does (with d < depth it always pays once every draft is accepted)."""
    plain = depth + head
    cost = round_cost(k, d, depth, head)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) * plain < cost else (lo, mid)
    return hi

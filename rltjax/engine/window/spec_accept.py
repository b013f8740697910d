"""Speculative rounds' sampling on the device: the drafts, and which of them the target keeps.

Greedy rows keep a draft while it is the target's argmax and then emit the target's own token
(the correction, or the bonus token when every draft was kept): exactly what plain decoding at
the target depth emits. Sampled rows run standard speculative rejection sampling against the
distributions the plain sampler draws from (temperature, then top-k, then top-p:
``sampling.sampling_probs``): draft x at output index i is kept when u < p(x) / q(x), the first
rejected one is replaced by a draw from max(p - q, 0) normalised, and a round whose drafts were
all kept draws its bonus token from p with the plain sampler's own key, so a row that drafts
nothing samples exactly the token plain decoding samples. Every draw's key depends only on
(request seed, output index, stream), never on the batch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rltjax.sampling import row_keys, sample_tokens, sampling_probs

DRAFT_STREAM, ACCEPT_STREAM, RESIDUAL_STREAM = 1, 2, 3


def draft_tokens(logits, rows, index, sampler: str):
    """logits [B, V] f32 at the draft depth -> the drafts [B] for output index ``index`` [B]
    (greedy rows: the argmax). rows: anything with temperature, top_k, top_p, seed_hi, seed_lo."""
    return sample_tokens(logits, rows.temperature, rows.top_k, rows.top_p, rows.seed_hi, rows.seed_lo, index,
                         sampler=sampler, stream=DRAFT_STREAM)


def probs(logits, rows, sampler: str):
    """logits [B, ..., V] -> the sampler's distributions [B, ..., V] f32 per row's settings."""
    shape = logits.shape
    flat = logits.reshape(shape[0], -1, shape[-1])
    one = jax.vmap(lambda lg, t, k, p: jax.vmap(lambda r: sampling_probs(r, t, k, p, sampler == "truncate"))(lg))
    return one(flat, rows.temperature, rows.top_k, rows.top_p).reshape(shape)


def accept(target, drafts, draft_probs, num_drafts, rows, index0, sampler: str):
    """One round's verdict per row.

    target [B, K + 1, V] f32: the target's logits at the round's K + 1 positions; drafts [B, K]
    int32: draft j is the proposal for output index index0 + j; draft_probs [B, K, V] (None for
    the greedy sampler): the distribution each draft was drawn from; num_drafts [B]: how many
    of the K the row made (0: plain decoding); index0 [B] the round's first output index.
    -> (tokens [B, K + 1] int32: the first ``made`` are the round's output, accepted [B] int32:
    drafts kept, made = accepted + 1)."""
    b, k = drafts.shape
    cols = jnp.arange(k)[None, :]
    if sampler == "greedy":
        best = jnp.argmax(target, axis=-1).astype(jnp.int32)                      # [B, K + 1]
        kept = (best[:, :k] == drafts) & (cols < num_drafts[:, None])
        accepted = jnp.sum(jnp.cumprod(kept, axis=1), axis=1).astype(jnp.int32)
        return best, accepted
    p = probs(target, rows, sampler)                                                 # [B, K + 1, V]
    px = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    qx = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    u = jax.vmap(lambda j: jax.vmap(jax.random.uniform)(
        row_keys(rows.seed_hi, rows.seed_lo, index0 + j, ACCEPT_STREAM)), out_axes=1)(jnp.arange(k))   # [B, K]
    kept = (u * qx < px) & (cols < num_drafts[:, None])
    accepted = jnp.sum(jnp.cumprod(kept, axis=1), axis=1).astype(jnp.int32)
    at = accepted[:, None, None]
    bonus = sample_tokens(jnp.take_along_axis(target, at, axis=1)[:, 0], rows.temperature, rows.top_k, rows.top_p,
                          rows.seed_hi, rows.seed_lo, index0 + accepted, sampler=sampler)
    residual = jnp.maximum(jnp.take_along_axis(p, at, axis=1)[:, 0]
                           - jnp.take_along_axis(draft_probs, jnp.minimum(at, k - 1), axis=1)[:, 0], 0.0)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, residual.shape[1:], jnp.float32))(
        row_keys(rows.seed_hi, rows.seed_lo, index0 + accepted, RESIDUAL_STREAM))
    fixed = jnp.argmax(jnp.log(residual) + gumbel, axis=-1).astype(jnp.int32)
    # a rejection leaves mass in max(p - q, 0) (else p(x) >= q(x) would have kept x)
    last = jnp.where((accepted < num_drafts) & (jnp.sum(residual, axis=-1) > 0), fixed, bonus)
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    every = jnp.arange(k + 1)[None, :]
    tokens = jnp.where(every < accepted[:, None], padded, jnp.where(every == accepted[:, None], last[:, None], 0))
    return tokens.astype(jnp.int32), accepted

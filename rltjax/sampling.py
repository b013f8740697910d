"""Token sampling on float32 logits, row by row, batch-invariant.

Order: temperature, then top-k, then top-p (the smallest set of tokens whose
cumulative probability reaches p; the most likely token is always kept), then
one draw with a key derived only from the request's seed and the output index.
Nothing depends on other rows, so a request samples the same tokens whatever
else shares its batch. Temperature 0 is greedy argmax of the raw logits.
Logprobs are those of the raw model distribution (log_softmax of the logits),
as vLLM reports them by default.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def split_seed(seed: int) -> tuple[int, int]:
    """A 63-bit seed as two uint32 words (device keys are built from 32-bit words)."""
    return (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF


def sample_key(seed_hi: jax.Array, seed_lo: jax.Array, output_index: jax.Array) -> jax.Array:
    """The PRNG key of one output token: depends on (seed, output index) only."""
    key = jax.random.key(0)
    key = jax.random.fold_in(key, seed_hi)
    key = jax.random.fold_in(key, seed_lo)
    return jax.random.fold_in(key, output_index)


def row_keys(seed_hi, seed_lo, output_index, stream: int = 0):
    """[B] keys of (seed, output index); a nonzero ``stream`` gives keys of their own (a
    speculative round's drafts, acceptance and residual draws)."""
    keys = jax.vmap(sample_key)(seed_hi, seed_lo, output_index)
    return keys if not stream else jax.vmap(lambda k: jax.random.fold_in(k, stream))(keys)


SAMPLERS = ("greedy", "draw", "truncate")


def _sample_row(logits, temperature, top_k, top_p, key, truncate: bool):
    """logits [V] f32 -> token id (int32). One Gumbel-max draw over the vocabulary in
    token order, restricted to the top-k / top-p set when ``truncate``; a row whose
    truncation keeps every token draws the same token either way."""
    vocab = logits.shape[0]
    greedy = jnp.argmax(logits).astype(jnp.int32)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
    noisy = scaled + jax.random.gumbel(key, (vocab,), jnp.float32)
    if truncate:
        noisy = jnp.where(keep_mask(scaled, top_k, top_p), noisy, -jnp.inf)
    sampled = jnp.argmax(noisy).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def keep_mask(scaled, top_k, top_p):
    """scaled [V] (temperature applied) -> [V] bool, in token order: the top-k tokens, then of
    those the smallest set whose probability reaches top_p (the most likely always kept)."""
    vocab = scaled.shape[0]
    order = jnp.argsort(-scaled, stable=True)                     # [V] most likely first
    ranked = scaled[order]
    rank = jnp.arange(vocab)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    keep = rank < k
    probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf))
    mass_before = jnp.cumsum(probs) - probs
    keep = keep & ((mass_before < top_p) | (rank == 0) | (top_p >= 1.0))
    return jnp.zeros(vocab, bool).at[order].set(keep)


def sampling_probs(logits, temperature, top_k, top_p, truncate: bool):
    """The distribution ``_sample_row`` draws from, one row: logits [V] f32 -> probabilities
    [V] f32 (a greedy row: one-hot at its argmax). Speculative decoding's rejection sampler
    compares the draft's and the target's (``engine.window.spec_accept``)."""
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
    if truncate:
        scaled = jnp.where(keep_mask(scaled, top_k, top_p), scaled, -jnp.inf)
    greedy = jax.nn.one_hot(jnp.argmax(logits), logits.shape[0], dtype=jnp.float32)
    return jnp.where(temperature > 0, jax.nn.softmax(scaled), greedy)


def sampler_for(temperature, top_k, top_p, vocab_size: int) -> str:
    """The cheapest of ``SAMPLERS`` that draws, for rows with these settings (host arrays),
    exactly the tokens "truncate" draws: "greedy" when every row is greedy, "draw" when no
    sampled row truncates (top-k off or >= vocab, top-p 1), else "truncate"."""
    temperature, top_k, top_p = (np.asarray(a) for a in (temperature, top_k, top_p))
    sampled = temperature > 0
    if not np.any(sampled):
        return "greedy"
    truncates = ((top_k > 0) & (top_k < vocab_size)) | (top_p < 1.0)
    return "truncate" if np.any(truncates & sampled) else "draw"


def window_sampler(sampling_params, vocab_size: int) -> str:
    """A decode window head's sampler for requests with these SamplingParams: the cheapest of
    SAMPLERS exact for them; "truncate" (the one computing logprobs) when any asks for logprobs
    (0 too: the sampled token's own). A window executable exists per sampler and row bucket."""
    if any(p.logprobs is not None for p in sampling_params):
        return "truncate"
    return sampler_for([p.temperature for p in sampling_params], [p.top_k for p in sampling_params],
                       [p.top_p for p in sampling_params], vocab_size)


@functools.partial(jax.jit, static_argnames=("sampler", "stream"))
def sample_tokens(logits, temperature, top_k, top_p, seed_hi, seed_lo, output_index, sampler: str = "auto",
                  stream: int = 0):
    """Sample one token per row.

    logits [B, V] f32; temperature/top_p [B] f32; top_k [B] int32 (<= 0: off);
    seed_hi/seed_lo [B] uint32; output_index [B] int32 -> tokens [B] int32.
    sampler: one of ``SAMPLERS``, when the caller knows it is exact for these rows
    (``sampler_for``): no data-dependent branch, so XLA's GPU runtime reads nothing back
    on the host. "auto": an all-greedy batch skips the full-vocabulary sort through a
    ``lax.cond``, whose predicate the GPU runtime reads on the host. stream: 0 for the tokens
    a request outputs; another number draws from keys of its own (speculative drafts).
    """
    def draw(truncate: bool):
        keys = row_keys(seed_hi, seed_lo, output_index, stream)
        row = functools.partial(_sample_row, truncate=truncate)
        return jax.vmap(row)(logits, temperature, top_k, top_p, keys)

    argmax = lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if sampler == "auto":   # a greedy row gives the same argmax on either branch: batch-invariant
        return jax.lax.cond(jnp.all(temperature <= 0), argmax, lambda: draw(True))
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler={sampler!r}: must be 'auto' or one of {SAMPLERS}")
    return argmax() if sampler == "greedy" else draw(sampler == "truncate")


@functools.partial(jax.jit, static_argnames=("num_top",))
def token_logprobs(logits, tokens, num_top: int):
    """logits [B, V] f32, tokens [B] -> (chosen [B], top_ids [B, n], top_logprobs [B, n])."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logp, num_top) if num_top else (
        jnp.zeros((logp.shape[0], 0), jnp.float32), jnp.zeros((logp.shape[0], 0), jnp.int32))
    return chosen, top_ids.astype(jnp.int32), top_lp


def sample_one(logits: np.ndarray, *, temperature: float, top_k: int, top_p: float,
               seed: int, output_index: int) -> int:
    """Host convenience for one row (used by the reference oracle)."""
    hi, lo = split_seed(seed)
    out = sample_tokens(jnp.asarray(logits, jnp.float32)[None], jnp.float32([temperature]),
                        jnp.int32([top_k]), jnp.float32([top_p]), jnp.uint32([hi]),
                        jnp.uint32([lo]), jnp.int32([output_index]))
    return int(out[0])

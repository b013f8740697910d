"""vLLM's tokenizer endpoints: /tokenize, /detokenize and /tokenizer_info.

lm-eval's ``local-completions`` uses them as its "remote" tokenizer, so an
evaluation needs no copy of the tokenizer on the client side (and no
``transformers``): the ids it scores are the server's own.
"""
from __future__ import annotations

import asyncio

from rltjax.entrypoints.server.protocol import APIError, DetokenizeRequest, TokenizeRequest, parse_body
from rltjax.entrypoints.server.serving import ServingContext
from rltjax.entrypoints.server.tokenize_pool import TOKENIZE_LIMIT
from rltjax.tokenizer import CHATML_TEMPLATE


async def tokenize(ctx: ServingContext, raw: bytes) -> dict:
    prep = await ctx.read(TokenizeRequest, raw)
    return {"count": len(prep.ids), "max_model_len": ctx.engine.engine.scheduler.max_model_len,
            "tokens": prep.ids}


async def detokenize(ctx: ServingContext, raw: bytes) -> dict:
    tok = _tokenizer(ctx)
    limit = TOKENIZE_LIMIT * ctx.engine.engine.scheduler.max_model_len
    return {"prompt": await asyncio.to_thread(_detokenize, ctx, tok, raw, limit)}


def _detokenize(ctx: ServingContext, tok, raw: bytes, limit: int) -> str:
    """In a thread: parsing, the checks and the decode hold the GIL for as long as the body is big."""
    body = parse_body(DetokenizeRequest, raw)
    _check_model(ctx, body.model)
    if len(body.tokens) > limit:
        raise APIError(400, f"tokens: {len(body.tokens)} ids; /detokenize takes up to {limit} "
                            f"({TOKENIZE_LIMIT} x the context)", "tokens")
    bad = [t for t in body.tokens if not 0 <= t < tok.vocab_size]
    if bad:
        raise APIError(400, f"tokens: ids {bad[:8]} are outside the vocabulary (size {tok.vocab_size})", "tokens")
    return tok.decode(body.tokens, False)


def tokenizer_info(ctx: ServingContext) -> dict:
    tok = _tokenizer(ctx)
    special = {name: tok.special_strings.get(name) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    if special["eos_token"] is None and tok.eos_token_ids:
        special["eos_token"] = tok.backend.id_to_token(tok.eos_token_ids[0])
    return {"tokenizer_class": "PreTrainedTokenizerFast", **special,
            "chat_template": tok.chat_template or CHATML_TEMPLATE,
            "model_max_length": ctx.engine.engine.scheduler.max_model_len}


def _tokenizer(ctx: ServingContext):
    ctx.available()
    tok = ctx.engine.engine.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer")
    return tok


def _check_model(ctx: ServingContext, model: str | None) -> None:
    if model is not None and model not in ctx.served_names:
        raise APIError(404, f"The model `{model}` does not exist.", "model")

"""The FastAPI application: routes, the ASGI guard (auth, body limit, draining), error mapping.

Every error leaves as OpenAI's ``{"error": {"message", "type", "param", "code"}}``.
The guard is plain ASGI rather than ``BaseHTTPMiddleware``, which would buffer
streaming responses and hide client disconnects from the handlers.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from rltjax.entrypoints.server import tokenization
from rltjax.entrypoints.server.async_engine import AsyncEngine
from rltjax.entrypoints.server.metrics import ServerMetrics
from rltjax.entrypoints.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from rltjax.entrypoints.server.serving import ServingContext, create_chat_completion, create_completion

logger = logging.getLogger("rltjax.server")


# Routes behind the API key, draining and the JSON-only rule (/health and /metrics are not).
_GUARDED = ("/v1", "/tokenize", "/detokenize", "/tokenizer_info")


class Guard:
    """API key on the API routes (401), draining (503), JSON bodies only on POST (415: a browser
    may send a form or text/plain across origins without asking first), and the request body
    size limit (413). Every refusal is counted in ``rltjax:request_rejected``."""

    def __init__(self, app, *, engine: AsyncEngine, api_key: str | None, max_request_bytes: int | None,
                 metrics: ServerMetrics):
        self.app, self.engine, self.metrics = app, engine, metrics
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_bytes = max_request_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        err = self._refuse(scope)
        if err is not None:
            self.metrics.rejected.labels(str(err.status)).inc()
            return await JSONResponse(err.body(), status_code=err.status, headers=err.headers)(scope, receive, send)
        if self.max_bytes is not None:
            receive = _limited(receive, self.max_bytes)
        await self.app(scope, receive, send)

    def _refuse(self, scope) -> APIError | None:
        headers = dict(scope["headers"])
        if scope["path"].startswith(_GUARDED):
            if self.expected and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                return APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                headers={"WWW-Authenticate": "Bearer"})
            if self.engine.draining:
                return APIError(503, "the server is shutting down")
            kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if scope["method"] == "POST" and kind != b"application/json":
                return APIError(415, f"Content-Type must be application/json, not {kind.decode(errors='replace')!r}")
        length = headers.get(b"content-length")
        if self.max_bytes is not None and length is not None:
            if not length.isdigit():
                return APIError(400, "bad Content-Length header")
            if int(length) > self.max_bytes:
                return APIError(413, f"request body exceeds {self.max_bytes} bytes")
        return None


def _limited(receive, limit: int):
    """A receive that fails once a (chunked) body grows past ``limit`` bytes."""
    seen = 0

    async def wrapped():
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise APIError(413, f"request body exceeds {limit} bytes")
        return message
    return wrapped


def build_app(engine: AsyncEngine, *, served_names: list[str], metrics: ServerMetrics | None = None,
              api_key: str | None = None, max_request_bytes: int | None = None,
              max_waiting_requests: int | None = None, model_root: str | None = None,
              tokenizer_pool_size: int = 2, reasoning_parser: str | None = None) -> FastAPI:
    """The server app around an AsyncEngine (started and stopped with the app's lifespan)."""
    metrics = metrics or engine.metrics or ServerMetrics()
    engine.metrics = metrics
    ctx = ServingContext(engine, list(served_names), max_waiting_requests, tokenizer_pool_size, reasoning_parser)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.begin_drain()
        await asyncio.to_thread(engine.stop)
        ctx.close()

    app = FastAPI(title="rltjax", lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.ctx = engine, metrics, ctx
    app.add_middleware(Guard, engine=engine, api_key=api_key, max_request_bytes=max_request_bytes, metrics=metrics)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        metrics.rejected.labels(str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse(error_body(400, str(exc)), status_code=400)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect):   # mid-upload: nothing was queued
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error in %s", request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)

    @app.get("/health")
    async def health():
        if engine.ready and not engine.draining:
            return Response(status_code=200)
        why = engine.error or ("shutting down" if engine.draining else "loading")
        return JSONResponse(error_body(503, f"not ready: {why}"), status_code=503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models():
        max_len = engine.engine.scheduler.max_model_len if engine.ready else None
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "rltjax",
             "root": model_root or served_names[0], "max_model_len": max_len} for name in served_names]}

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await tokenization.tokenize(ctx, await request.body())

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await tokenization.detokenize(ctx, await request.body())

    @app.get("/tokenizer_info")
    async def tokenizer_info_route():
        return tokenization.tokenizer_info(ctx)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await create_completion(ctx, request, await ctx.read(CompletionRequest, await request.body()))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await create_chat_completion(ctx, request,
                                            await ctx.read(ChatCompletionRequest, await request.body()))

    return app

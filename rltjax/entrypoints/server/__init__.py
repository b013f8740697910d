"""OpenAI-compatible HTTP server (``rltjax serve``).

Modules, one concern each: ``protocol`` (request models, errors), ``async_engine``
(the engine thread), ``request_stream`` (one request's loop-side handle),
``serving`` (request flow), ``formatting`` (response bodies), ``metrics``
(Prometheus), ``app`` (routes and guard), ``launcher`` (CLI + uvicorn).
Nothing heavy is imported here, so ``rltjax --help`` stays fast.
"""

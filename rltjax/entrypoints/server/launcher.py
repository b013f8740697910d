"""``rltjax serve``: flags, and running the app under uvicorn with a draining shutdown.

The HTTP server starts at once and the engine loads (and compiles) in its own
thread meanwhile, so /health can answer 503 until the model is ready, as load
balancers expect; a model that fails to load stops the server with the error.
On SIGINT/SIGTERM the server drains: new requests get 503, in-flight ones run
to completion (a second Ctrl+C forces the exit), then the engine stops.
"""
from __future__ import annotations

import argparse
import contextlib
import os

from rltjax.engine.rules import ServerInputs, check_rules
from rltjax.entrypoints.engine_args import add_engine_arguments, configs_from_args
from rltjax.entrypoints.server.reasoning import REASONING_PARSERS


API_KEY_ENV = "RLTJAX_API_KEY"


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory (Hugging Face safetensors or `rltjax convert` output)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) the API accepts, the first reported (default: MODEL as given)")
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV}, which keeps "
                        f"the key out of the process list)")
    g.add_argument("--max-waiting-requests", type=int, default=1024, metavar="N",
                   help="queued requests before new ones get 429")
    g.add_argument("--max-request-bytes", type=int, default=10 * 1024 * 1024, metavar="N",
                   help="largest request body accepted (413 beyond)")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split a thinking model's <think>...</think> into reasoning_content in chat responses")
    g.add_argument("--tokenizer-pool-size", type=int, default=2, metavar="N",
                   help="processes that tokenize long prompts, so a 10 MB prompt never pauses the server "
                        "(0: tokenize every prompt in a thread of the server process)")
    g = p.add_argument_group("prefill/decode disaggregation (a worker process each; 0 and 0: one engine here)")
    g.add_argument("--num-prefill-workers", type=int, default=0, metavar="P", help="processes that run prompts")
    g.add_argument("--num-decode-workers", type=int, default=0, metavar="D",
                   help="processes that decode (each pulls a prompt's KV from its prefill worker)")
    g.add_argument("--disagg-address", default="127.0.0.1:0", metavar="HOST:PORT",
                   help="where the workers reach this server (port 0: any free one)")
    g.add_argument("--disagg-remote-workers", action="store_true",
                   help="wait for P + D workers started elsewhere: `python -m rltjax.disagg.worker HOST:PORT K` "
                        "(RLTJAX_DISAGG_KEY: one hex key)")
    g = p.add_argument_group("several hosts (jax.distributed: one process per host, the server on process 0)")
    g.add_argument("--num-processes", type=int, default=1, metavar="N", help="processes in the job")
    g.add_argument("--process-id", type=int, default=0, metavar="I", help="this process (0 serves HTTP)")
    g.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="process 0's address for jax.distributed (every process passes the same)")
    add_engine_arguments(p)


def make_server(app, *, host: str, port: int, log_level: str = "info"):
    """A uvicorn server that marks the engine as draining before it stops accepting work."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None):
            app.state.engine.begin_drain()
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn raises a captured SIGTERM / SIGINT again once it has shut down, so the
            # process would die by the signal (exit -15) after a complete drain: a drained
            # shutdown is a clean exit (0). A signal during a failed run is still raised.
            with super().capture_signals():
                yield
                self._captured_signals.clear()

    return DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                         timeout_keep_alive=5, access_log=log_level == "debug"))


def run_serve(args: argparse.Namespace, engine_wrapper=None) -> int:
    from rltjax.entrypoints.llm import build_engine
    from rltjax.entrypoints.server.app import build_app
    from rltjax.entrypoints.server.async_engine import AsyncEngine

    from rltjax.checkpoints.loader import check_model_dir
    from rltjax.config import load_hf_config

    configs = configs_from_args(args)   # bad flags fail here, before anything starts
    check_rules(ServerInputs(args.num_prefill_workers, args.num_decode_workers, args.num_processes,
                             args.data_parallel_size))
    if args.num_processes > 1:
        return _run_multihost(args, configs)
    for flag in ("max_waiting_requests", "max_request_bytes", "tokenizer_pool_size", "num_prefill_workers",
                 "num_decode_workers"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0")
    # a model that cannot load fails here, with one error, before the HTTP server starts
    load_hf_config(check_model_dir(args.model), configs["hf_overrides"])
    if args.reasoning_parser:
        from rltjax.entrypoints.server.reasoning import check_tokenizer
        from rltjax.tokenizer import Tokenizer
        check_tokenizer(Tokenizer.from_dir(args.model), args.reasoning_parser)
    server = None

    def fatal(message: str) -> None:     # reported once, by the command, after the server stops
        if server is not None:
            server.should_exit = True

    wrap = engine_wrapper or (lambda engine: engine)
    factory = lambda: wrap(build_engine(args.model, **configs))     # noqa: E731
    if args.num_prefill_workers or args.num_decode_workers:
        from rltjax.disagg.coordinator import DisaggEngine
        factory = lambda: DisaggEngine(args.model, configs, num_prefill=args.num_prefill_workers,   # noqa: E731
                                       num_decode=args.num_decode_workers, address=args.disagg_address,
                                       remote_workers=args.disagg_remote_workers)
    engine = AsyncEngine(factory, on_fatal=fatal)
    app = build_app(engine, served_names=args.served_model_name or [args.model], api_key=args.api_key,
                    max_request_bytes=args.max_request_bytes, max_waiting_requests=args.max_waiting_requests,
                    model_root=args.model, tokenizer_pool_size=args.tokenizer_pool_size,
                    reasoning_parser=args.reasoning_parser)
    server = make_server(app, host=args.host, port=args.port, log_level=args.log_level)
    try:
        server.run()
    except KeyboardInterrupt:   # uvicorn re-raises the SIGINT it drained for; the drain is done
        pass
    if engine.error:
        raise ValueError(engine.error)
    return 0


def _run_multihost(args: argparse.Namespace, configs: dict) -> int:
    """Process 0 serves with a ``Leader`` engine; the others follow its steps until it stops."""
    from rltjax.engine import multihost
    from rltjax.entrypoints.llm import build_engine

    if args.coordinator_address is None or not 0 <= args.process_id < args.num_processes:
        raise ValueError("--num-processes > 1 needs --coordinator-address HOST:PORT and 0 <= --process-id < "
                         "--num-processes")
    multihost.initialize(args.coordinator_address, args.num_processes, args.process_id)
    if args.process_id == 0:
        args.num_processes = 1           # what follows serves as usual, around the leader
        return run_serve(args, engine_wrapper=multihost.Leader)
    steps = multihost.follow(build_engine(args.model, **configs))
    import logging
    logging.getLogger("rltjax").info(f"process {args.process_id}: process 0 stopped after {steps} steps")
    return 0

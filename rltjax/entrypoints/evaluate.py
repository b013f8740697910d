"""``rltjax eval``: lm-eval's tasks against this engine, served in this process.

The engine runs behind the OpenAI server on 127.0.0.1 (a free port), and
lm-eval talks to it exactly as it would to ``rltjax serve``: ``local-completions``
with the server's own tokenizer (``/tokenize``, so no ``transformers`` is
needed), or ``local-chat-completions`` with ``--apply-chat-template``. The
default task is GSM8K with chain of thought (lm-eval's ``gsm8k_cot``, 8 shots,
greedy); its ``strict-match`` row is the one to compare. lm-eval fetches its
datasets from the Hugging Face Hub, so the machine needs access to it (or a
filled ``HF_HOME`` cache), or use ``--include-path`` with local tasks.
"""
from __future__ import annotations

import argparse
import json
import logging
import socket
import threading
import time

from rltjax.entrypoints.engine_args import add_engine_arguments, configs_from_args

log = logging.getLogger("rltjax")
SERVED_NAME = "rltjax-eval"


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory (Hugging Face safetensors or `rltjax convert` output)")
    g = p.add_argument_group("evaluation (lm-eval)")
    g.add_argument("--tasks", default="gsm8k_cot", metavar="T1,T2",
                   help="lm-eval task names, comma-separated (default: gsm8k_cot, greedy, strict match)")
    g.add_argument("--num-fewshot", type=int, default=None, metavar="N", help="few-shot examples (task default)")
    g.add_argument("--limit", type=float, default=None, metavar="N",
                   help="examples per task (a fraction below 1); default: all")
    g.add_argument("--num-concurrent", type=int, default=16, metavar="N", help="requests lm-eval keeps in flight")
    g.add_argument("--apply-chat-template", action="store_true",
                   help="send chat messages through /v1/chat/completions (generation tasks only)")
    g.add_argument("--include-path", default=None, metavar="DIR", help="a folder of extra task YAML files")
    g.add_argument("--output-path", default=None, metavar="FILE", help="write lm-eval's results here (JSON)")
    add_engine_arguments(p)


def _serve(args, configs) -> tuple[str, object, threading.Thread, object]:
    from rltjax.entrypoints.llm import build_engine
    from rltjax.entrypoints.server.app import build_app
    from rltjax.entrypoints.server.async_engine import AsyncEngine
    from rltjax.entrypoints.server.launcher import make_server

    engine = AsyncEngine(lambda: build_engine(args.model, **configs))
    app = build_app(engine, served_names=[SERVED_NAME], model_root=args.model)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = make_server(app, host="127.0.0.1", port=0, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not engine.ready:
        if engine.error or not thread.is_alive():
            raise ValueError(f"the engine did not start: {engine.error or 'the server stopped'}")
        time.sleep(0.1)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", engine, thread, server


def run_eval(args: argparse.Namespace) -> int:
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import make_table
    except ImportError:
        raise ValueError("rltjax eval needs lm-eval: pip install 'rltjax[eval]'") from None
    from rltjax.checkpoints.loader import check_model_dir
    from rltjax.config import load_hf_config

    configs = configs_from_args(args)
    load_hf_config(check_model_dir(args.model), configs["hf_overrides"])
    url, engine, thread, server = _serve(args, configs)
    chat = args.apply_chat_template
    model_args = {"base_url": url + ("/v1/chat/completions" if chat else "/v1/completions"), "model": SERVED_NAME,
                  "max_length": engine.engine.scheduler.max_model_len, "num_concurrent": args.num_concurrent,
                  "max_retries": 3}
    model_args.update({"tokenizer_backend": None, "tokenized_requests": False} if chat
                      else {"tokenizer_backend": "remote"})
    try:
        results = lm_eval.simple_evaluate(
            model="local-chat-completions" if chat else "local-completions", model_args=model_args,
            tasks=args.tasks.split(","), num_fewshot=args.num_fewshot, limit=args.limit, apply_chat_template=chat,
            task_manager=TaskManager(include_path=args.include_path))
    finally:
        server.should_exit = True
        thread.join(60)
    print(make_table(results))
    if args.output_path:
        with open(args.output_path, "w") as f:
            json.dump({k: results[k] for k in ("results", "configs", "versions", "n-shot") if k in results}, f,
                      indent=2, default=str)
        log.info(f"results written to {args.output_path}")
    return 0

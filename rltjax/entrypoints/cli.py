"""The ``rltjax`` command: ``generate``, ``serve``, ``bench``, ``eval`` and ``convert``.

``generate`` runs the batched engine (``LLM``) over the given prompts; with
``--engine reference`` it runs the dense reference oracle instead (exact,
one request at a time, slow). Without ``--model`` it uses a tiny random-weight
Ouro checkpoint that rltjax writes itself (``checkpoints.tiny``), so the
command works on a fresh machine: its text is gibberish by construction.
``serve`` runs the OpenAI-compatible HTTP server (``rltjax.entrypoints.server``);
``eval`` runs lm-eval's tasks against it (``rltjax.entrypoints.evaluate``).
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Sequence

from rltjax.entrypoints.cli_format import HelpFormatter, add_log_level, setup_logging
from rltjax.entrypoints.engine_args import add_engine_arguments, configs_from_args
from rltjax.entrypoints.server.launcher import add_serve_arguments, run_serve

log = logging.getLogger("rltjax")

DEFAULT_PROMPT = "The looped model thinks in loops:"


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("input")
    g.add_argument("--model", default=None, metavar="DIR",
                   help="model directory (Hugging Face or `rltjax convert`; default: a tiny random-weight Ouro)")
    g.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help=f"a prompt; repeat for several (default: {DEFAULT_PROMPT!r})")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the checkpoint's chat template")
    g.add_argument("--engine", default="batched", choices=["batched", "reference"],
                   help="batched: the serving engine; reference: the dense oracle (exact, slow)")
    g = p.add_argument_group("sampling (every prompt)")
    g.add_argument("--max-tokens", type=int, default=32, metavar="N", help="tokens to generate per prompt")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0: greedy")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="keep the smallest set of mass P")
    g.add_argument("--seed", type=int, default=0, metavar="N", help="sampling seed of each request")
    g.add_argument("--ignore-eos", action="store_true", help="go on past end-of-sequence tokens")
    g = p.add_argument_group("loops (every prompt)")
    g.add_argument("--exit-threshold", type=float, default=1.0, metavar="Q",
                   help="exit once the exit probability reaches Q (1: always --max-loops)")
    g.add_argument("--min-loops", type=int, default=1, metavar="N", help="loops every token runs at least")
    g.add_argument("--max-loops", type=int, default=None, metavar="N",
                   help="loops a token runs at most (default: the model's loop count)")
    add_engine_arguments(p, compile_ahead=False)


def _reference_outputs(model_dir, args, prompts, sp, configs):
    from rltjax.checkpoints.loader import load_checkpoint
    from rltjax.models.base import get_model
    from rltjax.reference.generate import ReferenceModel
    from rltjax.tokenizer import Tokenizer
    ckpt = load_checkpoint(model_dir, dtype=configs["dtype"], hf_overrides=configs["hf_overrides"])
    tokenizer = Tokenizer.from_dir(ckpt.model_dir)
    runner = ReferenceModel(get_model(ckpt.cfg), ckpt.params, kv_layout=args.kv_layout,
                            exit_config=configs["exit_config"])
    for text in prompts:
        out = runner.generate(tokenizer.encode(text), sp, eos_token_ids=tokenizer.eos_token_ids)
        yield text, tokenizer.decode(out.token_ids), out.exit_depths, out.finish_reason, len(out.token_ids)


def run_generate(args: argparse.Namespace) -> int:
    from rltjax.checkpoints.tiny import default_demo_checkpoint
    from rltjax.entrypoints.llm import LLM
    from rltjax.sampling_params import SamplingParams

    model_dir = args.model
    if model_dir is None:
        model_dir = default_demo_checkpoint()
        log.info(f"no --model given: the built-in tiny Ouro checkpoint with RANDOM weights ({model_dir}): "
                 f"expect gibberish text; the exit depths are real")
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, seed=args.seed, min_loops=args.min_loops,
                        max_loops=args.max_loops, exit_threshold=args.exit_threshold,
                        ignore_eos=args.ignore_eos)
    configs = configs_from_args(args)
    prompts = args.prompt or [DEFAULT_PROMPT]
    t0 = time.perf_counter()
    if args.engine == "reference":
        if args.chat:
            raise ValueError("--chat is not supported with --engine reference")
        results = list(_reference_outputs(model_dir, args, prompts, sp, configs))
    else:
        llm = LLM(str(model_dir), **configs)
        if args.chat:
            prompts = [llm.get_tokenizer().apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        results = [(p, o.text, o.exit_depths, o.finish_reason, len(o.token_ids))
                   for p, o in zip(prompts, llm.generate(prompts, sp))]
    elapsed = time.perf_counter() - t0
    for prompt, text, depths, reason, n in results:
        print(f"prompt: {prompt!r}")
        print(f"output: {text!r}")
        print(f"exit depths: {' '.join(map(str, depths))}   (loops each token ran; "
              f"mean {sum(depths) / max(1, len(depths)):.2f})")
        print(f"finish: {reason}, {n} tokens")
    total = sum(r[4] for r in results)
    log.info(f"{len(results)} prompt(s), {total} tokens in {elapsed:.2f}s including start-up (engine: {args.engine})")
    return 0


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``rltjax`` parser and its subcommands' parsers by name."""
    from rltjax.checkpoints import convert
    from rltjax.entrypoints.bench import add_bench_arguments, run_bench
    from rltjax.entrypoints.evaluate import add_eval_arguments, run_eval

    parser = argparse.ArgumentParser(prog="rltjax", description="Serve looped language models with JAX.",
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,serve,bench,eval,convert}")
    commands = {}
    for name, summary, add, run in (
            ("generate", "generate text from prompts", add_generate_arguments, run_generate),
            ("serve", "serve a model over an OpenAI-compatible HTTP API", add_serve_arguments, run_serve),
            ("bench", "offline throughput at fixed concurrency (random weights by default)", add_bench_arguments,
             run_bench),
            ("eval", "lm-eval's tasks (GSM8K by default) against the model, served in this process",
             add_eval_arguments, run_eval),
            ("convert", "convert a Hugging Face checkpoint to rltjax's Orbax layout", convert.add_arguments,
             convert.run)):
        commands[name] = sub.add_parser(name, help=summary, description=summary, formatter_class=HelpFormatter)
        add(commands[name])
        add_log_level(commands[name])
        commands[name].set_defaults(func=run)
    return parser, commands


def main(argv: Sequence[str] | None = None) -> int:
    from rltjax.checkpoints.safetensors_reader import CheckpointError
    from rltjax.config import ConfigError
    from rltjax.engine_config import EngineConfigError
    from rltjax.engine.llm_engine import RequestRejectedError
    from rltjax.sampling_params import SamplingParamsError

    parser, commands = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:        # the subcommand's usage, not the top level's
        commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    setup_logging(args.log_level)
    try:
        return args.func(args)
    except (CheckpointError, ConfigError, EngineConfigError, SamplingParamsError, RequestRejectedError,
            ValueError) as exc:
        print(f"rltjax {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

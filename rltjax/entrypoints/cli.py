"""The ``rltjax`` command: ``generate``, ``serve``, ``bench`` and ``convert``.

``generate`` runs the batched engine (``LLM``) over the given prompts; with
``--engine reference`` it runs the dense reference oracle instead (exact,
one request at a time, slow). Without ``--model`` it uses a tiny random-weight
Ouro checkpoint that rltjax writes itself (``checkpoints.tiny``), so the
command works on a fresh machine: its text is gibberish by construction.
``serve`` runs the OpenAI-compatible HTTP server (``rltjax.entrypoints.server``).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from rltjax.entrypoints.engine_args import add_engine_arguments, configs_from_args
from rltjax.entrypoints.server.launcher import add_serve_arguments, run_serve

DEFAULT_PROMPT = "The looped model thinks in loops:"


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model directory (Hugging Face safetensors or `rltjax convert` output); "
                        "default: a tiny random-weight Ouro checkpoint written to ~/.cache/rltjax")
    p.add_argument("--prompt", action="append", default=None,
                   help=f"prompt text; repeat for several prompts (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the checkpoint's chat template")
    p.add_argument("--engine", default="batched", choices=["batched", "reference"],
                   help="batched: the continuous-batching engine; reference: the dense oracle")
    g = p.add_argument_group("sampling (per request)")
    g.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0, help="per-request sampling seed")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    g.add_argument("--exit-threshold", type=float, default=1.0,
                   help="exit threshold q in [0, 1]; 1 = always run max-loops")
    g.add_argument("--min-loops", type=int, default=1)
    g.add_argument("--max-loops", type=int, default=None, help="default: the model's loop count")
    add_engine_arguments(p)


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
        print(f"[rltjax] no --model given: using the built-in tiny Ouro checkpoint with RANDOM weights "
              f"({model_dir}); expect gibberish text", file=sys.stderr)
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
        print(f"exit_depths: {depths}")
        print(f"finish_reason: {reason}; {n} tokens")
    total = sum(r[4] for r in results)
    print(f"[rltjax] {len(results)} prompt(s), {total} tokens in {elapsed:.2f}s including start-up "
          f"(engine: {args.engine})", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from rltjax.checkpoints import convert
    from rltjax.entrypoints.bench import add_bench_arguments, run_bench

    parser = argparse.ArgumentParser(prog="rltjax", description="Serve looped language models with JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from prompts",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_generate_arguments(gen)
    gen.set_defaults(func=run_generate)
    srv = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_arguments(srv)
    srv.set_defaults(func=run_serve)
    bench = sub.add_parser("bench", help="offline throughput at fixed concurrency (random weights by default)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_bench_arguments(bench)
    bench.set_defaults(func=run_bench)
    conv = sub.add_parser("convert", help="convert a Hugging Face checkpoint to rltjax's Orbax layout",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    convert.add_arguments(conv)
    conv.set_defaults(func=convert.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from rltjax.checkpoints.safetensors_reader import CheckpointError
    from rltjax.config import ConfigError
    from rltjax.engine_config import EngineConfigError
    from rltjax.engine.llm_engine import RequestRejectedError
    from rltjax.sampling_params import SamplingParamsError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointError, ConfigError, EngineConfigError, SamplingParamsError, RequestRejectedError,
            ValueError) as exc:
        print(f"rltjax {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

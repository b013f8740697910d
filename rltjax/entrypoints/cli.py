"""The ``rltjax`` command: ``generate`` and ``convert``.

``generate`` runs the dense reference oracle for now (one request at a time,
exact but slow); the batched engine replaces it behind the same flags.
Without ``--model`` it uses a tiny random-weight Ouro checkpoint that rltjax
writes itself (``checkpoints.tiny``), so the command works on a fresh machine:
its text is gibberish by construction.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

DEFAULT_PROMPT = "The looped model thinks in loops:"


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model directory (Hugging Face safetensors or `rltjax convert` output); "
                        "default: a tiny random-weight Ouro checkpoint written to ~/.cache/rltjax")
    p.add_argument("--prompt", action="append", default=None,
                   help=f"prompt text; repeat for several prompts (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the checkpoint's chat template")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="parameter dtype (default: the checkpoint's)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--exit-mode", default="ouro",
                   choices=["ouro", "ouro_delayed", "random_lookahead", "fixed"],
                   help="how a decode token picks its loop count")
    p.add_argument("--exit-threshold", type=float, default=1.0,
                   help="exit threshold q in [0, 1]; 1 = always run max-loops")
    p.add_argument("--min-loops", type=int, default=1)
    p.add_argument("--max-loops", type=int, default=None, help="default: the model's loop count")
    p.add_argument("--kv-layout", default="last_exited", choices=["last_exited", "shared"])
    p.add_argument("--hf-overrides", default=None,
                   help='JSON object of config.json fields to override, e.g. \'{"total_ut_steps": 2}\'')


def run_generate(args: argparse.Namespace) -> int:
    import json

    from checkpoints.loader import load_checkpoint
    from checkpoints.tiny import default_demo_checkpoint
    from rltjax.engine_config import ExitConfig
    from rltjax.models.base import get_model
    from rltjax.reference.generate import ReferenceModel
    from rltjax.sampling_params import SamplingParams
    from rltjax.tokenizer import Tokenizer

    model_dir = args.model
    if model_dir is None:
        model_dir = default_demo_checkpoint()
        print(f"[rltjax] no --model given: using the built-in tiny Ouro checkpoint with RANDOM weights "
              f"({model_dir}); expect gibberish text", file=sys.stderr)
    overrides = json.loads(args.hf_overrides) if args.hf_overrides else None
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, seed=args.seed, min_loops=args.min_loops,
                        max_loops=args.max_loops, exit_threshold=args.exit_threshold,
                        ignore_eos=args.ignore_eos)
    t0 = time.perf_counter()
    ckpt = load_checkpoint(model_dir, dtype=args.dtype, hf_overrides=overrides)
    tokenizer = Tokenizer.from_dir(ckpt.model_dir)
    runner = ReferenceModel(get_model(ckpt.cfg), ckpt.params, kv_layout=args.kv_layout,
                            exit_config=ExitConfig(mode=args.exit_mode))
    print(f"[rltjax] loaded {ckpt.cfg.arch} ({ckpt.cfg.num_layers} layers x {ckpt.cfg.num_loops} loops, "
          f"{ckpt.dtype}) in {time.perf_counter() - t0:.1f}s; engine: dense reference", file=sys.stderr)
    for text in args.prompt or [DEFAULT_PROMPT]:
        if args.chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        ids = tokenizer.encode(text)
        t0 = time.perf_counter()
        out = runner.generate(ids, sp, eos_token_ids=tokenizer.eos_token_ids)
        dt = time.perf_counter() - t0
        print(f"prompt: {text!r}")
        print(f"output: {tokenizer.decode(out.token_ids)!r}")
        print(f"exit_depths: {out.exit_depths}")
        print(f"finish_reason: {out.finish_reason}; {len(out.token_ids)} tokens in {dt:.2f}s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from checkpoints import convert

    parser = argparse.ArgumentParser(prog="rltjax", description="Serve looped language models with JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from prompts",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_generate_arguments(gen)
    gen.set_defaults(func=run_generate)
    conv = sub.add_parser("convert", help="convert a Hugging Face checkpoint to rltjax's Orbax layout",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    convert.add_arguments(conv)
    conv.set_defaults(func=convert.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from checkpoints.safetensors_reader import CheckpointError
    from rltjax.config import ConfigError
    from rltjax.engine_config import EngineConfigError
    from rltjax.sampling_params import SamplingParamsError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointError, ConfigError, EngineConfigError, SamplingParamsError, ValueError) as exc:
        print(f"rltjax {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

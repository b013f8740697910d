"""Draft acceptance of self-speculative decoding on random weights, and where it pays.

    python scripts/spec_acceptance.py                               # the tiny Ouro fixture, CPU
    python scripts/spec_acceptance.py --preset ouro-1.4b --scales 0.02 0.05 0.1   # GPU

For each branch scale (``checkpoints.random_init.converging``: how strongly the loops
converge), the engine generates greedily at full depth D (fixed depth); the dense reference
then reads every generated position at depth d, teacher-forced, and a draft counts as
accepted when its argmax is the token full depth chose. Then, per K, the acceptance at which
a round breaks even (``benchmarks.speculation``; --head-cost: a head's cost in loop passes).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.speculation import break_even  # noqa: E402


def measure(cfg, params, d: int, depth: int, prompts, tokens: int) -> float:
    from rltjax.engine_config import CacheConfig, ExecutionConfig, ExitConfig, SchedulerConfig
    from rltjax.entrypoints.llm import build_engine
    from rltjax.models.base import get_model
    from rltjax.reference.stages import sequence_forward
    from rltjax.sampling_params import SamplingParams
    engine = build_engine(None, params=params, cfg=cfg, cache_config=CacheConfig(page_size=16),
                          scheduler_config=SchedulerConfig(max_num_seqs=len(prompts)),
                          exit_config=ExitConfig(mode="fixed"),
                          execution_config=ExecutionConfig(compile_ahead=False, show_progress=False))
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, max_loops=depth)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    while engine.has_unfinished_requests():
        engine.step()
    model, hits, total = get_model(cfg), 0, 0
    for i, p in enumerate(prompts):
        out = engine.get_output(str(i)).token_ids
        seq = list(p) + out[:-1]               # the last output's successor is not known
        shallow = sequence_forward(model, params, seq, d)["logits"].argmax(-1)
        drafts = shallow[len(p) - 1:len(p) - 1 + len(out)]     # the draft for each output position
        hits += int((drafts == np.asarray(out[:len(drafts)])).sum())
        total += len(drafts)
    return hits / total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default=None, help="random weights at a preset's shape (default: tests' ouro-tiny)")
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0, 0.2, 0.1, 0.05, 0.02])
    ap.add_argument("--draft-loops", type=int, default=2)
    ap.add_argument("--target-loops", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--head-cost", type=float, default=0.25,
                    help="a head's cost in loop passes (Ouro-1.4B: lm_head bytes / one pass's weight bytes)")
    args = ap.parse_args(argv)
    from rltjax.checkpoints.random_init import converging, random_checkpoint
    if args.preset:
        from rltjax.presets import preset_config
        cfg = preset_config(args.preset)
        base = random_checkpoint(cfg, seed=0, dtype="bfloat16")
    else:
        from rltjax.checkpoints.loader import load_checkpoint
        ckpt = load_checkpoint(os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "ouro-tiny"),
                               dtype="float32")
        cfg, base = ckpt.cfg, ckpt.params
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, 8).tolist() for _ in range(args.prompts)]
    d, depth = args.draft_loops, args.target_loops
    print(f"draft at {d} loops, target at {depth}; {args.prompts} prompts x {args.tokens} greedy tokens")
    for scale in args.scales:
        a = measure(cfg, converging(base, scale), d, depth, prompts, args.tokens)
        print(f"branch scale {scale:g}: acceptance {a:.3f}")
    for k in (2, 4, 8):
        print(f"K = {k}: breaks even at acceptance {break_even(k, d, depth, args.head_cost):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

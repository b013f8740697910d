"""Offline engine throughput at fixed concurrency (random weights, token-id prompts).

    python scripts/bench_throughput.py --preset ouro-1.4b --concurrency 1 8 32 --out thr.json   # GPU
    python scripts/bench_throughput.py --quick                                                  # CPU

C requests run at a time (closed loop: a finished request is replaced at once
until --num-requests are done); every request has a --prompt-len random prompt
and generates exactly --output-len tokens (ignore_eos). Reported: output
tokens/s over the timed run (after a warm-up run that also compiles), mean
loops per output token, and the steps the engine took by kind.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from checkpoints.random_init import random_checkpoint  # noqa: E402
from rltjax.engine_config import CacheConfig, ExecutionConfig, ExitConfig, SchedulerConfig  # noqa: E402
from rltjax.entrypoints.llm import build_engine  # noqa: E402
from rltjax.presets import preset_config  # noqa: E402
from rltjax.sampling_params import SamplingParams  # noqa: E402

QUICK_OVERRIDES = {"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2, "hidden_size": 64,
                   "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 4,
                   "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 1024}


def run_closed_loop(engine, concurrency, num_requests, prompt_len, output_len, params, rng, tag):
    vocab = engine.cfg.vocab_size
    submitted = finished = 0
    while finished < num_requests:
        while submitted < num_requests and submitted - finished < concurrency:
            prompt = rng.integers(3, vocab, prompt_len).tolist()
            engine.add_request(f"{tag}-{submitted}", prompt, params)
            submitted += 1
        for out in engine.step():
            if out.finished:
                finished += 1
                engine.forget(out.request_id)


def bench(engine, concurrency, args, params):
    rng = np.random.default_rng(0)
    run_closed_loop(engine, concurrency, concurrency, args.prompt_len, min(8, args.output_len), params, rng, "warm")
    engine.steps_by_kind.clear()
    t0 = time.perf_counter()
    n = max(concurrency, args.num_requests or concurrency)
    run_closed_loop(engine, concurrency, n, args.prompt_len, args.output_len, params, rng, f"c{concurrency}")
    jax.block_until_ready(engine.runner.kv.k)
    wall = time.perf_counter() - t0
    tokens = n * args.output_len
    return dict(concurrency=concurrency, requests=n, output_tokens=tokens, seconds=wall,
                output_tokens_per_s=tokens / wall, steps=dict(engine.steps_by_kind))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="ouro-1.4b")
    p.add_argument("--concurrency", type=int, nargs="+", default=None, help="default 1 8 32 (--quick: 1 4)")
    p.add_argument("--num-requests", type=int, default=None, help="per concurrency (default: = concurrency)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 256 (--quick: 16)")
    p.add_argument("--output-len", type=int, default=None, help="default 256 (--quick: 8)")
    p.add_argument("--exit-threshold", type=float, default=1.0, help="1 = fixed depth R")
    p.add_argument("--kv-layout", default="last_exited")
    p.add_argument("--attn-impl", default="auto")
    p.add_argument("--dtype", default=None, help="default bfloat16 (--quick: float32)")
    p.add_argument("--quick", action="store_true", help="tiny config on CPU")
    p.add_argument("--out")
    args = p.parse_args(argv)
    overrides = QUICK_OVERRIDES if args.quick else None
    for name, full, quick in (("concurrency", [1, 8, 32], [1, 4]), ("prompt_len", 256, 16),
                              ("output_len", 256, 8), ("dtype", "bfloat16", "float32")):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    cfg = preset_config(args.preset, overrides)
    params = random_checkpoint(cfg, seed=0, dtype=args.dtype)
    max_seqs = max(args.concurrency)
    engine = build_engine(
        None, params=params, cfg=cfg,
        cache_config=CacheConfig(kv_layout=args.kv_layout),
        scheduler_config=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max(256, args.prompt_len),
                                         prefill_chunk_size=max(256, args.prompt_len),
                                         max_model_len=args.prompt_len + args.output_len),
        exit_config=ExitConfig(mode="ouro"),
        execution_config=ExecutionConfig(attn_impl=args.attn_impl, compilation_cache_dir=None,
                                         show_progress=not args.quick))
    params_s = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True,
                              exit_threshold=args.exit_threshold)
    rows = []
    for c in args.concurrency:
        r = bench(engine, c, args, params_s)
        rows.append(r)
        print(f"{args.preset} C={c:<3d} {r['output_tokens_per_s']:9.1f} output tok/s  ({r['output_tokens']} tokens "
              f"in {r['seconds']:.2f}s; steps {r['steps']})", flush=True)
    info = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, preset=args.preset,
                quick=args.quick, compile_seconds=engine.compile_seconds, prompt_len=args.prompt_len,
                output_len=args.output_len, exit_threshold=args.exit_threshold, results=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``rltjax bench``: offline engine throughput at fixed concurrency.

C requests run at a time (closed loop: a finished request is replaced at once
until ``--num-requests`` are done); every request has a random ``--prompt-len``
token prompt and generates exactly ``--output-len`` tokens (ignore_eos), so
random weights give the intended lengths. Reported: output tokens/s over the
timed run (after a warm-up run) and the engine's steps by kind.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import numpy as np

from rltjax.entrypoints.engine_args import add_engine_arguments, configs_from_args

QUICK_OVERRIDES = {"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2, "hidden_size": 64,
                   "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 4,
                   "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 1024}


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="model directory (weights are loaded)")
    src.add_argument("--preset", default="ouro-1.4b",
                     help="random weights at a named model's shape (default: ouro-1.4b)")
    p.add_argument("--quick", action="store_true", help="shrink the preset to a tiny config (CPU smoke runs)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--num-requests", type=int, default=None, help="per concurrency (default: = concurrency)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--exit-threshold", type=float, default=1.0, help="1 = fixed depth R")
    p.add_argument("--out", help="write results as JSON here")
    p.add_argument("--trace-dir", help="after each measured run, profile one more closed loop of C requests "
                                       "(--trace-tokens outputs each) here and print its GPU kernels per loop pass")
    p.add_argument("--trace-tokens", type=int, default=64)
    add_engine_arguments(p)


def run_closed_loop(engine, concurrency, num_requests, prompt_len, params, rng, tag) -> None:
    submitted = finished = 0
    while finished < num_requests:
        while submitted < num_requests and submitted - finished < concurrency:
            engine.add_request(f"{tag}-{submitted}", rng.integers(3, engine.cfg.vocab_size, prompt_len).tolist(),
                               params)
            submitted += 1
        for out in engine.step():
            if out.finished:
                finished += 1
                engine.forget(out.request_id)


def measure(engine, concurrency: int, args, params) -> dict:
    import jax
    rng = np.random.default_rng(0)
    warm = dataclasses.replace(params, max_tokens=min(8, params.max_tokens))
    run_closed_loop(engine, concurrency, concurrency, args.prompt_len, warm, rng, f"warm{concurrency}")
    from rltjax.benchmarks.compile_watch import CompileWatch
    engine.steps_by_kind.clear()
    n = max(concurrency, args.num_requests or concurrency)
    with CompileWatch() as compiles:
        t0 = time.perf_counter()
        run_closed_loop(engine, concurrency, n, args.prompt_len, params, rng, f"c{concurrency}")
        jax.block_until_ready(engine.runner.kv.k)
        wall = time.perf_counter() - t0
    tokens = n * params.max_tokens
    row = dict(concurrency=concurrency, requests=n, output_tokens=tokens, seconds=wall,
               output_tokens_per_s=tokens / wall, steps=dict(engine.steps_by_kind),
               compiles_during_run=compiles.report())
    if compiles.warning(f"C={concurrency}"):
        print(compiles.warning(f"C={concurrency}"), file=sys.stderr, flush=True)
    if args.trace_dir:
        row["kernels_per_pass"] = profile_run(engine, concurrency, args, params, rng)
    return row


def profile_run(engine, concurrency: int, args, params, rng) -> dict:
    """One more closed loop under the profiler; GPU kernel time per loop pass (prefill included)."""
    import os

    import jax

    from rltjax.benchmarks.kernel_trace import format_summary, summarise_dir
    trace_dir = os.path.join(args.trace_dir, f"c{concurrency}")
    engine.steps_by_kind.clear()
    short = dataclasses.replace(params, max_tokens=min(args.trace_tokens, params.max_tokens))
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        t0 = time.perf_counter()
        run_closed_loop(engine, concurrency, concurrency, args.prompt_len, short, rng, f"trace{concurrency}")
        jax.block_until_ready(engine.runner.kv.k)
        wall = time.perf_counter() - t0
    passes = engine.steps_by_kind.get("window_passes", 0) + engine.steps_by_kind.get("loop", 0)
    summary = summarise_dir(trace_dir, per=max(passes, 1), top=25)
    print(f"[trace C={concurrency}] {passes} loop passes in {wall * 1e3:.0f} ms (profiled): per pass "
          + format_summary(summary), flush=True)
    return dict(summary, passes=passes, wall_ms_per_pass=wall * 1e3 / max(passes, 1))


def run_bench(args: argparse.Namespace) -> int:
    import jax

    from checkpoints.random_init import random_checkpoint
    from rltjax.benchmarks.report import source_identity
    from rltjax.entrypoints.llm import build_engine
    from rltjax.presets import preset_config
    from rltjax.sampling_params import SamplingParams

    configs = configs_from_args(args)
    sched = dataclasses.replace(
        configs["scheduler_config"], max_num_seqs=max(args.concurrency),
        max_model_len=configs["scheduler_config"].max_model_len or args.prompt_len + args.output_len)
    configs["scheduler_config"] = sched
    if args.model:
        engine = build_engine(args.model, **configs)
    else:
        cfg = preset_config(args.preset, QUICK_OVERRIDES if args.quick else None)
        dtype = configs["dtype"] or ("float32" if args.quick else "bfloat16")
        # no reference kept here: the engine keeps one (split) copy of the weights
        engine = build_engine(None, params=random_checkpoint(cfg, seed=0, dtype=dtype), cfg=cfg,
                              **{k: v for k, v in configs.items() if k not in ("dtype", "hf_overrides")})
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True,
                            exit_threshold=args.exit_threshold)
    rows = []
    for c in args.concurrency:
        r = measure(engine, c, args, params)
        rows.append(r)
        print(f"C={c:<4d} {r['output_tokens_per_s']:10.1f} output tok/s  ({r['output_tokens']} tokens in "
              f"{r['seconds']:.2f}s; steps {r['steps']})", flush=True)
    info = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, source=source_identity(),
                model=args.model or args.preset,
                quick=args.quick, compile_seconds=engine.compile_seconds, prompt_len=args.prompt_len,
                output_len=args.output_len, exit_threshold=args.exit_threshold,
                kv_layout=configs["cache_config"].kv_layout, scheduler_mode=sched.mode,
                max_num_batched_tokens=engine.scheduler.config.max_num_batched_tokens,
                prefill_chunk_size=engine.scheduler.config.prefill_chunk_size, results=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)
    print(f"[rltjax] compile at start-up: {engine.compile_seconds:.1f}s", file=sys.stderr)
    return 0

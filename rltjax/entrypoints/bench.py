"""``rltjax bench``: offline engine throughput at fixed concurrency.

C requests run at a time (closed loop: a finished request is replaced at once
until ``--num-requests`` are done); every request has a random ``--prompt-len``
token prompt and generates exactly ``--output-len`` tokens (ignore_eos), so
random weights give the intended lengths. Reported: output tokens/s over the
timed run (after a warm-up run) and the engine's steps by kind.

``--variant NAME=FLAGS`` (repeatable) A/B-tests engine settings: after the base run,
each variant builds its own engine from the base flags plus FLAGS, on the same random
weights, one after another in this process, and runs the same requests; the report
gives each variant's tok/s and how many of its requests' greedy tokens equal the base
run's (equal settings give equal tokens; a setting that changes the arithmetic, such
as the attention splits, may change bfloat16 tokens).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import shlex
import sys
import time

import numpy as np

from rltjax.entrypoints.engine_args import add_engine_arguments, configs_from_args, hf_overrides_from_args

QUICK_OVERRIDES = {"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2, "hidden_size": 64,
                   "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 4,
                   "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 1024}


def preset_config_from_args(args):
    """The ModelConfig of ``--preset``: shrunk by ``--quick``, then ``--hf-overrides`` on top."""
    from rltjax.presets import preset_config
    overrides = {**(QUICK_OVERRIDES if args.quick else {}), **(hf_overrides_from_args(args) or {})}
    return preset_config(args.preset, overrides or None)


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, metavar="DIR", help="model directory (its weights are loaded)")
    src.add_argument("--preset", default="ouro-1.4b", metavar="NAME", help="random weights at a named model's shape")
    g.add_argument("--quick", action="store_true", help="shrink the preset to a tiny config (CPU smoke runs)")
    g.add_argument("--converging-scale", type=float, default=None, metavar="S",
                   help="random weights whose loops converge (residual branches x S in (0, 1]): drafts agree "
                        "with full depth as often as S dials (speculation benchmarks)")
    g.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], metavar="C",
                   help="closed-loop streams, one run each")
    g.add_argument("--num-requests", type=int, default=None, metavar="N",
                   help="requests per run (default: the concurrency)")
    g.add_argument("--prompt-len", type=int, default=256, metavar="N", help="prompt tokens per request")
    g.add_argument("--output-len", type=int, default=256, metavar="N", help="output tokens per request")
    g.add_argument("--exit-threshold", type=float, default=1.0, metavar="Q", help="1: fixed depth R")
    g = p.add_argument_group("output")
    g.add_argument("--out", metavar="FILE", help="write the results as JSON here")
    g.add_argument("--trace-dir", metavar="DIR",
                   help="profile one more run per concurrency here and print its GPU kernels per loop pass")
    g.add_argument("--trace-tokens", type=int, default=64, metavar="N", help="output tokens per profiled request")
    g.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="also run with these engine flags, e.g. 's1=--attn-num-splits 1' (repeatable)")
    add_engine_arguments(p)


def run_closed_loop(engine, concurrency, num_requests, prompt_len, params, rng, tag, outputs=None,
                    timings=None) -> None:
    """``outputs``: a dict that receives each request's output token ids; ``timings``: a list
    that receives each request's (seconds to its first token, seconds from it to its last)."""
    submitted = finished = 0
    while finished < num_requests:
        while submitted < num_requests and submitted - finished < concurrency:
            engine.add_request(f"{tag}-{submitted}", rng.integers(3, engine.cfg.vocab_size, prompt_len).tolist(),
                               params)
            submitted += 1
        for out in engine.step():
            if out.finished:
                finished += 1
                if outputs is not None:
                    outputs[out.request_id] = list(engine.get_output(out.request_id).token_ids)
                m = out.metrics
                if timings is not None and m["first_token_time"] is not None:     # not an error before it
                    timings.append((m["first_token_time"] - m["arrival_time"],
                                    m["finished_time"] - m["first_token_time"]))
                engine.forget(out.request_id)


def _random_params(cfg, dtype, converging_scale: float | None):
    """Random weights (``--converging-scale``: loops that converge); returned, not kept."""
    from rltjax.checkpoints.random_init import converging, random_checkpoint
    params = random_checkpoint(cfg, seed=0, dtype=dtype)
    return params if converging_scale is None else converging(params, converging_scale)


def measure(engine, concurrency: int, args, params, outputs=None) -> dict:
    import jax
    rng = np.random.default_rng(0)
    warm = dataclasses.replace(params, max_tokens=min(8, params.max_tokens))
    run_closed_loop(engine, concurrency, concurrency, args.prompt_len, warm, rng, f"warm{concurrency}")
    from rltjax.engine.compile_watch import CompileWatch
    engine.steps_by_kind.clear()
    n = max(concurrency, args.num_requests or concurrency)
    before, timings = engine.stats(), []
    with CompileWatch() as compiles:
        t0 = time.perf_counter()
        run_closed_loop(engine, concurrency, n, args.prompt_len, params, rng, f"c{concurrency}", outputs, timings)
        jax.block_until_ready(engine.runner.kv.k)
        wall = time.perf_counter() - t0
    tokens = n * params.max_tokens
    # a request's time to its first token (its prefill, and any wait for admission) and from
    # there to its last: where a closed loop's time goes, e.g. long prompts' prefill
    ttft, rest = zip(*timings) if timings else ((np.nan,), (np.nan,))
    row = dict(concurrency=concurrency, requests=n, output_tokens=tokens, seconds=wall,
               output_tokens_per_s=tokens / wall, steps=dict(engine.steps_by_kind),
               mean_ttft_s=float(np.mean(ttft)), mean_decode_s=float(np.mean(rest)),
               compiles_during_run=compiles.report())
    after = engine.stats()
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    if drafted:     # speculation: its acceptance beside its throughput
        accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
        row.update(spec_draft_tokens=drafted, spec_accepted_tokens=accepted, spec_acceptance=accepted / drafted)
    if compiles.warning(f"C={concurrency}"):
        print(compiles.warning(f"C={concurrency}"), file=sys.stderr, flush=True)
    if args.trace_dir:
        row["kernels_per_pass"] = profile_run(engine, concurrency, args, params, rng)
    return row


def profile_run(engine, concurrency: int, args, params, rng) -> dict:
    """One more closed loop under the profiler; GPU kernel time per loop pass (prefill included)."""
    import os

    import jax

    from rltjax.profiling import format_summary, summarise_dir
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


def variant_args(args: argparse.Namespace, spec: str) -> tuple[str, str, argparse.Namespace]:
    """``NAME=FLAGS`` -> (NAME, FLAGS, the base flags with FLAGS parsed over them)."""
    name, sep, flags = spec.partition("=")
    if not sep or not name.strip():
        raise SystemExit(f"--variant {spec!r}: expected NAME=FLAGS, e.g. 's1=--attn-num-splits 1'")
    parser = argparse.ArgumentParser(prog=f"--variant {name}", add_help=False)
    add_engine_arguments(parser)
    # parsed into a copy of the base flags: those FLAGS leaves out keep the base values
    return name.strip(), flags, parser.parse_args(shlex.split(flags), namespace=copy.deepcopy(args))


def bench_engine(args: argparse.Namespace, outputs: dict) -> dict:
    """One engine built from ``args``, measured at every --concurrency; ``outputs[C]``
    receives each request's token ids."""
    import jax

    from rltjax.entrypoints.llm import build_engine, setup_compilation_cache
    from rltjax.sampling_params import SamplingParams

    configs = configs_from_args(args)
    sched = dataclasses.replace(
        configs["scheduler_config"], max_num_seqs=max(args.concurrency),
        max_model_len=configs["scheduler_config"].max_model_len or args.prompt_len + args.output_len)
    configs["scheduler_config"] = sched
    if args.model:
        engine = build_engine(args.model, **configs)
    else:
        cfg = preset_config_from_args(args)
        dtype = configs["dtype"] or ("float32" if args.quick else "bfloat16")
        # the draw's compile comes from the persistent cache too, as a warm engine's do
        setup_compilation_cache(configs["execution_config"].compilation_cache_dir)
        # no reference kept here: the engine keeps one (split) copy of the weights
        engine = build_engine(None, params=_random_params(cfg, dtype, args.converging_scale), cfg=cfg,
                              **{k: v for k, v in configs.items() if k not in ("dtype", "hf_overrides")})
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True,
                            exit_threshold=args.exit_threshold)
    rows = []
    for c in args.concurrency:
        r = measure(engine, c, args, params, outputs.setdefault(c, {}))
        rows.append(r)
        spec = f"; draft acceptance {r['spec_acceptance']:.3f}" if "spec_acceptance" in r else ""
        print(f"C={c:<4d} {r['output_tokens_per_s']:10.1f} output tok/s  ({r['output_tokens']} tokens in "
              f"{r['seconds']:.2f}s; steps {r['steps']}{spec})", flush=True)
    info = dict(device=jax.devices()[0].device_kind, compile_seconds=engine.compile_seconds,
                kv_layout=configs["cache_config"].kv_layout, scheduler_mode=sched.mode,
                max_num_batched_tokens=engine.scheduler.config.max_num_batched_tokens,
                prefill_chunk_size=engine.scheduler.config.prefill_chunk_size, results=rows)
    print(f"[rltjax] compile at start-up: {engine.compile_seconds:.1f}s", file=sys.stderr)
    return info


def run_bench(args: argparse.Namespace) -> int:
    import jax

    from rltjax.source_files import source_identity

    if args.data_parallel_size > 1:
        raise ValueError("rltjax bench measures one engine: leave --data-parallel-size at 1 (scripts/bench_serving.py "
                         "drives replicas through the server)")
    variants = [variant_args(args, spec) for spec in args.variant]     # bad flags fail before any engine
    base_outputs: dict = {}
    # every flag as it resolved (not argv: main(argv) and python -m reach here alike), so a JSON
    # names e.g. its --converging-scale without its file name
    flags = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, type(None)))}
    info = dict(jax=jax.__version__, source=source_identity(), args=flags, model=args.model or args.preset,
                quick=args.quick, prompt_len=args.prompt_len, output_len=args.output_len,
                exit_threshold=args.exit_threshold, **bench_engine(args, base_outputs))
    if variants:
        info["variants"] = []
    for name, flags, vargs in variants:
        gc.collect()        # the last engine's KV pool and weights go before the next is sized
        if args.trace_dir:
            vargs.trace_dir = f"{args.trace_dir}/{name}"
        print(f"[variant {name}] {flags}", flush=True)
        outputs: dict = {}
        v = dict(name=name, flags=flags, **bench_engine(vargs, outputs))
        for row in v["results"]:
            base, got = base_outputs[row["concurrency"]], outputs[row["concurrency"]]
            row["requests_with_base_tokens"] = sum(got.get(rid) == toks for rid, toks in base.items())
        info["variants"].append(v)
    if variants:
        print("\nvariant      " + "".join(f"{'C=' + str(c):>12s}" for c in args.concurrency)
              + "   requests with the base run's tokens", flush=True)
        print(f"{'base':12s} " + "".join(f"{r['output_tokens_per_s']:12.1f}" for r in info["results"]))
        for v in info["variants"]:
            print(f"{v['name']:12s} " + "".join(f"{r['output_tokens_per_s']:12.1f}" for r in v["results"]) + "   "
                  + ", ".join(f"C={r['concurrency']}: {r['requests_with_base_tokens']}/{r['requests']}"
                              for r in v["results"]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)
    return 0

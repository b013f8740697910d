"""Host-side cost of the engine's steps on the CPU: a tiny model, many decode windows.

    python scripts/bench_host_overhead.py [--requests 64] [--concurrency 8] [--repeat 3]

A closed loop of ``--concurrency`` streams over the tiny Ouro fixture at fixed depth, run
through ``LLMEngine.step`` until ``--requests`` requests are done. The device programs of a
tiny model take microseconds, so the step's time is mostly the host's: the scheduler,
building the window's rows, launching, reading and replaying its outputs. The number that
compares two trees is the main thread's CPU time per output token (``time.thread_time``:
XLA's CPU executables run on other threads, and a wait for them costs no CPU); wall time is
printed beside it. The workload and its outputs are the same whatever the tree, so a ratio
of two runs on one machine is a ratio of host costs. ``--root`` runs another checkout's code.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def run_once(args) -> dict:
    try:
        from rltjax.checkpoints.loader import load_checkpoint
    except ImportError:
        from checkpoints.loader import load_checkpoint
    from rltjax.engine_config import CacheConfig, ExecutionConfig, ExitConfig, SchedulerConfig
    from rltjax.entrypoints.llm import build_engine
    from rltjax.sampling_params import SamplingParams

    ckpt = load_checkpoint(args.root / "tests" / "fixtures" / "ouro-tiny", dtype="float32")
    engine = build_engine(None, params=ckpt.params, cfg=ckpt.cfg, cache_config=CacheConfig(page_size=8),
                          scheduler_config=SchedulerConfig(max_num_seqs=args.concurrency),
                          exit_config=ExitConfig(mode="ouro"),
                          execution_config=ExecutionConfig(compilation_cache_dir=None, show_progress=False,
                                                           decode_window=args.window))
    params = SamplingParams(max_tokens=args.output_len, exit_threshold=1.0, ignore_eos=True, seed=0)
    prompt = list(range(3, 3 + args.prompt_len))
    started = done = tokens = 0

    def top_up():
        nonlocal started
        while started < args.requests and started - done < args.concurrency:
            engine.add_request(f"r{started}", prompt, params)
            started += 1

    # one warm request first: anything compiled late is compiled before the timing
    engine.add_request("warm", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    top_up()
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done += 1
                tokens += len(out.token_ids)
        steps += 1
        top_up()
    wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
    return dict(tokens=tokens, steps=steps, wall_s=wall, host_cpu_s=cpu,
                host_cpu_us_per_token=1e6 * cpu / tokens, wall_us_per_token=1e6 * wall / tokens)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--window", type=int, default=8, help="decode window K (0: step-by-step passes)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                    help="the checkout whose code runs (default: this one)")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args(argv)
    args.root = args.root.resolve()
    sys.path.insert(0, str(args.root))
    runs = [run_once(args) for _ in range(args.repeat)]
    best = min(runs, key=lambda r: r["host_cpu_s"])
    summary = dict(root=str(args.root), runs=runs,
                   host_cpu_us_per_token=statistics.median(r["host_cpu_us_per_token"] for r in runs),
                   wall_us_per_token=statistics.median(r["wall_us_per_token"] for r in runs),
                   tokens=best["tokens"], steps=best["steps"])
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{args.root}: {best['tokens']} tokens in {best['steps']} steps; median of {args.repeat}: "
              f"host CPU {summary['host_cpu_us_per_token']:.1f} us/token, wall {summary['wall_us_per_token']:.1f} "
              f"us/token")
    return 0


if __name__ == "__main__":
    sys.exit(main())

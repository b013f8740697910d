"""Continuous Depth Batching on one exit trace: fixed depth vs adaptive, refill vs no_refill,
step-by-step (sync) vs async scheduling vs device-side decode windows (random weights at a
preset's shape).

    python scripts/bench_cdb.py --preset ouro-1.4b --concurrency 32 --out cdb.json        # GPU
    python scripts/bench_cdb.py --concurrency 32 --num-requests 256 --executors window    # steady state
    python scripts/bench_cdb.py --quick --concurrency 4 --prompt-len 16 --output-len 16   # CPU

The trace: every request's decode depths are drawn (seeded) from --depth-probs (default
uniform over 1..4: mean 2.5), run once, and recorded as an ``ExitTrace`` (tokens, depths,
model fingerprint); every adaptive run below replays it and is checked token for token.
Random weights have no meaningful gate, hence a drawn trace, not a gated one.

Ideal speed-up (DESIGN section 4) = (F0 + R*Fr) / (F0 + dbar*Fr) with the memory model's
bytes: Fr = core weights + B*L*KV bytes per position per plane (one loop pass),
F0 = the weights a token reads once (``roofline.token_weight_bytes``: Ouro's lm_head, final
norm and gate), B = concurrency, L = mean context. Achieved speed-up =
adaptive tok/s / fixed-depth tok/s of the same executor; the ratio achieved/ideal is the
CDB paper's measure. "full-depth overhead" compares the adaptive machinery at full depth
(step engine, refill, threshold 1) with running each token's R loops back to back on the
device (a decode window at fixed depth).

The schedule bound separates the workload from the engine: with few requests per row the
batch drains at the end (rows idle while the deepest requests finish), which no engine
avoids. ``depth_trace.schedule_bound`` replays the trace's pass counts through a perfect
closed-loop scheduler (a pass costing the same however many rows are busy) and gives the
factor by which the drain scales the ideal; achieved / (ideal x that factor) is the
engine's own efficiency. ``depth_trace.pass_split`` then splits the achieved speed-up into
the loop passes the trace run saved (to set against the perfect scheduler's pass counts)
and how much more wall time each of its passes took than a fixed-depth pass (prefill,
heads and host gaps included).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from rltjax.entrypoints.bench import QUICK_OVERRIDES  # noqa: E402
from rltjax.engine_config import DEFAULT_DECODE_WINDOW  # noqa: E402
from rltjax.entrypoints.engine_args import mixed_prefill_tokens  # noqa: E402


EXECUTORS = ("step", "async", "window")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="ouro-1.4b")
    p.add_argument("--quick", action="store_true", help="tiny config, float32 (CPU smoke run)")
    p.add_argument("--concurrency", type=int, default=32, help="rows in flight (max_num_seqs)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests in the closed loop (default: --concurrency, all at once); more than "
                        "--concurrency queue and take the rows that free up, so the batch drains once at "
                        "the end instead of every --concurrency requests")
    p.add_argument("--executors", nargs="+", choices=EXECUTORS, default=list(EXECUTORS),
                   help="which executors to run (each against its own fixed-depth run)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--depth-probs", type=float, nargs="+", default=[0.25, 0.25, 0.25, 0.25],
                   help="probability of depth 1..R for each decode token")
    p.add_argument("--decode-window", type=int, default=DEFAULT_DECODE_WINDOW,
                   help=f"K passes per window (default: the engine's, {DEFAULT_DECODE_WINDOW})")
    p.add_argument("--mixed-prefill-tokens", type=mixed_prefill_tokens, default=None, metavar="T | ROWS:T,...",
                   help="window executor: admitted prompts of up to T tokens run inside the windows' first "
                        "passes (ExecutionConfig.mixed_prefill_tokens; ROWS:T,...: a T per window size; 0: off; "
                        "auto, the default: the engine's auto mode, off with --standby)")
    p.add_argument("--standby", type=int, default=0, metavar="S",
                   help="window executor: S more requests admitted beyond the --concurrency rows, prefilled "
                        "and waiting on the device for the next row to free up (max_num_seqs = C + S, "
                        "ExecutionConfig.decode_window_rows = C, a power of two >= 8; 0: off)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    p.add_argument("--trace-dir", default=None,
                   help="after each timed run, profile one more run of --trace-requests requests here: GPU "
                        "busy vs span and the summed event time of each executable (prefill, windows, heads, loop passes)")
    p.add_argument("--trace-requests", type=int, default=None, help="requests in the profiled run (default: C)")
    args = p.parse_args(argv)
    for flag in ("num_requests", "trace_requests"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    return args


def run(engine, prompts, params, ids) -> tuple[float, dict, list, dict]:
    """All requests at once (closed loop of size = concurrency); seconds, steps, outputs and
    the executables compiled inside the run (any is a stall the numbers include)."""
    import jax

    from rltjax.engine.compile_watch import CompileWatch
    engine.steps_by_kind.clear()
    with CompileWatch() as compiles:
        t0 = time.perf_counter()
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        jax.block_until_ready(engine.runner.kv.k)
        wall = time.perf_counter() - t0
    outs = [engine.get_output(rid) for rid in ids]
    for rid in ids:
        engine.forget(rid)
    return wall, dict(engine.steps_by_kind), outs, compiles.report()


def profile(engine, prompts, params, ids, trace_dir: str, n: int) -> dict:
    """One more run of the first n requests under the profiler: GPU busy, span and summed
    event time per executable (ms; events on every device stream), and the loop passes it ran."""
    import jax

    from rltjax.profiling import device_kernels, load_events, summarise
    n = min(n, len(ids))
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        wall, steps, _, _ = run(engine, prompts[:n], params, ids[:n])
    s = summarise(device_kernels(load_events(trace_dir)))
    out = dict(requests=n, wall_ms=wall * 1e3, busy_ms=s["busy_us"] / 1e3, span_ms=s["span_us"] / 1e3,
               event_ms_by_executable={m: t / 1e3 for m, t in s["by_module"].items()},
               window_passes=steps.get("window_passes", 0), step_loop_passes=steps.get("loop", 0))
    print(f"  profiled {n} requests: wall {out['wall_ms']:.0f} ms, GPU busy {out['busy_ms']:.0f} / span "
          f"{out['span_ms']:.0f} ms; " + ", ".join(f"{m} {t:.0f} ms" for m, t in out["event_ms_by_executable"].items()),
          flush=True)
    return out


def main(argv=None) -> int:
    args = parse(argv)
    import jax

    from rltjax.checkpoints.random_init import random_checkpoint
    from benchmarks.depth_trace import draw_depths, loop_passes, pass_split, schedule_bound
    from benchmarks.report import source_identity
    from benchmarks.roofline import ideal_speedup, model_bytes
    from rltjax.engine.exit_trace import ExitTrace
    from rltjax.engine_config import CacheConfig, ExecutionConfig, ExitConfig, SchedulerConfig
    from rltjax.entrypoints.llm import build_engine
    from rltjax.presets import preset_config
    from rltjax.sampling_params import SamplingParams

    cfg = preset_config(args.preset, QUICK_OVERRIDES if args.quick else None)
    params_w = random_checkpoint(cfg, seed=0, dtype="float32" if args.quick else "bfloat16")
    R, C = cfg.num_loops, args.concurrency
    N = args.num_requests or C
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(3, cfg.vocab_size, args.prompt_len).tolist() for _ in range(N)]
    ids = [f"t{i}" for i in range(N)]
    try:   # entry 0 (the prefill token) is R; then one drawn depth per decode token
        drawn = draw_depths({rid: args.output_len + 1 for rid in ids}, args.depth_probs, R, args.seed,
                            flag="--depth-probs")
    except ValueError as exc:
        raise SystemExit(str(exc))
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    if args.standby and (args.standby < 0 or C < 8 or C & (C - 1)):
        raise SystemExit(f"--standby {args.standby} needs --concurrency a power of two >= 8 (the window rows), "
                         f"not {C}, and S >= 0")
    pages = (C + args.standby) * -(-(args.prompt_len + args.output_len) // args.page_size) * R + 1

    def engine_for(exit_config, mode="refill", window=0, async_scheduling=False):
        gc.collect()
        standby = args.standby if window else 0
        return build_engine(None, params=params_w, cfg=cfg, cache_config=CacheConfig(page_size=args.page_size,
                                                                                      num_pages=pages),
                            scheduler_config=SchedulerConfig(max_num_seqs=C + standby, mode=mode,
                                                             max_model_len=args.prompt_len + args.output_len),
                            exit_config=exit_config,
                            execution_config=ExecutionConfig(decode_window=window, async_scheduling=async_scheduling,
                                                             mixed_prefill_tokens=args.mixed_prefill_tokens if window
                                                             else 0, show_progress=False,
                                                             decode_window_rows=C if standby else None))

    class _Recorder:           # ExitTrace.record reads an LLM's .engine
        def __init__(self, engine):
            self.engine = engine

    # recorded on the windows when they are asked for (the fastest), else step by step;
    # every run below replays it
    eng = engine_for(ExitConfig(mode="trace", depths_by_request=drawn),
                     window=args.decode_window if "window" in args.executors else 0)
    run(eng, prompts[:1], dataclasses.replace(sp, max_tokens=4), ids[:1])          # warm
    _, _, outs, _ = run(eng, prompts, sp, ids)
    trace = ExitTrace.record(_Recorder(eng), prompts, outs, sp)
    for rec, rid in zip(trace.records, ids):
        rec["request_id"] = rid
    del eng
    dbar = trace.mean_depth

    configs = [c for c in [("fixed", "step", "refill"), ("trace", "step", "refill"), ("trace", "step", "no_refill"),
                           ("fixed", "async", "refill"), ("trace", "async", "refill"),
                           ("fixed", "window", "refill"), ("trace", "window", "refill")]
               if c[1] in args.executors]
    rows = []
    for depth, executor, mode in configs:
        exit_config = trace.exit_config() if depth == "trace" else ExitConfig(mode="fixed")
        eng = engine_for(exit_config, mode, args.decode_window if executor == "window" else 0,
                         async_scheduling=executor == "async")
        run(eng, prompts[:2], dataclasses.replace(sp, max_tokens=3), ids[:2])       # warm
        wall, steps, outs, compiles = run(eng, prompts, sp, ids)
        if depth == "trace":
            trace.check_engine(eng)
            assert all(o.exit_depths == r["exit_depths"] for o, r in zip(outs, trace.records)), "trace not replayed"
        rows.append(dict(depth=depth, executor=executor, scheduler=mode, seconds=wall,
                         output_tokens_per_s=N * args.output_len / wall, steps=steps,
                         compiles_during_run=compiles))
        if args.trace_dir:
            rows[-1]["profile"] = profile(eng, prompts, sp, ids, os.path.join(args.trace_dir, f"{depth}-{executor}-{mode}"),
                                          args.trace_requests or C)
        if compiles["count"]:
            print(f"WARNING: {depth}/{executor}/{mode} compiled {compiles['count']} executable(s) inside the "
                  f"timed run ({compiles['seconds']:.1f}s)", flush=True)
        print(json.dumps(rows[-1]), flush=True)
        del eng

    by = {(r["depth"], r["executor"], r["scheduler"]): r["output_tokens_per_s"] for r in rows}
    run_of = {(r["depth"], r["executor"], r["scheduler"]): r for r in rows}
    dtype = "float32" if args.quick else "bfloat16"
    sizes = model_bytes(cfg, dtype)
    L = args.prompt_len + args.output_len / 2
    fr = sizes.core_weight_bytes + C * L * sizes.kv_bytes_per_position_per_plane
    ideal = ideal_speedup(R, dbar, fr, sizes.token_weight_bytes)
    bound = schedule_bound([r["exit_depths"] for r in trace.records], C, R)
    summary = dict(mean_depth=dbar, depth_histogram=trace.depth_histogram(), ideal_speedup=ideal,
                   schedule_bound=bound)
    for executor in args.executors:
        achieved = by[("trace", executor, "refill")] / by[("fixed", executor, "refill")]
        summary[f"{executor}_speedup"] = achieved
        summary[f"{executor}_fraction_of_ideal"] = achieved / ideal
        summary[f"{executor}_fraction_of_schedule_bound"] = achieved / (ideal * bound["bound_fraction"])
        fixed, traced = run_of[("fixed", executor, "refill")], run_of[("trace", executor, "refill")]
        summary[f"{executor}_pass_split"] = pass_split(fixed["seconds"], loop_passes(fixed["steps"]),
                                                       traced["seconds"], loop_passes(traced["steps"]))
    if "step" in args.executors:
        summary["no_refill_speedup"] = by[("trace", "step", "no_refill")] / by[("fixed", "step", "refill")]
    if {"step", "window"} <= set(args.executors):
        summary["full_depth_overhead_step_vs_back_to_back"] = (by[("fixed", "window", "refill")]
                                                              / by[("fixed", "step", "refill")] - 1)
    info = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, source=source_identity(),
                preset=args.preset, quick=args.quick,
                concurrency=C, num_requests=N, prompt_len=args.prompt_len, output_len=args.output_len,
                decode_window=args.decode_window, mixed_prefill_tokens=args.mixed_prefill_tokens,
                standby=args.standby, results=rows,
                summary=summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)
    print(f"\n{'depth':<7}{'executor':<9}{'scheduler':<11}{'tok/s':>10}   ({info['device']}, C={C}, N={N}, "
          f"{args.prompt_len}+{args.output_len}, mean depth {dbar:.2f})")
    for r in rows:
        print(f"{r['depth']:<7}{r['executor']:<9}{r['scheduler']:<11}{r['output_tokens_per_s']:>10.1f}")
    achieved = ", ".join(f"{e} {summary[e + '_speedup']:.3f} ({summary[e + '_fraction_of_ideal']:.1%})"
                         for e in args.executors)
    print(f"ideal speed-up {ideal:.3f}; achieved: {achieved}")
    print(f"schedule bound: a perfect engine keeps {bound['occupancy_trace']:.1%} of the rows busy on this "
          f"trace ({bound['occupancy_fixed']:.1%} at fixed depth): the drain scales the ideal by "
          f"{bound['bound_fraction']:.1%}; achieved / (ideal x that): " + ", ".join(
              f"{e} {summary[e + '_fraction_of_schedule_bound']:.1%}" for e in args.executors))
    print("passes: " + ", ".join(
        f"{e} {summary[e + '_pass_split']['pass_ratio']:.3f}x fewer with the trace (a perfect scheduler: "
        f"{bound['passes_fixed'] / bound['passes_trace']:.3f}x), each {summary[e + '_pass_split']['pass_cost_ratio'] - 1:+.1%} "
        f"wall time ({summary[e + '_pass_split']['trace_ms_per_pass']:.3f} against "
        f"{summary[e + '_pass_split']['fixed_ms_per_pass']:.3f} ms)" for e in args.executors))
    if "no_refill_speedup" in summary:
        print(f"no_refill {summary['no_refill_speedup']:.3f}")
    if "full_depth_overhead_step_vs_back_to_back" in summary:
        print(f"back-to-back full depth vs CDB step: {summary['full_depth_overhead_step_vs_back_to_back']:+.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

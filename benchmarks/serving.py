"""Serving benchmark: closed-loop clients at concurrency C on the ShareGPT V3 workload.

Against a running server (start it yourself; requests send ``ignore_eos``, so
the server needs no special flag):

    rltjax serve MODEL_DIR --max-num-seqs 64 &
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --model MODEL_DIR --concurrency 1 8 32

Here --model (default: the served directory, when /v1/models names one on this
machine) or --preset describes the served model for the roofline and supplies
the tokenizer; the mean loop depth comes from the server's /metrics.

In process (the engine is built here from --preset with random weights, or
from --model; start-up is timed cold and with a warm compilation cache first):

    python scripts/bench_serving.py --in-process --preset ouro-1.4b --concurrency 1 8 32

Without a checkpoint, ``--write-random-model DIR`` writes a random-weight model
directory at --preset's shape with the ShareGPT-trained tokenizer, for
``rltjax serve DIR``. Reported per C: output tokens/s, requests/s, TTFT, TPOT,
ITL and end-to-end latency (mean/p50/p95/p99) and the memory-bound roofline
(DESIGN section 4) with the fraction reached; JSON and PNG plots go to --out-dir.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import clients, depth_trace, metrics, report, roofline, startup, workload
from rltjax.engine.compile_watch import CompileWatch


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--base-url", help="server root, e.g. http://127.0.0.1:8000 (an OpenAI-compatible server)")
    mode.add_argument("--in-process", action="store_true", help="drive an LLMEngine built here")
    mode.add_argument("--write-random-model", metavar="DIR",
                      help="write a random-weight model directory at --preset's shape, then exit")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--warmup-requests", type=int, default=4, help="untimed short requests before the runs")
    g = p.add_argument_group("server mode")
    g.add_argument("--served-model-name", default=None, help="'model' field (default: the server's first)")
    g.add_argument("--api-key", default=None)
    g.add_argument("--prompt-format", choices=["text", "ids"], default="text",
                   help="send prompt text (the server tokenizes) or this tokenizer's token ids")
    g.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds to wait for /health")
    g = p.add_argument_group("in-process mode")
    g.add_argument("--skip-startup", action="store_true", help="do not time cold/warm start-up")
    g.add_argument("--startup-cache-dir", default=None, metavar="DIR",
                   help="an empty directory for the start-up measurement's compilation cache (default: a "
                        "temporary one); it is kept, so a later run can start warm from it")
    startup.add_trace_argument(g)
    startup.add_model_arguments(p)
    workload.add_workload_arguments(p)
    return p


def wait_ready(base_url: str, timeout: float) -> dict:
    """Poll /health until 200, then read /v1/models."""
    import httpx
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base_url}/health did not answer 200 within {timeout:.0f}s")
        time.sleep(0.5)
    return httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]


def _model_dir(path: str | None) -> str | None:
    return path if path and (Path(path) / "config.json").is_file() else None


def run_benchmark(args, argv: list[str]) -> dict:
    per_run_counts(args)   # bad flags fail before anything starts
    if args.startup_cache_dir and args.skip_startup:
        raise ValueError("--startup-cache-dir holds the start-up measurement's cache; with --skip-startup "
                         "there is none (use --compilation-cache-dir)")
    if args.trace_depth_probs and not args.in_process:
        raise ValueError("--trace-depth-probs replays a drawn exit trace in the in-process engine; a server "
                         "decides depths itself (use --in-process)")
    base_url = (args.base_url or "").rstrip("/")
    server_model, engine, build = {}, None, None
    if base_url:
        server_model = wait_ready(base_url, args.ready_timeout)
    model_dir = _model_dir(args.model) or _model_dir(server_model.get("root"))
    if model_dir and not args.model:
        args.model = model_dir   # the served directory is on this machine: its config and tokenizer
    cfg, dtype = startup.model_config(args)
    env = report.environment()   # jax stays uninitialised: start-up children need the whole GPU
    max_model_len = args.max_model_len or server_model.get("max_model_len") or (
        args.max_prompt_len + args.max_output_len)
    requests, tok, data_info = workload.prepare_workload(args, model_dir=model_dir, default_vocab=cfg.vocab_size,
                                                         max_model_len=max_model_len)
    mb = roofline.model_bytes(cfg, dtype, name=args.model or args.preset + (" (quick)" if args.quick else ""))
    config = dict(vars(args), mode="server" if base_url else "in-process", served_model=server_model or None)
    report.print_header(env, config, {"tokenizer": tok.describe(), "dataset": data_info})
    result = dict(kind="serving", config=config, environment=env, tokenizer=tok.describe(), dataset=data_info,
                  model_bytes=vars(mb), startup=None, runs=[])
    exit_config = None
    if args.trace_depth_probs:
        exit_config, result["exit_trace"] = _drawn_trace(args, cfg, requests)
        t = result["exit_trace"]
        print(f"[bench] exit trace: depths drawn from {args.trace_depth_probs}, mean {t['mean_depth']:.3f} over "
              f"{t['decode_tokens']} decode tokens", flush=True)
    with tempfile.TemporaryDirectory(prefix="rltjax-bench-xla-") as tmp_dir:
        cache_dir = args.startup_cache_dir or tmp_dir
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        if args.in_process:
            child_argv = [*argv, "--max-num-seqs", str(max(args.concurrency)), "--max-model-len", str(max_model_len)]
            if not args.skip_startup:
                result["startup"] = startup.measure_startup(child_argv, cache_dir)
                s = result["startup"]
                print(f"[bench] start-up to ready: cold {s['cold']['ready_s']:.1f}s (compile "
                      f"{s['cold']['compile_s']:.1f}s), warm cache {s['warm']['ready_s']:.1f}s (compile "
                      f"{s['warm']['compile_s']:.1f}s); process wall {s['cold']['process_wall_s']:.1f}s / "
                      f"{s['warm']['process_wall_s']:.1f}s", flush=True)
            engine, build = startup.build_engine_from_args(
                args, max_num_seqs=max(args.concurrency), max_model_len=max_model_len,
                cache_dir=None if args.skip_startup else cache_dir, exit_config=exit_config)
            result["main_build"] = build
            env.update(report.jax_devices())
            print(f"[bench] jax devices: {env['jax_devices']}; engine: {build['engine']}", flush=True)
        model_name = args.served_model_name or server_model.get("id")
        _warm_up(args, engine, base_url, model_name, requests)
        timings_by_run = []
        for c, n in zip(args.concurrency, per_run_counts(args)):
            reqs = requests[:n]
            before = clients.scrape_exit_depth(base_url) if base_url else None
            memory_before = clients.memory_counters(engine, base_url)
            compiles = None
            if engine is not None:
                engine.steps_by_kind.clear()
                with CompileWatch() as compiles:
                    timings, wall = clients.run_engine(engine, reqs, c, temperature=args.temperature,
                                                       exit_threshold=args.exit_threshold, tag=f"c{c}")
            else:
                timings, wall = clients.run_http(base_url, reqs, c, model_name, prompt_format=args.prompt_format,
                                                 temperature=args.temperature, exit_threshold=args.exit_threshold,
                                                 api_key=args.api_key)
            summary = metrics.summarize(timings, wall)
            memory = clients.memory_report(memory_before, clients.memory_counters(engine, base_url))
            if before is not None and (after := clients.scrape_exit_depth(base_url)) and after[1] > before[1]:
                summary["mean_decode_depth"] = (after[0] - before[0]) / (after[1] - before[1])
            ctx = roofline.mean_context([t.prompt_tokens for t in timings], [t.output_tokens for t in timings])
            roof = roofline.roofline_report(mb, min(c, n), ctx, summary["mean_decode_depth"],
                                            summary["output_throughput"], args.bandwidth)
            mismatches = sum(t.ok and t.output_tokens != r.output_len for t, r in zip(timings, reqs))
            steps = dict(engine.steps_by_kind) if engine is not None else None
            run = dict(concurrency=c, num_requests=n, summary=summary, roofline=roof, memory=memory,
                       output_len_mismatches=mismatches, per_request=report.per_request(timings),
                       compiles_during_run=compiles.report() if compiles else None, engine_steps=steps,
                       passes=metrics.pass_occupancy(timings, depth_trace.loop_passes(steps), wall, min(c, n))
                       if steps else None)
            result["runs"].append(run)
            timings_by_run.append(timings)
            print(report.summary_line(run), flush=True)
            print("      " + roofline.roofline_line(roof), flush=True)
            if run["engine_steps"]:
                print(f"      engine steps: {run['engine_steps']}", flush=True)
            if memory:
                rate = memory["prefix_cache_hit_rate"]
                print(f"      prefix cache: {memory['prefix_cache_hits']} of {memory['prefix_cache_queries']} prompt "
                      f"tokens found ({'-' if rate is None else f'{100 * rate:.1f}%'}); "
                      f"{memory['preemptions']} preemption(s)", flush=True)
            if run["passes"]:
                print("      " + report.passes_line(run["passes"], run["concurrency"], roof), flush=True)
            if compiles and compiles.warning(f"C={c}"):
                print("      " + compiles.warning(f"C={c}"), flush=True)
            if mismatches:
                print(f"      WARNING: {mismatches} request(s) did not generate their target length", flush=True)
    return _write(args, result, timings_by_run)


def _drawn_trace(args, cfg, requests):
    """ExitConfig(mode="trace") with depths drawn for every request id the runs will use."""
    from rltjax.engine_config import ExitConfig
    runs = [(f"c{c}", [r.output_len for r in requests[:n]]) for c, n in zip(args.concurrency, per_run_counts(args))]
    runs.append(("warmup", [4] * min(args.warmup_requests, len(requests))))
    depths = depth_trace.draw_depths(depth_trace.workload_ids(runs), args.trace_depth_probs, cfg.num_loops,
                                     args.seed)
    return (ExitConfig(mode="trace", depths_by_request=depths),
            depth_trace.describe(depths, args.trace_depth_probs, args.seed))


def per_run_counts(args) -> list[int]:
    """N for each concurrency value: one --num-requests for all, or one each."""
    if len(args.num_requests) == 1:
        return args.num_requests * len(args.concurrency)
    if len(args.num_requests) != len(args.concurrency):
        raise ValueError(f"--num-requests: give one value or one per --concurrency value "
                         f"({len(args.concurrency)}), got {len(args.num_requests)}")
    return list(args.num_requests)


def _warm_up(args, engine, base_url, model_name, requests) -> None:
    warm = list(requests[: args.warmup_requests])
    if not warm:
        return
    c = max(args.concurrency)
    if engine is not None:
        clients.run_engine(engine, warm, c, tag="warmup", max_tokens=4)
    else:
        timings, _ = clients.run_http(base_url, warm, c, model_name, prompt_format=args.prompt_format,
                                      api_key=args.api_key, max_tokens=4)
        errors = [t.error for t in timings if t.error]
        if errors:
            raise RuntimeError(f"warm-up requests failed: {errors[0]}")


def _write(args, result: dict, timings_by_run) -> dict:
    out = workload.out_dir(args, "serving")
    if not args.no_plots and result["runs"]:
        title = (f"{result['model_bytes']['name']} ({result['config']['mode']}), ShareGPT "
                 f"N={'/'.join(map(str, args.num_requests))}, seed {args.seed}")
        result["plots"] = report.plot_runs(out, result["runs"], timings_by_run, title)
    report.write_json(out / "results.json", result)
    print(f"[bench] wrote {out / 'results.json'}" + (f" and {len(result.get('plots', []))} plots"
                                                     if result.get("plots") else ""), flush=True)
    result["out_dir"] = str(out)
    return result


def write_random_model(args) -> int:
    from benchmarks import bench_tokenizer, dataset
    from benchmarks.random_model import write_random_model as write
    from rltjax.presets import preset_hf_dict
    from rltjax.entrypoints.bench import QUICK_OVERRIDES
    hf = {**preset_hf_dict(args.preset), **(QUICK_OVERRIDES if args.quick else {})}
    if args.tokenizer:
        tok_json = Path(args.tokenizer) / "tokenizer.json"
    else:
        pairs = dataset.exchanges(dataset.load_sharegpt(args.dataset))
        tok_json = bench_tokenizer.trained_tokenizer(pairs, args.tokenizer_vocab_size or hf["vocab_size"]).source
        tok_json = tok_json.split(":", 1)[1]
    dst = write(args.write_random_model, hf, tok_json, dtype=args.dtype or ("float32" if args.quick else "bfloat16"))
    print(f"[bench] wrote a random-weight {args.preset}{' (quick)' if args.quick else ''} model to {dst}; "
          f"serve it with: rltjax serve {dst}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.write_random_model:
        return write_random_model(args)
    if args.base_url and "jax" not in sys.modules:   # a client must not take GPU memory from the server
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        run_benchmark(args, argv)
    except (ValueError, TimeoutError) as exc:
        print(f"bench_serving: error: {exc}", file=sys.stderr)
        return 2
    return 0

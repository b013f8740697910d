"""Offline throughput: ``LLM.generate`` over the whole ShareGPT workload at once.

    python scripts/bench_offline.py --preset ouro-1.4b --max-num-seqs 32 --num-requests 500   # N = the largest given
    python scripts/bench_offline.py --model MODEL_DIR --max-num-seqs 64

Every request is submitted at t0 and the engine runs at most --max-num-seqs of
them at a time (so B = min(max_num_seqs, N) in the roofline). Reported: output
and total tokens/s, requests/s, TTFT and end-to-end latency from t0 (queueing
included), TPOT, the engine's start-up time, and the roofline fraction. Token
ids come from the benchmark tokenizer, folded into the model's vocabulary when
it is smaller (tiny --quick models).
"""
from __future__ import annotations

import argparse
import sys
import time

from benchmarks import clients, metrics, report, roofline, startup, workload
from rltjax.engine.compile_watch import CompileWatch
from rltjax.entrypoints.llm import LLM


class EngineLLM(LLM):
    """``LLM`` around an engine that was built already (random weights at a preset's shape)."""

    def __init__(self, engine):   # noqa: super().__init__ would load a checkpoint directory
        self.engine = engine
        self._next_id = 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--warmup-requests", type=int, default=4, help="untimed short requests first")
    startup.add_model_arguments(p)
    workload.add_workload_arguments(p)
    return p


def timings_from_outputs(outputs, t0: float) -> list[metrics.RequestTiming]:
    """RequestTimings from the engine's own per-request times (all requests started at t0)."""
    out = []
    for o in outputs:
        first, end = o.metrics.get("first_token_time"), o.metrics.get("finished_time")
        out.append(metrics.RequestTiming(start=t0, arrivals=[first] if first is not None else [], end=end,
                                         prompt_tokens=len(o.prompt_token_ids), output_tokens=len(o.token_ids),
                                         exit_depths=list(o.exit_depths),
                                         error=o.error if o.finish_reason == "error" else None))
    return out


def run(args) -> dict:
    from rltjax.sampling_params import SamplingParams

    cfg, dtype = startup.model_config(args)
    max_model_len = args.max_model_len or args.max_prompt_len + args.max_output_len
    requests, tok, data_info = workload.prepare_workload(args, model_dir=args.model, default_vocab=cfg.vocab_size,
                                                         max_model_len=max_model_len)
    env = report.environment(with_jax=True)
    config = dict(vars(args), mode="offline")
    report.print_header(env, config, {"tokenizer": tok.describe(), "dataset": data_info})
    engine, build = startup.build_engine_from_args(args, max_num_seqs=args.max_num_seqs,
                                                   max_model_len=max_model_len)
    print(f"[bench] engine ready in {build['ready_s']:.1f}s (compile {build['compile_s']:.1f}s)", flush=True)
    llm = EngineLLM(engine)
    vocab = engine.cfg.vocab_size
    prompts = [{"prompt_token_ids": clients.fold_ids(r.prompt_ids, vocab)} for r in requests]
    params = [SamplingParams(max_tokens=r.output_len, temperature=args.temperature, ignore_eos=True,
                             exit_threshold=args.exit_threshold, seed=i) for i, r in enumerate(requests)]
    warm = slice(0, args.warmup_requests)
    if args.warmup_requests:
        llm.generate(prompts[warm], [SamplingParams(max_tokens=4, ignore_eos=True) for _ in prompts[warm]],
                     use_tqdm=False)
    engine.steps_by_kind.clear()
    with CompileWatch() as compiles:
        t0 = time.monotonic()
        outputs = llm.generate(prompts, params)
        wall = time.monotonic() - t0
    timings = timings_from_outputs(outputs, t0)
    summary = metrics.summarize(timings, wall)
    summary.pop("itl_ms")   # token arrivals are not observable through LLM.generate
    mb = roofline.model_bytes(cfg, dtype, name=args.model or args.preset + (" (quick)" if args.quick else ""))
    ctx = roofline.mean_context([r.prompt_len for r in requests], [r.output_len for r in requests])
    roof = roofline.roofline_report(mb, min(args.max_num_seqs, len(requests)), ctx, summary["mean_decode_depth"],
                                    summary["output_throughput"], args.bandwidth)
    mismatches = sum(t.output_tokens != r.output_len for t, r in zip(timings, requests))
    s = summary
    print(f"offline N={len(requests)} max_num_seqs={args.max_num_seqs}: {s['output_throughput']:.1f} out tok/s, "
          f"{s['total_token_throughput']:.1f} total tok/s, {s['request_throughput']:.2f} req/s in "
          f"{wall:.2f}s | TTFT p50 {s['ttft_ms']['p50']:.1f} ms, TPOT p50 {s['tpot_ms']['p50']:.2f} ms, "
          f"E2E p50 {s['e2e_ms']['p50']:.1f} ms", flush=True)
    print("      " + roofline.roofline_line(roof), flush=True)
    if compiles.warning("the offline run"):
        print("      " + compiles.warning("the offline run"), flush=True)
    result = dict(kind="offline", config=config, environment=env, tokenizer=tok.describe(), dataset=data_info,
                  model_bytes=vars(mb), build=build, summary=summary, roofline=roof,
                  output_len_mismatches=mismatches, steps=dict(engine.steps_by_kind),
                  compiles_during_run=compiles.report(),
                  per_request=report.per_request(timings))
    out = workload.out_dir(args, "offline")
    report.write_json(out / "results.json", result)
    print(f"[bench] wrote {out / 'results.json'}", flush=True)
    result["out_dir"] = str(out)
    return result


def main(argv: list[str] | None = None) -> int:
    run(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

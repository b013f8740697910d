"""What adaptive depth bought on one serving workload: a fixed-depth run of
``scripts/bench_serving.py`` against an exit-trace run of the same requests.

    python -m benchmarks.trace_vs_fixed fixed/results.json trace/results.json [--out F]

Per concurrency that both ran: the achieved speed-up (trace output tok/s / fixed), the ideal
speed-up for the depths each run measured, the fraction of it reached (the CDB measure),
and the speed-up split into the loop passes the trace saved and the wall time each of its
passes took (``depth_trace.pass_split``). The ideal is DESIGN section 4's
(F0 + R·Fr) / (F0 + d̄·Fr) in bytes read (``roofline.ideal_speedup``, as ``bench_cdb``
computes it): Fr = W + B·L·kv, one loop pass of the fixed-depth run's roofline, F0 = the
weights a token reads once (the results' ``model_bytes.token_weight_bytes``: Ouro's lm_head),
R and d̄ the two runs' mean depths. Results written before they carried F0 get the ratio of
the two runs' rooflines instead (F0 = 0: R / d̄ at equal B and L), and the table says so.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.depth_trace import pass_split
from benchmarks.roofline import ideal_speedup
from benchmarks.report import write_json

# bench_serving's configuration fields that make it another engine or another workload
SAME_CONFIG = ("mode", "model", "preset", "quick", "dtype", "hf_overrides", "max_model_len", "kv_layout",
               "page_size", "num_pages", "cache_max_loops", "scheduler_mode", "max_num_seqs",
               "max_num_batched_tokens", "prefill_chunk_size", "max_prefill_batches_before_decode",
               "min_coda_batch_size", "exit_mode", "exit_threshold", "attn_impl", "attn_num_splits",
               "matmul_impl", "xla_option", "decode_window", "window_trip", "mixed_prefill_tokens",
               "async_scheduling", "temperature", "max_output_len", "max_prompt_len", "min_len", "dataset",
               "tokenizer", "tokenizer_vocab_size", "bandwidth")


def _same(what: str, fixed, trace, hint="run both with the same --num-requests, --seed and dataset flags") -> None:
    if fixed != trace:
        raise ValueError(f"not the same runs: {what} is {fixed!r} in the fixed-depth run and {trace!r} in the "
                         f"trace run ({hint})")


def compare(fixed: dict, trace: dict) -> dict:
    """fixed, trace: two ``bench_serving`` results (results.json), the second with an exit
    trace. -> {"same_source": bool, "rows": one dict per concurrency both ran}."""
    for name, result in (("fixed-depth", fixed), ("trace", trace)):
        if result.get("kind") != "serving":
            raise ValueError(f"the {name} file is not a bench_serving result (kind {result.get('kind')!r})")
    if fixed.get("exit_trace") or not trace.get("exit_trace"):
        raise ValueError("give the fixed-depth run first and the --trace-depth-probs run second")
    if "config" in fixed and "config" in trace:
        for key in SAME_CONFIG:
            _same(f"config {key!r}", fixed["config"].get(key), trace["config"].get(key),
                  "run both with the same engine and workload flags")
    _same("the dataset's workload", fixed["dataset"]["workload"], trace["dataset"]["workload"])
    _same("the dataset seed", fixed["dataset"]["seed"], trace["dataset"]["seed"])
    by_c = {run["concurrency"]: run for run in fixed["runs"]}
    token_bytes = (fixed.get("model_bytes") or {}).get("token_weight_bytes")
    rows = []
    for t in trace["runs"]:
        f = by_c.get(t["concurrency"])
        if f is None:
            continue
        c = t["concurrency"]
        _same(f"C = {c}'s requests", f["num_requests"], t["num_requests"])
        _same(f"C = {c}'s output tokens", f["summary"]["output_tokens"], t["summary"]["output_tokens"])
        for name, run in (("fixed-depth", f), ("trace", t)):
            if not run["summary"]["output_throughput"] > 0 or not run["roofline"]["bound_tokens_per_s"] > 0:
                raise ValueError(f"C = {c}: the {name} run has no output throughput or roofline "
                                 f"({run['summary']['output_throughput']} tok/s, bound "
                                 f"{run['roofline']['bound_tokens_per_s']}); did its requests fail?")
        speedup = t["summary"]["output_throughput"] / f["summary"]["output_throughput"]
        ideal = _ideal(f["roofline"], t["roofline"], token_bytes)
        row = dict(concurrency=c, num_requests=t["num_requests"], fixed_tokens_per_s=f["summary"]["output_throughput"],
                   trace_tokens_per_s=t["summary"]["output_throughput"], fixed_depth=f["summary"]["mean_decode_depth"],
                   trace_depth=t["summary"]["mean_decode_depth"], speedup=speedup, ideal_speedup=ideal,
                   fraction_of_ideal=speedup / ideal)
        if f.get("passes") and t.get("passes"):
            row["pass_split"] = pass_split(f["summary"]["duration_s"], f["passes"]["loop_passes"],
                                           t["summary"]["duration_s"], t["passes"]["loop_passes"])
        rows.append(row)
    if not rows:
        raise ValueError(f"no concurrency in both runs (fixed: {sorted(by_c)}, "
                         f"trace: {sorted(r['concurrency'] for r in trace['runs'])})")
    digests = [r["environment"].get("source_digest") for r in (fixed, trace)]
    return dict(same_source=digests[0] is not None and digests[0] == digests[1], source_digests=digests,
                token_weight_bytes=token_bytes, rows=rows)


def _ideal(fixed_roof: dict, trace_roof: dict, token_bytes: int | None) -> float:
    """DESIGN's ideal from the runs' rooflines and F0; the rooflines' ratio without F0."""
    if token_bytes is None:
        return trace_roof["bound_tokens_per_s"] / fixed_roof["bound_tokens_per_s"]
    loop_bytes = fixed_roof["W_bytes"] + fixed_roof["B"] * fixed_roof["L"] * fixed_roof["kv_bytes_per_position_per_plane"]
    return ideal_speedup(fixed_roof["mean_depth"], trace_roof["mean_depth"], loop_bytes, token_bytes)


def _depth(depth) -> str:
    return "-" if depth is None else f"{depth:.2f}"


def table(result: dict) -> str:
    lines = ["| C | N | fixed tok/s | trace tok/s (depth) | speed-up | ideal | of ideal | passes saved | wall a pass |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        split = r.get("pass_split")
        passes = (f"{split['pass_ratio']:.3f}x | {split['pass_cost_ratio'] - 1:+.1%} "
                  f"({split['trace_ms_per_pass']:.3f} / {split['fixed_ms_per_pass']:.3f} ms)" if split else "- | -")
        lines.append(f"| {r['concurrency']} | {r['num_requests']} | {r['fixed_tokens_per_s']:,.1f} | "
                     f"{r['trace_tokens_per_s']:,.1f} ({_depth(r['trace_depth'])}) | {r['speedup']:.3f} | "
                     f"{r['ideal_speedup']:.3f} | {r['fraction_of_ideal']:.1%} | {passes} |")
    f0 = result.get("token_weight_bytes")
    lines.append("\nideal: (F0 + R·Fr) / (F0 + d̄·Fr), F0 = " + (f"{f0 / 1e6:,.1f} MB of per-token weights" if f0 is not None
                 else "0 (these results do not carry it): the two rooflines' ratio"))
    if not result["same_source"]:
        lines.append(f"\nWARNING: the runs may come from different code (source digests {result['source_digests']})")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("fixed", help="results.json of the fixed-depth run")
    p.add_argument("trace", help="results.json of the --trace-depth-probs run of the same requests")
    p.add_argument("--out", help="write the comparison as JSON here")
    args = p.parse_args(argv)
    try:
        with open(args.fixed) as f, open(args.trace) as t:
            result = compare(json.load(f), json.load(t))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyError as exc:
        print(f"error: field {exc} is missing from a results.json (not a bench_serving result of this "
              f"version?)", file=sys.stderr)
        return 2
    print(table(result))
    if args.out:
        write_json(Path(args.out), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

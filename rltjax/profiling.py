"""Summarise the GPU kernels of a `jax.profiler` perfetto trace.

    python -m rltjax.profiling TRACE_DIR --per 20      # 20 passes were traced

Prints, per traced unit of work (``--per``): the kernel count, the time the GPU
was busy (union of kernel intervals), the span from first kernel start to last
kernel end, the summed event time of each executable (events on every device stream,
copies included, so it can exceed busy), and the top kernels by total time,
each named with the executable it ran in (the event's ``hlo_module``): XLA's
fusion names repeat across executables, and a prefill step's kernel once passed
for a decode window's. Busy much smaller than span means
the GPU waited for launches (host or launch overhead); busy close to span means
the kernels themselves are the cost.

``median_call_us`` times a jitted call from such a trace (the kernel benchmarks' timer).
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time


def load_events(trace_dir: str) -> list[dict]:
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(paths[-1]) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def device_kernels(events: list[dict]) -> list[dict]:
    """Complete ('X') events on device processes (names like '/device:GPU:0')."""
    device_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                   and "device" in str(e.get("args", {}).get("name", "")).lower()}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in device_pids and e.get("dur") is not None]


def busy_time(kernels: list[dict]) -> float:
    """Union length of [ts, ts + dur) intervals (microseconds)."""
    total, end = 0.0, float("-inf")
    for e in sorted(kernels, key=lambda e: e["ts"]):
        start, stop = e["ts"], e["ts"] + e["dur"]
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def kernel_time_per_call(kernels: list[dict], gap_us: float = 1000.0) -> list[float]:
    """Kernel time (sum of durations) of each call: the host waits for each call before the
    next, so calls are the runs of kernels separated by idle gaps longer than ``gap_us``."""
    sums, last_end = [], None
    for e in sorted(kernels, key=lambda e: e["ts"]):
        if last_end is None or e["ts"] - last_end > gap_us:
            sums.append(0.0)
        sums[-1] += e["dur"]
        last_end = max(last_end or e["ts"], e["ts"] + e["dur"])
    return sums


def median_wall_us(fn, args: tuple, iters: int) -> float:
    """Median wall-clock time of ``fn(*args)``, each call waited for, in microseconds (no
    warm-up call: the caller makes one)."""
    import jax       # here: summarising a trace (this module's CLI) needs no jax
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def median_call_us(fn, args: tuple, iters: int) -> float:
    """Median time of ``fn(*args)`` in microseconds: on a GPU its kernels' summed durations
    from a profiler trace (launch gaps and host dispatch are not in it), else wall-clock."""
    import jax       # here: summarising a trace (this module's CLI) needs no jax
    jax.block_until_ready(fn(*args))
    if jax.default_backend() != "gpu":
        return median_wall_us(fn, args, iters)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(iters):
                jax.block_until_ready(fn(*args))
                time.sleep(0.002)            # an idle gap the trace splits calls at
        per_call = kernel_time_per_call(device_kernels(load_events(trace_dir)))
    if len(per_call) != iters:
        raise RuntimeError(f"median_call_us: the trace split into {len(per_call)} calls, expected {iters}")
    return statistics.median(per_call)


def summarise(kernels: list[dict], per: int = 1, top: int = 15) -> dict:
    if not kernels:
        return dict(kernels=0, busy_us=0.0, span_us=0.0, top=[], by_module={})
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    by_kernel: dict[tuple[str, str | None], list[float]] = collections.defaultdict(list)
    for e in kernels:
        by_kernel[(e["name"], e.get("args", {}).get("hlo_module"))].append(e["dur"])
    ranked = sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]
    by_module: dict[str, float] = collections.defaultdict(float)
    for (_, module), d in by_kernel.items():
        by_module[module or "(no executable)"] += sum(d) / per
    return dict(kernels=len(kernels) / per, busy_us=busy_time(kernels) / per, span_us=span / per,
                by_module=dict(sorted(by_module.items(), key=lambda kv: -kv[1])),
                top=[dict(name=name[:90], module=module, count=len(d) / per, total_us=sum(d) / per,
                          mean_us=sum(d) / len(d)) for (name, module), d in ranked])


def summarise_dir(trace_dir: str, per: int = 1, top: int = 15) -> dict:
    """``summarise`` of the GPU kernels in the trace written under ``trace_dir``."""
    return summarise(device_kernels(load_events(trace_dir)), per, top)


def format_summary(s: dict) -> str:
    lines = [f"kernels {s['kernels']:.0f}  busy {s['busy_us']:.0f} us  span {s['span_us']:.0f} us"]
    if s.get("by_module"):
        lines.append("  by executable: " + ", ".join(f"{m} {t:.0f} us" for m, t in s["by_module"].items()))
    lines += [f"  {t['total_us']:8.1f} us  x{t['count']:<5.0f} ({t['mean_us']:6.2f} us)  {t['name']}"
              + (f"  [{t['module']}]" if t.get("module") else "") for t in s["top"]]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace_dir")
    p.add_argument("--per", type=int, default=1, help="divide counts and times by this many units")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args(argv)
    print(format_summary(summarise_dir(args.trace_dir, args.per, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

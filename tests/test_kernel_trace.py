"""The profiler-trace summary: device kernels only, busy time as the union of intervals,
counts and times per unit of work, kernels of one name in different executables apart."""
from __future__ import annotations

import gzip
import json

import pytest

from rltjax.profiling import (busy_time, device_kernels, format_summary, kernel_time_per_call, load_events,
                                            summarise)


def write_trace(tmp_path, events):
    run = tmp_path / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_summary_of_a_known_trace(tmp_path):
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}}]
    kernels = [dict(ph="X", pid=2, tid=1, ts=0.0, dur=10.0, name="gemm"),
               dict(ph="X", pid=2, tid=2, ts=5.0, dur=10.0, name="attn"),      # overlaps gemm: 0..15 busy
               dict(ph="X", pid=2, tid=1, ts=30.0, dur=10.0, name="gemm"),     # gap 15..30
               dict(ph="X", pid=1, tid=1, ts=0.0, dur=100.0, name="host_dispatch")]
    write_trace(tmp_path, meta + kernels)
    found = device_kernels(load_events(str(tmp_path)))
    assert [e["name"] for e in found] == ["gemm", "attn", "gemm"]
    assert busy_time(found) == 25.0
    s = summarise(found, per=2)
    assert s["kernels"] == 1.5 and s["busy_us"] == 12.5 and s["span_us"] == 20.0
    assert s["top"][0] == dict(name="gemm", module=None, count=1.0, total_us=10.0, mean_us=10.0)
    assert s["by_module"] == {"(no executable)": 15.0}     # event time, overlaps counted: above busy


def test_same_fusion_name_in_two_executables_is_two_entries(tmp_path):
    meta = [{"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}}]
    kernels = [dict(ph="X", pid=2, tid=1, ts=10.0 * i, dur=2.0, name="input_scatter_fusion_48",
                    args={"hlo_module": "jit_decode_window"}) for i in range(4)]
    kernels.append(dict(ph="X", pid=2, tid=1, ts=100.0, dur=1300.0, name="input_scatter_fusion_48",
                        args={"hlo_module": "jit_prefill_step"}))
    write_trace(tmp_path, meta + kernels)
    s = summarise(device_kernels(load_events(str(tmp_path))), per=4)
    assert [(t["module"], t["count"], t["mean_us"]) for t in s["top"]] == [
        ("jit_prefill_step", 0.25, 1300.0), ("jit_decode_window", 1.0, 2.0)]
    assert "input_scatter_fusion_48  [jit_prefill_step]" in format_summary(s)
    assert s["by_module"] == {"jit_prefill_step": 325.0, "jit_decode_window": 2.0}
    assert "by executable: jit_prefill_step 325 us, jit_decode_window 2 us" in format_summary(s)


def test_missing_trace_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no perfetto_trace.json.gz"):
        load_events(str(tmp_path))


def test_compile_watch_counts_only_inside_the_block():
    import jax
    import jax.numpy as jnp

    from rltjax.engine.compile_watch import CompileWatch
    x = jnp.arange(4.0)
    warm = jax.jit(lambda a: a * 3.0)
    warm(x)
    with CompileWatch() as w:
        warm(x)                                   # cached: nothing obtained
        assert w.count == 0 and w.warning("run") is None
        jax.jit(lambda a: a - 7.0)(x)             # a new executable
    assert w.count == 1 and w.seconds > 0
    jax.jit(lambda a: a + 11.0)(x)                # after the block: not counted
    assert w.report()["count"] == 1 and "compiled 1 executable(s)" in w.warning("run")


def test_kernel_time_per_call_splits_a_trace_into_calls():
    k = lambda ts, dur: dict(ts=ts, dur=dur)                                   # noqa: E731
    # two calls (back-to-back kernels, one overlapping its neighbour), 200 us of host wait between
    kernels = [k(300.0, 4.0), k(0.0, 5.0), k(6.0, 3.0), k(8.0, 2.0), k(305.0, 1.5)]
    assert kernel_time_per_call(kernels, gap_us=100.0) == [10.0, 5.5]
    assert kernel_time_per_call(kernels) == [15.5]             # 1 ms: the benchmarks sleep 2 ms between calls
    assert kernel_time_per_call([]) == []

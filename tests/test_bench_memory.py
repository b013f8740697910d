"""``scripts/bench_memory.py`` (``benchmarks.memory``) on the tiny model: every part runs and
reports what the KV memory manager did, and a run cut short keeps the runs it finished."""
from __future__ import annotations

import json

import pytest

from benchmarks import memory
from test_bench_scripts import run_script

QUICK = ["--quick", "--max-num-seqs", "4", "--num-requests", "8", "--max-prompt-len", "48", "--max-output-len", "12",
         "--system-prompt-len", "48", "--turns", "2", "--no-compile-ahead", "--compilation-cache-dir", ""]


def test_bench_memory_quick(tmp_path):
    """Every part runs: prefix caching finds the shared system prompt only when on; the
    capacity runs use the same pool and incremental pages run at least as many requests at
    once; the pressure runs preempt and finish every request."""
    run_script("bench_memory.py", *QUICK, "--out-dir", str(tmp_path))
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert runs["prefix/system/off"]["hit_rate"] == 0 and runs["prefix/system/on"]["hit_rate"] > 0.3
    assert runs["prefix/multi_turn/on"]["stats"]["prefix_cache_queries"] > 0
    cap = runs["capacity/lifetime"], runs["capacity/incremental"]
    assert cap[0]["num_pages"] == cap[1]["num_pages"] and cap[1]["running_mean"] >= cap[0]["running_mean"]
    assert cap[0]["stats"]["num_preemptions"] == 0
    assert sum(runs[f"pressure/{m}"]["stats"]["num_preemptions"] for m in ("recompute", "swap")) > 0
    assert all(r["summary"]["failed"] == 0 and r["replay_mismatches"] == 0 for r in runs.values())


def test_a_run_cut_short_keeps_the_runs_it_finished(tmp_path, monkeypatch):
    """results.json is written after every run: when the second capacity run dies (as a time
    limit would end it), the first one is on disk."""
    real = memory.run_sessions

    def dies_on_the_second(engine, sessions, clients, tag):
        if tag == "capacity-incremental":
            raise KeyboardInterrupt
        return real(engine, sessions, clients, tag)
    monkeypatch.setattr(memory, "run_sessions", dies_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        memory.main([*QUICK, "--parts", "capacity", "--out-dir", str(tmp_path)])
    assert list(json.loads((tmp_path / "results.json").read_text())["runs"]) == ["capacity/lifetime"]

"""scripts/bench_context_sweep.py on the tiny model: its cells' repeats, the roofline recomputed
from its inputs, and the two ways a cell can fail to fit the KV pool."""
from __future__ import annotations

import json

import pytest

from benchmarks.report import source_digest
from test_bench_scripts import ROOT, run_script


def test_bench_context_sweep_quick(tmp_path):
    """Every fitting cell runs its repeats against a measured bandwidth's roofline; a cell whose
    KV does not fit the capped pool is recorded, not run: 64:3 after its engine is built (run at
    the largest C that fits, --fit-concurrency), 512:1 before any engine is built for it."""
    out = tmp_path / "sweep.json"
    # 121 pages: 120 usable; a request holds 4 planes x ceil((P + 128) / 16) pages: 40 at P=32,
    # 48 at P=64, 160 at P=512
    text = run_script("bench_context_sweep.py", "--quick", "--cells", "32:1,2", "64:2,3", "512:1", "--repeats", "2",
                      "--num-pages", "121", "--fit-concurrency", "--out", str(out))
    info = json.loads(out.read_text())
    assert info["bandwidth_bytes_per_s"] > 0 and info["source"]["source_digest"] == source_digest(ROOT)
    assert info["argv"][:2] == ["--quick", "--cells"] and "--fit-concurrency" in info["argv"]   # the flags it ran
    cells = {(c["P"], c.get("asked_C", c["C"])): c for c in info["cells"]}
    assert list(cells) == [(32, 1), (32, 2), (64, 2), (64, 3), (512, 1)] and len(text.strip().splitlines()) == 6
    for key in [(32, 1), (32, 2), (64, 2), (64, 3)]:
        c, t = cells[key], cells[key]["tokens_per_s"]
        assert len(t["repeats"]) == 2 and min(t["repeats"]) > 0 and t["min"] <= t["median"] <= t["max"]
        assert c["roofline"]["bound_tokens_per_s"] > 0 and c["roofline"]["fraction"] > 0
        assert all(r["requests"] == 2 * c["C"] and r["output_tokens"] == 2 * c["C"] * 128 and r["preemptions"] == 0
                   for r in c["runs"])
        # each request's first token and then its last: within the loop's time; at C = 1 the two
        # requests run one after the other, so their times make up most of it
        for r in c["runs"]:
            per_request = r["mean_ttft_s"] + r["mean_decode_s"]
            assert r["mean_ttft_s"] > 0 and r["mean_decode_s"] > 0 and per_request <= r["seconds"]
            assert c["C"] > 1 or 2 * per_request > 0.5 * r["seconds"]
        assert c["mean_ttft_s"] == pytest.approx(sorted(r["mean_ttft_s"] for r in c["runs"])[0] / 2
                                                 + sorted(r["mean_ttft_s"] for r in c["runs"])[1] / 2)
        # the asked C's requests x 4 planes x whole pages of 16 positions x 1024 bytes (float32 K and V)
        assert c["kv_bytes_needed"] == key[1] * 4 * -(-(key[0] + 128) // 16) * 16 * 1024
        assert c["roofline"]["core_only"]["kv_bytes_per_position_per_plane"] == 1024
        # the bound from its inputs: R passes over the core weights and C rows' K/V at one plane
        # (L = P + 64: the mean context of 128 outputs), plus the head's bytes once a step
        roof, bw = c["roofline"], info["bandwidth_bytes_per_s"]
        core = roof["core_only"]
        assert core["L"] == key[0] + 64 and core["mean_depth"] == 4 and core["bandwidth"] == bw
        per_token_bytes = 4 * (core["W_bytes"] + c["C"] * core["L"] * 1024) + roof["F0_bytes"]
        assert roof["bound_tokens_per_s"] == pytest.approx(c["C"] * bw / per_token_bytes, rel=1e-9)
        assert roof["fraction"] == pytest.approx(t["median"] / roof["bound_tokens_per_s"])
    over = cells[(64, 3)]
    assert not over["fits"] and over["C"] == over["largest_C_that_fits"] == 2
    assert over["kv_bytes_available"] == 120 * 16 * 1024
    never = cells[(512, 1)]
    assert not never["fits"] and never["largest_C_that_fits"] == 0 and "tokens_per_s" not in never
    assert "does not fit" in text and "(fit C=2)" in text

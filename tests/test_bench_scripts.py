"""The GPU benchmark scripts run end to end on CPU in their --quick mode."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.report import source_digest

ROOT = Path(__file__).parent.parent


def run_script(name, *args):
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_bench_attention_quick(tmp_path):
    out = tmp_path / "attn.json"
    text = run_script("bench_attention.py", "--quick", "--impls", "xla", "pallas", "--out", str(out))
    results = json.loads(out.read_text())["results"]
    assert {r["impl"] for r in results} >= {"xla", "pallas"}
    assert all(r["max_abs_diff"] < 1e-2 for r in results)
    assert "best per shape" in text


def test_bench_cdb_quick(tmp_path):
    """Replays its recorded trace in every adaptive configuration (the script asserts the
    depths) and reports the speed-ups against the ideal from the trace's mean depth."""
    out = tmp_path / "cdb.json"
    run_script("bench_cdb.py", "--quick", "--concurrency", "3", "--prompt-len", "8", "--output-len", "12",
               "--decode-window", "4", "--depth-probs", "0.5", "0.5", "0", "0", "--out", str(out))
    info = json.loads(out.read_text())
    s = info["summary"]
    assert set(s["depth_histogram"]) <= {"1", "2"} and 1.0 <= s["mean_depth"] <= 2.0
    assert s["ideal_speedup"] > 1.5          # 4 loops vs <= 2: close to R / dbar for a tiny head
    assert len(info["results"]) == 7 and all(r["output_tokens_per_s"] > 0 for r in info["results"])
    assert {r["executor"] for r in info["results"]} == {"step", "async", "window"}
    # compiled ahead and warmed: no timed run may compile (continued windows included)
    assert all(r["compiles_during_run"]["count"] == 0 for r in info["results"]), info["results"]
    assert s["async_speedup"] > 0 and s["window_fraction_of_ideal"] > 0
    assert info["source"]["source_digest"] == source_digest(ROOT)
    b = s["schedule_bound"]          # 3 requests on 3 rows: only the trace run drains (fixed rows end together)
    assert b["passes_fixed"] == 11 * 4 and b["occupancy_fixed"] == 1.0 and 0 < b["bound_fraction"] <= 1


def test_bench_cdb_queues_more_requests_than_rows(tmp_path):
    """--num-requests above --concurrency: the extra requests wait for rows, every one is
    replayed, and only the executors asked for run."""
    out = tmp_path / "cdb.json"
    text = run_script("bench_cdb.py", "--quick", "--concurrency", "2", "--num-requests", "5", "--prompt-len", "8",
                      "--output-len", "6", "--decode-window", "4", "--executors", "window", "--out", str(out),
                      "--trace-dir", str(tmp_path / "trace"), "--trace-requests", "3")
    info = json.loads(out.read_text())
    assert info["num_requests"] == 5 and [(r["depth"], r["executor"]) for r in info["results"]] == [
        ("fixed", "window"), ("trace", "window")]
    assert all(r["compiles_during_run"]["count"] == 0 for r in info["results"]), info["results"]
    s = info["summary"]
    assert "step_speedup" not in s and "full_depth_overhead_step_vs_back_to_back" not in s
    # 5 requests x 5 decode tokens x 4 loops on 2 rows: 3 rounds of 20 passes
    assert s["schedule_bound"]["passes_fixed"] == 60
    assert s["window_fraction_of_schedule_bound"] == pytest.approx(
        s["window_speedup"] / (s["ideal_speedup"] * s["schedule_bound"]["bound_fraction"]))
    assert "schedule bound:" in text
    # the split of the speed-up: the runs' own passes and seconds
    split, (fixed, traced) = s["window_pass_split"], info["results"]
    passes = [r["steps"].get("window_passes", 0) + r["steps"].get("loop", 0) for r in (fixed, traced)]
    assert split["pass_ratio"] == pytest.approx(passes[0] / passes[1])
    bound = s["schedule_bound"]        # no engine takes fewer passes than the perfect scheduler
    assert passes[0] >= bound["passes_fixed"] and passes[1] >= bound["passes_trace"]
    assert split["pass_ratio"] / split["pass_cost_ratio"] == pytest.approx(s["window_speedup"])
    assert "passes: window" in text
    # the profiled run (no GPU kernels on CPU): 3 requests, each a prefill token then 5 decode
    # tokens of >= 1 pass, all in windows
    for r in info["results"]:
        assert r["profile"]["requests"] == 3 and r["profile"]["step_loop_passes"] == 0
        assert r["profile"]["window_passes"] >= 5 and (tmp_path / "trace" / f"{r['depth']}-window-refill").is_dir()


def test_bench_loop_pass_quick(tmp_path):
    out = tmp_path / "loop.json"
    run_script("bench_loop_pass.py", "--quick", "--out", str(out))
    rows = json.loads(out.read_text())["results"]
    assert rows and all(r["ms"] > 0 and r["bound_ms"] > 0 for r in rows)


def test_bench_throughput_quick(tmp_path):
    out = tmp_path / "thr.json"
    run_script("bench_throughput.py", "--quick", "--concurrency", "1", "4", "--prompt-len", "16",
               "--output-len", "8", "--no-compile-ahead", "--compilation-cache-dir", "", "--out", str(out),
               "--trace-dir", str(tmp_path / "trace"), "--trace-tokens", "4")
    info = json.loads(out.read_text())
    rows = info["results"]
    assert [r["concurrency"] for r in rows] == [1, 4]
    assert info["source"]["source_digest"] == source_digest(ROOT)     # the code that ran
    assert all(r["kernels_per_pass"]["passes"] >= 3 * 4 for r in rows)   # the profiled loop ran (no GPU kernels here)
    for r in rows:
        assert r["output_tokens"] == r["requests"] * info["output_len"]
        # fixed depth: every output token but each request's first costs R loop passes at most
        passes = r["steps"].get("loop", 0) + r["steps"].get("window_passes", 0)
        assert passes >= (info["output_len"] - 1) * 4


def test_bench_throughput_variants_compare_with_the_base_run(tmp_path):
    """--variant builds one more engine per variant on the same weights and requests: the
    step-by-step and async executors must give the base run's (decode windows') tokens in
    float32, and the variant's own flags must reach its engine."""
    out = tmp_path / "ab.json"
    text = run_script("bench_throughput.py", "--quick", "--concurrency", "1", "3", "--prompt-len", "8",
                      "--output-len", "5", "--no-compile-ahead", "--compilation-cache-dir", "", "--out", str(out),
                      "--variant", "step=--decode-window 0",
                      "--variant", "async=--decode-window 0 --async-scheduling --exit-mode fixed")
    info = json.loads(out.read_text())
    assert [v["name"] for v in info["variants"]] == ["step", "async"]
    assert "window" in info["results"][0]["steps"]                  # the base ran decode windows
    for v in info["variants"]:
        assert [r["concurrency"] for r in v["results"]] == [1, 3]
        for r in v["results"]:
            assert "window" not in r["steps"] and r["steps"]["loop"] > 0   # --decode-window 0 reached it
            assert r["requests_with_base_tokens"] == r["requests"]
    assert "requests with the base run's tokens" in text


@pytest.mark.parametrize("spec, message", [("nameonly", "expected NAME=FLAGS"),
                                           ("x=--no-such-flag", "unrecognized arguments")])
def test_bench_throughput_rejects_a_bad_variant_before_any_engine(spec, message):
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_throughput.py"), "--quick",
                          "--variant", spec], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and message in res.stderr and "output tok/s" not in res.stdout


def test_bench_skinny_quick(tmp_path):
    out = tmp_path / "skinny.json"
    run_script("bench_skinny.py", "--quick", "--gated", "--engine-forms", "--out", str(out))
    rows = json.loads(out.read_text())["results"]
    plain = [r for r in rows if r["shape"] == "tiny"]
    assert [r["rows"] for r in plain] == [1, 4]
    for r in plain:
        assert r["xla_us"] > 0 and r["kernel"][0]["label"] == "config"
        # the sweep: 64 x 128 fits block_k 16 / 32 and block_n 16 / 32, each at 1 and 2 K splits
        swept = {(c["block_n"], c["block_k"], c["k_splits"]) for c in r["kernel"][1:]}
        assert swept == {(bn, bk, s) for bn in (16, 32) for bk in (16, 32) for s in (1, 2)}
        assert all(c["rel_err_vs_xla"] < 1e-2 and c["us"] > 0 for c in r["kernel"])
        assert r["mosaic"][0]["label"] == "config" and r["mosaic"][0]["rel_err_vs_xla"] < 1e-2
    # the gate | up pair on each implementation, and every engine form on both backends
    assert [r["rows"] for r in rows if r["shape"] == "gated"] == [1, 4]
    assert all(r["xla_us"] > 0 and r["pallas_us"] > 0 and r["mosaic_us"] > 0 for r in rows if r["shape"] == "gated")
    forms = [r for r in rows if r["shape"].endswith("-engine")]
    assert {r["shape"] for r in forms} == {"qkv-engine", "o-engine", "down-engine", "lm_head-engine"}
    assert all(r["triton_us"] > 0 and r["mosaic_us"] > 0 for r in forms)


def test_explore_weight_layout_quick(tmp_path):
    """Every variant (both layouts on XLA, the engine's kernel, the K-major kernel's sweep and
    refinement) computes the projection; swiglu: SiLU(gate) * up in the kernel's prologue."""
    out = tmp_path / "layout.json"
    run_script("explore_weight_layout.py", "--quick", "--out", str(out))
    rows = json.loads(out.read_text())["results"]
    assert [(r["case"], r["rows"]) for r in rows] == [("o", 1), ("downsw", 8)]
    for r in rows:
        assert {"xla_kn", "xla_nk"} <= set(r["us"]) and any(label.endswith("_w8_st6_ev") for label in r["us"])
        assert ("pallas_kn" in r["us"]) == (r["case"] == "o")
        # bfloat16 outputs; with swiglu the prologue rounds SiLU(gate) * up once more
        assert max(r["rel_err_vs_xla"].values()) < (2e-2 if r["case"] == "downsw" else 1e-2)


def test_explore_panel_layout_quick(tmp_path):
    """The engine's calls and every panel variant (panel widths, K splits as partial sums for o
    and down, the gate | up pair with its SiLU-multiply) compute the projection."""
    out = tmp_path / "panel.json"
    run_script("explore_panel_layout.py", "--quick", "--out", str(out))
    rows = json.loads(out.read_text())["results"]
    assert [(r["case"], r["rows"]) for r in rows] == [(c, m) for c in ("qkv", "o", "gateup", "down") for m in (1, 16)]
    for r in rows:
        labels = set(r["us"])
        assert "engine" in labels and {"panel_p16_bk64_s1_w4_st3", "panel_p32_bk64_s1_w4_st3"} <= labels
        assert ("panel_p16_bk64_s2_w4_st3" in labels) == (r["case"] in ("o", "down"))
        assert max(r["rel_err"].values()) < 1e-2 and min(r["us"].values()) > 0


def test_explore_persistent_chain_quick(tmp_path):
    """The engine's chain, XLA's and the persistent kernel compute the chain's product: one stage
    at 4, 5 and 8 programs (units of column tiles x K splits, partial waves, partial sums added)
    and three stages in one program with 1 and 2 K splits (each stage adding the last one's partial
    sums as it reads them)."""
    out = tmp_path / "persistent.json"
    run_script("explore_persistent_chain.py", "--quick", "--out", str(out))
    rows = json.loads(out.read_text())["results"]
    runs = [(1, None, {"persistent_P4", "persistent_P5", "persistent_P8"}), (3, None, {"persistent_P1"}),
            (3, 2, {"persistent_P1_S2"})]
    assert [(r["stages"], r["splits"], r["chain"], r["rows"]) for r in rows] == [
        (s, k, c, m) for s, k, _ in runs for c in ("o", "qkv") for m in (1, 8)]
    for r, (_, _, persistent) in zip(rows, (run for run in runs for _ in range(4))):
        assert set(r["us"]) == {"engine", "xla"} | persistent
        assert max(r["rel_err"].values()) < 1e-2 and min(r["us"].values()) > 0


def test_profile_loop_pass_quick(tmp_path):
    """Each XLA option set compiles its own pass (the values parsed as --xla-option parses them);
    a name XLA does not know fails the run."""
    text = run_script("profile_loop_pass.py", "--quick", "--batch", "2", "--trace-dir", str(tmp_path / "tr"),
                      "--options", "default", "nofm:xla_cpu_enable_fast_math=false")
    assert "full[default]" in text and "full[nofm]" in text and "kernels " in text
    assert all(name in text for name in ("matmuls", "unrolled", "fused", "weights_rd"))
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_loop_pass.py"), "--quick", "--skip-micro",
                          "--options", "bad:xla_no_such_option=1"], capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "No such compile option" in res.stderr


def test_source_digest_names_the_code_not_the_git_metadata(tmp_path):
    """Reports carry a digest of the source files, so a run from a copied tree whose git
    metadata is stale still names its code: equal trees give equal digests, any source edit
    changes it, caches and non-source files do not."""
    import shutil

    from rltjax.source_files import SOURCE_DIRS

    a, b = tmp_path / "a", tmp_path / "b"
    for tree in (a, b):
        for d in SOURCE_DIRS:
            shutil.copytree(ROOT / d, tree / d, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    assert source_digest(a) == source_digest(b) == source_digest(ROOT)
    (b / "rltjax" / "__pycache__").mkdir(exist_ok=True)
    (b / "rltjax" / "__pycache__" / "x.cpython-312.pyc").write_bytes(b"\0")
    (b / "scripts" / "notes.txt").write_text("not source")
    assert source_digest(b) == source_digest(a)
    engine = b / "rltjax" / "engine" / "runner.py"
    engine.write_text(engine.read_text() + "\n")
    assert source_digest(b) != source_digest(a)


class _Built(Exception):
    """Raised by the stand-in build_engine: the order of calls up to it is what is checked."""


@pytest.mark.parametrize("builder", ["startup", "bench"])
def test_random_weights_are_drawn_with_the_compilation_cache_set(monkeypatch, tmp_path, builder):
    """The benchmarks' random weights stand in for loading a checkpoint: their draw must be
    compiled (cold) or loaded (warm) through the persistent cache like every engine
    executable, so the cache directory is set before the draw."""
    import argparse

    import rltjax.checkpoints.random_init
    import rltjax.entrypoints.llm as llm
    calls = []
    monkeypatch.setattr(llm, "setup_compilation_cache", lambda path: calls.append(("cache", path)))
    monkeypatch.setattr(rltjax.checkpoints.random_init, "random_checkpoint",
                        lambda cfg, seed=0, dtype=None: calls.append(("draw", seed)))

    def build(*a, **k):
        raise _Built
    monkeypatch.setattr(llm, "build_engine", build)
    cache = str(tmp_path / "xla")
    p = argparse.ArgumentParser()
    if builder == "startup":
        from benchmarks.startup import add_model_arguments, build_engine_from_args
        add_model_arguments(p)
        args = p.parse_args(["--quick", "--compilation-cache-dir", cache])
        run = lambda: build_engine_from_args(args, max_num_seqs=2, max_model_len=64)   # noqa: E731
    else:
        from rltjax.entrypoints.bench import add_bench_arguments, bench_engine
        add_bench_arguments(p)
        args = p.parse_args(["--quick", "--concurrency", "1", "--compilation-cache-dir", cache])
        run = lambda: bench_engine(args, {})   # noqa: E731
    with pytest.raises(_Built):
        run()
    assert calls == [("cache", cache), ("draw", 0)]


def test_bench_mlp_quick(tmp_path):
    out = tmp_path / "mlp.json"
    run_script("bench_mlp.py", "--quick", "--sweep", "--out", str(out))
    rows = json.loads(out.read_text())["results"]
    assert [r["rows"] for r in rows] == [1, 4]
    for r in rows:
        assert r["xla"]["up"] > 0 and r["xla"]["down"] > 0
        halves = [(c["half"], c["label"]) for c in r["kernel"]]
        assert halves == [("up", "config"), ("down", "config"), ("up", "sweep"), ("down", "sweep")]
        # the fused kernels' outputs against XLA's path: the activation, and (x_new, h) of the norm
        assert all(c["rel_err_vs_xla"] < 1e-2 and c["us"] > 0 for c in r["kernel"])
        assert r["kernel"][3]["k_splits"] == 2          # the sweep's split point ran (checked by rel_err above)


def test_hf_overrides_apply_on_top_of_the_preset():
    """--hf-overrides reshapes a --preset model (after --quick), as it does a --model's."""
    import argparse

    from rltjax.entrypoints.bench import preset_config_from_args
    layers = json.dumps({"num_hidden_layers": 3, "layer_types": ["full_attention"] * 3})
    cfg = preset_config_from_args(argparse.Namespace(preset="ouro-1.4b", quick=True, hf_overrides=layers))
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (3, 64, 512)
    full = preset_config_from_args(argparse.Namespace(preset="ouro-1.4b", quick=False, hf_overrides=layers))
    assert (full.num_layers, full.hidden_size) == (3, 2048)
    plain = preset_config_from_args(argparse.Namespace(preset="ouro-1.4b", quick=False, hf_overrides=None))
    assert plain.num_layers == 24


def test_bench_speculation_quick():
    """The device-side rounds and the host-driven ones make the same tokens (the script exits 1
    otherwise), and it reports acceptance, tokens a round and the break-even acceptance."""
    text = run_script("bench_speculation.py", "--scales", "0.05", "--tokens", "12", "--rounds", "3",
                      "--concurrency", "2")
    assert "same tokens: True" in text and "tokens a round" in text and "pays from acceptance" in text

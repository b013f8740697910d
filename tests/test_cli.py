"""The rltjax command line: generate (reference engine) and convert."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import FIXTURES, reference_model
from rltjax.entrypoints.cli import main
from rltjax.sampling_params import SamplingParams
from rltjax.tokenizer import Tokenizer

FAST = ["--no-compile-ahead", "--compilation-cache-dir", "", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "32", "--prefill-chunk-size", "32"]


def test_generate_greedy_matches_the_reference_oracle(capsys):
    tok = Tokenizer.from_dir(FIXTURES / "ouro-tiny")
    text = "Cooking rice takes patience and water."
    ref = reference_model("ouro-tiny").generate(
        tok.encode(text), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for engine in ("batched", "reference"):
        rc = main(["generate", "--model", str(FIXTURES / "ouro-tiny"), "--prompt", text, "--engine", engine,
                   "--max-tokens", "12", "--ignore-eos", *FAST])
        out = capsys.readouterr().out
        assert rc == 0
        assert f"output: {tok.decode(ref.token_ids)!r}" in out
        assert "exit depths: 4 4 4 4 4 4 4 4 4 4 4 4 " in out


def test_generate_adaptive_depths_are_reported(capsys):
    rc = main(["generate", "--model", str(FIXTURES / "ouro-tiny"), "--max-tokens", "8", "--ignore-eos",
               "--exit-threshold", "0.3", "--temperature", "1.0", "--seed", "5", "--prompt", "a", "--prompt", "bb",
               *FAST])
    found = re.findall(r"exit depths: ([0-9 ]+)\(loops each token ran; mean ([0-9.]+)\)", capsys.readouterr().out)
    assert rc == 0 and len(found) == 2
    for depths, mean in found:
        depths = [int(d) for d in depths.split()]
        assert depths[0] == 4 and all(1 <= d <= 4 for d in depths)
        assert float(mean) == pytest.approx(sum(depths) / len(depths), abs=0.005)


def test_generate_errors_are_reported_not_raised(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "--model", str(FIXTURES / "ouro-tiny"), "--max-loops", "7", *FAST]) == 2
    assert "max_loops" in capsys.readouterr().err
    assert main(["generate", "--model", str(FIXTURES / "ouro-tiny"), "--top-p", "0", *FAST]) == 2
    assert "top_p" in capsys.readouterr().err


def test_convert_then_generate(tmp_path, capsys):
    dst = tmp_path / "converted"
    assert main(["convert", str(FIXTURES / "ouro-tiny"), str(dst), "--dtype", "float32"]) == 0
    assert main(["generate", "--model", str(dst), "--max-tokens", "4", "--ignore-eos", *FAST]) == 0
    assert "finish: length, 4 tokens" in capsys.readouterr().out


def test_python_dash_m_entry_point():
    res = subprocess.run([sys.executable, "-m", "rltjax", "generate", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "--exit-threshold" in res.stdout


def test_bench_subcommand(tmp_path, capsys):
    import json
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--concurrency", "1", "2", "--prompt-len", "8", "--output-len", "4",
                 "--out", str(out), *FAST]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["concurrency"] for r in rows] == [1, 2] and all(r["output_tokens_per_s"] > 0 for r in rows)
    assert "output tok/s" in capsys.readouterr().out


def test_bench_speculative_reports_acceptance_and_converging_weights_raise_it(tmp_path, capsys):
    """``bench --speculative-tokens`` prints and records the draft acceptance beside each
    throughput; ``--converging-scale`` weights make shallow drafts agree with full depth more."""
    import json
    accept = []
    for scale in ([], ["--converging-scale", "0.05"]):
        out = tmp_path / f"bench{len(scale)}.json"
        assert main(["bench", "--quick", "--concurrency", "2", "--prompt-len", "8", "--output-len", "24",
                     "--exit-mode", "fixed", "--speculative-tokens", "2", "--out", str(out), *scale, *FAST]) == 0
        info = json.loads(out.read_text())
        row = info["results"][0]
        assert info["args"]["converging_scale"] == (0.05 if scale else None)     # the flags it ran, recorded
        assert info["args"]["speculative_tokens"] == 2
        assert row["spec_draft_tokens"] > 0
        assert row["spec_acceptance"] == row["spec_accepted_tokens"] / row["spec_draft_tokens"]
        accept.append(row["spec_acceptance"])
    assert "draft acceptance" in capsys.readouterr().out
    assert accept[1] > accept[0] + 0.2, accept


def test_every_subcommand_documents_the_engine_flags():
    for cmd in ("generate", "serve", "bench"):
        res = subprocess.run([sys.executable, "-m", "rltjax", cmd, "--help"], capture_output=True, text=True)
        assert res.returncode == 0
        for flag in ("--max-num-seqs", "--max-num-batched-tokens", "--kv-layout", "--exit-mode",
                     "--prefill-chunk-size", "--scheduler-mode", "--dtype", "--num-pages",
                     "--gpu-memory-utilization", "--decode-window", "--async-scheduling"):
            assert flag in res.stdout, (cmd, flag)


def test_execution_flags_reach_the_engine_config():
    import argparse

    from rltjax.entrypoints.engine_args import add_engine_arguments, configs_from_args
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    default = configs_from_args(p.parse_args([]))["execution_config"]
    assert default.decode_window is None and default.async_scheduling is False and default.decode_window_rows is None
    ex = configs_from_args(p.parse_args(["--decode-window", "4", "--async-scheduling", "--decode-window-rows", "16",
                                         "--exit-mode", "ouro_delayed"]))["execution_config"]
    assert ex.decode_window == 4 and ex.async_scheduling is True and ex.decode_window_rows == 16
    assert default.matmul_impl == "auto" and dict(default.xla_options) == {} and default.attn_num_splits is None
    ex = configs_from_args(p.parse_args([
        "--attn-num-splits", "3", "--matmul-impl", "pallas", "--xla-option", "xla_gpu_enable_command_buffer=FUSION,WHILE",
        "--xla-option", "xla_gpu_graph_min_graph_size=1", "--xla-option", "xla_cpu_enable_fast_math=false"]))
    assert ex["execution_config"].matmul_impl == "pallas" and ex["execution_config"].attn_num_splits == 3
    assert dict(ex["execution_config"].xla_options) == {"xla_gpu_enable_command_buffer": "FUSION,WHILE",
                                                        "xla_gpu_graph_min_graph_size": 1,
                                                        "xla_cpu_enable_fast_math": False}
    with pytest.raises(ValueError, match="expected NAME=VALUE"):
        configs_from_args(p.parse_args(["--xla-option", "xla_gpu_graph_min_graph_size"]))
    assert default.mixed_prefill_tokens is None          # auto
    for flag, tokens in (("auto", None), ("128", 128), ("0", 0)):
        ex = configs_from_args(p.parse_args(["--mixed-prefill-tokens", flag]))["execution_config"]
        assert ex.mixed_prefill_tokens == tokens
    with pytest.raises(SystemExit):
        p.parse_args(["--mixed-prefill-tokens", "some"])


@pytest.mark.parametrize("splits", [0, 65, 2.0, True, {}, {12: 2}, {8: 0}, {8: 65}, {True: 2}, {"8": 2}, [8, 2]])
def test_attn_num_splits_is_checked(splits):
    from rltjax.engine_config import EngineConfigError, ExecutionConfig
    with pytest.raises(EngineConfigError, match=r"attn_num_splits.*integer in \[1, 64\]"):
        ExecutionConfig(attn_num_splits=splits)


def test_attn_num_splits_per_row_bucket_from_the_command_line():
    import argparse

    from rltjax.engine_config import ExecutionConfig
    from rltjax.entrypoints.engine_args import add_engine_arguments, configs_from_args
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    ex = configs_from_args(p.parse_args(["--attn-num-splits", "32:1,8:8"]))["execution_config"]
    assert ex.attn_num_splits == {32: 1, 8: 8}
    assert ExecutionConfig(attn_num_splits={8: 8, 64: 1}).attn_num_splits == {8: 8, 64: 1}
    for bad in ("32:1,32:2", "32:", "a:1", "8:1:2", "x"):
        with pytest.raises(SystemExit):
            p.parse_args(["--attn-num-splits", bad])


def test_mixed_prefill_tokens_per_window_size_from_the_command_line():
    """--mixed-prefill-tokens ROWS:T,...: a {rows: T} map that ExecutionConfig turns into
    ascending steps; auto, a single T and off keep their meanings."""
    import argparse

    from rltjax.engine_config import EngineConfigError, ExecutionConfig
    from rltjax.entrypoints.engine_args import add_engine_arguments, configs_from_args
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    ex = configs_from_args(p.parse_args(["--mixed-prefill-tokens", "32:128,8:32,16:0"]))["execution_config"]
    assert ex.mixed_prefill_tokens == {32: 128, 8: 32, 16: 0}
    assert ex.mixed_prefill_steps() == ((8, 32), (16, 0), (32, 128))
    steps = [ExecutionConfig(mixed_prefill_tokens=t).mixed_prefill_steps() for t in (None, 0, 64)]
    assert steps == [None, (), ((1, 64),)]
    for bad in ("8:32,8:64", "8:", "a:32", "8:32:1", "x"):
        with pytest.raises(SystemExit):
            p.parse_args(["--mixed-prefill-tokens", bad])
    for bad in ({}, {12: 32}, {8: 48}, {8: 16}, {0: 32}, {True: 32}, {"8": 32}, {8: True}, [8, 32]):
        with pytest.raises(EngineConfigError, match=r"mixed_prefill_tokens.*\{rows: T\}"):
            ExecutionConfig(mixed_prefill_tokens=bad)


def test_backend_picks_the_splits_of_a_row_bucket():
    from rltjax.cache.paged_kv import PagedKVBackend
    per_bucket = PagedKVBackend(num_splits={32: 1, 8: 4})
    assert per_bucket.num_splits == ((8, 4), (32, 1))          # hashable: a static jit argument
    hash(per_bucket)
    assert [per_bucket.splits_for(n) for n in (8, 16, 32)] == [4, None, 1]     # 16: the kernel's default
    assert PagedKVBackend(num_splits=3).splits_for(16) == 3 and PagedKVBackend().splits_for(8) is None


@pytest.mark.parametrize("options, match", [({"gpu_thing": 1}, "names are XLA debug options"),
                                            ({"xla_x": [1]}, "values are str, int, float or bool")])
def test_xla_options_are_checked(options, match):
    from rltjax.engine_config import EngineConfigError, ExecutionConfig
    with pytest.raises(EngineConfigError, match=match):
        ExecutionConfig(xla_options=options)


def test_gpu_engines_compile_with_the_gpu_default_options():
    """A GPU engine's steps get GPU_DEFAULT_OPTIONS, and KERNEL_DECODE_OPTIONS where its decode
    projections run on the kernels (XLA accepts both: compiled with them here); other platforms
    only the caller's options. A caller's own passes to disable are added to the default; for
    other names the caller's value wins."""
    from rltjax.jit_options import GPU_DEFAULT_OPTIONS, KERNEL_DECODE_OPTIONS, check_options, engine_options
    check_options(GPU_DEFAULT_OPTIONS + KERNEL_DECODE_OPTIONS)
    assert dict(GPU_DEFAULT_OPTIONS) == {"xla_disable_hlo_passes": "rematerialization"}
    assert dict(KERNEL_DECODE_OPTIONS) == {"xla_gpu_enable_triton_gemm": False}
    mine = (("xla_gpu_autotune_level", 0),)
    assert engine_options(mine, "cpu") == engine_options(mine, "cpu", decode_on_kernels=True) == mine
    assert engine_options(mine, "gpu") == (("xla_disable_hlo_passes", "rematerialization"),
                                           ("xla_gpu_autotune_level", 0))
    assert engine_options(mine, "gpu", decode_on_kernels=True) == (
        ("xla_disable_hlo_passes", "rematerialization"), ("xla_gpu_autotune_level", 0),
        ("xla_gpu_enable_triton_gemm", False))
    # the caller can turn XLA's Triton GEMMs back on
    on = dict(engine_options((("xla_gpu_enable_triton_gemm", True),), "gpu", decode_on_kernels=True))
    assert on["xla_gpu_enable_triton_gemm"] is True
    joined = dict(engine_options((("xla_disable_hlo_passes", "algsimp, rematerialization"),), "gpu"))
    assert joined == {"xla_disable_hlo_passes": "rematerialization,algsimp"}


def test_memory_flags_reach_the_engine_config():
    import argparse

    from rltjax.engine_config import EngineConfigError
    from rltjax.entrypoints.engine_args import add_engine_arguments, configs_from_args
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    default = configs_from_args(p.parse_args([]))
    cache, sched = default["cache_config"], default["scheduler_config"]
    assert (cache.kv_allocation, cache.kv_watermark, cache.enable_prefix_caching, cache.swap_space,
            cache.kv_cache_memory_bytes) == ("incremental", 0.01, False, 4.0, None)
    assert (sched.policy, sched.preemption_mode) == ("fcfs", "swap")
    got = configs_from_args(p.parse_args([
        "--enable-prefix-caching", "--kv-allocation", "lifetime", "--kv-watermark", "0.05", "--swap-space", "1.5",
        "--kv-cache-memory-bytes", "1000000", "--scheduling-policy", "priority", "--preemption-mode", "recompute"]))
    cache, sched = got["cache_config"], got["scheduler_config"]
    assert (cache.kv_allocation, cache.kv_watermark, cache.enable_prefix_caching, cache.swap_space,
            cache.kv_cache_memory_bytes) == ("lifetime", 0.05, True, 1.5, 1_000_000)
    assert (sched.policy, sched.preemption_mode) == ("priority", "recompute")
    with pytest.raises(EngineConfigError, match="kv_cache_memory_bytes"):
        configs_from_args(p.parse_args(["--num-pages", "100", "--kv-cache-memory-bytes", "1000000"]))
    with pytest.raises(EngineConfigError, match="kv_watermark"):
        configs_from_args(p.parse_args(["--kv-watermark", "1.5"]))


def test_log_lines_print_once():
    """The CLI's log handler is the only one that prints rltjax's lines (a root handler some
    library installs would print each again)."""
    res = subprocess.run([sys.executable, "-m", "rltjax", "generate", "--model", str(FIXTURES / "ouro-tiny"),
                          "--max-tokens", "2", "--log-level", "info", *FAST], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-1000:]
    lines = [line for line in res.stderr.splitlines() if "prompt(s)," in line]
    assert len(lines) == 1 and lines[0].startswith("[rltjax] ")

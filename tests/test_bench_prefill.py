"""scripts/bench_prefill.py on CPU (interpret mode): its launches against the reference, and
long-prefix cases (--cases) with their TFLOP/s."""
from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from test_bench_scripts import run_script


def test_bench_prefill_quick(tmp_path):
    out = tmp_path / "prefill.json"
    text = run_script("bench_prefill.py", "--quick", "--block-q", "16", "32", "--program-rows", "32", "64",
                      "--out", str(out))
    rows = json.loads(out.read_text())["results"]
    launches = ("bq16_rows32", "bq16_rows64", "bq32_rows32", "bq32_rows64")
    assert rows and all(r["per_row_err"] < 1e-4 and all(r[f"prefill_{n}_err"] < 1e-4 for n in launches)
                        for r in rows)
    assert "speed-up" in text and all(n in text for n in launches)


def test_bench_prefill_custom_cases(tmp_path, monkeypatch):
    """--cases LEN@PREFIX: the prefill kernel's launches alone (--no-baselines: errors against the
    first launch) on the chunks asked; its TFLOP/s counts the visible keys that make_case's row
    lengths give."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    import bench_prefill
    chunks = bench_prefill.parse_case("16@40,8@0")
    assert chunks == [(40, 16), (0, 8)]
    lengths = np.asarray(bench_prefill.make_case(chunks, 2, 64, 8, jnp.float32, 16)[-1])
    assert bench_prefill.attention_flops(chunks, 2, 64) == 4 * 2 * 64 * int(lengths.sum())
    with pytest.raises(SystemExit, match="LEN@PREFIX"):
        bench_prefill.parse_case("16:40")
    out = tmp_path / "prefill.json"
    run_script("bench_prefill.py", "--quick", "--cases", "16@40,8@0", "--no-baselines", "--num-warps", "4", "8",
               "--block-k", "16", "--key-splits", "1", "3", "--out", str(out))
    (row,) = json.loads(out.read_text())["results"]
    launches = ("bq32_w4_k16_split1", "bq32_w4_k16_split3", "bq32_w8_k16_split1", "bq32_w8_k16_split3")
    assert row["chunks"] == [[40, 16], [0, 8]] and "per_row_us" not in row
    assert all(row[f"prefill_{n}_err"] < 1e-4 for n in launches[1:])      # to the first launch
    best = min(row[f"prefill_{n}_us"] for n in launches)
    assert row["tflops"] == pytest.approx(4 * 2 * 64 * int(lengths.sum()) / best / 1e6)


def test_write_json_replaces_the_report_whole(tmp_path):
    """The benchmarks' JSON writer (bench_prefill and the context sweep write after every case):
    each write leaves the whole latest report under its name and no temporary file beside it."""
    from benchmarks.report import write_json
    path = tmp_path / "new" / "report.json"
    write_json(path, dict(results=[1]))
    write_json(str(path), dict(results=[1, 2]))         # scripts pass --out as a string
    assert json.loads(path.read_text()) == dict(results=[1, 2])
    assert [p.name for p in path.parent.iterdir()] == ["report.json"]

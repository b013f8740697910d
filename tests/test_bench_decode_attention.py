"""scripts/bench_decode_attention.py: its CPU smoke run, the pages its cases back, and the
serving workload's steady-state row lengths (``--length-file``)."""
from __future__ import annotations

import importlib.util
import json

import numpy as np

from test_bench_scripts import ROOT, run_script


def test_bench_decode_attention_quick(tmp_path):
    """Both kernels' default launches (one split at these shapes) and the swept Triton one (two
    splits), each checked against the XLA path; GB/s is the rows' K and V bytes over the time."""
    out = tmp_path / "decode_attn.json"
    run_script("bench_decode_attention.py", "--quick", "--block-keys", "16", "--num-splits", "2",
               "--backends", "triton", "mosaic", "--out", str(out))
    results = json.loads(out.read_text())["results"]
    configs = [(r["rows"], r["backend"], r["config"]) for r in results]
    swept = dict(pages_per_block=2, num_warps=4, num_stages=2, num_splits=2)
    assert configs == [(rows, b, c) for rows in (1, 3)
                       for b, c in (("triton", "default"), ("mosaic", "default"), ("triton", swept))]
    assert all(r["us"] > 0 and r["max_abs_diff"] < 2e-2 for r in results)
    for r in results:        # --quick: 20 keys a row, 2 KV heads of 64, bf16 K and V
        assert abs(r["gbps"] - r["rows"] * 20 * 2 * 64 * 2 * 2 / r["us"] / 1e3) < 1e-9


def test_bench_decode_attention_backs_only_touched_pages():
    """make_case's pool holds the pages a call reads or writes and no more (a 2,048-key table
    at 32 rows overran the H200's memory when every table entry was backed): the rows' read
    pages and every plane's write page are distinct and nonzero, the rest of the tables page 0."""
    mod = load_decode_attention_script()
    rows, length, page, planes, ppt = 5, 37, 8, 3, 16
    case = mod.make_case(rows, length, kv_heads=2, head_dim=16, page_size=page, pages_per_table=ppt, planes=planes)
    tables = np.asarray(case["block_tables"])
    n_pages = -(-length // page)
    read = tables[:rows, :n_pages]
    write = np.asarray(case["write_page"])                       # [planes, rows]
    assert case["num_pages"] == rows * (n_pages + planes - 1) + 1
    used = np.concatenate([read.ravel(), write[1:].ravel()])
    assert used.min() >= 1 and len(set(used)) == used.size == case["num_pages"] - 1
    np.testing.assert_array_equal(write[0], read[:, (length - 1) // page])
    assert np.count_nonzero(tables) == used.size                 # nothing else backed
    assert np.all(np.asarray(case["lengths"]) == length)


def load_decode_attention_script():
    spec = importlib.util.spec_from_file_location("bench_decode_attention", ROOT / "scripts" / "bench_decode_attention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_serving_lengths_weighs_requests_by_their_passes():
    """A request is active for output_len passes: with outputs of 1 and 99 tokens, 99% of the
    passes are the long one's, so both stratified rows fall in it (prompt 500 + 1..99); a
    request repeated is the same distribution; the table's capacity caps the lengths."""
    mod = load_decode_attention_script()
    assert all(501 <= n <= 599 for n in mod.serving_lengths([10, 500], [1, 99], 2, 2048))
    one = mod.serving_lengths([7], [8], 4, 2048)
    assert one == mod.serving_lengths([7, 7, 7], [8, 8, 8], 4, 2048) == sorted(one)
    assert len(set(one)) == 4 and all(8 <= n <= 15 for n in one)
    assert mod.serving_lengths([100], [400], 3, 300) == [167, 300, 300]    # 101..500: 1/6 quantile, median, 5/6
    results = {"runs": [{"per_request": [{"prompt_tokens": 5, "output_tokens": 9}]},
                        {"per_request": [{"prompt_tokens": 3, "output_tokens": 4}] * 2}]}
    assert mod.workload_lengths(results) == ([3, 3], [4, 4])             # the run with the most requests
    assert mod.workload_lengths({"prompt_len": [1], "output_len": [2]}) == ([1], [2])


def test_bench_decode_attention_ragged_rows_back_their_own_pages():
    """make_case with one length a row: each row's table holds its own pages, its write
    position is its own last key."""
    mod = load_decode_attention_script()
    lengths = [3, 17, 40]
    case = mod.make_case(3, lengths, kv_heads=2, head_dim=16, page_size=8, pages_per_table=8, planes=2)
    tables = np.asarray(case["block_tables"])
    assert np.asarray(case["lengths"]).tolist() == lengths
    assert [np.count_nonzero(tables[r]) for r in range(3)] == [1, 3, 5]
    assert np.asarray(case["write_offset"]).tolist() == [(n - 1) % 8 for n in lengths]
    assert case["num_pages"] == 1 + 3 + 5 + 3 + 1

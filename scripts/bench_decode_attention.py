"""The fused decode attention kernel as the engine runs it: each row writes its new K/V to
every write-through plane, q and k rotated in the kernel (RoPE), attention over the row's
pages, the key splits combined after it.

    python scripts/bench_decode_attention.py --out decode_attn.json          # GPU, Ouro-1.4B shapes
    python scripts/bench_decode_attention.py --rows 32 64 --lengths 512 270 --block-keys 32 64 \
        --num-warps 1 2 4 --num-stages 1 3 --num-splits 2 4
    python scripts/bench_decode_attention.py --max-model-len 2048 --rows 8 32 64 --lengths \
        --length-file bench-results/fixed/results.json    # rows at a ShareGPT run's lengths
    python scripts/bench_decode_attention.py --backends triton mosaic --length-file results.json  # Hopper
    python scripts/bench_decode_attention.py --quick        # CPU smoke run (interpret mode, tiny shapes)

A measurement chains --reps x layers calls in one jitted loop, layer i % layers of the
stacked pool each (the pools donated and updated in place, the outputs summed so the split
combine runs), and reports wall time / calls, median over --iters samples: launch gaps and
the loop's own overhead are in it, the same for every config. Every row has --lengths keys
in a table of max_model_len / page_size pages, writes --planes pages. --length-file adds a
ragged case a rows value: the steady-state keys of a closed-loop serving batch on that
workload's prompt / output lengths (``serving_lengths``). "default" is the
kernel's own launch (``kernels.paged_attention_launch.default_launch``); the sweep runs every
point of --block-keys x --num-warps x --num-stages x --num-splits (the Triton kernel's launch).
--backends mosaic adds the Pallas Mosaic GPU kernel at its default launch (Hopper;
``kernels.paged_attention_mosaic``). GB/s counts the K and V bytes of the rows' keys a call
reads. Each config's outputs are checked against the XLA path (write, then attend) on one call.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from rltjax.kernels import BACKENDS  # noqa: E402
from rltjax.kernels.paged_attention import decode_kernel, paged_attention_write  # noqa: E402
from rltjax.models.layers import rope_cos_sin  # noqa: E402


def make_case(rows, length, *, kv_heads, head_dim, page_size, pages_per_table, planes, seed=0):
    """Rows with their own tables, one per plane; every row reads its plane-0 table and writes
    its key at position length - 1 of each plane's table (length: one for every row, or a
    sequence of one per row). Only the pages a call touches are backed (the rest of each table
    is page 0), so a 2,048-key table at 64 rows fits the timing's pools and the check's random
    ones at once. The pools are shapes only (allocated per timing): case["num_pages"] of them."""
    rng = np.random.default_rng(seed)
    lengths = np.broadcast_to(np.asarray(length, np.int64), (rows,))
    n_pages = -(-lengths // page_size)                                   # [rows]
    pos = lengths - 1
    r = np.arange(rows)
    num_pages = int(n_pages.sum()) + rows * (planes - 1) + 1
    ids = iter(rng.permutation(np.arange(1, num_pages)))
    pages = np.zeros((rows * planes, pages_per_table), np.int64)
    for row in r:
        pages[row, :n_pages[row]] = np.fromiter(ids, np.int64, n_pages[row])
    for m in range(1, planes):
        pages[r + m * rows, pos // page_size] = np.fromiter(ids, np.int64, rows)
    write_page = np.stack([pages[r + m * rows, pos // page_size] for m in range(planes)])
    qkv = jax.random.normal(jax.random.key(seed), (rows, 3 * kv_heads, head_dim), jnp.bfloat16)
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    return dict(q=qkv[:, :kv_heads], k_new=qkv[:, kv_heads:2 * kv_heads], v_new=qkv[:, 2 * kv_heads:],
                block_tables=i32(pages), row_tables=i32(r), lengths=i32(pos + 1), write_page=i32(write_page),
                write_offset=i32(pos % page_size), rope=rope_cos_sin(i32(pos), head_dim, 1e6), num_pages=num_pages)


def workload_lengths(data: dict) -> tuple[list[int], list[int]]:
    """(prompt lengths, output lengths) of a --length-file: {"prompt_len": [...], "output_len":
    [...]}, or a ``bench_serving.py`` results.json (its run with the most requests)."""
    if "runs" in data:
        rows = max(data["runs"], key=lambda run: len(run["per_request"]))["per_request"]
        return [r["prompt_tokens"] for r in rows], [r["output_tokens"] for r in rows]
    return list(data["prompt_len"]), list(data["output_len"])


def serving_lengths(prompt_len, output_len, rows: int, max_len: int) -> list[int]:
    """Keys a row of a closed-loop serving batch holds, as ``rows`` stratified quantiles of its
    steady state: a request is active for as many passes as it has output tokens (so drawn
    with weight output_len), at a uniform point of its output (context prompt + 1..output)."""
    p, o = np.asarray(prompt_len, np.int64), np.asarray(output_len, np.int64)
    ctx = np.concatenate([pi + np.arange(1, oi + 1) for pi, oi in zip(p, o)])    # every pass of every request
    qs = np.quantile(ctx, (np.arange(rows) + 0.5) / rows, method="nearest")
    return [int(min(q, max_len)) for q in qs]


def kv_bytes(case, kv_heads: int, head_dim: int, itemsize: int = 2) -> int:
    """The K and V bytes of every row's keys: what a call must read."""
    return int(np.sum(np.asarray(case["lengths"]))) * kv_heads * head_dim * itemsize * 2


def call(case, k, v, layer, impl, interpret, **launch):
    c = case
    return paged_attention_write(c["q"], c["k_new"], c["v_new"], k, v, c["block_tables"], c["row_tables"],
                                 c["lengths"], c["write_page"], c["write_offset"], layer=layer, impl=impl,
                                 interpret=interpret, rope=c["rope"], **launch)


def time_config(case, pool, layers, reps, iters, interpret, **launch):
    """Median us a call over a chain of layers * reps calls."""
    calls = layers * reps

    def chain(k, v, acc):
        def body(i, carry):
            k, v, acc = carry
            out, k, v = call(case, k, v, i % layers, "pallas", interpret, **launch)
            return k, v, acc + out.astype(jnp.float32)
        return jax.lax.fori_loop(0, calls, body, (k, v, acc))
    run = jax.jit(chain, donate_argnums=(0, 1))
    k, v = jnp.zeros(pool.shape, pool.dtype), jnp.zeros(pool.shape, pool.dtype)
    acc = jnp.zeros(case["q"].shape, jnp.float32)
    k, v, acc = jax.block_until_ready(run(k, v, acc))
    samples = []
    for _ in range(iters):
        t = time.perf_counter()
        k, v, acc = jax.block_until_ready(run(k, v, acc))
        samples.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(samples)


def check_config(case, pool, interpret, **launch) -> float:
    """Max abs difference of one call's output from the XLA path's, on random pools."""
    keys = jax.random.split(jax.random.key(1))
    k, v = (jax.random.normal(key, pool.shape, pool.dtype) for key in keys)
    layer = jnp.int32(pool.shape[0] - 1)
    out = call(case, k, v, layer, "pallas", interpret, **launch)[0]
    ref = call(case, k, v, layer, "xla", False)[0]
    return float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))


def sweep(args):
    for keys, warps, stages, splits in itertools.product(args.block_keys, args.num_warps, args.num_stages,
                                                         args.num_splits):
        if keys % args.page_size == 0 and keys >= 16:
            yield dict(pages_per_block=keys // args.page_size, num_warps=warps, num_stages=stages,
                       num_splits=splits)


def run_case(args, case, pool, rows: int, label, length) -> list[dict]:
    """Each backend's default launch and the Triton sweep on one case: timed, checked, printed."""
    results = []
    launches = [dict(backend=b) for b in args.backends] + [dict(backend="triton", **c) for c in sweep(args)]
    # the kernel the dispatcher runs: "mosaic" falls back to Triton where it does not take the shapes
    ran = {b: decode_kernel(b, args.kv_heads, args.kv_heads, args.head_dim, args.page_size, jnp.bfloat16)
           for b in BACKENDS}
    for launch in launches:
        try:
            us = time_config(case, pool, args.layers, args.reps, args.iters, args.quick, **launch)
            err = check_config(case, pool, args.quick, **launch)
        except Exception as e:  # noqa: BLE001 - a config Triton refuses: report and go on
            print(f"rows {rows:3d} keys {label!s:>7} {launch}: failed ({type(e).__name__}: {e})"[:300])
            continue
        config = {k: v for k, v in launch.items() if k != "backend"} or "default"
        gbps = kv_bytes(case, args.kv_heads, args.head_dim) / us / 1e3
        kernel = ran[launch["backend"]]
        results.append(dict(rows=rows, length=label, backend=kernel, config=config, us=us, gbps=gbps,
                            max_abs_diff=err, **({} if label == length else dict(row_lengths=length))))
        print(f"rows {rows:3d} keys {label!s:>7} {kernel:7s} {str(config):68s} {us:8.2f} us "
              f"{gbps:7.1f} GB/s  diff {err:.1e}", flush=True)
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64], help="decode rows (the engine's buckets)")
    p.add_argument("--lengths", type=int, nargs="*", default=[512],
                   help="keys a row (each with every --rows; none: only --length-file's case)")
    p.add_argument("--max-model-len", type=int, default=768, help="the table's capacity in keys")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--planes", type=int, default=4, help="write-through pages a row (Ouro: its 4 loops)")
    p.add_argument("--reps", type=int, default=8, help="chains of --layers calls a sample")
    p.add_argument("--iters", type=int, default=9)
    p.add_argument("--block-keys", type=int, nargs="+", default=[], help="sweep: keys per block")
    p.add_argument("--num-warps", type=int, nargs="+", default=[4])
    p.add_argument("--num-stages", type=int, nargs="+", default=[2])
    p.add_argument("--num-splits", type=int, nargs="+", default=[2])
    p.add_argument("--length-file", help="a serving workload's lengths: a bench_serving.py results.json, or JSON with "
                   "prompt_len and output_len lists; adds, for every --rows, a ragged case of the rows' "
                   "steady-state lengths (serving_lengths)")
    p.add_argument("--backends", nargs="+", default=["triton"], choices=BACKENDS,
                   help="kernels to time (mosaic: its default launch; the sweep is Triton's)")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shapes, interpret mode")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.lengths, args.max_model_len, args.layers, args.kv_heads = [1, 3], [20], 32, 2, 2
        args.head_dim, args.page_size, args.planes, args.reps, args.iters = 64, 8, 3, 1, 1
    if any(n > args.max_model_len for n in args.lengths):
        p.error(f"--lengths must be at most --max-model-len ({args.max_model_len})")
    print(f"devices: {jax.devices()}  jax {jax.__version__}", flush=True)
    pages_per_table = -(-args.max_model_len // args.page_size)
    cases = [(rows, length, length) for rows, length in itertools.product(args.rows, args.lengths)]
    if args.length_file:
        with open(args.length_file) as f:
            prompts, outputs = workload_lengths(json.load(f))
        cases += [(rows, "serving", serving_lengths(prompts, outputs, rows, args.max_model_len)) for rows in args.rows]
    results = []
    for rows, label, length in cases:
        case = make_case(rows, length, kv_heads=args.kv_heads, head_dim=args.head_dim, page_size=args.page_size,
                         pages_per_table=pages_per_table, planes=args.planes)
        pool = jax.ShapeDtypeStruct((args.layers, args.kv_heads, case["num_pages"], args.page_size, args.head_dim),
                                    jnp.bfloat16)
        if label != length:
            print(f"rows {rows:3d} serving lengths: mean {np.mean(length):.0f}, max {max(length)}", flush=True)
        results += run_case(args, case, pool, rows, label, length)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), jax=jax.__version__, device=str(jax.devices()[0]), results=results), f,
                      indent=1)
    bad = [r for r in results if r["max_abs_diff"] > 5e-2]
    if bad:
        print(f"outputs off the XLA path: {bad}")
    return 1 if bad or not results else 0


if __name__ == "__main__":
    sys.exit(main())

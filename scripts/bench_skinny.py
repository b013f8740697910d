"""Decode projections: the weight-streaming Pallas kernel vs XLA's dot, kernel time per layer.

    python scripts/bench_skinny.py --out skinny.json                 # GPU, Ouro-1.4B shapes
    python scripts/bench_skinny.py --rows 1 8 --shapes o qkv --block-n 16 32 --block-k 128 256
    python scripts/bench_skinny.py --quick          # CPU smoke run (interpret mode, tiny shapes)

Each measurement runs one projection over L layers' own [K, N] weights (as the engine
holds them after splitting its layer stacks; more bytes than the L2 holds, as in a real
pass), each layer with its own input, in one jitted call. On a GPU the time is the sum
of the call's kernel durations from a profiler trace (XLA: its GEMM and any split-K
reduction after it; the kernel: itself and, with k_splits > 1, the sum of its partials),
median over --iters calls, divided by L: launch gaps and host dispatch are not in it.
Without a GPU (--quick) it is wall-clock time of the call. The kernel runs at
`kernels.skinny_matmul.kernel_config` for the shape ("config") and at every point of the
--block-n x --block-k x --k-splits x --num-warps x --num-stages grid given ("sweep").
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from rltjax.kernels.skinny_matmul import fit_block, kernel_config, kernel_unsupported, skinny_matmul  # noqa: E402
from rltjax.profiling import median_call_us  # noqa: E402

SHAPES = {"qkv": (2048, 6144), "o": (2048, 2048), "gate": (2048, 5632), "down": (5632, 2048),
          "lm_head": (2048, 49152), "tiny": (64, 96)}


def per_layer_us(fn, xs, ws, iters: int) -> float:
    """Median time of one call over all layers, divided by the layer count (microseconds)."""
    return median_call_us(fn, (xs, ws), iters) / len(ws)


def projection(impl: str, interpret: bool, **config):
    """All layers' projections of their own inputs: a tuple out, so nothing else runs."""
    return jax.jit(lambda xs, ws: tuple(skinny_matmul(x, w, impl=impl, interpret=interpret, **config)
                                        for x, w in zip(xs, ws)))


def sweep_configs(args, m, k, n):
    for bn, bk, splits, warps, stages in itertools.product(args.block_n, args.block_k, args.k_splits,
                                                           args.num_warps, args.num_stages):
        shapes = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
        if fit_block(n, bn) != bn or fit_block(k, bk) != bk or (k // bk) % splits or kernel_unsupported(*shapes, bn, bk):
            continue
        yield dict(block_n=bn, block_k=bk, k_splits=splits, num_warps=warps, num_stages=stages)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16], help="powers of two (the engine's buckets)")
    p.add_argument("--shapes", nargs="+", default=["qkv", "o", "gate", "down"], choices=list(SHAPES))
    p.add_argument("--block-n", type=int, nargs="*", default=[], help="sweep: column tiles")
    p.add_argument("--block-k", type=int, nargs="*", default=[128, 256], help="sweep: K steps")
    p.add_argument("--k-splits", type=int, nargs="*", default=[1], help="sweep: K splits")
    p.add_argument("--num-warps", type=int, nargs="*", default=[2, 4])
    p.add_argument("--num-stages", type=int, nargs="*", default=[3, 5])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="tiny shape in interpret mode (CPU smoke run)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    interpret = args.quick
    if any(m & (m - 1) for m in args.rows):
        raise SystemExit(f"bench_skinny: --rows {args.rows}: the kernel takes power-of-two row counts")
    if args.quick:
        args.shapes, args.rows, args.layers, args.iters = ["tiny"], [1, 4], 2, 2
        args.block_n, args.block_k, args.k_splits, args.num_warps, args.num_stages = [16, 32], [16, 32], [1, 2], [4], [3]
    key = jax.random.key(0)
    results = []
    for name in args.shapes:
        k, n = SHAPES[name]
        ws = [(0.02 * jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.float32)).astype(jnp.bfloat16)
              for i in range(args.layers)]
        gb = k * n * 2 / 1e3                       # GB/s = bytes / us / 1e3
        for m in args.rows:
            xs = [jax.random.normal(jax.random.fold_in(key, 1000 + i), (m, k), jnp.bfloat16)
                  for i in range(args.layers)]
            ref = projection("xla", False)(xs, ws)
            row = dict(shape=name, k=k, n=n, rows=m, xla_us=per_layer_us(projection("xla", False), xs, ws, args.iters))
            default = kernel_config(m, k, n)
            points = [("config", default)] + [("sweep", c) for c in sweep_configs(args, m, k, n)]
            row["kernel"] = []
            for label, config in points:
                fn = projection("pallas", interpret, **config)
                try:
                    got = fn(xs, ws)
                except jax.errors.JaxRuntimeError as e:     # a sweep point over the GPU's shared memory
                    if label == "config":
                        raise
                    print(f"{name} M={m} {config}: {str(e).splitlines()[0]}", flush=True)
                    continue
                err = max(float(jnp.linalg.norm((g - r).astype(jnp.float32)) / jnp.linalg.norm(r.astype(jnp.float32)))
                          for g, r in zip(got, ref))
                row["kernel"].append(dict(label=label, **config, us=per_layer_us(fn, xs, ws, args.iters),
                                          rel_err_vs_xla=err))
            best = min(row["kernel"], key=lambda r: r["us"])
            results.append(row)
            cfg = row["kernel"][0]
            print(f"{name:8s} {k}x{n} M={m:<3d} xla {row['xla_us']:7.2f} us ({gb / row['xla_us']:5.0f} GB/s) | "
                  f"config {cfg['us']:7.2f} us | best {best['us']:7.2f} us ({gb / best['us']:5.0f} GB/s) "
                  f"bn={best['block_n']} bk={best['block_k']} S={best['k_splits']} w={best['num_warps']} "
                  f"st={best['num_stages']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

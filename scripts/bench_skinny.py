"""Decode projections: the weight-streaming Pallas kernel vs XLA's dot, in GB/s of weights read.

    python scripts/bench_skinny.py --out skinny.json                 # GPU, Ouro-1.4B shapes
    python scripts/bench_skinny.py --rows 1 8 --block-n 64 128 --block-k 128 256
    python scripts/bench_skinny.py --quick          # CPU smoke run (interpret mode, tiny shapes)

Each timing runs the projection over all L layers of a stacked [L, K, N] weight in one
jitted call (more bytes than the L2 holds, as in a real pass) and reports time per layer.
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

from kernels.pallas_skinny import choose_splits  # noqa: E402
from kernels.skinny_matmul import kernel_unsupported, skinny_matmul  # noqa: E402

SHAPES = {"qkvo 2048x2048": (2048, 2048), "gate/up 2048x5632": (2048, 5632),
          "down 5632x2048": (5632, 2048), "lm_head 2048x49152": (2048, 49152), "tiny 64x96": (64, 96)}


def time_per_layer(fn, x, w, iters: int) -> float:
    jax.block_until_ready(fn(x, w))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x, w))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / w.shape[0]


def all_layers(impl: str, **kw):
    """Every layer's projection of one input, summed: one jitted call over the whole stack."""
    @jax.jit
    def fn(x, w):
        # a different input per layer: XLA would otherwise merge the dots into one over
        # concatenated weights (which overflowed shared memory at 32 rows on an H200)
        return sum(skinny_matmul(x * (1 + layer), w, layer, impl=impl, **kw).astype(jnp.float32)
                   for layer in range(w.shape[0]))
    return fn


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES)[:4], choices=list(SHAPES))
    p.add_argument("--block-n", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--block-k", type=int, nargs="+", default=[128, 256])
    p.add_argument("--split-scale", type=int, nargs="+", default=[1, 2],
                   help="multiples of the default split count to try")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    p.add_argument("--quick", action="store_true", help="tiny shape in interpret mode (CPU smoke run)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.quick:
        args.shapes, args.rows, args.block_n, args.block_k = ["tiny 64x96"], [1, 5], [16, 32], [16, 32]
        args.split_scale, args.iters, args.interpret = [1], 2, True
    key = jax.random.key(0)
    rows_out = []
    for name in args.shapes:
        k, n = SHAPES[name]
        layers = 2 if args.quick else max(2, (256 << 20) // (k * n * 2))   # >= 256 MiB of weights a call
        w = (0.02 * jax.random.normal(key, (layers, k, n), jnp.float32)).astype(jnp.bfloat16)
        for m in args.rows:
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
            gbs = lambda s: k * n * 2 / s / 1e9
            xla_s = time_per_layer(all_layers("xla"), x, w, args.iters)
            best = None
            for bn, bk, scale in itertools.product(args.block_n, args.block_k, args.split_scale):
                if kernel_unsupported(x, w, bn, bk) or k % bk or n % bn:
                    continue
                splits = choose_splits(k, n, bn, bk)
                if (k // bk) % (splits * scale):
                    continue
                s = time_per_layer(all_layers("pallas", block_n=bn, block_k=bk, k_splits=splits * scale,
                                              interpret=args.interpret), x, w, args.iters)
                if best is None or s < best[0]:
                    best = (s, bn, bk, splits * scale)
            if best is None:
                raise SystemExit(f"bench_skinny: no --block-n / --block-k / --split-scale combination fits "
                                 f"{name} (K={k}, N={n})")
            fn = all_layers("pallas", block_n=best[1], block_k=best[2], k_splits=best[3], interpret=args.interpret)
            ref = all_layers("xla")(x, w)
            err = float(jnp.linalg.norm(fn(x, w) - ref) / jnp.linalg.norm(ref))
            row = dict(shape=name, rows=m, rel_err_vs_xla=err, xla_us=xla_s * 1e6, xla_gbs=gbs(xla_s), pallas_us=best[0] * 1e6,
                       pallas_gbs=gbs(best[0]), block_n=best[1], block_k=best[2], k_splits=best[3])
            rows_out.append(row)
            print(f"{name:20s} M={m:<3d} xla {row['xla_us']:7.1f} us ({row['xla_gbs']:6.0f} GB/s)   pallas "
                  f"{row['pallas_us']:7.1f} us ({row['pallas_gbs']:6.0f} GB/s) bn={best[1]} bk={best[2]} "
                  f"S={best[3]}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, results=rows_out), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

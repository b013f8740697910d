"""A decode layer's SwiGLU MLP through to the residual-norm kernel: XLA's GEMMs against the
fused kernels, kernel time per layer.

    python scripts/bench_mlp.py --out mlp.json             # GPU, Ouro-1.4B shapes, rows 1 8 16 32
    python scripts/bench_mlp.py --rows 8 --sweep           # also sweep both kernels' blocks
    python scripts/bench_mlp.py --quick                    # CPU smoke run (interpret mode, tiny shapes)
    python scripts/bench_mlp.py --halves down --intermediate 2048 --sweep --down-splits 1 2 4 8
                                 # the o projection's shape (K = 2048) into the norm

Two halves, each over L layers' own weights in one jitted call (as in ``bench_skinny``):
- "up": XLA's GEMM of the two weights side by side and the activation's fusion (what XLA
  makes of the engine's two dots: it merges dots that share their input), against
  ``gated_up``'s kernel (both products and silu(gate) * up in one);
- "down": XLA's down GEMM (split-K, then its reduction) and the residual-norm kernel,
  against down's split kernel handing its partial sums to the norm unreduced.
On a GPU the time is the call's summed kernel durations from a profiler trace, median over
--iters calls, divided by L; without one (--quick) wall-clock time.
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

from rltjax.kernels.residual_norm import residual_norm  # noqa: E402
from rltjax.kernels.skinny_matmul import (fit_block, gated_config, gated_up, gated_up_ref, kernel_config,  # noqa: E402
                                   skinny_matmul)
from rltjax.profiling import median_call_us  # noqa: E402

EPS = 1e-6


def up_fn(impl: str, interpret: bool, **config):
    if impl == "xla":      # gs: the pairs side by side [K, 2F]
        def merged(x, gu):
            gate, up = jnp.split(jnp.dot(x, gu, preferred_element_type=jnp.float32).astype(x.dtype), 2, axis=-1)
            return jax.nn.silu(gate) * up
        return jax.jit(lambda xs, gus: tuple(merged(x, gu) for x, gu in zip(xs, gus)))
    return jax.jit(lambda xs, gs, us: tuple(gated_up(x, g, u, impl="pallas", interpret=interpret, **config)
                                            for x, g, u in zip(xs, gs, us)))


def down_fn(impl: str, interpret: bool, norm_impl: str, **config):
    def layer(act, w, res, norm_w):
        y = skinny_matmul(act, w, impl=impl, interpret=interpret, partial_sums=impl == "pallas", **config)
        return residual_norm(res, y, norm_w, norm_w, EPS, impl=norm_impl, interpret=interpret)
    return jax.jit(lambda acts, ws, res, norm_w: tuple(layer(a, w, r, norm_w) for a, w, r in zip(acts, ws, res)))


def max_rel_err(got, want) -> float:
    flat = lambda t: jax.tree.leaves(t)                                  # noqa: E731
    return max(float(jnp.linalg.norm((g - w).astype(jnp.float32)) / jnp.linalg.norm(w.astype(jnp.float32)))
               for g, w in zip(flat(got), flat(want)))


def sweep_points(args, k: int, f: int, d: int):
    """(half, config) pairs: each kernel's default first, then the sweep's valid points."""
    yield from ((half, {}) for half in args.halves)
    if not args.sweep:
        return
    if args.quick:
        ups, downs = [(16, 16, 4, 3)], [(16, 16, 2, 4, 3)]
    else:
        ups = list(itertools.product((16, 32, 64), (128, 256), (2, 4), (4,)))
        downs = list(itertools.product(args.down_block_n, args.down_block_k, args.down_splits, (2, 4),
                                       args.down_stages))
    ups, downs = (ups if "up" in args.halves else []), (downs if "down" in args.halves else [])
    for bn, bk, warps, stages in ups:
        if fit_block(f, bn) == bn and fit_block(k, bk) == bk:
            yield "up", dict(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
    for bn, bk, splits, warps, stages in downs:
        if fit_block(d, bn) == bn and fit_block(f, bk) == bk and (f // bk) % splits == 0:
            yield "down", dict(block_n=bn, block_k=bk, k_splits=splits, num_warps=warps, num_stages=stages)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32], help="powers of two (the engine's buckets)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--sweep", action="store_true", help="also time a grid of both kernels' blocks")
    p.add_argument("--halves", nargs="+", default=["up", "down"], choices=["up", "down"])
    p.add_argument("--down-block-n", type=int, nargs="+", default=[16, 32, 64], help="sweep: down's column tiles")
    p.add_argument("--down-block-k", type=int, nargs="+", default=[128], help="sweep: down's K steps")
    p.add_argument("--down-splits", type=int, nargs="+", default=[2, 4, 11], help="sweep: down's K splits")
    p.add_argument("--down-stages", type=int, nargs="+", default=[3], help="sweep: down's pipeline stages")
    p.add_argument("--quick", action="store_true", help="tiny shapes in interpret mode (CPU smoke run)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if any(m < 1 or m & (m - 1) for m in args.rows):
        raise SystemExit(f"bench_mlp: --rows {args.rows}: the kernels take power-of-two row counts")
    interpret = args.quick
    if args.quick:
        args.rows, args.hidden, args.intermediate, args.layers, args.iters = [1, 4], 64, 96, 2, 2
    d, f, num = args.hidden, args.intermediate, args.layers
    norm_impl = "pallas" if (interpret or jax.default_backend() == "gpu") else "xla"
    key = jax.random.key(0)
    draw = lambda i, shape, scale=1.0: (scale * jax.random.normal(jax.random.fold_in(key, i), shape)  # noqa: E731
                                        ).astype(jnp.bfloat16)
    gates = [draw(i, (d, f), d ** -0.5) for i in range(num)]
    ups = [draw(100 + i, (d, f), d ** -0.5) for i in range(num)]
    downs = [draw(200 + i, (f, d), f ** -0.5) for i in range(num)]
    pairs = [jnp.concatenate([g, u], axis=-1) for g, u in zip(gates, ups)]
    norm_w = jnp.ones((d,), jnp.bfloat16)
    results = []
    for m in args.rows:
        xs = [draw(1000 + i, (m, d)) for i in range(num)]
        acts = [draw(2000 + i, (m, f)) for i in range(num)]
        res = [draw(3000 + i, (m, d)) for i in range(num)]
        up_args, down_args = (xs, gates, ups), (acts, downs, res, norm_w)
        want = dict(up=tuple(gated_up_ref(*a) for a in zip(*up_args)),
                    down=down_fn("xla", interpret, norm_impl)(*down_args))
        xla_fns = dict(up=(up_fn("xla", False), (xs, pairs)), down=(down_fn("xla", interpret, norm_impl), down_args))
        row = dict(rows=m, xla={half: median_call_us(*xla_fns[half], args.iters) / num for half in args.halves},
                   kernel=[])
        for half, config in sweep_points(args, d, f, d):
            fn = up_fn("pallas", interpret, **config) if half == "up" else down_fn("pallas", interpret, norm_impl,
                                                                                   **config)
            fn_args = up_args if half == "up" else down_args
            full = gated_config(m, d, f, **config) if half == "up" else kernel_config(m, f, d, **config,
                                                                                        partial_sums=True)
            point = dict(half=half, label="sweep" if config else "config", **full)
            try:
                point.update(us=median_call_us(fn, fn_args, args.iters) / num,
                             rel_err_vs_xla=max_rel_err(fn(*fn_args), want[half]))
            except jax.errors.JaxRuntimeError as e:     # a sweep point over the GPU's shared memory
                if not config:
                    raise
                print(f"M={m} {half} {full}: {str(e).splitlines()[0]}", flush=True)
                continue
            row["kernel"].append(point)
        results.append(row)
        if args.out:       # after every row count: a run cut short keeps what it measured
            with open(args.out, "w") as fh:
                json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, hidden=d, intermediate=f,
                               layers=num, results=results), fh, indent=1)
        for half in args.halves:
            points = [r for r in row["kernel"] if r["half"] == half]
            best = min(points, key=lambda r: r["us"])
            blocks = " ".join(f"{k}={best[k]}" for k in ("block_n", "block_k", "k_splits", "num_warps", "num_stages")
                              if k in best)
            print(f"M={m:<3d} {half:4s} xla {row['xla'][half]:7.2f} us | config {points[0]['us']:7.2f} us | "
                  f"best {best['us']:7.2f} us {blocks}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

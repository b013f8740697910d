"""Decode projections: the weight-streaming kernels (Pallas Triton, Pallas Mosaic GPU) vs XLA's
dot, kernel time per layer and the weight bandwidth it reaches.

    python scripts/bench_skinny.py --out skinny.json                 # GPU, Ouro-1.4B shapes
    python scripts/bench_skinny.py --rows 1 8 --shapes o qkv --block-n 16 32 --block-k 128 256
    python scripts/bench_skinny.py --impls xla mosaic --block-n 64 128 --block-k 64 128 256 --k-splits 1 2 4 \
        --num-stages 3 4 6                                           # a Mosaic GPU sweep
    python scripts/bench_skinny.py --rows 1 8 32 --shapes qkv --gated --engine-forms   # as the engine calls them
    python scripts/bench_skinny.py --quick          # CPU smoke run (interpret mode, tiny shapes)

Each measurement runs one projection over L layers' own [K, N] weights (as the engine
holds them after splitting its layer stacks; more bytes than the L2 holds, as in a real
pass), each layer with its own input, in one jitted call. On a GPU the time is the sum
of the call's kernel durations from a profiler trace (XLA: its GEMM and any split-K
reduction after it; a kernel: itself and, with k_splits > 1, the sum of its partials),
median over --iters calls, divided by L: launch gaps and host dispatch are not in it.
Without a GPU (--quick) it is wall-clock time of the call. GB/s: the weight's bytes over
that time. --impls: "pallas" (Triton; `kernels.skinny_matmul.kernel_config`), "mosaic"
(Mosaic GPU, Hopper only; `kernels.skinny_matmul_mosaic.mosaic_config`); each runs at its
config ("config") and at every point of the --block-n x --block-k x --k-splits x
--num-warps x --num-stages grid it takes ("sweep"; Mosaic: blocks multiples of 64, stages
as its max_concurrent_steps, no warps). Default: every implementation this host can run.
--gated adds the gate | up pair with its activation on each implementation; --engine-forms
each projection in the form the engine calls it through ``kernels.skinny_matmul`` (o and
down as partial sums for the norm kernel, the head widened with its skip flag) on the
Triton and the Mosaic GPU backend: what ExecutionConfig.kernel_backend changes in a pass.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from rltjax.kernels import BACKENDS  # noqa: E402
from rltjax.kernels.skinny_matmul import (fit_block, gated_up, gated_up_ref, kernel_config,  # noqa: E402
                                          kernel_unsupported, skinny_matmul)
from rltjax.kernels.mosaic_common import hopper  # noqa: E402
from rltjax.kernels.skinny_matmul_mosaic import (gated_mosaic_config, gated_up_mosaic,  # noqa: E402
                                                 mosaic_config, mosaic_unsupported, skinny_matmul_mosaic)
from rltjax.profiling import median_call_us  # noqa: E402

# tiny: the --quick shape, 64-column multiples for the Mosaic kernel's 64-wide tiles
SHAPES = {"qkv": (2048, 6144), "o": (2048, 2048), "gate": (2048, 5632), "down": (5632, 2048),
          "lm_head": (2048, 49152), "tiny": (64, 128)}
IMPLS = ("xla", "pallas", "mosaic")


def per_layer_us(fn, xs, ws, iters: int) -> float:
    """Median time of one call over all layers, divided by the layer count (microseconds)."""
    return median_call_us(fn, (xs, ws), iters) / len(ws)


def projection(impl: str, interpret: bool, **config):
    """All layers' projections of their own inputs: a tuple out, so nothing else runs."""
    return jax.jit(lambda xs, ws: tuple(skinny_matmul(x, w, impl=impl, interpret=interpret, **config)
                                        for x, w in zip(xs, ws)))


def mosaic_projection(interpret: bool, k_splits: int = 1, **config):
    """``projection`` on the Mosaic GPU kernel; K splits' partial sums added up in XLA (and timed)."""
    def one(x, w):
        out = skinny_matmul_mosaic(x, w, None, k_splits=k_splits, interpret=interpret, **config)
        return out if k_splits == 1 else out.sum(axis=0).astype(x.dtype)
    return jax.jit(lambda xs, ws: tuple(one(x, w) for x, w in zip(xs, ws)))


def sweep_configs(args, m, k, n):
    for bn, bk, splits, warps, stages in itertools.product(args.block_n, args.block_k, args.k_splits,
                                                           args.num_warps, args.num_stages):
        shapes = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
        if fit_block(n, bn) != bn or fit_block(k, bk) != bk or (k // bk) % splits:
            continue
        if kernel_unsupported(*shapes, bn, bk):
            continue
        yield dict(block_n=bn, block_k=bk, k_splits=splits, num_warps=warps, num_stages=stages)


def mosaic_sweep_configs(args, m, k, n):
    """The sweep grid's points the Mosaic kernel takes (stages as max_concurrent_steps)."""
    shapes = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
    for bn, bk, splits, depth in itertools.product(args.block_n, args.block_k, args.k_splits, args.num_stages):
        config = dict(block_n=bn, block_k=bk, k_splits=splits, max_concurrent_steps=depth)
        if not mosaic_unsupported(*shapes, **config):
            yield config


def runnable_impls(quick: bool) -> tuple[str, ...]:
    """XLA anywhere; the kernels in interpret mode (--quick) or on a GPU, Mosaic GPU on Hopper only."""
    if quick:
        return IMPLS
    if jax.default_backend() != "gpu":
        return ("xla",)
    return IMPLS if hopper(jax.devices()[0]) else ("xla", "pallas")


def measure(points, make_fn, xs, ws, ref, iters: int, what: str) -> list[dict]:
    """Each (label, config) point's time per layer, GB/s and error against XLA's product."""
    k, n = ws[0].shape
    out = []
    for label, config in points:
        fn = make_fn(**config)
        try:
            got = fn(xs, ws)
        except (jax.errors.JaxRuntimeError, ValueError) as e:   # a sweep point over the shared memory
            if label == "config":
                raise
            print(f"{what} {config}: {str(e).splitlines()[0]}", flush=True)
            continue
        err = max(float(jnp.linalg.norm((g - r).astype(jnp.float32)) / jnp.linalg.norm(r.astype(jnp.float32)))
                  for g, r in zip(got, ref))
        us = per_layer_us(fn, xs, ws, iters)
        out.append(dict(label=label, **config, us=us, gbps=k * n * 2 / 1e3 / us, rel_err_vs_xla=err))
    return out


def summary(row) -> str:
    line = f"{row['shape']:8s} {row['k']}x{row['n']} M={row['rows']:<3d} xla {row['xla_us']:7.2f} us " \
           f"({row['xla_gbps']:5.0f} GB/s)"
    for impl, key in (("pallas", "kernel"), ("mosaic", "mosaic")):
        if row.get(key):
            cfg, best = row[key][0], min(row[key], key=lambda r: r["us"])
            tiles = " ".join(f"{k}={v}" for k, v in best.items() if k not in ("label", "us", "gbps", "rel_err_vs_xla"))
            line += (f" | {impl} config {cfg['us']:7.2f} us, best {best['us']:7.2f} us "
                     f"({best['gbps']:5.0f} GB/s) {tiles}")
    return line


def gated_rows(args, key, interpret: bool):
    """--gated: gate | up and the activation (Ouro's 2048 x 5632 pair), each impl at its config."""
    k, f = SHAPES["tiny" if args.quick else "gate"]
    ws = [tuple((0.02 * jax.random.normal(jax.random.fold_in(key, 2 * i + s), (k, f))).astype(jnp.bfloat16)
                for s in (0, 1)) for i in range(args.layers)]
    fns = dict(xla=gated_up_ref, pallas=functools.partial(gated_up, impl="pallas", interpret=interpret),
               mosaic=lambda x, g, u: gated_up_mosaic(x, g, u, None, interpret=interpret,
                                                      **gated_mosaic_config(x.shape[0], k, f)))
    for m in args.rows:
        xs = [jax.random.normal(jax.random.fold_in(key, 1000 + i), (m, k), jnp.bfloat16) for i in range(args.layers)]
        row = dict(shape="gated", k=k, n=f, rows=m)
        for impl in args.impls:
            fn = jax.jit(lambda xs, ws, one=fns[impl]: tuple(one(x, *w) for x, w in zip(xs, ws)))
            row[f"{impl}_us"] = per_layer_us(fn, xs, ws, args.iters)
        print(f"gated    {k}x{f} M={m:<3d} " + " | ".join(f"{i} {row[i + '_us']:7.2f} us" for i in args.impls))
        yield row


ENGINE_FORMS = {"qkv": {}, "o": {"partial_sums": True}, "down": {"partial_sums": True},
                "lm_head": {"widen": True, "skip": False}}


def engine_form_rows(args, key, interpret: bool):
    """--engine-forms: each projection as the engine calls it (o and down as partial sums for the
    norm kernel, the head widened with its skip flag; gate | up is --gated's), through
    ``kernels.skinny_matmul`` on each backend at its own config."""
    for name, form in ENGINE_FORMS.items():
        k, n = SHAPES["tiny" if args.quick else name]
        ws = [(0.02 * jax.random.normal(jax.random.fold_in(key, i), (k, n))).astype(jnp.bfloat16)
              for i in range(args.layers)]
        for m in args.rows:
            xs = [jax.random.normal(jax.random.fold_in(key, 1000 + i), (m, k), jnp.bfloat16)
                  for i in range(args.layers)]
            row = dict(shape=f"{name}-engine", k=k, n=n, rows=m, form=str(form))
            for backend in BACKENDS:
                call = functools.partial(skinny_matmul, impl="pallas", interpret=interpret, backend=backend,
                                         **{f: (jnp.bool_(v) if f == "skip" else v) for f, v in form.items()})
                fn = jax.jit(lambda xs, ws, call=call: tuple(call(x, w) for x, w in zip(xs, ws)))
                row[f"{backend}_us"] = per_layer_us(fn, xs, ws, args.iters)
            print(f"{name + ' ' + str(form):40s} M={m:<3d} triton {row['triton_us']:7.2f} us | "
                  f"mosaic {row['mosaic_us']:7.2f} us", flush=True)
            yield row


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16], help="powers of two (the engine's buckets)")
    p.add_argument("--shapes", nargs="+", default=["qkv", "o", "gate", "down"], choices=list(SHAPES))
    p.add_argument("--impls", nargs="+", choices=IMPLS, help="default: all this host can run")
    p.add_argument("--block-n", type=int, nargs="*", default=[], help="sweep: column tiles")
    p.add_argument("--block-k", type=int, nargs="*", default=[128, 256], help="sweep: K steps")
    p.add_argument("--k-splits", type=int, nargs="*", default=[1], help="sweep: K splits")
    p.add_argument("--num-warps", type=int, nargs="*", default=[2, 4])
    p.add_argument("--num-stages", type=int, nargs="*", default=[3, 5])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="tiny shape in interpret mode (CPU smoke run)")
    p.add_argument("--gated", action="store_true", help="also gate | up with its activation (xla, pallas, mosaic)")
    p.add_argument("--engine-forms", action="store_true",
                   help="also each projection in the form the engine calls it, Triton against Mosaic GPU")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if any(m & (m - 1) for m in args.rows):
        raise SystemExit(f"bench_skinny: --rows {args.rows}: the kernel takes power-of-two row counts")
    if args.quick:
        args.shapes, args.rows, args.layers, args.iters = ["tiny"], [1, 4], 2, 2
        args.block_n, args.block_k, args.k_splits = [16, 32], [16, 32], [1, 2]
        args.num_warps, args.num_stages = [4], [3]
    runnable = runnable_impls(args.quick)
    if args.impls is None:
        args.impls = runnable
    elif missing := [i for i in args.impls if i not in runnable]:
        raise SystemExit(f"bench_skinny: --impls {missing}: this host runs only {list(runnable)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    interpret = args.quick
    key = jax.random.key(0)
    results = []
    for name in args.shapes:
        k, n = SHAPES[name]
        ws = [(0.02 * jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.float32)).astype(jnp.bfloat16)
              for i in range(args.layers)]
        for m in args.rows:
            xs = [jax.random.normal(jax.random.fold_in(key, 1000 + i), (m, k), jnp.bfloat16)
                  for i in range(args.layers)]
            ref = projection("xla", False)(xs, ws)
            row = dict(shape=name, k=k, n=n, rows=m, weight_bytes=k * n * 2,
                       xla_us=per_layer_us(projection("xla", False), xs, ws, args.iters))
            row["xla_gbps"] = k * n * 2 / 1e3 / row["xla_us"]
            if "pallas" in args.impls:
                points = [("config", kernel_config(m, k, n))] + [("sweep", c) for c in sweep_configs(args, m, k, n)]
                row["kernel"] = measure(points, functools.partial(projection, "pallas", interpret), xs, ws, ref,
                                        args.iters, f"{name} M={m} pallas")
            if "mosaic" in args.impls:
                config = mosaic_config(m, k, n)
                if why_not := mosaic_unsupported(xs[0], ws[0], **config):
                    row["mosaic_skipped"] = why_not
                else:
                    points = [("config", config)] + [("sweep", c) for c in mosaic_sweep_configs(args, m, k, n)]
                    row["mosaic"] = measure(points, functools.partial(mosaic_projection, interpret), xs, ws, ref,
                                            args.iters, f"{name} M={m} mosaic")
            results.append(row)
            print(summary(row), flush=True)
    if args.gated:
        results.extend(gated_rows(args, key, interpret))
    if args.engine_forms:
        results.extend(engine_form_rows(args, key, interpret))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

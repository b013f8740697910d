"""Exploration: decode projections on panel-major weights against the engine's kernels on
[K, N], kernel time per layer on a GPU.

    python scripts/explore_panel_layout.py --out panel.json     # GPU, Ouro-1.4B shapes
    python scripts/explore_panel_layout.py --quick              # CPU smoke run (interpret mode)

The engine's weight-streaming kernels (``kernels.skinny_matmul_pallas``) read [block_k, block_n]
tiles of a row-major [K, N] weight: block_n columns (32-128 bytes) from each of block_k rows
that lie N columns apart. On an H200 they fit about 2.2 us + bytes / 3.8 TB/s against a 4.3
TB/s device copy (docs/performance.md). A panel-major weight, [N / P, K, P], makes each
program's whole [K, P] slab one contiguous range: the question is whether that streams
faster, and whether narrow panels (P = 16: 128 programs for a 2,048-wide output) let o and
down run in one pass over K, with no split-K partial sums for the residual-norm kernel to add.

Variants per (projection, rows): the engine's call at its own config (``skinny_matmul``;
o and down as the split-K partial sums it hands to the norm; ``gated_up`` for the gate | up
pair with its SiLU-multiply) and a panel kernel over P x block_k x K splits x warps x
stages. Each call runs one projection over --layers layers' own weights; the time is the
summed kernel durations of a profiler trace (median over calls) divided by the layers
(``explore_weight_layout.time_all``). Not part of the engine: kept to reproduce its table.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

from explore_weight_layout import compile_all, time_all  # noqa: E402
from rltjax.kernels.skinny_matmul import gated_up, gated_up_ref, skinny_matmul, skinny_matmul_ref  # noqa: E402
from benchmarks.report import write_json  # noqa: E402

SHAPES = {"qkv": (2048, 6144), "o": (2048, 2048), "gateup": (2048, 5632), "down": (5632, 2048)}
DOT_ROWS = 16
SMEM_BYTES = 200 * 1024


def _panel_kernel(x_ref, *refs, block_k: int, steps: int, gated: bool):
    j, split = pl.program_id(0), pl.program_id(1)
    *w_refs, o_ref = refs
    m, dtype = x_ref.shape[0], x_ref.dtype
    rows, panel = max(m, DOT_ROWS), w_refs[0].shape[-1]
    live = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < m          # rows past M read as zeros

    def body(i, accs):
        k0 = (split * steps + i) * block_k
        xs = plgpu.load(x_ref.at[pl.ds(0, rows), pl.ds(k0, block_k)], mask=live, other=0)     # [16+, bk]
        return tuple(acc + plgpu.dot(xs, w[j, pl.ds(k0, block_k), :])                       # [16+, P] f32
                     for acc, w in zip(accs, w_refs))

    accs = jax.lax.fori_loop(0, steps, body, tuple(jnp.zeros((rows, panel), jnp.float32) for _ in w_refs))
    if gated:       # the rounding of ``kernels.skinny_matmul.silu_mul``
        gate, up = (a.astype(dtype).astype(jnp.float32) for a in accs)
        out = gate / (1.0 + jnp.exp(-gate)) * up
    else:
        out = accs[0]
    cols = pl.ds(j * panel, panel)
    dst = o_ref.at[pl.ds(0, rows), cols] if len(o_ref.shape) == 2 else o_ref.at[split, pl.ds(0, rows), cols]
    plgpu.store(dst, out.astype(o_ref.dtype), mask=live)


def panel_matmul(x, panels, *, block_k, splits=1, warps=4, stages=4, interpret=False):
    """x [M, K] @ one panel-major weight [N / P, K, P] -> [M, N] in x's dtype (splits = 1) or
    [S, M, N] float32 partial sums; two panel weights (gate, up) -> silu(x @ g) * (x @ u)."""
    (m, k), (tiles, _, panel) = x.shape, panels[0].shape
    shape = (m, tiles * panel) if splits == 1 else (splits, m, tiles * panel)
    whole = lambda s: pl.BlockSpec(s, lambda *_: (0,) * len(s))   # noqa: E731
    return pl.pallas_call(
        functools.partial(_panel_kernel, block_k=block_k, steps=k // block_k // splits, gated=len(panels) == 2),
        grid=(tiles, splits), in_specs=[whole(x.shape)] + [whole(p.shape) for p in panels], out_specs=whole(shape),
        out_shape=jax.ShapeDtypeStruct(shape, x.dtype if splits == 1 else jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages), interpret=interpret,
        name=f"panel_p{panel}_bk{block_k}_s{splits}_w{warps}_st{stages}")(x, *panels)


def to_panels(w, panel: int):
    """[K, N] -> [N / P, K, P]: column tile j's whole [K, P] slab contiguous."""
    k, n = w.shape
    return w.reshape(k, n // panel, panel).transpose(1, 0, 2).copy()


def engine_call(name: str, interpret: bool):
    """The engine's decode call for this projection (its own kernel config)."""
    if name == "gateup":
        return lambda x, ws: gated_up(x, *ws, impl="pallas", interpret=interpret)
    return lambda x, ws: skinny_matmul(x, ws[0], impl="pallas", interpret=interpret, partial_sums=name in ("o", "down"))


def variants(name, k, n, interpret, grid):
    """{label: (fn(xs, per-layer weights), layout)}: layout "kn" takes [K, N] weights, an int P
    takes P-wide panels."""
    out = {"engine": (lambda xs, ws: tuple(engine_call(name, interpret)(x, w) for x, w in zip(xs, ws)), "kn")}
    nweights = 2 if name == "gateup" else 1
    split_choices = grid["splits"] if name in ("o", "down") else (1,)
    for p, bk, s, w, st in itertools.product(grid["panels"], grid["block_k"], split_choices, grid["warps"],
                                             grid["stages"]):
        if n % p or k % bk or (k // bk) % s or st * (DOT_ROWS * bk + nweights * bk * p) * 2 > SMEM_BYTES:
            continue
        cfg = dict(block_k=bk, splits=s, warps=w, stages=st, interpret=interpret)
        out[f"panel_p{p}_bk{bk}_s{s}_w{w}_st{st}"] = (
            lambda xs, ws, cfg=cfg: tuple(panel_matmul(x, pw, **cfg) for x, pw in zip(xs, ws)), p)
    return out


def as_product(out):
    """A call's output as the [M, N] product: split-K partial sums added up."""
    return out.sum(0).astype(jnp.bfloat16) if out.ndim == 3 else out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--panels", type=int, nargs="+", default=[16, 32, 64], help="panel widths P")
    p.add_argument("--block-k", type=int, nargs="+", default=[128, 256])
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4], help="K splits (o and down only)")
    p.add_argument("--warps", type=int, nargs="+", default=[2, 4])
    p.add_argument("--stages", type=int, nargs="+", default=[4])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="tiny shapes in interpret mode (CPU smoke run)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    shapes = SHAPES
    grid = dict(panels=args.panels, block_k=args.block_k, splits=args.splits, warps=args.warps, stages=args.stages)
    if args.quick:
        shapes = {name: (128, 64) for name in SHAPES}
        grid = dict(panels=(16, 32), block_k=(64,), splits=(1, 2), warps=(4,), stages=(3,))
        args.rows, args.layers = [1, 16], 2
    key = jax.random.key(0)
    summary = []
    for name in args.shapes:
        k, n = shapes[name]
        nweights = 2 if name == "gateup" else 1
        kn = [[(0.02 * jax.random.normal(jax.random.fold_in(key, 10 * i + j), (k, n), jnp.float32))
               .astype(jnp.bfloat16) for j in range(nweights)] for i in range(args.layers)]
        fns = variants(name, k, n, args.quick, grid)
        panels = {lay: [[to_panels(w, lay) for w in layer] for layer in kn]
                  for lay in {layout for _, layout in fns.values() if layout != "kn"}}
        for m in args.rows:
            xs = [jax.random.normal(jax.random.fold_in(key, 1000 + i), (m, k), jnp.bfloat16) for i in range(args.layers)]
            ref = tuple(gated_up_ref(x, *w) if name == "gateup" else skinny_matmul_ref(x, w[0]) for x, w in zip(xs, kn))
            compiled, inputs = [], {}
            for layout in {layout for _, layout in fns.values()}:
                inputs[layout] = (xs, kn if layout == "kn" else panels[layout])
                group = {label: fn for label, (fn, lay) in fns.items() if lay == layout}
                compiled += [(label, c, layout) for label, c in compile_all(group, inputs[layout], 16 if gpu else 2)]
            times, errs = {}, {}
            for layout in inputs:          # one trace per layout: time_all takes one argument set
                mine = [(label, c) for label, c, lay in compiled if lay == layout]
                t, _ = time_all(mine, inputs[layout], ref, args.layers, args.iters, gpu) if mine else ({}, {})
                times.update(t)
                for label, c in mine:
                    got = c(*inputs[layout])
                    errs[label] = max(float(jnp.linalg.norm((as_product(g) - r).astype(jnp.float32))
                                            / jnp.linalg.norm(r.astype(jnp.float32))) for g, r in zip(got, ref))
            panel_times = {label: t for label, t in times.items() if label != "engine"}
            best = min(panel_times, key=panel_times.get)
            one_pass = {label: t for label, t in panel_times.items() if "_s1_" in label} or panel_times
            best1 = min(one_pass, key=one_pass.get)      # no K splits: no partial sums for a consumer
            mb = nweights * k * n * 2 / 1e6
            summary.append(dict(case=name, rows=m, k=k, n=n, weight_mb=mb, us=times, rel_err=errs))
            print(f"{name:7s} M={m:<3d} {mb:5.1f} MB  engine {times['engine']:6.2f} us ({mb / times['engine']:.2f} TB/s)"
                  f"  best panel {best} {times[best]:6.2f} ({mb / times[best]:.2f} TB/s)  one pass {best1} "
                  f"{times[best1]:6.2f}  max err {max(errs.values()):.1e}", flush=True)
    if args.out:
        write_json(Path(args.out), dict(jax=jax.__version__, device=jax.devices()[0].device_kind, results=summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

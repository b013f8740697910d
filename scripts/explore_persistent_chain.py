"""Exploration: one persistent Pallas Triton kernel with grid barriers against a chain of the
engine's weight-streaming kernels, for decode rows on a GPU.

    python scripts/explore_persistent_chain.py --out persistent.json     # GPU, Ouro-1.4B widths
    python scripts/explore_persistent_chain.py --quick                   # CPU smoke run (interpret mode)

A decode pass at 1-8 rows is ~200 kernels, each paying about 2 us of ramp and tail
(docs/performance.md). The question: does one kernel that streams every stage, with its
programs meeting at a barrier between stages, lose less? A chain is --stages dependent
products x <- x @ w_s: "o" (every w_s [D, D], 8.4 MB at D = 2,048, like Ouro's o) or "qkv"
(alternating [D, 3D] and [3D, D], 25 MB each, like q|k|v). Variants:
- ``engine``: the engine's kernel per stage (``skinny_matmul(impl="pallas")``); ``xla``: XLA's dots;
- ``persistent_P{P}``: one pallas_call of P programs. Program p owns work units p, p + P, ...
  of each stage, a unit a column tile x a share of K (``choose_split`` spreads the units
  evenly); units store float32 partial sums, which the next stage adds in a fixed order as it
  reads its input (deterministic); between stages each program adds 1 to an atomic counter and
  spins until all P have. The barrier needs every program resident at once, so it runs only
  for P up to the GPU's SM count (one SM a program at least); one program needs none;
- ``nobarrier_P{P}`` (``--no-barrier``): the same kernel without the barrier, so stages race
  and the result is wrong: it times the streaming alone.

Time: wall time of a jitted loop of --reps chains over --stages, median of --iters, per stage.
A persistent chain's time includes zeroing its partial sums and counter and the final sum
(2-3 small XLA kernels a chain, a fraction of a us a stage). Interpret mode runs programs one
after another, so a barrier would spin forever there: --quick runs one-stage chains at 4, 5
and 8 programs (units, waves, K splits; no barrier to cross) and three-stage chains in one
program, with 1 and 2 K splits (the stages' partial sums read back), each checked against XLA. Not part of the
engine: kept to reproduce its table.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

from rltjax.kernels.skinny_matmul_pallas import DOT_ROWS  # noqa: E402   (fewer rows are read masked to 16)
from rltjax.kernels.skinny_matmul import skinny_matmul  # noqa: E402


def stage_shapes(chain: str, d: int, stages: int) -> list[tuple[int, int]]:
    if chain == "o":
        return [(d, d)] * stages
    return [(d, 3 * d) if s % 2 == 0 else (3 * d, d) for s in range(stages)]


def choose_split(k: int, n: int, block_n: int, block_k: int, programs: int) -> int:
    """K splits S (dividing K / block_k) whose tiles x S units fill the programs most evenly,
    the fewest splits on ties; all of K / block_k when no S gives every program a unit."""
    tiles, steps = n // block_n, k // block_k
    best = None
    for s in range(1, steps + 1):
        units = tiles * s
        if steps % s or units < programs:
            continue
        score = (-(-units // programs) * programs / units, s)
        best = score if best is None or score < best else best
    return steps if best is None else best[1]


def _spin_until(count_ref, target: int):
    read = lambda: plgpu.atomic_add(count_ref, (0,), jnp.int32(0))        # an acquiring read
    jax.lax.while_loop(lambda c: c < target, lambda c: read(), read())


def _kernel(x_ref, *refs, plan, programs, block_n, block_k, rows, barrier):
    w_refs, (_, _, part_ref, count_ref) = refs[:len(plan)], refs[len(plan):]
    p = pl.program_id(0)
    padded = max(rows, DOT_ROWS)
    live = jax.lax.broadcasted_iota(jnp.int32, (padded, 1), 0) < rows

    def load_input(s, k0):                                   # -> [16, bk] in x's dtype
        if s == 0:
            return plgpu.load(x_ref.at[pl.ds(0, padded), pl.ds(k0, block_k)], mask=live, other=0)
        total = jnp.zeros((padded, block_k), jnp.float32)
        for j in range(plan[s - 1][2]):       # the previous stage's partial sums, in a fixed order
            # volatile: other programs wrote them during this kernel, so L1 may hold stale lines
            piece = part_ref.at[jnp.int32((s - 1) % 2), jnp.int32(j), pl.ds(0, padded), pl.ds(k0, block_k)]
            total += plgpu.load(piece, mask=live, other=0, volatile=True)
        return total.astype(x_ref.dtype)

    for s, (k, n, splits) in enumerate(plan):
        tiles, steps = n // block_n, k // block_k // splits
        units = tiles * splits
        for wave in range(-(-units // programs)):
            unit = jnp.minimum(p + wave * programs, units - 1)
            tile, split = unit % tiles, unit // tiles

            def work(s=s, steps=steps, tile=tile, split=split):
                cols = pl.ds(tile * block_n, block_n)

                def body(i, acc):
                    k0 = (split * steps + i) * block_k
                    return acc + plgpu.dot(load_input(s, k0), w_refs[s][pl.ds(k0, block_k), cols])
                acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((padded, block_n), jnp.float32))
                plgpu.store(part_ref.at[jnp.int32(s % 2), split, pl.ds(0, padded), cols], acc, mask=live)
            if (wave + 1) * programs <= units:
                work()
            else:
                pl.when(p + wave * programs < units)(work)
        if barrier and programs > 1 and s + 1 < len(plan):
            plgpu.debug_barrier()                      # the program's stores before its arrival
            plgpu.atomic_add(count_ref, (0,), jnp.int32(1))
            _spin_until(count_ref, (s + 1) * programs)


def persistent_chain(x, ws, *, programs, block_n, block_k, splits=None, num_warps=4, barrier=True,
                     interpret=False):
    """x [M, K0] through every w in ws in one kernel -> [M, N_last] in x's dtype. splits: K splits
    of every stage (None: ``choose_split``'s)."""
    m = x.shape[0]
    plan = [(k, n, splits or choose_split(k, n, block_n, block_k, programs)) for k, n in (w.shape for w in ws)]
    parts = jnp.zeros((2, max(p[2] for p in plan), m, max(p[1] for p in plan)), jnp.float32)
    count = jnp.zeros((1,), jnp.int32)
    args = [x, *ws, parts, count]
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    parts, _ = pl.pallas_call(
        functools.partial(_kernel, plan=plan, programs=programs, block_n=block_n, block_k=block_k, rows=m,
                          barrier=barrier),
        grid=(programs,), in_specs=[whole(a) for a in args], out_specs=[whole(parts), whole(count)],
        out_shape=[jax.ShapeDtypeStruct(parts.shape, parts.dtype), jax.ShapeDtypeStruct(count.shape, count.dtype)],
        input_output_aliases={len(args) - 2: 0, len(args) - 1: 1},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=3),
        interpret=interpret, name="explore_persistent_chain")(*args)
    _, n, splits = plan[-1]
    return jnp.sum(parts[(len(ws) - 1) % 2, :splits, :, :n], axis=0).astype(x.dtype)


def kernel_chain(x, ws, impl, interpret=False):
    layer = jnp.zeros((1,), jnp.int32)
    for w in ws:
        x = skinny_matmul(x, w[None], layer, impl=impl, interpret=interpret)
    return x


def per_stage_us(fn, x, ws, reps, iters):
    if ws[-1].shape[1] != x.shape[1]:        # --quick's odd qkv chains end wider than they start
        reps = 1

    def chains(x, ws):
        return jax.lax.fori_loop(0, reps, lambda _, x: fn(x, ws), x) if reps > 1 else fn(x, ws)
    loop = jax.jit(chains)
    loop(x, ws).block_until_ready()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        loop(x, ws).block_until_ready()
        times.append(time.perf_counter() - t)
    return statistics.median(times) / (reps * len(ws)) * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--chains", nargs="+", choices=("o", "qkv"), default=["o", "qkv"])
    p.add_argument("--programs", type=int, nargs="+", default=[128])
    p.add_argument("--block-n", type=int, default=16)
    p.add_argument("--block-k", type=int, default=256)
    p.add_argument("--splits", type=int, help="K splits of every stage (default: the most even spread of units)")
    p.add_argument("--stages", type=int, default=24)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--no-barrier", action="store_true", help="also time the kernel without its barrier")
    p.add_argument("--quick", action="store_true", help="one tiny stage in interpret mode (CPU smoke run)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if any(m < 1 or m & (m - 1) for m in args.rows):
        p.error(f"--rows must be powers of two (the kernel's tiles), got {args.rows}")
    if "qkv" in args.chains and args.stages % 2 and not args.quick:
        p.error(f"--stages must be even for the qkv chain (it must end as wide as it starts), got {args.stages}")
    d, interpret = 2048, args.quick
    runs = [(args.stages, args.programs, args.splits)]      # (stages, program counts, K splits)
    if args.quick:
        d, args.reps, args.iters, args.block_k, args.rows = 64, 1, 1, 32, [1, 8]
        runs = [(1, [4, 5, 8], None), (3, [1], None), (3, [1], 2)]
    resident_programs = jax.devices()[0].core_count if jax.default_backend() == "gpu" else None
    rng = np.random.default_rng(0)
    results = []
    for (stages, counts, splits), chain in ((run, chain) for run in runs for chain in args.chains):
        shapes = stage_shapes(chain, d, stages)
        ws = [jnp.asarray(rng.standard_normal((k, n), np.float32) / np.sqrt(k), jnp.bfloat16) for k, n in shapes]
        mb = sum(k * n * 2 for k, n in shapes) / len(shapes) / 1e6
        for m in args.rows:
            x = jnp.asarray(rng.standard_normal((m, d), np.float32), jnp.bfloat16)
            ref = np.asarray(jax.jit(lambda x, ws: kernel_chain(x, ws, "xla"))(x, ws), np.float32)
            fns = {"engine": functools.partial(kernel_chain, impl="pallas", interpret=interpret),
                   "xla": functools.partial(kernel_chain, impl="xla")}
            for programs in counts:
                common = dict(programs=programs, block_n=args.block_n, block_k=args.block_k, splits=splits,
                              interpret=interpret)
                label = f"P{programs}" + (f"_S{splits}" if splits else "")
                if resident_programs is None or programs <= resident_programs:
                    fns[f"persistent_{label}"] = functools.partial(persistent_chain, **common)
                if args.no_barrier:
                    fns[f"nobarrier_{label}"] = functools.partial(persistent_chain, barrier=False, **common)
            row = dict(chain=chain, stages=stages, splits=splits, rows=m, stage_mb=mb, us={}, rel_err={})
            for name, fn in fns.items():
                row["us"][name] = per_stage_us(fn, x, ws, args.reps, args.iters)
                got = np.asarray(jax.jit(fn)(x, ws), np.float32)
                row["rel_err"][name] = float(np.max(np.abs(got - ref)) / (np.max(np.abs(ref)) + 1e-9))
                print(f"{chain:4s} x{stages:<2d} M={m:<2d} {mb:5.1f} MB a stage  {name:16s} "
                      f"{row['us'][name]:7.2f} us a stage ({mb / row['us'][name]:.2f} TB/s)  "
                      f"rel err vs xla {row['rel_err'][name]:.1e}", flush=True)
            results.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, block_n=args.block_n,
                           block_k=args.block_k, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

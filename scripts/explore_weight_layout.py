"""Exploration: decode projections with K-major weights ([N, K], the layout of a PyTorch
Linear) against the engine's [K, N], kernel time per layer on a GPU.

    python scripts/explore_weight_layout.py --out layout.json      # GPU, Ouro-1.4B shapes
    python scripts/explore_weight_layout.py --quick                # CPU smoke run (interpret mode)

Kept to reproduce the weight-layout finding in docs/performance.md (the layout did
not pay: the engine keeps [K, N]); the kernel here is not part of the engine. Variants
per (projection, rows): XLA's dot on either layout (and on cuBLAS instead of XLA's Triton
GEMMs), the engine's weight-streaming kernel (``kernels.skinny_matmul`` at its
``kernel_config``), and a K-major Pallas kernel over block_n x block_k x K splits, then
warps x stages x eviction policy around its best point. ``downsw`` is the down projection
with SiLU(gate) * up computed in the kernel's prologue. As in ``bench_skinny.py``, each
call runs one projection over --layers layers' own weights and the time is the summed
kernel durations of a profiler trace (median over calls) divided by the layers.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import functools
import itertools
import json
import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

from rltjax.kernels.skinny_matmul_pallas import _from_dot_rows, _to_dot_rows  # noqa: E402
from rltjax.kernels.skinny_matmul import skinny_matmul  # noqa: E402
from rltjax.profiling import device_kernels, kernel_time_per_call, load_events  # noqa: E402

SHAPES = {"qkv": (2048, 6144), "o": (2048, 2048), "gateup": (2048, 11264), "down": (5632, 2048)}
CASES = [("qkv", 1), ("qkv", 8), ("qkv", 32), ("o", 1), ("o", 8), ("o", 32), ("gateup", 8), ("gateup", 32),
         ("down", 8), ("down", 32), ("downsw", 8), ("downsw", 32)]
NT = (((1,), (1,)), ((), ()))          # x [M, K] . wt [N, K] over K


def _nk_kernel(x_ref, w_ref, o_ref, *, block_n, block_k, steps, swiglu, evict):
    j, split = pl.program_id(0), pl.program_id(1)
    rows, k_in = pl.ds(j * block_n, block_n), w_ref.shape[1]

    def body(i, acc):
        k0 = (split * steps + i) * block_k
        if swiglu:      # x is gate | up [M, 2K]
            gate = x_ref[:, pl.ds(k0, block_k)].astype(jnp.float32)
            xs = (jax.nn.silu(gate) * x_ref[:, pl.ds(k_in + k0, block_k)].astype(jnp.float32)).astype(w_ref.dtype)
        else:
            xs = x_ref[:, pl.ds(k0, block_k)]
        ws = (plgpu.load(w_ref.at[rows, pl.ds(k0, block_k)], eviction_policy="evict_first") if evict
              else w_ref[rows, pl.ds(k0, block_k)])                                  # [bn, bk]
        return acc + plgpu.dot(_to_dot_rows(xs), ws, trans_b=True)                 # [16, bn] f32

    m = x_ref.shape[0]
    acc = _from_dot_rows(jax.lax.fori_loop(0, steps, body, jnp.zeros((max(m, 16), block_n), jnp.float32)), m)
    if len(o_ref.shape) == 2:
        o_ref[:, rows] = acc.astype(o_ref.dtype)
    else:
        o_ref[split, :, rows] = acc


def nk_matmul(x, wt, *, block_n, block_k, splits=1, warps=4, stages=4, swiglu=False, evict=False, interpret=False):
    """x [M, K] (gate | up [M, 2K] with swiglu) @ wt[N, K].T -> [M, N] in x's dtype."""
    (m, _), (n, k) = x.shape, wt.shape
    shape = (m, n) if splits == 1 else (splits, m, n)
    whole = lambda s: pl.BlockSpec(s, lambda *_: (0,) * len(s))   # noqa: E731
    out = pl.pallas_call(
        functools.partial(_nk_kernel, block_n=block_n, block_k=block_k, steps=k // block_k // splits,
                          swiglu=swiglu, evict=evict),
        grid=(n // block_n, splits), in_specs=[whole(x.shape), whole(wt.shape)], out_specs=whole(shape),
        out_shape=jax.ShapeDtypeStruct(shape, x.dtype if splits == 1 else jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages), interpret=interpret,
        name=f"nk_bn{block_n}_bk{block_k}_s{splits}_w{warps}_st{stages}")(x, wt)
    return out if splits == 1 else out.sum(0).astype(x.dtype)


def swiglu_input(x, k, swiglu):
    return (jax.nn.silu(x[:, :k]) * x[:, k:]) if swiglu else x


def variants(name, m, k, n, interpret, gpu, blocks_n, blocks_k):
    sw = name == "downsw"
    f32 = jnp.float32
    out = {"xla_kn": lambda xs, ws, wts: tuple(jnp.dot(swiglu_input(x, k, sw), w, preferred_element_type=f32)
                                               .astype(x.dtype) for x, w in zip(xs, ws)),
           "xla_nk": lambda xs, ws, wts: tuple(jax.lax.dot_general(swiglu_input(x, k, sw), wt, NT,
                                                                   preferred_element_type=f32)
                                               .astype(x.dtype) for x, wt in zip(xs, wts))}
    if gpu:      # the same dots on cuBLAS (compiled with xla_gpu_enable_triton_gemm=false)
        out["xla_kn_cublas"], out["xla_nk_cublas"] = out["xla_kn"], out["xla_nk"]
    if not sw:
        out["pallas_kn"] = lambda xs, ws, wts: tuple(skinny_matmul(x, w, impl="pallas", interpret=interpret)
                                                     for x, w in zip(xs, ws))
    for bn, bk, s in itertools.product(blocks_n, blocks_k, (1, 2, 4)):
        if n % bn == 0 and k % bk == 0 and (k // bk) % s == 0:
            out[f"nk_bn{bn}_bk{bk}_s{s}"] = nk_variant(dict(block_n=bn, block_k=bk, splits=s, swiglu=sw,
                                                            interpret=interpret))
    return out


def nk_variant(cfg):
    return lambda xs, ws, wts: tuple(nk_matmul(x, wt, **cfg) for x, wt in zip(xs, wts))


def refinements(name, best, interpret, warps=(2, 4, 8), stages=(3, 4, 6)):
    """warps x stages x eviction policy around the best K-major point."""
    bn, bk, s = map(int, re.match(r"nk_bn(\d+)_bk(\d+)_s(\d+)", best).groups())
    return {f"{best}_w{w}_st{st}{'_ev' if ev else ''}": nk_variant(dict(
        block_n=bn, block_k=bk, splits=s, warps=w, stages=st, swiglu=name == "downsw", evict=ev, interpret=interpret))
        for w, st, ev in itertools.product(warps, stages, (False, True))}


def compile_all(fns, args, threads):
    def one(item):
        label, fn = item
        options = {"xla_gpu_enable_triton_gemm": False} if label.endswith("_cublas") else None
        try:
            return label, jax.jit(fn).lower(*args).compile(compiler_options=options)
        except Exception as exc:     # a block shape the backend refuses: reported, not fatal
            print(f"  {label}: did not compile ({type(exc).__name__})", flush=True)
            return label, None
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return [(label, c) for label, c in pool.map(one, fns.items()) if c is not None]


def time_all(compiled, args, ref, layers, iters, gpu):
    """{label: us per layer}, {label: max relative error against XLA's [K, N] dot}."""
    errs = {label: max(float(jnp.linalg.norm((g - r).astype(jnp.float32)) / jnp.linalg.norm(r.astype(jnp.float32)))
                       for g, r in zip(c(*args), ref)) for label, c in compiled}
    if not gpu:
        times = {}
        for label, c in compiled:
            t0 = time.perf_counter()
            jax.block_until_ready(c(*args))
            times[label] = (time.perf_counter() - t0) * 1e6 / layers
        return times, errs
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _, c in compiled:
                for _ in range(iters):
                    jax.block_until_ready(c(*args))
                    time.sleep(0.002)            # an idle gap the trace splits calls at
        calls = kernel_time_per_call(device_kernels(load_events(trace_dir)))
    if len(calls) != iters * len(compiled):
        raise RuntimeError(f"the trace split into {len(calls)} calls, expected {iters * len(compiled)}")
    return {label: statistics.median(calls[i * iters:(i + 1) * iters]) / layers
            for i, (label, _) in enumerate(compiled)}, errs


def case_inputs(name, m, k, n, layers):
    key = jax.random.key(0)
    ws = [(0.02 * jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.float32)).astype(jnp.bfloat16)
          for i in range(layers)]
    k_in = 2 * k if name == "downsw" else k
    xs = [jax.random.normal(jax.random.fold_in(key, 1000 + i), (m, k_in), jnp.bfloat16) for i in range(layers)]
    return xs, ws, [w.T.copy() for w in ws]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="tiny shapes in interpret mode (CPU smoke run)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    shapes, cases, blocks_n, blocks_k = SHAPES, CASES, (16, 32, 64), (256, 512)
    if args.quick:
        shapes = {name: (128, 64) for name in SHAPES}
        cases, blocks_n, blocks_k, args.layers = [("o", 1), ("downsw", 8)], (16, 32), (64,), 2
    summary = []
    for name, m in cases:
        k, n = shapes["down" if name == "downsw" else name]
        inputs = case_inputs(name, m, k, n, args.layers)
        fns = variants(name, m, k, n, args.quick, gpu, blocks_n, blocks_k)
        ref = jax.jit(fns["xla_kn"])(*inputs)
        times, errs = time_all(compile_all(fns, inputs, 16 if gpu else 2), inputs, ref, args.layers, args.iters, gpu)
        best_nk = min((label for label in times if label.startswith("nk")), key=times.get)
        grid = dict(warps=(8,), stages=(6,)) if args.quick else {}
        refined = compile_all(refinements(name, best_nk, args.quick, **grid), inputs, 16 if gpu else 2)
        more, more_errs = time_all(refined, inputs, ref, args.layers, args.iters, gpu)
        times.update(more)
        errs.update(more_errs)
        best = min(times, key=times.get)
        mb = k * n * 2 / 1e6
        summary.append(dict(case=name, rows=m, k=k, n=n, weight_mb=mb, us=times, rel_err_vs_xla=errs))
        print(f"{name:7s} M={m:<3d} {mb:5.1f} MB  xla [K,N] {times['xla_kn']:6.2f}  xla [N,K] {times['xla_nk']:6.2f}  "
              f"kernel [K,N] {times.get('pallas_kn', float('nan')):6.2f}  best {best} {times[best]:.2f} us "
              f"({mb / times[best]:.2f} TB/s)  max err {max(errs.values()):.1e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, results=summary), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

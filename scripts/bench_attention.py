"""Benchmark paged attention decode: our Pallas Triton kernel vs the XLA reference vs
jax's built-in Pallas paged attention, on Ouro-1.4B shapes (16 KV heads x 128, bf16,
page 16), batch 8/32/128 x context 512/2048/8192.

    python scripts/bench_attention.py --out results.json       # on a GPU (jax[cuda])
    python scripts/bench_attention.py --quick                  # CPU smoke run, tiny shapes

Each timing is the median over --iters samples (after warm-up) of one call, where a
sample is a jitted chain of calls (each call's output is the next call's q, so nothing
is hoisted and dispatch is amortized; at least --chain calls and >= 2 ms), timed with
jax.block_until_ready. The chain includes the split combine step of our kernel and the
1/sqrt(Dh) scaling of q that jax's kernel needs.
Effective bandwidth counts K+V bytes read: batch*context*Hkv*Dh*2*itemsize / time.
Our kernel is tuned over a small grid of (pages_per_block, num_splits, num_warps, path)
per shape; jax's kernel over (pages_per_compute_block, k_splits). Outputs are checked
against the reference (max abs diff).
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from rltjax.kernels.paged_attention_ref import paged_attention_ref  # noqa: E402
from rltjax.kernels.paged_attention_pallas import paged_attention_pallas  # noqa: E402


def make_inputs(batch, context, num_heads, num_kv, head_dim, page_size, dtype, seed=0):
    """Full-length rows (lengths == context), each with its own table of shuffled pages."""
    pages_per_seq = context // page_size
    num_pages = batch * pages_per_seq + 1
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (batch, num_heads, head_dim), dtype)
    k_pages = jax.random.normal(kk, (num_kv, num_pages, page_size, head_dim), dtype)
    v_pages = jax.random.normal(kv, (num_kv, num_pages, page_size, head_dim), dtype)
    perm = rng.permutation(num_pages)[: batch * pages_per_seq]
    block_tables = jnp.asarray(perm.reshape(batch, pages_per_seq), jnp.int32)
    row_tables = jnp.arange(batch, dtype=jnp.int32)
    lengths = jnp.full((batch,), context, jnp.int32)
    return q, k_pages, v_pages, block_tables, row_tables, lengths


def chained(fn, chain):
    """jit(q -> fn applied `chain` times, each output feeding the next q). The trip count
    is static: XLA:GPU then runs the loop without a device->host sync per iteration."""
    @jax.jit
    def run(q, k, v, bt, rt, ln):
        return jax.lax.fori_loop(0, chain, lambda i, x: fn(x, k, v, bt, rt, ln), q)
    return run


def time_us(fn, args, iters, chain, min_sample_us=2000.0):
    """Median us per call; a sample chains >= `chain` calls and lasts >= min_sample_us."""
    run = chained(fn, chain)
    jax.block_until_ready(run(*args))                      # compile + warm-up
    t0 = time.perf_counter()
    jax.block_until_ready(run(*args))
    per_call = (time.perf_counter() - t0) / chain * 1e6
    if per_call * chain < min_sample_us:                   # short calls: a longer chain
        chain = 1 << math.ceil(math.log2(min(1024, min_sample_us / max(per_call, 1e-3))))
        run = chained(fn, chain)
        jax.block_until_ready(run(*args))
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        samples.append((time.perf_counter() - t0) / chain * 1e6)
    return statistics.median(samples)


def max_diff(a, b):
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def ours(interpret, ppb, splits, warps, stages, use_dot):
    return functools.partial(paged_attention_pallas, pages_per_block=ppb, num_splits=splits,
                             num_warps=warps, num_stages=stages, use_dot=use_dot,
                             interpret=interpret)


def builtin(interpret, ppcb, splits):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention as jpa
    def fn(q, k, v, bt, rt, ln):
        # jax's layout: q [B, H, Dh], pages [Hkv, P, S, Dh], lengths [B], page_indices [B, pps].
        # It applies no 1/sqrt(Dh) scale: fold it into q (one tiny fused XLA op).
        qs = (q * (q.shape[-1] ** -0.5)).astype(q.dtype)
        return jpa.paged_attention(qs, k, v, bt[rt], ln, pages_per_compute_block=ppcb,
                                   k_splits=splits, interpret=interpret)
    return fn


def our_grid(quick, group, pages_per_seq, sweep=None):
    """(pages_per_block, num_splits, num_warps, num_stages, use_dot); None = the kernel's default.
    sweep: (ppbs, splits, warps, stages) lists for a full grid instead of the built-in one."""
    if quick:
        return [(None,) * 5, (2, 2, 4, 2, None)]
    if sweep:
        return [(None,) * 5] + [(ppb, splits, warps, stages, None)
                                for ppb, splits, warps, stages in itertools.product(*sweep)
                                if splits == 1 or pages_per_seq // splits >= ppb]
    grid = [(None,) * 5]
    for ppb, warps, splits_set in ((4, 4, (1, 2, 4, 8, 16, 32)), (8, 4, (1, 2, 4, 8, 16, 32)),
                                   (4, 8, (2, 16))):
        for splits in splits_set:
            if splits == 1 or pages_per_seq // splits >= 2 * ppb:
                grid.append((ppb, splits, warps, 2, None))
    if group == 1:                                          # also the padded-dot path
        grid.append((4, None, 4, 2, True))
    return grid


def builtin_grid(quick, pages_per_seq):
    if quick:
        return [(2, 1)]
    return [(ppcb, ks) for ppcb in (4, 8, 16) for ks in (1, 4, 16)
            if pages_per_seq % ks == 0 and (pages_per_seq // ks) % ppcb == 0]


def bench_shape(args, batch, context, results):
    h, hkv, dh, ps = args.heads, args.kv_heads, args.head_dim, args.page_size
    dtype = jnp.dtype(args.dtype)
    inputs = make_inputs(batch, context, h, hkv, dh, ps, dtype)
    nbytes = batch * context * hkv * dh * 2 * dtype.itemsize
    ref = jax.jit(paged_attention_ref)(*inputs)
    pages_per_seq = context // ps
    interpret = args.quick
    candidates = [("xla", {}, paged_attention_ref)]
    if "pallas" in args.impls:
        candidates += [("pallas", dict(pages_per_block=a, num_splits=b, num_warps=c,
                                       num_stages=d, use_dot=e), ours(interpret, a, b, c, d, e))
                       for a, b, c, d, e in our_grid(args.quick, h // hkv, pages_per_seq, args.sweep)]
    if "jax" in args.impls:
        candidates += [("jax_builtin", dict(pages_per_compute_block=a, k_splits=b),
                        builtin(interpret, a, b)) for a, b in builtin_grid(args.quick, pages_per_seq)]
    for impl, cfg, fn in candidates:
        if impl == "xla" and "xla" not in args.impls:
            continue
        rec = dict(batch=batch, context=context, impl=impl, config=cfg)
        try:
            out = jax.jit(fn)(*inputs)
            rec["max_abs_diff"] = max_diff(out, ref)
            rec["us"] = time_us(fn, inputs, args.iters, args.chain)
            rec["tbps"] = nbytes / (rec["us"] * 1e-6) / 1e12
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is reported, not fatal
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        results.append(rec)
        shown = (f"{rec['us']:9.1f} us {rec['tbps']:6.3f} TB/s diff {rec['max_abs_diff']:.2e}"
                 if "us" in rec else rec["error"])
        cfg_s = " ".join(f"{k}={v}" for k, v in cfg.items() if v is not None) or "default"
        print(f"b={batch:<4} ctx={context:<5} {impl:<12} {cfg_s:<62} {shown}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write all results as JSON here")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shapes, interpret mode")
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--impls", nargs="+", default=["xla", "pallas", "jax"])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--chain", type=int, default=10,
                   help="min calls per timed sample (raised until a sample lasts >= 2 ms)")
    p.add_argument("--sweep-ppb", type=int, nargs="+",
                   help="pages per block of a full grid in place of the built-in one (turns it on; each split "
                        "keeps >= one block)")
    p.add_argument("--sweep-splits", type=int, nargs="+", help="the grid's key splits (default 1 2 4)")
    p.add_argument("--sweep-warps", type=int, nargs="+", help="the grid's warps (default 4)")
    p.add_argument("--sweep-stages", type=int, nargs="+", help="the grid's pipeline stages (default 2)")
    args = p.parse_args(argv)
    rest = (args.sweep_splits, args.sweep_warps, args.sweep_stages)
    if not args.sweep_ppb and any(rest):
        p.error("--sweep-splits / --sweep-warps / --sweep-stages need --sweep-ppb")
    args.sweep = (args.sweep_ppb, args.sweep_splits or [1, 2, 4], args.sweep_warps or [4],
                  args.sweep_stages or [2]) if args.sweep_ppb else None
    if args.quick:
        args.batches, args.contexts = [2], [64]
        args.heads, args.kv_heads, args.head_dim = 4, 2, 64
        args.iters, args.chain = 2, 1
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; H={args.heads} "
          f"Hkv={args.kv_heads} Dh={args.head_dim} page={args.page_size} {args.dtype}", flush=True)
    results = []
    for context in args.contexts:
        for batch in args.batches:
            bench_shape(args, batch, context, results)
            if args.out:                                    # partial results survive a timeout
                with open(args.out, "w") as f:
                    json.dump(dict(partial=True, results=results), f)

    print("\nbest per shape (us, TB/s):")
    for r in results:                                       # the untuned kernel as its own column
        if r["impl"] == "pallas" and all(v is None for v in r["config"].values()):
            results.append({**r, "impl": "pallas_default"})
    impls = [i for i in ("xla", "pallas", "pallas_default", "jax_builtin")
             if any(r["impl"] == i for r in results)]
    print(f"{'batch':>5} {'ctx':>5} " + " ".join(f"{i:>22}" for i in impls) + "  best pallas config")
    best = []
    for context in args.contexts:
        for batch in args.batches:
            row, cells = dict(batch=batch, context=context), []
            for impl in impls:
                ok = [r for r in results if r["impl"] == impl and r["batch"] == batch
                      and r["context"] == context and "us" in r]
                if not ok:
                    cells.append(f"{'-':>22}")
                    continue
                b = min(ok, key=lambda r: r["us"])
                row[impl] = dict(us=b["us"], tbps=b["tbps"], config=b["config"],
                                 max_abs_diff=b["max_abs_diff"])
                cells.append(f"{b['us']:>12.1f} {b['tbps']:>5.2f}TB/s")
            cfg = row.get("pallas", {}).get("config", "")
            print(f"{batch:>5} {context:>5} " + " ".join(cells) + f"  {cfg}")
            best.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind,
                           args=vars(args), results=results, best=best), f, indent=1)
        print(f"wrote {args.out}")
    errors = [r for r in results if "error" in r and r["impl"] != "jax_builtin"]
    return 1 if errors and args.quick else 0


if __name__ == "__main__":
    sys.exit(main())

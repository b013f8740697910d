"""Where does a loop pass's time go? Times variants and takes differences.

    python scripts/profile_loop_pass.py --batch 8 --context 450 --hlo-out pass.hlo.txt

Variants over the same random bf16 weights (preset shapes):
  full        model.loop over paged KV (what the engine runs)
  matmuls     only the 7 projections of every layer, in the same lax.scan
  unrolled    the same matmuls in a Python loop over static layer slices
  weights_rd  a plain reduction over every core weight (the bandwidth floor)
The optimized HLO of `full` is written out to look for copies of weights or KV.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from checkpoints.random_init import random_checkpoint  # noqa: E402
from rltjax.models.base import get_model  # noqa: E402
from rltjax.presets import preset_config  # noqa: E402
from bench_loop_pass import build_pass  # noqa: E402


def timed(fn, *args, iters=30):
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def timed_donating(compiled, params, state, kv, meta, iters=30):
    """Like timed, for the pass that donates (and so must be fed back) its KV."""
    times = []
    for i in range(iters + 3):
        t0 = time.perf_counter()
        state, kv, gate = compiled(params, state, kv, meta)
        jax.block_until_ready(gate)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def matmul_layer(x, lp):
    q = x @ lp.wq
    k = x @ lp.wk
    v = x @ lp.wv
    a = q @ lp.wo
    h = jax.nn.silu(a @ lp.w_gate) * (a @ lp.w_up)
    return x + (h @ lp.w_down) + (k + v).sum() * 0


def run(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="ouro-1.4b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=450)
    p.add_argument("--attn", default="pallas", choices=["pallas", "xla"])
    p.add_argument("--hlo-out")
    args = p.parse_args(argv)
    cfg = preset_config(args.preset)
    params = random_checkpoint(cfg, seed=0, dtype="bfloat16")
    x = jax.random.normal(jax.random.key(1), (args.batch, cfg.hidden_size), jnp.bfloat16)

    @jax.jit
    def scanned(params, x):
        return jax.lax.scan(lambda c, lp: (matmul_layer(c, lp), None), x, params.layers)[0]

    @jax.jit
    def unrolled(params, x):
        for i in range(cfg.num_layers):
            x = matmul_layer(x, jax.tree.map(lambda a: a[i], params.layers))
        return x

    @jax.jit
    def weights_rd(params):
        return sum(jnp.sum(a, dtype=jnp.float32) for a in jax.tree.leaves(params.layers))

    compiled, pass_args = build_pass(get_model(cfg), params, cfg, args.batch, args.context, 16, args.attn)
    rows = {"full": timed_donating(compiled, *pass_args), "matmuls": timed(scanned, params, x),
            "unrolled": timed(unrolled, params, x), "weights_rd": timed(weights_rd, params)}
    for name, ms in rows.items():
        print(f"{name:11s} {ms:8.3f} ms")
    if args.hlo_out:
        with open(args.hlo_out, "w") as f:
            f.write(compiled.as_text())
    return 0


if __name__ == "__main__":
    sys.exit(run())

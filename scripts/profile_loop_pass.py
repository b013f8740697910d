"""Where does a loop pass's time go? Times variants and takes differences.

    python scripts/profile_loop_pass.py --batch 8 --context 450 --hlo-out pass.hlo.txt
    python scripts/profile_loop_pass.py --batch 1 --trace-dir /tmp/tr \
        --options default "graphs:xla_gpu_graph_min_graph_size=1"

Variants over the same random bf16 weights (preset shapes):
  full        model.loop over paged KV (what the engine runs)
  matmuls     only the 7 projections of every layer, in the same lax.scan
  unrolled    the same matmuls in a Python loop over static layer slices
  fused       the unrolled matmuls with q|k|v and gate|up concatenated (4 GEMMs a layer)
  weights_rd  a plain reduction over every core weight (the bandwidth floor)
``--options NAME:key=value;key=value`` times `full` once per set of XLA compiler
options (per executable, no environment variables); ``--trace-dir`` profiles each
set's `full` pass and prints its kernel summary (benchmarks/kernel_trace.py).
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

from rltjax.checkpoints.random_init import random_checkpoint  # noqa: E402
from rltjax.entrypoints.bench import QUICK_OVERRIDES  # noqa: E402
from rltjax.entrypoints.engine_args import parse_xla_options  # noqa: E402
from rltjax.models.base import get_model  # noqa: E402
from rltjax.presets import preset_config  # noqa: E402
from bench_loop_pass import build_pass  # noqa: E402
from rltjax.profiling import format_summary, median_wall_us, summarise_dir  # noqa: E402


def timed(fn, *args, iters=30):
    """Median wall-clock ms of fn(*args) after one warm-up call."""
    jax.block_until_ready(fn(*args))
    return median_wall_us(fn, args, iters) / 1e3


def timed_donating(compiled, params, state, kv, meta, iters=30):
    """Like timed, for the pass that donates (and so must be fed back) its KV."""
    times = []
    for i in range(iters + 3):
        t0 = time.perf_counter()
        state, kv, gate = compiled(params, state, kv, meta)
        jax.block_until_ready(gate)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, (params, state, kv, meta)


def matmul_layer(x, lp):
    q = x @ lp.wq
    k = x @ lp.wk
    v = x @ lp.wv
    a = q @ lp.wo
    h = jax.nn.silu(a @ lp.w_gate) * (a @ lp.w_up)
    return x + (h @ lp.w_down) + (k + v).sum() * 0


def fused_layer(x, lp):
    qkv = x @ lp["wqkv"]
    q = qkv[:, : lp["wo"].shape[0]]
    a = q @ lp["wo"] + (qkv[:, lp["wo"].shape[0]:]).sum() * 0
    gu = a @ lp["w_gateup"]
    f = gu.shape[1] // 2
    return x + (jax.nn.silu(gu[:, :f]) * gu[:, f:]) @ lp["w_down"]


def parse_option_set(text):
    """"name:key=value;key=value" -> (name, {key: value}) with the values parsed as ``--xla-option``
    parses them; "default" -> no options."""
    name, _, body = text.partition(":")
    return name, parse_xla_options([item for item in body.split(";") if item])


def traced_passes(compiled, params, state, kv, meta, trace_dir, passes=20):
    for _ in range(3):
        state, kv, gate = compiled(params, state, kv, meta)
    jax.block_until_ready(gate)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(passes):
            state, kv, gate = compiled(params, state, kv, meta)
        jax.block_until_ready(gate)
    return format_summary(summarise_dir(trace_dir, per=passes))


def run(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="ouro-1.4b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=450)
    p.add_argument("--attn", default="pallas", choices=["pallas", "xla"])
    p.add_argument("--matmul", default="xla", choices=["pallas", "xla"], help="decode projections")
    p.add_argument("--hlo-out")
    p.add_argument("--options", nargs="+", default=["default"],
                   help='option sets for the full pass, "name:key=value;key=value"')
    p.add_argument("--trace-dir", help="profile each option set's full pass here")
    p.add_argument("--skip-micro", action="store_true", help="only the full pass")
    p.add_argument("--quick", action="store_true", help="tiny config, XLA attention (CPU smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.attn, args.context = "xla", min(args.context, 40)
    cfg = preset_config(args.preset, QUICK_OVERRIDES if args.quick else None)
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

    @jax.jit
    def fused(fused_layers, x):
        for lp in fused_layers:
            x = fused_layer(x, lp)
        return x

    for text in args.options:
        name, options = parse_option_set(text)
        t0 = time.perf_counter()
        compiled, pass_args = build_pass(get_model(cfg), params, cfg, args.batch, args.context, 16,
                                         args.attn, compiler_options=options or None, matmul=args.matmul)
        compile_s = time.perf_counter() - t0
        ms, pass_args = timed_donating(compiled, *pass_args)
        print(f"full[{name}] {ms:8.3f} ms  (compile {compile_s:.1f} s)", flush=True)
        if args.trace_dir:
            print(traced_passes(compiled, *pass_args, os.path.join(args.trace_dir, name)), flush=True)
    if args.skip_micro:
        return 0
    lay = params.layers
    fused_layers = [dict(wqkv=jnp.concatenate([lay.wq[i], lay.wk[i], lay.wv[i]], axis=1), wo=lay.wo[i],
                         w_gateup=jnp.concatenate([lay.w_gate[i], lay.w_up[i]], axis=1),
                         w_down=lay.w_down[i]) for i in range(cfg.num_layers)]
    rows = {"matmuls": timed(scanned, params, x), "unrolled": timed(unrolled, params, x),
            "fused": timed(fused, fused_layers, x), "weights_rd": timed(weights_rd, params)}
    for name, ms in rows.items():
        print(f"{name:11s} {ms:8.3f} ms")
    if args.hlo_out:
        with open(args.hlo_out, "w") as f:
            f.write(compiled.as_text())
    return 0


if __name__ == "__main__":
    sys.exit(run())

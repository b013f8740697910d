"""Time ONE loop pass of a real-shape model over paged KV (random bf16 weights).

    python scripts/bench_loop_pass.py --preset ouro-1.4b --attn pallas --out loop.json
    python scripts/bench_loop_pass.py --quick          # CPU smoke run on a tiny config

A pass = all core layers for B decode rows (each at its own context length L),
K/V written then attended through the paged backend, then the shared norm and the
exit gate: the unit of work Continuous Depth Batching schedules. The roofline is
DESIGN section 4's memory bound: (W + B*L*kv_bytes_per_position) / bandwidth.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from rltjax.checkpoints.random_init import random_checkpoint  # noqa: E402
from rltjax.models.layers import split_layer_stacks  # noqa: E402
from rltjax.cache.paged_kv import PagedKVBackend, PagedMeta  # noqa: E402
from rltjax.cache.sizing import allocate_paged_kv, kv_bytes_per_token_per_plane  # noqa: E402
from rltjax.engine.settings import auto_matmul_shapes  # noqa: E402
from rltjax.models.base import get_model  # noqa: E402
from rltjax.presets import preset_config  # noqa: E402


def build_pass(model, params, cfg, batch, context, page_size, attn, compiler_options=None, matmul="xla"):
    """A compiled one-pass function (KV donated) and its arguments: B rows at context L.
    ``compiler_options``: XLA debug options for this executable only (e.g. command buffers)."""
    pages_per_seq = -(-(context + 1) // page_size)
    num_pages = batch * pages_per_seq + 1
    kv = allocate_paged_kv(cfg, num_pages, page_size, params.embed.dtype)
    rng = np.random.default_rng(0)
    perm = 1 + rng.permutation(num_pages - 1)[: batch * pages_per_seq]
    tables = jnp.asarray(perm.reshape(batch, pages_per_seq), jnp.int32)
    positions = jnp.full((batch,), context, jnp.int32)
    meta = PagedMeta(positions=positions,
                     write_page=tables[:, context // page_size],
                     write_offset=jnp.full((batch,), context % page_size, jnp.int32),
                     row_tables=jnp.arange(batch, dtype=jnp.int32),
                     lengths=positions + 1, block_tables=tables)
    backend = PagedKVBackend(attn_impl=attn, matmul_impl=matmul, decode_rows=True,     # one row per request
                             kernel_shapes=auto_matmul_shapes(cfg), fused_kernels=True)

    def one_pass(params, state, kv, meta):
        return model.loop(params, state, None, kv, meta, backend)

    state = jax.random.normal(jax.random.key(1), (batch, cfg.hidden_size), params.embed.dtype)
    compiled = jax.jit(one_pass, donate_argnums=(2,)).lower(params, state, kv, meta).compile(
        compiler_options=compiler_options)
    return compiled, (params, state, kv, meta)


def bench_one(model, params, cfg, batch, context, page_size, attn, iters, bandwidth, matmul="xla"):
    t0 = time.perf_counter()
    compiled, (params, state, kv, meta) = build_pass(model, params, cfg, batch, context, page_size, attn,
                                                     matmul=matmul)
    compile_s = time.perf_counter() - t0
    for _ in range(3):
        state, kv, _ = compiled(params, state, kv, meta)
    jax.block_until_ready(state)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        state, kv, gate = compiled(params, state, kv, meta)
        jax.block_until_ready(gate)
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    core_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params.layers))
    kv_bytes = batch * (context + 1) * kv_bytes_per_token_per_plane(cfg, params.embed.dtype)
    bound_ms = (core_bytes + kv_bytes) / bandwidth * 1e3
    return dict(batch=batch, context=context, attn=attn, matmul=matmul, ms=ms, bound_ms=bound_ms,
                fraction_of_roofline=bound_ms / ms, compile_s=compile_s)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="ouro-1.4b")
    p.add_argument("--attn", nargs="+", default=["pallas", "xla"], choices=["pallas", "xla"])
    p.add_argument("--matmul", nargs="+", default=["xla", "auto"], choices=["auto", "pallas", "xla"],
                   help="decode projections: XLA's dot, the weight-streaming kernel for the attention "
                        "projections (auto, on GPU), or the kernel for all")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[450, 1000])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--bandwidth", type=float, default=3.3e12, help="bytes/s for the roofline")
    p.add_argument("--quick", action="store_true", help="tiny config on CPU")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.quick:
        cfg = preset_config(args.preset, {"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2,
                                          "hidden_size": 128, "intermediate_size": 256,
                                          "num_attention_heads": 2, "num_key_value_heads": 2,
                                          "head_dim": 64, "vocab_size": 512})
        args.batches, args.contexts, args.attn, args.matmul, args.iters = [2], [40], ["xla"], ["xla"], 3
    else:
        cfg = preset_config(args.preset)
    params = split_layer_stacks(random_checkpoint(cfg, seed=0, dtype="bfloat16"))   # the engine's layout
    model = get_model(cfg)
    rows = []
    for attn, matmul in [(a, m) for a in args.attn for m in args.matmul]:
        for ctx in args.contexts:
            for b in args.batches:
                r = bench_one(model, params, cfg, b, ctx, args.page_size, attn, args.iters, args.bandwidth, matmul)
                rows.append(r)
                print(f"{args.preset} attn={attn:6s} matmul={matmul:6s} B={b:<4d} L={ctx:<5d} pass {r['ms']:.3f} ms  "
                      f"bound {r['bound_ms']:.3f} ms  ({100 * r['fraction_of_roofline']:.0f}% of roofline; "
                      f"compile {r['compile_s']:.1f}s)", flush=True)
    info = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, preset=args.preset,
                page_size=args.page_size, bandwidth=args.bandwidth, results=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

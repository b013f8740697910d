"""Long-context sweep: output tok/s per (prompt length P, concurrency C) against the memory roofline.

    python scripts/bench_context_sweep.py --preset ouro-1.4b --out sweep.json               # GPU (H200)
    python scripts/bench_context_sweep.py --preset ouro-1.4b --cells 16384:16 65536:1,4 --out long.json
    python scripts/bench_context_sweep.py --quick --cells 32:1,2 64:2 --repeats 2           # CPU smoke run

On GPU, JAX's allocator takes 75% of the device unless XLA_PYTHON_CLIENT_MEM_FRACTION says
otherwise, and the KV pool gets --gpu-memory-utilization of what is free inside that: Ouro-1.4B
on an H200 gets about 31,100 pages (91 GiB). At 4 planes (last_exited) that holds 1K:1 and 1K:32,
4K:1 and 64K:1; 1K:128 (needs 108 GiB, fits 108), 4K:64 (198 GiB, fits 29), 16K:16 (194 GiB,
fits 7) and 64K:4 (192 GiB, fits 1) do not. --fit-concurrency runs those at the C that fits;
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 should bring 1K:128 in (a pool of about 116 GiB);
--kv-layout shared (1 plane, not the exact per-depth KV) fits every cell.

The protocol of the system we compare against: per cell a closed loop of 2C requests with C in
flight, random token-id prompts of P tokens, 128 output tokens each (ignore_eos), fixed depth R
(--exit-threshold 1.0); output tok/s over the timed run (prefills included) after a warm-up, as
``rltjax bench`` measures it (its ``measure``: a short warm-up loop, then the timed loop). Each cell
runs --repeats times; the median is reported with the min..max spread. One engine per P (built
once, reused by that P's cells) with max_model_len = P + output and max_num_seqs = the largest C
of that P; where P + output exceeds the model's position limit, the limit is raised by an
hf override for that engine (recorded as ``max_position_raised_to``). Results are written
after every cell, so a run cut short keeps the cells it finished. Takes every engine flag.

Memory fit, before a cell runs: a request holds planes x ceil((P + output) / page_size) pages of
the core KV pool (planes: 4 for ``last_exited`` at Ouro's R = 4, 1 for ``--kv-layout shared``). The
built engine's pool (less its scratch page) is what is available; a cell needing more is
recorded with fits=false (``--fit-concurrency`` runs it at the largest C that fits instead). Before
building, a P none of whose cells fits an upper bound of the pool (--num-pages, or the device
memory x --gpu-memory-utilization) builds no engine.

Roofline: the device's bandwidth is measured here (x + 1 over a 1 GiB bf16 array: read + write). The bound adds
to ``benchmarks.roofline``'s per-pass bytes (core weights W once + every row's KV at one plane,
R passes per output token) the head's bytes F0 (``token_weight_bytes``: lm_head, final norm, exit
gate) once per output step of the C rows, as the engine runs the head:
    tokens/s <= C / ((R * (W + C*L*kv) + F0) / bandwidth),   L = P + output / 2.
``roofline_report``'s core-only bound (no F0) is kept under ``roofline.core_only``.

Columns: P, C (``fit C`` when run at a smaller C), tok/s median [min..max] of the repeats, roofline
tok/s with head and the fraction of it reached, the reference system's tok/s (B300, best of its
stages; default cells only) and ours / theirs; then a request's mean time to its first token (its
prefill) and from there to its last (its decode), medians over the repeats, which say where a
long prompt's time goes.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.report import write_json  # noqa: E402
from benchmarks.roofline import mean_context, model_bytes, roofline_report, roofline_tokens_per_s  # noqa: E402
from benchmarks.startup import build_engine_from_args, model_config  # noqa: E402
from rltjax.entrypoints.bench import add_bench_arguments, measure  # noqa: E402
from rltjax.cache.block_tables import pages_needed  # noqa: E402

DEFAULT_CELLS = ["1024:1,32,128", "4096:1,64", "16384:16", "65536:1,4"]
# the compared system on a B300, best of its stages, output tok/s
REFERENCE = {(1024, 1): 80.6, (1024, 32): 806.1, (1024, 128): 1519.8, (4096, 1): 78.2, (4096, 64): 505.1,
             (16384, 16): 134.3, (65536, 1): 23.1, (65536, 4): 29.0}


def parse_cells(specs: list[str]) -> list[tuple[int, list[int]]]:
    """'P:C1,C2' ... -> [(P, [C1, C2]), ...] in the order given (one P may repeat)."""
    try:
        cells = [(int(p), [int(c) for c in cs.split(",")]) for p, cs in (s.split(":") for s in specs)]
    except ValueError:
        raise SystemExit(f"--cells {' '.join(specs)}: expected P:C1,C2,... e.g. 1024:1,32") from None
    if any(p < 1 or min(cs) < 1 for p, cs in cells):
        raise SystemExit("--cells: P and C must be >= 1")
    return cells


def measure_bandwidth(nbytes: int, dtype: str, passes: int = 20, calls: int = 5) -> float:
    """Read + write bytes per second of elementwise passes over an array of the model's dtype
    (bf16 on GPU): ``passes`` of them inside one call, so the call's dispatch and sync are spread
    over them; median of ``calls`` after a warm-up call."""
    import jax
    import jax.numpy as jnp
    a = jnp.ones((nbytes // jnp.dtype(dtype).itemsize,), dtype)
    # x + 1, not x + 0: XLA may simplify x + 0 away, leaving no pass over the array to time
    step = jax.jit(lambda x: jax.lax.fori_loop(0, passes, lambda _, y: y + jnp.asarray(1, y.dtype), x))
    step(a).block_until_ready()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        step(a).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * a.nbytes * passes / statistics.median(times)


def pool_bound(args, page_bytes: int) -> int | None:
    """An upper bound on the KV pool's bytes before an engine exists (None: unknown, e.g. CPU)."""
    import jax
    if args.num_pages:
        return (args.num_pages - 1) * page_bytes
    if args.kv_cache_memory_bytes:
        return args.kv_cache_memory_bytes
    stats = jax.devices()[0].memory_stats() or {}
    return int(stats["bytes_limit"] * args.gpu_memory_utilization) if "bytes_limit" in stats else None


def fit(request_bytes: int, c: int, available: int | None) -> dict:
    """Whether C requests of ``request_bytes`` fit ``available`` (None: unknown, taken to fit)."""
    largest = None if available is None else available // request_bytes
    return dict(fits=largest is None or c <= largest, kv_bytes_needed=c * request_bytes,
                kv_bytes_available=available, largest_C_that_fits=largest)


def engine_args(args, p: int, max_position: int):
    """The flags of P's engine: max_model_len P + output, the position limit raised if needed."""
    a = copy.deepcopy(args)
    a.prompt_len, a.max_model_len = p, p + args.output_len
    if a.max_model_len > max_position:
        a.hf_overrides = json.dumps({**json.loads(args.hf_overrides or "{}"),
                                     "max_position_embeddings": a.max_model_len})
    a.trace_dir = args.trace_dir and os.path.join(args.trace_dir, f"p{p}")
    return a


def engine_pool(engine, positions: int) -> tuple[int, int]:
    """(KV bytes a request of ``positions`` holds, the pool's bytes) in the built engine."""
    s, kv = engine.scheduler, engine.runner.kv
    page_bytes = 2 * kv.k.nbytes // kv.num_pages          # K and V of a page, as the engine counts it
    # the whole pool but the scratch page: C requests at full length fit it, so none is preempted
    # (admission's watermark margin may delay one; each run's preemption count shows it did not)
    return s.num_planes * pages_needed(positions, s.page_size) * page_bytes, s.blocks.usable_pages * page_bytes


def run_cell(engine, a, c: int, f: dict, mb, bandwidth: float) -> dict:
    """--repeats timed closed loops of 2C requests (``measure``), and the roofline of C rows."""
    from rltjax.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True,
                            exit_threshold=a.exit_threshold)
    a.num_requests, runs = 2 * c, []
    for _ in range(a.repeats):
        before = engine.stats().num_preemptions
        runs.append(dict(measure(engine, c, a, params), preemptions=engine.stats().num_preemptions - before))
    tps = [r["output_tokens_per_s"] for r in runs]
    med = statistics.median(tps)
    L = mean_context([a.prompt_len], [a.output_len])
    core = roofline_report(mb, c, L, None, med, bandwidth)
    # one head pass per output step of the C rows: F0 read once per C tokens
    bound = roofline_tokens_per_s(c, L, core["mean_depth"], mb.core_weight_bytes, mb.kv_bytes_per_position_per_plane,
                                  bandwidth, head_bytes=mb.token_weight_bytes)
    # a cell run at a smaller C than asked (--fit-concurrency) is not the reference's cell
    ref = REFERENCE.get((a.prompt_len, c)) if f.get("asked_C", c) == c else None
    split = {k: statistics.median(r[f"mean_{k}_s"] for r in runs) for k in ("ttft", "decode")}
    return dict(f, C=c, tokens_per_s=dict(median=med, min=min(tps), max=max(tps), repeats=tps), runs=runs,
                mean_ttft_s=split["ttft"], mean_decode_s=split["decode"],
                roofline=dict(bound_tokens_per_s=bound, fraction=med / bound, F0_bytes=mb.token_weight_bytes,
                              core_only=core),
                reference_tokens_per_s=ref, ratio_to_reference=None if ref is None else med / ref)


def run_group(args, p: int, cs: list[int], mb, bandwidth: float, emit) -> None:
    """P's cells on one engine (none built when no cell can fit)."""
    from rltjax.entrypoints.engine_args import configs_from_args
    cfg, _ = model_config(args)
    planes = configs_from_args(args)["cache_config"].num_planes(cfg.num_loops)
    page_bytes = args.page_size * mb.kv_bytes_per_position_per_plane
    bound = pool_bound(args, page_bytes)
    pre = {c: fit(planes * pages_needed(p + args.output_len, args.page_size) * page_bytes, c, bound) for c in cs}
    runnable = [c if pre[c]["fits"] else pre[c]["largest_C_that_fits"] for c in cs
                if pre[c]["fits"] or (args.fit_concurrency and pre[c]["largest_C_that_fits"])]
    if not runnable:
        for c in cs:
            emit(dict(P=p, C=c, fits_checked="before building, against an upper bound of the pool", **pre[c]))
        return
    a = engine_args(args, p, cfg.max_position)
    try:
        engine, startup = build_engine_from_args(a, max_num_seqs=max(runnable), max_model_len=a.max_model_len)
    except Exception as exc:  # noqa: BLE001 - the other prompt lengths still run; the exit status says it failed
        for c in cs:
            emit(dict(P=p, C=c, error=f"engine build: {type(exc).__name__}: {exc}"))
        return
    req_bytes, available = engine_pool(engine, p + args.output_len)
    base = dict(P=p, num_pages=engine.runner.kv.num_pages, planes=engine.scheduler.num_planes,
                compile_s=startup["compile_s"],
                max_position_raised_to=a.max_model_len if a.max_model_len > cfg.max_position else None)
    for c in cs:
        f = dict(base, **fit(req_bytes, c, available))
        run_c = c if f["fits"] else min(f["largest_C_that_fits"], max(runnable))
        if not f["fits"] and not (args.fit_concurrency and run_c):
            emit(dict(f, C=c))
            continue
        try:
            emit(run_cell(engine, a, run_c, dict(f, asked_C=c), mb, bandwidth))
        except Exception as exc:  # noqa: BLE001 - the other cells still run; the exit status says it failed
            emit(dict(f, C=c, error=f"{type(exc).__name__}: {exc}"))
    del engine
    gc.collect()        # this engine's pool and weights go before the next one is sized


def cell_line(r: dict) -> str:
    head = f"P={r['P']:<6d} C={r.get('asked_C', r['C']):<4d}"
    if "error" in r:
        return f"{head} FAILED: {r['error']}"
    if "tokens_per_s" not in r:
        return (f"{head} does not fit: needs {r['kv_bytes_needed'] / 2**20:.1f} MiB of KV, "
                f"{r['kv_bytes_available'] / 2**20:.1f} MiB available; largest C that fits {r['largest_C_that_fits']}")
    t, roof = r["tokens_per_s"], r["roofline"]
    ref = "" if r["reference_tokens_per_s"] is None else \
        f"  ref {r['reference_tokens_per_s']:8.1f}  ours/ref {r['ratio_to_reference']:.2f}"
    fitc = "" if r["C"] == r.get("asked_C", r["C"]) else f" (fit C={r['C']})"
    return (f"{head} {t['median']:9.1f} tok/s [{t['min']:.1f}..{t['max']:.1f}]  roofline "
            f"{roof['bound_tokens_per_s']:9.1f} ({100 * roof['fraction']:.1f}%){ref}{fitc}  "
            f"a request: first token {r['mean_ttft_s']:.2f} s, then {r['mean_decode_s']:.2f} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(p)      # --concurrency / --prompt-len / --num-requests are replaced by --cells
    p.add_argument("--cells", nargs="+", default=DEFAULT_CELLS, metavar="P:C1,C2",
                   help="prompt length and its concurrencies, e.g. 1024:1,32,128 4096:64")
    p.add_argument("--repeats", type=int, default=3, metavar="N", help="timed runs per cell (median, min, max)")
    p.add_argument("--fit-concurrency", action="store_true",
                   help="run a cell that does not fit at the largest C that does (marked)")
    p.set_defaults(output_len=128)
    args = p.parse_args(argv)
    # every repeat draws the same prompts (measure's seed): cached prefixes would time a later
    # repeat's prefill as free; and the roofline charges R loops a token (fixed depth)
    if args.enable_prefix_caching:
        raise SystemExit("--enable-prefix-caching: the repeats share their prompts; the sweep runs without it")
    if args.exit_threshold < 1.0:
        raise SystemExit(f"--exit-threshold {args.exit_threshold}: the sweep is at fixed depth (1.0)")
    import jax

    from rltjax.source_files import source_identity
    cells = parse_cells(args.cells)
    dev = jax.devices()[0]
    cfg, dtype = model_config(args)
    # 1 GiB on an accelerator (launch overhead negligible), 32 MiB on CPU (past the caches, quick)
    bandwidth = measure_bandwidth(2**30 if dev.platform != "cpu" else 32 * 2**20, dtype)
    mb = model_bytes(cfg, dtype)
    info = dict(device=dev.device_kind, platform=dev.platform, jax=jax.__version__, bandwidth_bytes_per_s=bandwidth,
                source=source_identity(), model=args.model or args.preset, quick=args.quick, dtype=str(dtype),
                kv_layout=args.kv_layout, output_len=args.output_len, repeats=args.repeats,
                exit_threshold=args.exit_threshold, argv=list(sys.argv[1:] if argv is None else argv), cells=[])
    print(f"[sweep] {dev.device_kind}: measured bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)

    def emit(cell: dict) -> None:
        info["cells"].append(cell)
        print(cell_line(cell), flush=True)
        if args.out:
            write_json(args.out, info)

    for prompt_len, cs in cells:
        run_group(args, prompt_len, cs, mb, bandwidth, emit)
    return 1 if any("error" in c for c in info["cells"]) else 0


if __name__ == "__main__":
    sys.exit(main())

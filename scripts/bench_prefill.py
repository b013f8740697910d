"""Choose the prefill attention path by measurement: the flash-style prefill kernel
(``kernels.prefill_attention``, aligned query blocks) vs the per-row decode kernel vs the
XLA reference, on engine-shaped prefill batches at Ouro-1.4B shapes (16 heads x 128,
bf16, page 16).

    python scripts/bench_prefill.py --out prefill.json       # on a GPU
    python scripts/bench_prefill.py --block-q 32 --program-rows 32 64 --num-stages 2 3
    python scripts/bench_prefill.py --quick                  # CPU smoke run (interpret mode)
    python scripts/bench_prefill.py --cases 512@65024 4096@61440 --program-rows 64 128   # long prefixes

A case is a list of chunks (prefix already in the cache, chunk length): every chunk's
rows are consecutive positions of one sequence, starting at a block-aligned row, as the
engine lays them out. Each prefill-kernel column is one launch: block_q (the layout's
aligned blocks), program_rows (rows a program takes; a multiple of block_q) and stages
(None: the kernel's defaults). Timings: median microseconds per call (bench_attention's
chained timing). "speed-up" is per-row decode kernel time / the best prefill launch's, and
TFLOP/s (per launch in the JSON, the best launch's in the table) the rate counting each row's
visible keys (4 x heads x head_dim flops a query-key pair: QK^T and PV). ``--cases`` replaces
the built-in cases with chunks written LEN@PREFIX, a case's chunks joined by commas
("256@0,256@0"); --no-baselines leaves out the per-row kernel and XLA, whose reference gathers
each row's whole table (terabytes at 64K keys): each launch's error is then against the first
launch's output.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_attention import max_diff, time_us  # noqa: E402
from benchmarks.report import write_json  # noqa: E402
from rltjax.kernels.paged_attention_ref import paged_attention_ref  # noqa: E402
from rltjax.kernels.prefill_attention import paged_prefill_attention_pallas  # noqa: E402
from rltjax.kernels.paged_attention_pallas import paged_attention_pallas  # noqa: E402
from rltjax.kernels.triton_common import is_pow2  # noqa: E402

CASES = {  # name: [(prefix, chunk length)]
    "4x256 @0": [(0, 256)] * 4,         # bench_cdb's prompts, one 1,024-token step
    "8x128 @0": [(0, 128)] * 8,
    "12x85 @0": [(0, 85)] * 12,         # about ShareGPT's mean prompt
    "16x32 @0": [(0, 32)] * 16,
    "1x128 @0": [(0, 128)],
    "1x128 @1920": [(1920, 128)],
    "2x128 @0,@896": [(0, 128), (896, 128)],
    "1x256 @3840": [(3840, 256)],
    "8x32 @224": [(224, 32)] * 8,
    "2x1024 @0,@1024": [(0, 1024), (1024, 1024)],
}
QUICK_CASES = {"2x12": [(0, 12), (20, 12)]}


def make_case(chunks, num_heads, head_dim, page_size, dtype, align, seed=0):
    rng = np.random.default_rng(seed)
    pages = [-(-(p + n) // page_size) for p, n in chunks]
    num_pages = sum(pages) + 1
    perm = 1 + rng.permutation(num_pages - 1)
    tables = np.zeros((len(chunks), max(pages)), np.int32)
    at = 0
    for i, n in enumerate(pages):
        tables[i, :n] = perm[at:at + n]
        at += n
    row_tables, lengths = [], []
    for i, (p, n) in enumerate(chunks):
        pad = -len(row_tables) % align
        row_tables += [0] * pad + [i] * n
        lengths += [0] * pad + list(range(p + 1, p + n + 1))
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(k1, (len(lengths), num_heads, head_dim), dtype)
    kp = jax.random.normal(k2, (num_heads, num_pages, page_size, head_dim), dtype)
    vp = jax.random.normal(k3, (num_heads, num_pages, page_size, head_dim), dtype)
    return q, kp, vp, jnp.asarray(tables), jnp.asarray(row_tables, jnp.int32), jnp.asarray(lengths, jnp.int32)


def parse_case(spec: str) -> list[tuple[int, int]]:
    """"LEN@PREFIX[,LEN@PREFIX...]" -> [(prefix, chunk length), ...]."""
    try:
        chunks = [tuple(int(v) for v in c.split("@")[::-1]) for c in spec.split(",")]
    except ValueError:
        chunks = []
    if not chunks or any(len(c) != 2 or c[0] < 0 or c[1] < 1 for c in chunks):
        raise SystemExit(f"--cases {spec!r}: expected LEN@PREFIX[,LEN@PREFIX...], e.g. 512@65024")
    return chunks


def attention_flops(chunks, heads: int, head_dim: int) -> int:
    """QK^T and PV over each row's visible keys (the prefix and the chunk's rows up to it)."""
    keys = sum(n * p + n * (n + 1) // 2 for p, n in chunks)
    return 4 * heads * head_dim * keys


@dataclasses.dataclass(frozen=True)
class Launch:
    """One prefill-kernel launch (None: the kernel's default)."""
    block_q: int
    program_rows: int | None = None
    num_stages: int | None = None
    num_warps: int | None = None
    block_k: int | None = None
    key_splits: int | None = None

    @property
    def name(self) -> str:
        """Its column: bq32 (the kernel's defaults otherwise), bq32_rows64_s3_w8_k128, ..."""
        parts = [f"bq{self.block_q}"] + [f"{tag}{v}" for tag, v in (("rows", self.program_rows), ("s", self.num_stages),
                                                                   ("w", self.num_warps), ("k", self.block_k),
                                                                   ("split", self.key_splits)) if v]
        return "_".join(parts)

    def kwargs(self, page_size: int) -> dict:
        kw = dict(block_q=self.block_q, program_rows=self.program_rows, num_stages=self.num_stages,
                  pages_per_block=self.block_k // page_size if self.block_k else None)
        return kw | {k: v for k, v in (("num_warps", self.num_warps), ("key_splits", self.key_splits)) if v}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes, interpret mode (CPU)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--block-q", type=int, nargs="+", default=[32])
    p.add_argument("--program-rows", type=int, nargs="+", default=[None],
                   help="rows a program takes (a multiple of block_q; default: the kernel's)")
    p.add_argument("--num-stages", type=int, nargs="+", default=[None], help="default: the kernel's")
    p.add_argument("--num-warps", type=int, nargs="+", default=[None], help="default: the kernel's")
    p.add_argument("--block-k", type=int, nargs="+", default=[None],
                   help="keys an inner iteration takes (a power-of-two number of pages; default: the kernel's)")
    p.add_argument("--key-splits", type=int, nargs="+", default=[None],
                   help="programs a row block's keys are split over (default: the kernel's, 1)")
    p.add_argument("--cases", nargs="+", metavar="LEN@PREFIX[,...]", help="cases to run instead of the built-in")
    p.add_argument("--no-baselines", action="store_true", help="time only the prefill kernel's launches")
    p.add_argument("--out")
    args = p.parse_args(argv)
    page_size = 8 if args.quick else 16
    if any(v is not None and v < 1 for v in args.num_warps + args.key_splits + args.num_stages):
        p.error("--num-warps, --key-splits and --num-stages take values >= 1")
    if any(k is not None and (k < 16 or k % page_size or not is_pow2(k // page_size)) for k in args.block_k):
        p.error(f"--block-k: at least 16 keys, a power-of-two number of {page_size}-key pages")
    launches = [Launch(*x) for x in itertools.product(args.block_q, args.program_rows, args.num_stages,
                                                       args.num_warps, args.block_k, args.key_splits)
                if x[1] is None or (x[1] >= x[0] and is_pow2(x[1]))]
    if not launches:
        p.error("no launch left: a --program-rows must be a power of two >= a --block-q")
    return args, launches


def run_case(name: str, chunks, launches, args, shape) -> dict:
    """One case's timings: the baselines (unless --no-baselines), then every launch, each with
    its error (to the reference, else to the first launch) and TFLOP/s."""
    heads, head_dim, page_size, dtype = shape
    interpret = args.quick
    iters, chain = (1, 1) if args.quick else (args.iters, 5)
    case = make_case(chunks, heads, head_dim, page_size, dtype, max(args.block_q))
    ref = None if args.no_baselines else jax.jit(paged_attention_ref)(*case)
    row = dict(case=name, chunks=chunks, rows=int(case[0].shape[0]))
    flops = attention_flops(chunks, heads, head_dim)
    if not args.no_baselines:
        per_row = functools.partial(paged_attention_pallas, interpret=interpret)
        row["per_row_us"] = time_us(per_row, case, iters, chain)
        row["per_row_err"] = max_diff(per_row(*case), ref)
        if not args.quick or name in QUICK_CASES:
            row["xla_us"] = time_us(paged_attention_ref, case, iters, chain)
    for launch in launches:
        fn = functools.partial(paged_prefill_attention_pallas, interpret=interpret, **launch.kwargs(page_size))
        us = row[f"prefill_{launch.name}_us"] = time_us(fn, case, iters, chain)
        row[f"prefill_{launch.name}_tflops"] = flops / us / 1e6
        out = fn(*case)
        ref = out if ref is None else ref
        row[f"prefill_{launch.name}_err"] = max_diff(out, ref)
    best = min(row[f"prefill_{x.name}_us"] for x in launches)
    row["tflops"] = flops / best / 1e6
    if "per_row_us" in row:
        row["speedup_vs_per_row"] = row["per_row_us"] / best
    return row


def print_table(rows, launches, device: str) -> None:
    names = [x.name for x in launches]
    width = max(9, *(len(n) + 2 for n in names))
    first = max(18, *(len(r["case"]) + 2 for r in rows))
    print(f"\n{'case':<{first}}{'rows':>6}{'XLA ref':>10}{'per-row':>10}" + "".join(f"{n:>{width}}" for n in names)
          + f"{'speed-up':>10}{'TFLOP/s':>9}   (us; {device}; TFLOP/s: the best launch's)")
    nan = float("nan")
    for r in rows:
        print(f"{r['case']:<{first}}{r['rows']:>6}{r.get('xla_us', nan):>10.1f}{r.get('per_row_us', nan):>10.1f}"
              + "".join(f"{r[f'prefill_{n}_us']:>{width}.1f}" for n in names)
              + f"{r.get('speedup_vs_per_row', nan):>9.2f}x{r['tflops']:>9.1f}")


def main(argv=None) -> int:
    args, launches = parse_args(argv)
    shape = (2, 64, 8, jnp.float32) if args.quick else (16, 128, 16, jnp.bfloat16)
    cases = {c: parse_case(c) for c in args.cases} if args.cases else QUICK_CASES if args.quick else CASES
    info = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, heads=shape[0], head_dim=shape[1],
                page_size=shape[2], dtype=jnp.dtype(shape[3]).name,
                argv=list(sys.argv[1:] if argv is None else argv), results=[])
    rows = info["results"]
    for name, chunks in cases.items():
        rows.append(run_case(name, chunks, launches, args, shape))
        print(json.dumps(rows[-1]), flush=True)
        if args.out:        # after every case: a run cut short keeps the cases it finished
            write_json(args.out, info)
    print_table(rows, launches, info["device"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Offline engine throughput at fixed concurrency (random weights, token-id prompts).

    python scripts/bench_throughput.py --preset ouro-1.4b --concurrency 1 8 32 --out thr.json   # GPU
    python scripts/bench_throughput.py --quick --concurrency 1 4 --prompt-len 16 --output-len 8  # CPU

The same as ``rltjax bench`` (rltjax/entrypoints/bench.py), runnable from a checkout
without installing the package; it takes every engine flag of ``rltjax generate``.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rltjax.entrypoints.bench import add_bench_arguments, run_bench  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(p)
    return run_bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

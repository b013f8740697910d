"""Offline throughput of ``LLM.generate`` on the ShareGPT V3 workload (the serving benchmark's requests).

    python scripts/bench_offline.py --preset ouro-1.4b --max-num-seqs 32 --num-requests 500   # GPU
    python scripts/bench_offline.py --quick --num-requests 6 --max-num-seqs 4 \
        --max-prompt-len 48 --max-output-len 8                                                  # CPU smoke run

The logic lives in ``benchmarks.offline``; see its docstring and ``--help``.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.offline import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

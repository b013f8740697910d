"""The KV memory manager's benchmark: prefix caching on and off, incremental pages against
lifetime reservation, preemption under memory pressure.

    python scripts/bench_memory.py --quick --max-num-seqs 8 --num-requests 32     # CPU, tiny model
    python scripts/bench_memory.py --preset ouro-1.4b --max-num-seqs 64 --num-requests 512

The logic lives in ``benchmarks.memory``; see its docstring and ``--help``.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.memory import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

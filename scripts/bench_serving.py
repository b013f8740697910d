"""Serving benchmark on the ShareGPT V3 workload (closed-loop clients at concurrency C).

    rltjax serve MODEL_DIR --max-num-seqs 64 &            # a server, started separately
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --model MODEL_DIR --concurrency 1 8 32
    python scripts/bench_serving.py --in-process --preset ouro-1.4b --concurrency 1 8 32     # GPU, no server
    python scripts/bench_serving.py --in-process --quick --num-requests 8 --concurrency 1 4 \
        --max-prompt-len 48 --max-output-len 8                                               # CPU smoke run
    python scripts/bench_serving.py --write-random-model /tmp/ouro-1.4b-random --preset ouro-1.4b

Requests send ``ignore_eos``, so a server needs no special flag. The logic lives
in ``benchmarks.serving``; see its docstring and ``--help``.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

if "--base-url" in sys.argv or any(a.startswith("--base-url=") for a in sys.argv):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")   # a client must not take GPU memory from the server

from benchmarks.serving import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

"""One process of a two-process job (``test_parallel.py``): join jax.distributed, then run
parallel_worker's workload over every device of the job, as JSON on stdout."""
from __future__ import annotations

import json
import sys

from rltjax.engine import multihost

if __name__ == "__main__":
    pid, port, name = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    multihost.initialize(f"127.0.0.1:{port}", 2, pid)
    import jax
    import parallel_worker
    print(json.dumps(parallel_worker.run(name, len(jax.devices()), 1, 0, False)))

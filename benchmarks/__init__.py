"""Serving and offline benchmarks on the ShareGPT V3 workload.

- ``dataset``: ShareGPT loading (incremental JSON, stops at the first broken
  record) and seeded request sampling through a ``grain`` pipeline;
- ``bench_tokenizer``: the tokenizer that measures lengths (a real one from a
  model directory, or a byte-level BPE trained on ShareGPT and cached);
- ``metrics``: TTFT / TPOT / ITL / end-to-end statistics from token timestamps;
- ``roofline``: DESIGN section 4's memory-bound tokens/s limit;
- ``clients``: closed-loop load generators (HTTP streaming, in-process engine);
- ``startup``: time to ready, cold and with a warm compilation cache;
- ``report``: environment, JSON and PNG output;
- ``workload``: the flags and set-up the two benchmarks share;
- ``random_model``: a random-weight model directory at a preset's shape, for ``rltjax serve``;
- ``serving`` / ``offline``: the command lines behind ``scripts/bench_serving.py``
  and ``scripts/bench_offline.py``.
"""

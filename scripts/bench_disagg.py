"""Prefill/decode disaggregation on this machine's CPUs: how fast a prompt's KV moves, and how
much of it moves while the prompt still runs.

    python scripts/bench_disagg.py                       # the tiny Ouro fixture, 1 prefill + 1 decode worker

Requests arrive one at a time (nothing else shares the workers). For each, with pages streamed
as they complete and with every page moved once the first token is out: the prefill seconds on
the prefill worker, the transfer seconds after its first token (from the decode worker's pull
of the rest until the request is queued there), the bytes moved in all and of them while the
prompt ran, and the end-to-end time to the second token.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


def run(model: str, configs: dict, prompts, stream: bool) -> dict:
    from rltjax.disagg.coordinator import DisaggEngine
    from rltjax.sampling_params import SamplingParams
    engine = DisaggEngine(model, configs, num_prefill=1, num_decode=1, stream_pages=stream)
    try:
        sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        rows = []
        for i, p in enumerate([prompts[0]] + prompts):          # the first request: first calls
            engine.take_stage_timings()
            bytes0, streamed0 = engine.transfer_bytes, engine.streamed_bytes
            t0 = time.perf_counter()
            engine.add_request(f"r{i}", p, sp)
            while engine.has_unfinished_requests():
                engine.step()
            e2e = time.perf_counter() - t0
            stages = dict(engine.take_stage_timings()[0])
            rows.append(dict(prefill=stages.get("prefill"), transfer=stages.get("transfer"), e2e=e2e,
                             bytes=engine.transfer_bytes - bytes0, streamed=engine.streamed_bytes - streamed0))
        return {k: float(np.median([r[k] for r in rows[1:]])) for k in rows[0]}
    finally:
        engine.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "ouro-tiny"))
    ap.add_argument("--prompt-len", type=int, default=480)
    ap.add_argument("--chunk", type=int, default=64, help="prefill chunk (tokens a step)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--requests", type=int, default=5)
    args = ap.parse_args(argv)
    from rltjax.engine_config import CacheConfig, ExecutionConfig, ExitConfig, SchedulerConfig
    configs = dict(dtype="float32", cache_config=CacheConfig(page_size=args.page_size, num_pages=512),
                   scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=args.chunk,
                                                    prefill_chunk_size=args.chunk, max_model_len=args.prompt_len + 8),
                   exit_config=ExitConfig(mode="fixed"),
                   execution_config=ExecutionConfig(compile_ahead=True, show_progress=False))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, args.prompt_len).tolist() for _ in range(args.requests)]
    print(f"{args.requests} requests of {args.prompt_len} prompt tokens, {args.chunk}-token prefill chunks, "
          f"1 prefill + 1 decode worker (medians)")
    for stream in (False, True):
        r = run(args.model, configs, prompts, stream)
        label = "pages as they complete" if stream else "pages after the first token"
        tail = r["bytes"] - r["streamed"]           # what moved after the first token
        print(f"{label:28s}: prefill {r['prefill'] * 1e3:7.1f} ms, then {tail / 1e6:.2f} MB in "
              f"{r['transfer'] * 1e3:6.1f} ms until the decode worker queued it (pull, assembly, import: "
              f"{tail / 1e6 / max(r['transfer'], 1e-9):.0f} MB/s); {r['streamed'] / 1e6:.2f} MB moved while the prompt "
              f"ran; 2 tokens end to end {r['e2e'] * 1e3:.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run in a subprocess with several CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=4``):
one fixture's greedy and sampled outputs at each (tensor, data) parallel size, as JSON on stdout.
``test_parallel.py`` compares them."""
from __future__ import annotations

import json
import sys

import jax

from conftest import load_fixture
from engine_helpers import assert_all_pages_free, run_workload
from rltjax.config_checks import EngineConfigError
from rltjax.engine_config import CacheConfig, ExecutionConfig, ExitConfig, SchedulerConfig, SpeculativeConfig
from rltjax.entrypoints.llm import build_engine
from rltjax.parallel import ParallelConfig
from rltjax.sampling_params import SamplingParams

PROMPTS = [[5, 9, 17], [3, 41, 8, 22], [60, 7, 12, 31, 2], [19, 44, 5, 6, 70, 13], [9, 1, 4], [33, 34, 35, 36],
           [(7 * i) % 250 + 3 for i in range(60)]]      # 8 prefill chunks: several steps that read nothing


def arrivals():
    return [(i // 2, f"r{i}", p, SamplingParams(max_tokens=9, temperature=0.0 if i % 2 == 0 else 0.8, seed=i,
                                                exit_threshold=0.5 if i < 3 else 1.0, ignore_eos=True, logprobs=1))
            for i, p in enumerate(PROMPTS)]


def run(name: str, tp: int, dp: int, window: int, abort: bool, pallas: bool = False, layout: str = "last_exited",
        exit_mode: str = "ouro", store: str | None = None, spec: bool = False) -> dict:
    """pallas: the Pallas attention kernels in interpret mode (under TP: one per device, shard_map),
    on test_engine_kernels' small Ouro (head_dim 64, the kernels' smallest; ``name`` unused)."""
    overrides = {"state_init": "zero"} if name.startswith("huginn") else {}
    if pallas:
        cfg, params, heads = _small_ouro_counting()
    else:
        ckpt = load_fixture(name, "float32", tuple(overrides.items()))
        cfg, params, heads = ckpt.cfg, ckpt.params, []
    try:
        engine = build_engine(None, params=params, cfg=cfg, parallel_config=ParallelConfig(tp, dp),
                              cache_config=CacheConfig(page_size=8 if pallas else 4, num_pages=128, kv_layout=layout),
                              scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                                               prefill_chunk_size=8),
                              exit_config=ExitConfig(mode=exit_mode),
                              execution_config=ExecutionConfig(compile_ahead=store is not None, show_progress=False,
                                                               compilation_cache_dir=store,
                                                               decode_window=window,
                                                               attn_impl="pallas" if pallas else "auto",
                                                               interpret=pallas),
                              speculative_config=SpeculativeConfig(2, 2) if spec else None)
    except EngineConfigError as exc:
        return {"error": str(exc)}
    placed = []
    if dp > 1:     # which replica each request went to (routing), captured as they arrive
        add = engine.add_request
        engine.add_request = lambda rid, *a: placed.append(add(rid, *a))
    outs = run_workload(engine, arrivals(), aborts={3: "r1"} if abort else None)
    replicas = engine.replicas if dp > 1 else [engine]
    for e in replicas:
        assert_all_pages_free(e)
    kv = replicas[0].runner.kv.k
    return {"outputs": {rid: {"tokens": o.token_ids, "depths": o.exit_depths, "finish": o.finish_reason,
                              "logprobs": [max(d.values()) for d in (o.logprobs or [])]} for rid, o in outs.items()},
            "placed": placed, "kv_devices": len(kv.sharding.device_set),
            "kv_shard_heads": int(kv.addressable_shards[0].data.shape[1]), "kernel_heads": sorted(set(heads))}


def _small_ouro_counting():
    """A model the kernels take, and the head counts each kernel call saw (q | k | v merged)."""
    from rltjax.checkpoints.random_init import random_checkpoint
    from rltjax.kernels import paged_attention_pallas
    from rltjax.presets import preset_config
    from test_engine_kernels import SMALL
    heads, real = [], paged_attention_pallas.paged_attention_pallas
    paged_attention_pallas.paged_attention_pallas = lambda q, *a, **k: heads.append(q.shape[1]) or real(q, *a, **k)
    cfg = preset_config("ouro-1.4b", SMALL)
    return cfg, random_checkpoint(cfg, seed=1, dtype="float32"), heads


if __name__ == "__main__":
    name, window, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    store = mode.split(":", 1)[1] if mode.startswith("store:") else None
    layout, exit_mode = (mode.split(":")[1:] + ["last_exited", "ouro"])[:2] if mode.startswith("cfg:") else (
        "last_exited", "fixed" if mode == "spec" else "ouro")
    sizes = [tuple(map(int, s.split("x"))) for s in sys.argv[4:]]
    assert jax.device_count() >= 4, jax.devices()
    print(json.dumps({f"{tp}x{dp}": run(name, tp, dp, window, mode == "abort", mode == "pallas", layout, exit_mode,
                                        store, mode == "spec") for tp, dp in sizes}))

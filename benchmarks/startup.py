"""Building the benchmarked engine, and timing start-up to ready.

Start-up = weights (random at a preset's shape, or loaded) + ahead-of-time
compilation of every bucket. It is timed in fresh child processes, so that no
in-memory jit cache of the parent helps: first with an empty temporary
compilation cache directory (cold), then again with the same directory (warm:
XLA executables come from the persistent cache). ``python -m
benchmarks.startup ARGS`` is the child; it prints one JSON line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rltjax.entrypoints.engine_args import add_engine_arguments, configs_from_args, hf_overrides_from_args

ROOT = Path(__file__).resolve().parents[1]


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--model / --preset / --quick, plus every engine flag of ``rltjax serve``."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="model directory (weights are loaded)")
    src.add_argument("--preset", default="ouro-1.4b", help="random weights at a named model's shape")
    p.add_argument("--quick", action="store_true", help="shrink the preset to a tiny config (CPU smoke runs)")
    add_engine_arguments(p)


def add_trace_argument(p) -> None:
    p.add_argument("--trace-depth-probs", type=float, nargs="+", default=None, metavar="P",
                   help="replay a drawn exit trace: each decode token's depth is drawn (seeded by --seed) with "
                        "probability P1..PR of depth 1..R, e.g. 0.25 0.25 0.25 0.25 (mean 2.5); in-process only")


def model_config(args):
    """(ModelConfig, parameter dtype name) of the benchmarked model, without loading weights."""
    from rltjax.entrypoints.bench import preset_config_from_args
    if args.model:
        from rltjax.config import parse_hf_config
        hf = json.loads((Path(args.model) / "config.json").read_text())
        return parse_hf_config(hf, hf_overrides_from_args(args)), args.dtype or hf.get("torch_dtype") or "bfloat16"
    cfg = preset_config_from_args(args)
    return cfg, args.dtype or ("float32" if args.quick else "bfloat16")


def build_engine_from_args(args, *, max_num_seqs: int, max_model_len: int, cache_dir: str | None = None,
                           exit_config=None):
    """An LLMEngine for the benchmark, and its start-up times (seconds). ``exit_config``
    replaces the flags' (a drawn trace)."""
    import jax

    from rltjax.checkpoints.random_init import random_checkpoint
    from rltjax.entrypoints.llm import build_engine, setup_compilation_cache

    configs = configs_from_args(args)
    if exit_config is not None:
        configs["exit_config"] = exit_config
    configs["scheduler_config"] = dataclasses.replace(configs["scheduler_config"], max_num_seqs=max_num_seqs,
                                                      max_model_len=args.max_model_len or max_model_len)
    if cache_dir is not None:
        configs["execution_config"] = dataclasses.replace(configs["execution_config"],
                                                          compilation_cache_dir=cache_dir or None)
    t0 = time.perf_counter()
    if args.model:
        engine = build_engine(args.model, **configs)
    else:
        cfg, dtype = model_config(args)
        # the random weights stand in for loading a checkpoint; their draw's compile comes from
        # the persistent cache in a warm start, as every engine executable's does
        setup_compilation_cache(configs["execution_config"].compilation_cache_dir)
        # no reference kept here: the engine keeps one (split) copy of the weights
        engine = build_engine(None, params=jax.block_until_ready(random_checkpoint(cfg, seed=0, dtype=dtype)),
                              cfg=cfg, **{k: v for k, v in configs.items() if k not in ("dtype", "hf_overrides")})
    ready = time.perf_counter() - t0
    sched = engine.scheduler
    return engine, dict(ready_s=ready, compile_s=engine.compile_seconds, weights_and_setup_s=ready -
                        engine.compile_seconds, compile_ahead=configs["execution_config"].compile_ahead,
                        executables=engine.warm_up.executables if engine.warm_up else 0,
                        compiled_late=engine.warm_up.compiled_late if engine.warm_up else 0,
                        loaded_from_store=engine.warm_up.loaded if engine.warm_up else 0,
                        saved_to_store=engine.warm_up.stored if engine.warm_up else 0,
                        from_xla_cache=engine.warm_up.from_xla_cache if engine.warm_up else 0,
                        compile_phases=engine.warm_up.phase_seconds if engine.warm_up else {},
                        lower_seconds_by_kind=engine.warm_up.lower_seconds_by_kind if engine.warm_up else {},
                        engine=dict(max_num_seqs=sched.config.max_num_seqs, max_model_len=sched.max_model_len,
                                    num_pages=sched.allocator.num_pages, page_size=sched.page_size,
                                    num_planes=sched.num_planes, kv_layout=engine.settings.kv_layout,
                                    max_num_batched_tokens=sched.config.max_num_batched_tokens,
                                    prefill_chunk_size=sched.config.prefill_chunk_size,
                                    exit_mode=engine.settings.exit_config.mode,
                                    dtype=str(engine.runner.params.embed.dtype),
                                    projection_kernels=projection_kernels(engine.settings),
                                    attention_kernels=engine.settings.attention_kernel))


def projection_kernels(settings) -> str:
    """What the decode projections run on, as resolved: the kernels' backend where every decode
    batch's projections run on them, "xla" where none do, "mixed" otherwise (matmul_impl
    pallas at shapes "auto" would leave on XLA)."""
    backend = settings.decode_backend
    if settings.projections_on_kernels:
        return backend.kernel_backend
    return "mixed" if backend.matmul_impl == "pallas" else "xla"


def _child(argv: list[str], cache_dir: str, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.startup", *argv, "--compilation-cache-dir", cache_dir]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"start-up child failed ({res.returncode}): {res.stderr[-2000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["process_wall_s"] = wall   # interpreter start + imports + ready
    return out


def measure_startup(argv: list[str], cache_dir: str, timeout: float = 3600.0) -> dict:
    """Cold then warm start-up of the engine ``argv`` describes (model and engine flags).

    ``cache_dir`` must be an empty directory; it holds the warm cache afterwards.
    """
    if any(Path(cache_dir).iterdir()):
        raise ValueError(f"{cache_dir} is not empty: a cold start needs an empty compilation cache")
    cold = _child(argv, cache_dir, timeout)
    entries = sum(1 for p in Path(cache_dir).iterdir() if p.name != "executables")   # XLA's own
    warm = _child(argv, cache_dir, timeout)
    return dict(cold=cold, warm=warm, cache_entries=entries,
                note="fresh child processes; cold = empty temporary compilation cache, warm = the same "
                     "cache directory again (XLA's cache, and the engine's executable store in its "
                     "'executables' folder unless --no-executable-cache)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="time one engine start-up (child of measure_startup)",
                                allow_abbrev=False)
    add_model_arguments(p)
    add_trace_argument(p)
    args, _ = p.parse_known_args(argv)
    exit_config = None
    if args.trace_depth_probs:   # the trace-replay executables; no request runs here
        from rltjax.engine_config import ExitConfig
        exit_config = ExitConfig(mode="trace", depths_by_request={})
    _, info = build_engine_from_args(args, max_num_seqs=args.max_num_seqs,
                                     max_model_len=args.max_model_len or 2048, exit_config=exit_config)
    print(json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

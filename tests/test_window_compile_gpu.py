"""On the GPU, a decode window at full size compiles without XLA's rematerialization pass.

With the pass on, XLA sized an H200 engine's window program without the donated KV pool's
aliasing (the pool counted three times against its memory limit) and recomputed small values
in it; a recomputed standby take placed one request in two rows on an H200. The engine turns
the pass off on GPUs
(``jit_options.GPU_DEFAULT_OPTIONS``). This compiles the window as served, Ouro-1.4B shapes
with the pool sized from free memory as ``rltjax serve`` sizes it, and reads its optimized
HLO: no instruction may carry the pass's ``.remat`` suffix. The same window compiled without
the engine's options must still have them: otherwise this check could not see the pass on
this XLA (and the workaround may be obsolete). Skipped without a GPU; the window is compiled,
not run.
"""
from __future__ import annotations

import gc

import pytest

from rltjax.checkpoints.random_init import random_checkpoint
from rltjax.engine.device_steps import DeviceSteps
from rltjax.engine.warm_up import bucket_jobs
from rltjax.engine_config import ExecutionConfig, SchedulerConfig
from rltjax.entrypoints.llm import build_engine
from rltjax.presets import preset_config

pytestmark = pytest.mark.gpu


class _Compiled(Exception):
    """Stops a window call once its executable is compiled: the test needs its text only."""


def window_hlo(engine, steps: DeviceSteps, sampler: str = "greedy") -> str:
    """The optimized HLO of the largest window bucket's executable under ``steps``."""
    runner, texts = engine.runner, []

    def compile_only(*args, **kwargs):
        texts.append(steps.window.lower(*args, **kwargs).compile().as_text())
        raise _Compiled

    served = runner.steps
    runner.steps = steps._replace(window=compile_only)
    [job] = [job for job in bucket_jobs(runner, engine.batches) if job.kind == "window"
             and job.size == engine.settings.window.buckets[-1] and job.sampler == sampler]
    try:
        with pytest.raises(_Compiled):
            job.run()
    finally:
        runner.steps = served
    return texts[0]


def test_full_size_window_compiles_without_remat():
    cfg = preset_config("ouro-1.4b")
    engine = build_engine(None, params=random_checkpoint(cfg, seed=0, dtype="bfloat16"), cfg=cfg,
                          scheduler_config=SchedulerConfig(max_num_seqs=64, max_model_len=2048),
                          execution_config=ExecutionConfig(compile_ahead=False, show_progress=False,
                                                           compilation_cache_dir=None))
    try:
        pool_gib = engine.runner.kv.k.nbytes * 2 / 2**30
        assert pool_gib > 40, f"the pool is {pool_gib:.1f} GiB: not the full-size case this test is for"
        served = window_hlo(engine, engine.runner.steps)
        assert ".remat" not in served, "the served window still has rematerialized instructions"
        without = window_hlo(engine, DeviceSteps.build(()))
        assert without.count(".remat") > 0, ("without the engine's options XLA's remat pass left no trace: the "
                                             "check cannot see it on this XLA (is the workaround still needed?)")
    finally:
        del engine
        gc.collect()

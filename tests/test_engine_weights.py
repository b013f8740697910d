"""The engine holds one copy of the weights, per layer: built from a checkpoint directory,
the loaded stacked arrays are gone once it is ready (the KV pool is sized without them), each
layer's q / k / v are one fused weight (not also held apart), and only its decode backend
fuses the K/V write into attention."""
from __future__ import annotations

import gc
import weakref

import jax

import rltjax.entrypoints.llm as llm_module
from conftest import FIXTURES
from rltjax.engine_config import CacheConfig, ExecutionConfig, SchedulerConfig
from rltjax.models.layers import SplitLayers


def test_engine_from_a_checkpoint_keeps_only_the_split_weights(monkeypatch):
    loaded = []
    real_load = llm_module.load_checkpoint

    def recording_load(*args, **kwargs):
        ckpt = real_load(*args, **kwargs)
        loaded.extend(weakref.ref(leaf) for leaf in jax.tree.leaves(ckpt.params.layers))
        return ckpt

    alive_at_sizing = []
    real_sizing = llm_module.plan_memory

    def recording_sizing(*args, **kwargs):     # the KV pool is sized from the free memory now
        gc.collect()
        alive_at_sizing.append(sum(ref() is not None for ref in loaded))
        return real_sizing(*args, **kwargs)    # no memory statistics on CPU: the engine falls back

    monkeypatch.setattr(llm_module, "load_checkpoint", recording_load)
    monkeypatch.setattr(llm_module, "plan_memory", recording_sizing)
    engine = llm_module.build_engine(
        str(FIXTURES / "ouro-tiny"), dtype="float32", cache_config=CacheConfig(page_size=8),
        scheduler_config=SchedulerConfig(max_num_seqs=2),
        execution_config=ExecutionConfig(compile_ahead=False, compilation_cache_dir=None, show_progress=False))
    assert alive_at_sizing == [0], "stacked layer arrays in memory while the KV pool was sized"
    gc.collect()
    assert loaded and all(ref() is None for ref in loaded), "a stacked layer array outlived the start-up"
    assert isinstance(engine.runner.params.layers, SplitLayers)
    cfg = engine.cfg
    for layer in engine.runner.params.layers.layers:     # q | k | v as one weight, not also apart
        assert layer.wq is None and layer.wk is None and layer.wv is None
        assert layer.wqkv.shape == (cfg.hidden_size, cfg.q_width + 2 * cfg.kv_width)
    # prefill chunks read each other's writes: only the decode backend may fuse them into attention
    assert engine.settings.decode_backend.decode_rows and not engine.settings.prefill_backend.decode_rows

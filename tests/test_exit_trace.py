"""Exit traces: a recorded adaptive run replays token for token (step-by-step and in decode
windows); traces from another model, weights, dtype or KV layout, and tampered traces, are
rejected with a message that says what differs."""
from __future__ import annotations

import dataclasses
import hashlib
import json

import jax
import numpy as np
import pytest

from rltjax.checkpoints.loader import load_checkpoint
from conftest import FIXTURES
from rltjax.engine.exit_trace import ExitTrace, TraceMismatchError, model_fingerprint
from rltjax.engine_config import CacheConfig, ExecutionConfig, ExitConfig
from rltjax.entrypoints.llm import LLM
from rltjax.models.layers import FusedQKVLayer, SplitLayers, split_layer_stacks
from rltjax.sampling_params import SamplingParams

PROMPTS = [[5, 17, 42, 8, 99, 3], [7, 7, 120, 64], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
PARAMS = [SamplingParams(max_tokens=9, temperature=0.0, exit_threshold=0.6, ignore_eos=True),
          SamplingParams(max_tokens=7, temperature=0.8, seed=11, exit_threshold=0.3, ignore_eos=True),
          SamplingParams(max_tokens=8, temperature=0.0, exit_threshold=0.9, min_loops=2, ignore_eos=True)]


def make_llm(exit_config=ExitConfig(mode="ouro"), dtype="float32", kv_layout="last_exited", decode_window=0,
             name="ouro-tiny"):
    return LLM(str(FIXTURES / name), dtype=dtype, cache_config=CacheConfig(page_size=8, kv_layout=kv_layout),
               exit_config=exit_config,
               execution_config=ExecutionConfig(compile_ahead=False, compilation_cache_dir=None,
                                                show_progress=False, decode_window=decode_window))


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    llm = make_llm()
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    trace = ExitTrace.record(llm, PROMPTS, outputs, PARAMS)
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    trace.save(path)
    return path, outputs


@pytest.mark.parametrize("decode_window", [0, 4])
def test_replay_reproduces_the_recording(trace, decode_window):
    path, recorded = trace
    loaded = ExitTrace.load(path)
    assert any(d < 4 for out in recorded for d in out.exit_depths[1:]), "the recording should exit early"
    replayed = loaded.replay(make_llm(loaded.exit_config(), decode_window=decode_window))
    for a, b in zip(recorded, replayed):
        assert (a.token_ids, a.exit_depths) == (b.token_ids, b.exit_depths)
    assert 1 <= loaded.mean_depth <= 4 and sum(loaded.depth_histogram().values()) == sum(
        len(o.exit_depths) - 1 for o in recorded)


@pytest.mark.parametrize("change, what", [
    (dict(dtype="bfloat16"), "dtype"),
    (dict(kv_layout="shared"), "kv_layout"),
    (dict(name="ouro-tiny-gqa"), "model or weights"),
])
def test_replay_rejects_another_engine(trace, change, what):
    loaded = ExitTrace.load(trace[0])
    with pytest.raises(TraceMismatchError, match=what):
        loaded.replay(make_llm(loaded.exit_config(), **change))


def test_replay_rejects_tampered_outputs(trace, tmp_path):
    data = json.loads(trace[0].read_text())
    data["records"][1]["token_ids"][3] = (data["records"][1]["token_ids"][3] + 1) % 100
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    loaded = ExitTrace.load(bad)
    with pytest.raises(TraceMismatchError, match="'t1'.*at token 3"):
        loaded.replay(make_llm(loaded.exit_config()))
    bad.write_text(json.dumps({**data, "format": "something-else"}))
    with pytest.raises(TraceMismatchError, match="format"):
        ExitTrace.load(bad)


def test_fingerprint_sees_one_changed_weight():
    llm = make_llm()
    params = llm.engine.runner.params                        # held per layer (SplitLayers)
    base = model_fingerprint(llm.engine.cfg, params)
    assert base == llm.engine.model_fingerprint()
    layers = list(params.layers.layers)
    wqkv = np.asarray(layers[1].wqkv).copy()                 # q | k | v fused per layer
    col = llm.engine.cfg.q_width + 5                          # a column of wk
    wqkv[3, col] = np.nextafter(wqkv[3, col], np.float32(np.inf))    # one ulp in one element
    layers[1] = FusedQKVLayer(layers[1].layer, jax.numpy.asarray(wqkv))
    changed = dataclasses.replace(params, layers=SplitLayers(tuple(layers)))
    assert model_fingerprint(llm.engine.cfg, changed) != base


@pytest.mark.parametrize("name", ["ouro-tiny", "huginn-tiny"])
def test_fingerprint_does_not_depend_on_the_layer_layout(name):
    """Stacked or split per layer, the same weights give the same fingerprint, and the one a
    plain digest of the stacked leaves gives (traces recorded before the engine split its
    weights still replay)."""
    ckpt = load_checkpoint(FIXTURES / name, dtype="float32")
    h = hashlib.sha256(json.dumps(dataclasses.asdict(ckpt.cfg), sort_keys=True, default=str).encode())
    for path, leaf in jax.tree_util.tree_leaves_with_path(ckpt.params):
        bits = np.asarray(leaf).reshape(-1).view(np.uint32).astype(np.uint64)
        weights = (np.arange(bits.size, dtype=np.uint64) * 2654435761 + 1) % 2**32
        h.update(f"{jax.tree_util.keystr(path)}:{leaf.shape}:{leaf.dtype}".encode())
        h.update(np.array([bits.sum() % 2**32, (bits * weights % 2**32).sum() % 2**32], np.uint32).tobytes())
    plain = h.hexdigest()[:32]
    assert model_fingerprint(ckpt.cfg, ckpt.params) == plain
    assert model_fingerprint(ckpt.cfg, split_layer_stacks(ckpt.params)) == plain


def test_sampled_requests_need_a_seed():
    llm = make_llm()
    sp = SamplingParams(max_tokens=2, temperature=1.0)
    outs = llm.generate(PROMPTS[:1], sp, use_tqdm=False)
    with pytest.raises(TraceMismatchError, match="seed"):
        ExitTrace.record(llm, PROMPTS[:1], outs, sp)

"""Mixed prefill: prompts admitted while a decode window runs do their R loops inside the next
window's first R passes, batched with the decoding rows, instead of in a prefill step. The
outputs (tokens, exit depths, logprobs) equal the dense oracle's; prompts that do not fit
fall back to the prefill step; nothing compiles after warm-up; bad settings are refused."""
from __future__ import annotations

import numpy as np
import pytest

from rltjax.checkpoints.random_init import random_checkpoint
from engine_helpers import (assert_all_pages_free, check_equal, closed_loop, compile_events, make_engine,
                            record_calls, reference_for, run_workload)
from engine_trace_helpers import TOKENS
from test_engine_kernels import SMALL
from rltjax.engine_config import CacheConfig, EngineConfigError, ExecutionConfig, ExitConfig, SchedulerConfig
from rltjax.entrypoints.llm import build_engine
from rltjax.models.base import get_model
from rltjax.presets import preset_config
from rltjax.reference.generate import ReferenceModel
from rltjax.sampling_params import SamplingParams


def workload(n: int, seed: int = 0, max_prompt: int = 12):
    rng = np.random.default_rng(seed)
    return [(f"q{i}", TOKENS[int(s):int(s) + int(p)],
             SamplingParams(max_tokens=int(m), temperature=float(t), seed=i, exit_threshold=0.6, ignore_eos=True,
                            logprobs=2 if i % 3 == 0 else None))
            for i, (s, p, m, t) in enumerate(zip(rng.integers(0, 60, n), rng.integers(1, max_prompt, n),
                                                 rng.integers(1, 20, n), rng.choice([0.0, 0.9], n)))]


def mixed_engine(exit_mode="ouro_delayed", depths=None, **kw):
    return make_engine(exit_mode=exit_mode, depths_by_request=depths, decode_window=6, max_num_seqs=3,
                       window_trip="fixed", mixed_prefill_tokens=32, prefill_chunk_size=16,
                       max_num_batched_tokens=48, num_pages=128, **kw)


# two exit modes (CI time): a rule decided one pass ahead, and trace replay, whose recorded
# depths ride in the window's rows (windows under the same-step rule: test_decode_window; at
# fixed depth: test_async_scheduling)
@pytest.mark.parametrize("exit_mode", ["ouro_delayed", "trace"])
def test_prompts_ride_the_window_and_equal_the_oracle(exit_mode):
    """A closed loop of 14 requests (prompts of 1-11 tokens, some of them max_tokens 1): after
    the first admission every prompt runs inside a window, none in a prefill step of its own."""
    requests = workload(14)
    depths = ({rid: [4] + [int(d) for d in np.random.default_rng(1).integers(1, 5, 24)] for rid, _, _ in requests}
              if exit_mode == "trace" else None)
    engine = mixed_engine(exit_mode, depths)
    events = []
    record_calls(engine, ["prefill", "head", "window"], events)
    outs = closed_loop(engine, requests, clients=3)
    ref = reference_for("last_exited", exit_mode, depths_by_request=depths)
    for rid, prompt, params in requests:
        check_equal(outs[rid], ref.generate(prompt, params, request_id=rid))
    # the first prompts, and any admitted when no window was in flight (every row had finished)
    assert events.count("prefill") <= 2, events
    assert engine.steps_by_kind["mixed_prefill"] >= 5, engine.steps_by_kind
    assert any(len(outs[rid].token_ids) == 1 for rid, _, _ in requests)    # a first token that ends it
    assert_all_pages_free(engine)


def test_prompts_past_the_window_tokens_take_the_prefill_step():
    """Prompts longer than mixed_prefill_tokens (or needing two chunks) use the prefill step;
    the outputs are the oracle's either way."""
    requests = [(f"p{i}", TOKENS[3 * i:3 * i + n],
                 SamplingParams(max_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True))
                for i, n in enumerate((5, 6, 7, 30, 4, 20, 3))]
    engine = mixed_engine()
    prefills = []
    real = engine.runner.prefill
    engine.runner.prefill = lambda batch: prefills.append(int((batch.positions >= 0).sum())) or real(batch)
    outs = closed_loop(engine, requests, clients=3)
    ref = reference_for("last_exited", "ouro")
    for rid, prompt, params in requests:
        check_equal(outs[rid], ref.generate(prompt, params, request_id=rid))
    assert engine.steps_by_kind.get("mixed_prefill", 0) >= 1
    assert any(n >= 16 for n in prefills), prefills          # the 30- and 20-token prompts' chunks
    assert_all_pages_free(engine)


def test_mixed_windows_on_the_pallas_kernels_equal_the_oracle():
    """Interpret mode: in a mixed pass the rows go through the fused decode kernel and the
    prompts through the prefill kernel (aligned query blocks), one GEMM for both."""
    cfg = preset_config("ouro-1.4b", SMALL)
    params = random_checkpoint(cfg, seed=1, dtype="float32")
    engine = build_engine(
        None, params=params, cfg=cfg, cache_config=CacheConfig(kv_layout="last_exited", page_size=8),
        scheduler_config=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, prefill_chunk_size=32),
        exit_config=ExitConfig(mode="ouro_delayed"),
        execution_config=ExecutionConfig(attn_impl="pallas", interpret=True, compile_ahead=False, decode_window=6,
                                         window_trip="fixed", mixed_prefill_tokens=64, compilation_cache_dir=None,
                                         show_progress=False))
    rng = np.random.default_rng(0)
    requests = [(f"k{i}", rng.integers(3, cfg.vocab_size, n).tolist(),
                 SamplingParams(max_tokens=(5, 9, 4, 12, 6)[i], temperature=0.7 * (i % 2), seed=i, exit_threshold=0.5,
                                ignore_eos=True, logprobs=1))
                for i, n in enumerate((9, 5, 20, 7, 33))]
    outs = closed_loop(engine, requests, clients=2)
    ref = ReferenceModel(get_model(cfg), params, kv_layout="last_exited", exit_config=ExitConfig(mode="ouro_delayed"))
    for rid, prompt, sp in requests:
        check_equal(outs[rid], ref.generate(prompt, sp, request_id=rid))
    assert engine.steps_by_kind.get("mixed_prefill", 0) >= 2
    assert_all_pages_free(engine)


def test_mixed_windows_after_warm_up_do_not_compile():
    engine = mixed_engine(compile_ahead=True)
    with compile_events() as events:
        closed_loop(engine, workload(8, seed=3), clients=3)
    assert engine.steps_by_kind.get("mixed_prefill", 0) >= 2
    assert events == []
    assert_all_pages_free(engine)


def test_a_failed_mixed_launch_errors_only_the_new_requests():
    engine = mixed_engine()
    real, failed = engine.runner.window, []

    def flaky(rows, *rest):
        if rest[-1] is not None and not failed:        # a window carrying prompts
            failed.append(1)
            raise RuntimeError("injected device failure")
        return real(rows, *rest)

    engine.runner.window = flaky
    requests = workload(8, seed=5)
    outs = closed_loop(engine, requests, clients=3)
    errored = [rid for rid, _, _ in requests if outs[rid].finish_reason == "error"]
    assert failed and errored and len(errored) <= 3
    ref = reference_for("last_exited", "ouro_delayed")
    for rid, prompt, params in requests:
        if rid not in errored:
            check_equal(outs[rid], ref.generate(prompt, params, request_id=rid))
    assert_all_pages_free(engine)


@pytest.mark.parametrize("settings, message", [
    (dict(mixed_prefill_tokens=48), r"mixed_prefill_tokens=48: must be 0 \(off\), None \(auto\), a power"),
    (dict(mixed_prefill_tokens=32, decode_window=0), r"mixed prefill runs inside decode windows"),
    (dict(mixed_prefill_tokens={16: 0, 8: 32}, decode_window=0), r"mixed prefill runs inside decode windows"),
    (dict(mixed_prefill_tokens={8: 32, 16: 64}, decode_window=4, window_trip="fixed"),
     r"mixed_prefill_tokens=\{8: 32, 16: 64\}: decode_window=4 leaves no pass"),
    (dict(mixed_prefill_tokens=32, decode_window=6), r"fixed-trip windows"),     # early_stop here
    (dict(mixed_prefill_tokens=32, decode_window=4, window_trip="fixed"), r"decode_window=4 leaves no pass"),
    (dict(mixed_prefill_tokens=32, decode_window=6, window_trip="fixed", kv_layout="shared"),
     r"last_exited KV layout"),
    (dict(mixed_prefill_tokens=32, decode_window=6, window_trip="fixed", name="huginn-tiny",
          exit_mode="latent_diff", hf_overrides={"state_init": "zero"}), r"huginn.*boundary stages"),
])
def test_unsupported_settings_are_refused(settings, message):
    with pytest.raises(EngineConfigError, match=message):
        make_engine(**settings)


def test_steps_that_turn_mixed_prefill_off_leave_those_windows_to_standby_entries():
    """{8: 32, 16: 0}: 8-row windows carry prompts, 16-row ones take standby entries; all
    zeros is off, with no error where windows could not take prompts."""
    w = make_engine(decode_window=6, window_trip="fixed", max_num_seqs=16, max_num_batched_tokens=64,
                    prefill_chunk_size=16, mixed_prefill_tokens={8: 32, 16: 0}).settings.window
    assert w.mixed_buckets == (8,) and w.standby_for(16) and not w.standby_for(8)
    assert (w.prompt_tokens_for(8), w.prompt_tokens_for(16)) == (32, 0)
    off = make_engine(decode_window=6, max_num_seqs=16, mixed_prefill_tokens={8: 0}).settings.window   # early_stop
    assert off.mixed_buckets == ()


@pytest.mark.parametrize("settings, runs", [
    (dict(decode_window=6, window_trip="fixed"), True),
    (dict(decode_window=6), False),                                           # early_stop windows
    (dict(decode_window=4, window_trip="fixed"), False),                      # K = R: no pass after the prompts
    (dict(decode_window=0), False),
    (dict(decode_window=6, window_trip="fixed", kv_layout="shared"), False),
    (dict(decode_window=6, window_trip="fixed", decode_window_rows=8, max_num_seqs=12), False),   # standby rows
    (dict(decode_window=6, window_trip="fixed", name="huginn-tiny", exit_mode="latent_diff",
          hf_overrides={"state_init": "zero"}), False),                       # boundary stages
    (dict(decode_window=6, window_trip="fixed", max_num_seqs=8), False),      # no window of 16 rows
])
def test_auto_mixed_prefill_runs_where_windows_can_take_prompts(settings, runs, monkeypatch):
    """mixed_prefill_tokens=None: AUTO_MIXED_PREFILL's T (capped at the largest prefill batch)
    in windows that reach its first step where mixed prefill can run, no error where it
    cannot; the other windows take standby entries."""
    from rltjax.engine import settings as engine_settings
    monkeypatch.setattr(engine_settings, "AUTO_MIXED_PREFILL", ((16, 128),))   # the tiny engines' buckets: 8, 16
    engine = make_engine(mixed_prefill_tokens=None, **{"max_num_seqs": 16, **settings})
    w = engine.settings.window
    if runs:
        assert w.mixed_buckets == (16,) and w.buckets == (8, 16)
        assert w.standby_for(8) and not w.standby_for(16)
        assert (w.prompt_tokens_for(8), w.prompt_tokens_for(16)) == (0, min(128, engine.settings.token_buckets[-1]))
    elif w is None:
        assert settings.get("decode_window") == 0
    else:
        assert w.mixed_buckets == () and w.prompt_tokens_for(8) == w.prompt_tokens_for(16) == 0
        assert w.uses_standby


def test_prompt_tokens_follow_the_steps_per_row_bucket():
    """(rows, T) steps: each bucket carries the T of the last step it reaches, capped at the
    largest prefill batch; buckets below the first step carry none."""
    from rltjax.engine.window_settings import mixed_prompt_tokens
    by_bucket = lambda *args: dict(mixed_prompt_tokens(*args))    # noqa: E731
    buckets = [8, 16, 32, 64]
    assert by_bucket(((32, 128),), buckets, 2048) == {32: 128, 64: 128}
    assert by_bucket(((32, 128), (8, 32)), buckets, 2048) == {8: 32, 16: 32, 32: 128, 64: 128}
    assert by_bucket(((1, 256),), buckets, 64) == {8: 64, 16: 64, 32: 64, 64: 64}
    assert by_bucket(((16, 32), (32, 0)), buckets, 2048) == {16: 32}   # T = 0: off from 32
    assert by_bucket((), buckets, 2048) == {}


def test_a_t_per_bucket_runs_each_bucket_at_its_own_prompt_width():
    """mixed_prefill_tokens={8: 32, 16: 64}: each mixed bucket compiles its own prompt
    width, admissions ride both, every output equals the oracle's, nothing compiles after
    warm-up and no page leaks."""
    engine = make_engine(exit_mode="ouro_delayed", decode_window=6, window_trip="fixed",
                         mixed_prefill_tokens={16: 64, 8: 32},
                         max_num_seqs=16, prefill_chunk_size=16, max_num_batched_tokens=64, num_pages=256,
                         compile_ahead=True)
    runner, w = engine.runner, engine.settings.window
    assert w.mixed_buckets == (8, 16) and not w.uses_standby
    assert (w.prompt_tokens_for(8), w.prompt_tokens_for(16)) == (32, 64)
    widths = []
    launch = runner.window
    def spy(rows, *args):
        prompt = args[-1]
        if prompt is not None:
            widths.append((rows.slots.shape[0], prompt.tokens.shape[0]))
        return launch(rows, *args)
    runner.window = spy
    requests = workload(30, seed=11)
    # single arrivals while 8-row windows run, then a burst into 16-row ones
    arrivals = [(0 if i < 3 else 9 + 3 * i if i < 6 else 40, rid, prompt, params)
                for i, (rid, prompt, params) in enumerate(requests)]
    with compile_events() as compiles:
        outs = run_workload(engine, arrivals)
    assert compiles == []
    assert {w for _, w in widths} == {32, 64}          # admissions rode windows of both buckets
    assert all(w.prompt_tokens_for(rows) == t for rows, t in widths)
    ref = reference_for("last_exited", "ouro_delayed")
    for rid, prompt, params in requests:
        check_equal(outs[rid], ref.generate(prompt, params, request_id=rid))
    assert_all_pages_free(engine)


def test_auto_mixed_prefill_rides_large_windows_and_standby_the_small(monkeypatch):
    """Auto mode with mixed prefill from 16 rows: a few requests run in 8-row windows, taking
    standby entries; a burst moves them to 16-row windows, whose admissions carry prompts.
    Every output equals the oracle's; nothing compiles after warm-up; no page leaks."""
    from rltjax.engine import settings as engine_settings
    monkeypatch.setattr(engine_settings, "AUTO_MIXED_PREFILL", ((16, 128),))
    engine = make_engine(exit_mode="ouro_delayed", decode_window=6, window_trip="fixed", mixed_prefill_tokens=None,
                         max_num_seqs=16, prefill_chunk_size=16, max_num_batched_tokens=48, num_pages=256,
                         compile_ahead=True)
    events = []
    record_calls(engine, ["standby_put", "merge_rows"], events)
    requests = workload(30, seed=7)
    arrivals = [(0 if i < 3 else 12 if i < 6 else 30, rid, prompt, params)
                for i, (rid, prompt, params) in enumerate(requests)]
    with compile_events() as compiles:     # warm-up compiled each bucket's way of taking requests
        outs = run_workload(engine, arrivals)
    assert compiles == []
    ref = reference_for("last_exited", "ouro_delayed")
    for rid, prompt, params in requests:
        check_equal(outs[rid], ref.generate(prompt, params, request_id=rid))
    assert "standby_put" in events and "merge_rows" in events, events
    assert engine.steps_by_kind.get("mixed_prefill", 0) >= 1, engine.steps_by_kind
    assert_all_pages_free(engine)


def test_window_tokens_are_capped_and_a_fresh_row_counts_its_prompt_passes():
    """A T past the largest prefill batch buys nothing (capped there); a request whose first
    token is still in a window's prompt passes needs R passes for it, not max_loops."""
    from rltjax.engine.sequence import Request
    from rltjax.engine.window.planner import finishes_within
    engine = make_engine(decode_window=6, window_trip="fixed", mixed_prefill_tokens=8192, max_num_batched_tokens=48,
                         prefill_chunk_size=16)
    w = engine.settings.window
    assert w.prompt_tokens_for(w.buckets[-1]) == engine.settings.token_buckets[-1] == 64
    fresh = Request("f", [1, 2, 3], SamplingParams(max_tokens=3, max_loops=2), 0, 0, 1, 2)
    fresh.start_token()
    assert not finishes_within(fresh, 6, 4)          # 4 prompt passes, then one 2-pass token: 2 of 3
    assert finishes_within(fresh, 8, 4)               # 4 + 2 + 2: all three

"""The executable store: a second engine start loads every step the first one compiled,
without tracing, and serves the same tokens; keys change with what tracing reads; a bad
file is recompiled, never trusted."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rltjax.entrypoints.llm as llm_entry
from engine_helpers import assert_all_pages_free, make_engine, reference_for
from engine_trace_helpers import TOKENS, check_against_reference, drive, greedy
from rltjax.engine.dispatch import DispatchedStep, StepTable, call_signature, program_key, split_static
from rltjax.engine.executable_store import ExecutableStore, compile_fresh, engine_fingerprint
from rltjax.jit_options import engine_jit
from rltjax.sampling_params import SamplingParams

ARRIVALS = [(0, "a", TOKENS[:5], greedy(6)), (0, "b", TOKENS[10:23], greedy(4)),
            (2, "c", TOKENS[30:38], SamplingParams(max_tokens=5, temperature=0.8, top_p=0.9, seed=11,
                                                   ignore_eos=True, logprobs=2)),
            (5, "d", TOKENS[40:43], greedy(7))]


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    """A cache directory for the engine's store only: XLA's own persistent cache is a
    process-wide setting, left alone here."""
    monkeypatch.setattr(llm_entry, "setup_compilation_cache", lambda path: None)
    jax.clear_caches()       # the first engine here compiles afresh (only fresh compiles are stored)
    return tmp_path


def _engine(cache_dir):
    # a fixed pool: sized by free memory (a GPU), a second engine's pool would differ in shape,
    # and so would its programs
    return make_engine(compile_ahead=True, decode_window=3, window_trip="fixed", max_num_seqs=2, num_pages=129,
                       compilation_cache_dir=str(cache_dir))


STEP_NAMES = {"prefill_step", "embed_step", "loop_step", "head_step", "decode_window", "merge_rows"}


@pytest.fixture
def traced_steps():
    """The names of the engine steps jit traces while the fixture is active (jax.monitoring)."""
    seen = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            seen.append(kwargs.get("fun_name"))
    jax.monitoring.register_event_duration_secs_listener(listener)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listener)


def _check_same(outputs, first_outputs):
    """The same programs give the same tokens, depths and logprobs, bit for bit; on the CPU
    both equal the dense oracle too (the GPU's tolerances against it are test_engine_gpu's)."""
    for rid, out in first_outputs.items():
        assert (outputs[rid].token_ids, outputs[rid].exit_depths, outputs[rid].logprobs) == (
            out.token_ids, out.exit_depths, out.logprobs)
    if jax.default_backend() == "cpu":
        check_against_reference(outputs, ARRIVALS, reference_for("last_exited"))


def test_second_start_loads_every_step_and_serves_the_same_tokens(store_dir, traced_steps):
    first = _engine(store_dir)
    assert first.warm_up.stored == first.warm_up.executables > 0 and first.warm_up.loaded == 0
    assert set(traced_steps) >= STEP_NAMES - {"embed_step"}          # positive control: the first traced
    traced_steps.clear()
    second = _engine(store_dir)
    assert not STEP_NAMES & set(traced_steps)                        # the second traced no step
    assert second.warm_up.loaded == first.warm_up.executables and second.warm_up.stored == 0
    outputs = [drive(engine, ARRIVALS)[0] for engine in (first, second)]
    _check_same(outputs[1], outputs[0])
    assert all(step.jit_calls == 0 for step in second.runner.steps)     # every call hit a loaded step
    assert_all_pages_free(second)


def test_changed_settings_do_not_load(store_dir, monkeypatch):
    first = _engine(store_dir)
    with monkeypatch.context() as env:
        env.setenv("XLA_FLAGS", "--xla_dump_hlo_pass_re=nothing")   # part of the engine's fingerprint
        other = _engine(store_dir)
    assert first.warm_up.stored == first.warm_up.executables and other.warm_up.loaded == 0
    again = _engine(store_dir)                        # the first settings again: the first start's files
    assert again.warm_up.loaded == first.warm_up.stored


def test_a_damaged_file_is_compiled_again(store_dir):
    first = _engine(store_dir)
    files = sorted((store_dir / "executables").glob("*/*"))
    assert len(files) == first.warm_up.stored == first.warm_up.executables
    for path in files[:2]:
        path.write_bytes(b"not an executable")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = _engine(store_dir)
    dropped = [w for w in caught if "dropping the stored step" in str(w.message)]
    assert len(dropped) == 2, [str(w.message) for w in caught]
    assert second.warm_up.loaded == first.warm_up.executables - 2
    _check_same(drive(second, ARRIVALS)[0], drive(first, ARRIVALS)[0])


@engine_jit(static_argnames=("scale",), donate_argnames=("x",))
def _scaled(w, x, *, scale: float):
    return x * scale + w.sum()


def test_only_a_fresh_compile_counts_as_fresh():
    lowered = jax.jit(lambda v: v * 7 - 1).lower(jnp.zeros(6))
    compiled, fresh = compile_fresh(lowered)
    assert fresh and compiled(jnp.ones(6))[0] == 6.0
    assert compile_fresh(lowered)[1] is False       # jit's in-memory executable, not compiled again


def test_keys_follow_static_values_shapes_and_fingerprint(monkeypatch, tmp_path):
    w, x = jnp.ones(3), jnp.zeros(4)

    def key(*a, **k):
        static, dynamic = split_static(_scaled, a, k)
        return program_key(_scaled, static, a, dynamic)
    base = key(w, x, scale=2.0)
    assert base == key(w, jnp.ones(4), scale=2.0)                       # values do not matter
    assert len({base, key(w, x, scale=3.0), key(w, jnp.zeros(5), scale=2.0),
                key(w, jnp.zeros(4, jnp.int32), scale=2.0), key(w, np.zeros(4, np.float32), scale=2.0)}) == 5
    store = ExecutableStore(tmp_path)
    assert store.file_key(base) != store.file_key(key(w, x, scale=3.0))
    assert store.file_key(base + " <object at 0x7f00>") is None       # keyed by identity: not stored
    weak = split_static(_scaled, (w, 2.0), dict(scale=2.0))               # a weakly typed x: another program
    strong = split_static(_scaled, (w, jnp.float32(2.0)), dict(scale=2.0))
    assert call_signature(weak[0], (w, 2.0), weak[1]) != call_signature(strong[0], (w, jnp.float32(2.0)), strong[1])
    from rltjax.jit_options import with_options
    optioned = with_options(_scaled, (("xla_cpu_enable_fast_math", False),))      # compiler options: in the key
    static, dynamic = split_static(optioned, (w, x), dict(scale=2.0))
    assert program_key(optioned, static, (w, x), dynamic) != base
    with jax.default_matmul_precision("highest"):                     # JAX's configuration is read
        assert engine_fingerprint() != store.fingerprint
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    assert engine_fingerprint() != store.fingerprint


def test_no_store_when_turned_off(store_dir, monkeypatch):
    """executable_cache=False (--no-executable-cache) or no cache directory: no store is
    opened, nothing stored or loaded."""
    opened = []
    monkeypatch.setattr(ExecutableStore, "open", classmethod(lambda cls, directory: opened.append(directory)))
    engine = make_engine(compile_ahead=True, decode_window=3, window_trip="fixed", max_num_seqs=2, num_pages=129,
                         compilation_cache_dir=str(store_dir), executable_cache=False)
    assert engine.warm_up.executables > 0 and engine.warm_up.stored == engine.warm_up.loaded == 0
    assert not (store_dir / "executables").exists()
    none = make_engine(compile_ahead=True, decode_window=3, window_trip="fixed", max_num_seqs=2, num_pages=129,
                       compilation_cache_dir=None)
    assert none.warm_up.stored == none.warm_up.loaded == 0 and opened == []


def test_each_fingerprint_has_a_folder_and_the_least_recently_used_are_pruned(tmp_path):
    root = tmp_path / "executables"
    old = [root / f"{i:016x}" for i in range(6)]
    for age, folder in enumerate(old):
        folder.mkdir(parents=True)
        (folder / "step").write_bytes(b"x")
        os.utime(folder, (1e9 + age, 1e9 + age))           # old[5] the most recently used
    (root / "flat_file_of_the_old_layout").write_bytes(b"x")
    store = ExecutableStore.open(root)
    assert store.directory == root / store.fingerprint[:16]
    kept = {p.name for p in root.iterdir()}
    assert kept == {f.name for f in old[6 - 4:]}          # the 4 most recently used of the others
    store.save("k", jax.jit(lambda v: v + 1).lower(jnp.zeros(2)).compile())
    assert (store.directory / "k").is_file() and store.saved == 1
    os.utime(store.directory, (1e9 - 1, 1e9 - 1))        # the oldest of all, until opened: marked used
    ExecutableStore.open(root)
    assert store.directory.stat().st_mtime > 1e9 + 5
    again = ExecutableStore.open(root)                   # the same fingerprint: nothing more to prune
    assert {p.name for p in root.iterdir()} == {f.name for f in old[2:]} | {store.directory.name}
    assert sorted(again.prune(keep=1)) == old[2:5]
    assert {p.name for p in root.iterdir()} == {old[5].name, store.directory.name}   # the current one stays


def test_dispatch_calls_the_compiled_step_and_defers_what_it_cannot_tell_apart():
    w, x = jnp.ones(3), jnp.zeros(4)
    static, dynamic = split_static(_scaled, (w, x), dict(scale=2.0))
    table = StepTable()
    compiled = _scaled.lower(w, x, scale=2.0).compile()
    table.add(call_signature(static, (w, x), dynamic), program_key(_scaled, static, (w, x), dynamic), compiled)
    step = DispatchedStep(_scaled, table)
    np.testing.assert_allclose(step(w, jnp.ones(4), scale=2.0), np.full(4, 5.0))
    assert step.jit_calls == 0
    np.testing.assert_allclose(step(w, jnp.ones(4), scale=3.0), np.full(4, 6.0))   # another program: jit
    assert step.jit_calls == 1
    # two programs under one signature (only the weights' shape differs): both go to jit
    w5 = jnp.ones(5)
    table.add(call_signature(static, (w5, x), dynamic), program_key(_scaled, static, (w5, x), dynamic),
              _scaled.lower(w5, x, scale=2.0).compile())
    np.testing.assert_allclose(step(w5, jnp.ones(4), scale=2.0), np.full(4, 7.0))
    assert step.jit_calls == 2 and not table.compiled
    assert split_static(_positional, (w, x, 2.0), {}) is None       # a static argument by position
    assert split_static(_by_number, (w, x), {}) is None and split_static(_positional, (w, x), {}) is not None


@engine_jit(static_argnames=("scale",))
def _positional(w, x, scale):
    return x * scale + w.sum()


def _start(cache_dir) -> tuple[dict, str]:
    """One engine start in a child process (XLA's persistent cache on, in ``cache_dir``), on
    the CPU: on a GPU this process may already hold most of its memory (JAX preallocates), and
    the store's bookkeeping checked here is the same on every device."""
    res = subprocess.run([sys.executable, "-m", "benchmarks.startup", "--quick", "--max-num-seqs", "2",
                          "--max-model-len", "64", "--compilation-cache-dir", str(cache_dir)],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


def test_steps_served_by_xla_cache_are_not_stored_and_the_start_says_so(tmp_path):
    first, _ = _start(tmp_path)
    assert first["saved_to_store"] == first["executables"] > 0
    shutil.rmtree(tmp_path / "executables")
    # XLA's cache holds every step that took over jax_persistent_cache_min_compile_time_secs
    # (0.5 s) to compile: those come from it and are not stored; the quicker ones compile afresh
    second, log = _start(tmp_path)
    assert second["loaded_from_store"] == 0 and second["from_xla_cache"] > 0, log[-2000:]
    assert second["from_xla_cache"] + second["saved_to_store"] == second["executables"]


@engine_jit(static_argnums=(2,))
def _by_number(w, x, scale=1.0):
    return x * scale + w.sum()


_GENERATE = """
import sys
from rltjax.entrypoints.llm import build_engine
from rltjax.engine_config import ExecutionConfig, SchedulerConfig
from rltjax.sampling_params import SamplingParams
eng = build_engine(sys.argv[1], scheduler_config=SchedulerConfig(max_num_seqs=1),
                   execution_config=ExecutionConfig(compile_ahead=True, compilation_cache_dir=sys.argv[2],
                                                    show_progress=False))
eng.add_request("r", [5, 6, 7, 8, 9], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
while eng.has_unfinished_requests():
    eng.step()
print("TOKENS", eng.get_output("r").token_ids, "LOADED", eng.warm_up.loaded)
"""


def test_a_step_stored_by_one_multi_device_process_runs_in_another(tmp_path):
    """With several devices visible, a step two models share (the window rows' merge) stored by
    one process is loaded by the next onto the device it was compiled for, not onto every
    device (which made it expect a shard on each)."""
    import os
    import subprocess
    import sys
    from conftest import FIXTURES
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    runs = []
    for model in ("ouro-tiny-gqa", "ouro-tiny"):
        res = subprocess.run([sys.executable, "-c", _GENERATE, str(FIXTURES / model), str(tmp_path / "cache")],
                             capture_output=True, text=True, env=env, timeout=600)
        assert res.returncode == 0, res.stderr[-1500:]
        runs.append(res.stdout.split("TOKENS")[-1])
    assert int(runs[1].split("LOADED")[1]) >= 1          # the shared step came from the store

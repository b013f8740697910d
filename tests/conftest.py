"""Shared fixtures: the tiny upstream checkpoints and their reference outputs."""
from __future__ import annotations

import functools
import os
import sys
import tempfile
from pathlib import Path

# benchmarks/ lives in the repository, not in the installed package: tests import it from here
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# On a machine without an NVIDIA GPU (CI) XLA compiles for the CPU at LLVM -O0 (CI time): the
# suite is mostly XLA compiling small programs. XLA's HLO passes run as before; only LLVM's code
# optimisation is off, which keeps IEEE float semantics. On 2 cores the suite took 11 min 3 s
# against 12 min 45 s (tests that run long loops got slower, the compile-bound ones faster).
# Set before jax starts a backend; child processes (the scripts' tests) inherit it. A GPU
# machine keeps the defaults.
if not Path("/dev/nvidia0").exists() and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI runs derandomized examples so a submission's result does not depend on luck;
# local runs keep exploring new examples.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

FIXTURES = Path(__file__).parent / "fixtures"

# JAX's persistent compilation cache is process-wide: once one test builds an engine with a
# cache directory (ExecutionConfig's default), every later compile in this process would be
# written to it and read back by later tests, so results would depend on test order and on
# what earlier runs left there. Tests of the cache itself run the engine in child processes.
jax.config.update("jax_enable_compilation_cache", False)
# Engines built with the default cache directory (~/.cache/rltjax/xla) would write there, and
# open its executable store, which prunes other code versions' folders: the user's. Tests use
# a fresh directory of their own instead (child processes inherit it).
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="rltjax-tests-cache-")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables():
    """Each test module's compiled executables are dropped after it. The suite compiles
    thousands (engines at many shapes, kernels in interpret mode); kept for the whole process,
    their code mappings ran into the kernel's limit (vm.max_map_count, 65530) and XLA's CPU
    compiler segfaulted in a later module."""
    yield
    jax.clear_caches()


def pytest_collection_modifyitems(config, items):
    import jax
    if jax.default_backend() != "gpu":
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run on the device machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@functools.cache
def load_fixture(name: str, dtype: str = "float32", overrides: tuple = ()):
    from rltjax.checkpoints.loader import load_checkpoint
    return load_checkpoint(FIXTURES / name, dtype=dtype, hf_overrides=dict(overrides) or None)


@functools.cache
def reference_npz(name: str):
    return dict(np.load(FIXTURES / "reference" / f"{name}.npz"))


@functools.cache
def reference_model(name: str = "ouro-tiny", kv_layout: str = "last_exited", dtype: str = "float32",
                    overrides: tuple = (), exit_mode: str = "ouro", lookahead_seed: int = 0):
    from rltjax.engine_config import ExitConfig
    from rltjax.models.base import get_model
    from rltjax.reference.generate import ReferenceModel
    ckpt = load_fixture(name, dtype, overrides)
    return ReferenceModel(get_model(ckpt.cfg), ckpt.params, kv_layout=kv_layout,
                          exit_config=ExitConfig(mode=exit_mode, lookahead_seed=lookahead_seed))


@pytest.fixture
def fresh_mosaic_interpreter():
    """Mosaic GPU interpret mode keeps global state that an exception inside a kernel leaves
    behind: reset after each test so one failure does not break the next."""
    yield
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state
    reset_gpu_interpret_mode_state()


@pytest.fixture
def lower_to_triton(monkeypatch):
    """``lower(fn, *shape_dtype_structs)`` -> the Triton IR text of the (last) Pallas kernel in
    ``jax.jit(fn)``, lowered for an H100-class GPU on any host (no GPU needed)."""
    import jax
    try:
        from jax._src.pallas.triton import lowering, pallas_call_registration as reg
        from jax.experimental.pallas import triton as plgpu
        info = plgpu.get_gpu_info_from_version(plgpu.GpuVersion.H100)
    except Exception as e:  # noqa: BLE001 - private API moved: nothing to check here
        pytest.skip(f"Pallas Triton internals unavailable: {e}")
    seen = []
    orig = lowering.lower_jaxpr_to_triton_module

    def spy(*a, **k):
        res = orig(*a, **k)
        seen.append(res.module.operation.get_asm())
        return res
    monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info", lambda: info)
    monkeypatch.setattr(reg.lowering, "lower_jaxpr_to_triton_module", spy)

    def lower(fn, *args):
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
        return seen[-1]
    return lower

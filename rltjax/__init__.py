"""rltjax: serve looped language models with JAX.

``from rltjax import LLM, SamplingParams`` is the offline API; names resolve
lazily so importing a submodule does not pull in the whole engine.
"""
from __future__ import annotations

_EXPORTS = {
    "LLM": "rltjax.entrypoints.llm",
    "LLMEngine": "rltjax.engine.llm_engine",
    "RequestOutput": "rltjax.engine.outputs",
    "SamplingParams": "rltjax.sampling_params",
    "CacheConfig": "rltjax.engine_config",
    "SchedulerConfig": "rltjax.engine_config",
    "ExitConfig": "rltjax.engine_config",
    "ExecutionConfig": "rltjax.engine_config",
    "SpeculativeConfig": "rltjax.engine_config",
    "ParallelConfig": "rltjax.parallel",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rltjax' has no attribute {name!r}")

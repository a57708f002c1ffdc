"""The inference engine: model, paged KV cache, scheduler, sampler and the step loop.

Names are imported lazily, so that ``corral.engine.block_manager`` (pure Python) imports without torch, and
importing the package does not load a model: ``LLMEngine(EngineConfig(...))`` does.
"""

import importlib

_EXPORTS = {
    "EngineConfig": "corral.engine.config",
    "LLMEngine": "corral.engine.llm_engine",
    "CompletionOutput": "corral.engine.outputs",
    "EngineStats": "corral.engine.outputs",
    "RequestMetrics": "corral.engine.outputs",
    "RequestOutput": "corral.engine.outputs",
    "SamplingParams": "corral.engine.sampling_params",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'corral.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

"""The real model, loaded once per test module (fp32; the converted-weights cache makes later loads fast)."""

import pytest


@pytest.fixture(scope="module")
def engine():
    from corral.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=2048))

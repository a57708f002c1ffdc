"""Test helpers: a ServingContext over any engine (real or fake), served on a free loopback port."""

from corral.api.async_engine import AsyncEngine, AsyncEngineConfig
from corral.api.context import ServerConfig, ServingContext
from corral.api.launch import serve_in_background as running_server  # noqa: F401 (re-exported for the tests)
from corral.api.metrics import ServerMetrics


def make_context(engine, compiler, tokenizer, vocabulary, *, model_name="test-model", max_model_len=2048,
                 max_in_flight=320, **config) -> ServingContext:
    metrics = ServerMetrics(model_name)
    async_engine = AsyncEngine(engine, compiler, AsyncEngineConfig(max_in_flight=max_in_flight), observer=metrics)
    return ServingContext(async_engine, tokenizer, vocabulary,
                          ServerConfig(model_name=model_name, max_model_len=max_model_len, **config), metrics)

"""Run an app on a free loopback port in a background thread, for tests that talk to it over real HTTP."""

import contextlib
import socket
import threading
import time

import uvicorn

from corral.api.async_engine import AsyncEngine, AsyncEngineConfig
from corral.api.context import ServerConfig, ServingContext
from corral.api.metrics import ServerMetrics
from corral.api.server import build_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_context(engine, compiler, tokenizer, vocabulary, *, model_name="test-model", max_model_len=2048,
                 max_in_flight=320, **config) -> ServingContext:
    metrics = ServerMetrics(model_name)
    async_engine = AsyncEngine(engine, compiler, AsyncEngineConfig(max_in_flight=max_in_flight), observer=metrics)
    return ServingContext(async_engine, tokenizer, vocabulary,
                          ServerConfig(model_name=model_name, max_model_len=max_model_len, **config), metrics)


@contextlib.contextmanager
def running_server(ctx: ServingContext):
    """Yield the base URL (``http://127.0.0.1:PORT``) of a uvicorn server over ``build_app(ctx)``."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(ctx), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        ctx.engine.shutdown()

"""Build the real serving stack: ``LLMEngine`` + ``GrammarCompiler`` → ``AsyncEngine`` → ``ServingContext``."""

import contextlib
import socket
import threading
import time
from dataclasses import dataclass

from corral.api.async_engine import AsyncEngine, AsyncEngineConfig
from corral.api.context import ServerConfig, ServingContext
from corral.api.metrics import ServerMetrics


@dataclass(frozen=True)
class ServeOptions:
    """What ``corral serve`` sets beyond the engine's own config."""

    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 << 20
    default_max_tokens: int | None = None
    max_in_flight: int = 320
    compile_cache_bytes: int = 256 << 20
    compile_time_budget_s: float = 10.0


def build_engine(engine_config=None):
    from corral.engine import EngineConfig, LLMEngine

    return LLMEngine(engine_config or EngineConfig())


def build_compiler(engine, options: ServeOptions = ServeOptions()):
    from corral.fsm.compiler import GrammarCompiler

    return GrammarCompiler(engine.vocabulary, cache_bytes=options.compile_cache_bytes,
                           time_budget_s=options.compile_time_budget_s)


def engine_max_model_len(engine) -> int:
    return getattr(engine, "max_model_len", None) or engine.model_config.max_position


def build_context(engine, compiler=None, options: ServeOptions = ServeOptions(),
                  model_name: str | None = None) -> ServingContext:
    """A ``ServingContext`` over a ready engine (the compiler is built from its vocabulary when not given)."""
    from corral.models import resolve_model

    name = model_name or resolve_model(getattr(getattr(engine, "config", None), "model", None)).name
    metrics = ServerMetrics(name)
    async_engine = AsyncEngine(engine, compiler or build_compiler(engine, options),
                               AsyncEngineConfig(max_in_flight=options.max_in_flight), observer=metrics)
    config = ServerConfig(model_name=name, max_model_len=engine_max_model_len(engine), api_keys=options.api_keys,
                          max_body_bytes=options.max_body_bytes, default_max_tokens=options.default_max_tokens)
    return ServingContext(async_engine, engine.tokenizer, engine.vocabulary, config, metrics)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_background(ctx: ServingContext, host: str = "127.0.0.1", port: int | None = None):
    """Serve ``build_app(ctx)`` with uvicorn in a daemon thread; yield its base URL; stop it (and the engine
    loop) on exit. For notebooks, benchmarks and tests that talk to a real server."""
    import uvicorn

    from corral.api.server import build_app

    port = port or free_port(host)
    server = uvicorn.Server(uvicorn.Config(build_app(ctx), host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="corral-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        ctx.engine.shutdown()

"""Build the real serving stack: ``LLMEngine`` + ``GrammarCompiler`` → ``AsyncEngine`` → ``ServingContext``, and
serve it with uvicorn, shutting down gracefully.

Shutdown (SIGTERM or Ctrl-C): new requests get a 503 at once and the listening socket closes; requests in flight
have ``shutdown_grace_s`` to finish; then the rest end with a 503 (an error event, when streaming) and their
compilations are cancelled. The process is gone within ``shutdown_grace_s + 2`` seconds whatever it is doing:
a watchdog that needs no GIL (``faulthandler``) ends it if a native call still holds on.
"""

import asyncio
import contextlib
import faulthandler
import gc
import socket
import threading
import time
from dataclasses import dataclass, field

from corral.api.async_engine import AsyncEngine, AsyncEngineConfig, ShuttingDownError
from corral.api.context import ServerConfig, ServingContext
from corral.api.metrics import ServerMetrics
from corral.schemas.limits import RequestLimits


@dataclass(frozen=True)
class ServeOptions:
    """What ``corral serve`` sets beyond the engine's own config."""

    api_keys: tuple[str, ...] = ()
    protect_all: bool = False  # /metrics and the API docs need a key too
    max_body_bytes: int = 4 << 20
    default_max_tokens: int | None = None
    max_in_flight: int = 320
    max_compiling: int = 64
    compile_cache_bytes: int = 256 << 20
    compile_time_budget_s: float = 10.0
    send_timeout_s: float = 30.0
    header_timeout_s: float = 20.0
    body_timeout_s: float = 60.0
    max_connections: int = 1024
    shutdown_grace_s: float = 5.0
    reject_unknown_keywords: bool = False
    limits: RequestLimits = field(default_factory=RequestLimits)


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
    same_bits = deterministic(engine)
    async_engine = AsyncEngine(engine, compiler or build_compiler(engine, options),
                               AsyncEngineConfig(max_in_flight=options.max_in_flight,
                                                 max_compiling=options.max_compiling), observer=metrics)
    config = ServerConfig(model_name=name, max_model_len=engine_max_model_len(engine), api_keys=options.api_keys,
                          protect_all=options.protect_all, max_body_bytes=options.max_body_bytes,
                          default_max_tokens=options.default_max_tokens, send_timeout_s=options.send_timeout_s,
                          header_timeout_s=options.header_timeout_s, body_timeout_s=options.body_timeout_s,
                          max_connections=options.max_connections,
                          reject_unknown_keywords=options.reject_unknown_keywords, limits=options.limits,
                          decode_step=decode_path(engine), decode_burst=decode_burst(engine),
                          deterministic=same_bits,
                          **formats_fields(getattr(engine, "formats", None), same_bits))
    metrics.decode_step, metrics.decode_burst = config.decode_step, config.decode_burst
    metrics.deterministic = config.deterministic
    return ServingContext(async_engine, engine.tokenizer, engine.vocabulary, config, metrics)


def decode_path(engine) -> str | None:
    """``native`` or ``torch`` for what runs a real engine's steps; None for a toy one."""
    return getattr(getattr(engine, "runner", None), "decode_path", None)


def decode_burst(engine) -> int | None:
    """The most tokens one native call decodes per sequence (``EngineConfig.decode_burst`` where the
    runner can burst, else 1); None for a toy engine."""
    runner = getattr(engine, "runner", None)
    if runner is None or not hasattr(runner, "max_burst_rows"):
        return None
    return engine.config.decode_burst if runner.max_burst_rows else 1


def deterministic(engine) -> bool | None:
    """Whether a real engine runs every query through the decode kernel (``EngineConfig.deterministic``); None for
    a toy one."""
    return getattr(getattr(engine, "runner", None), "deterministic", None)


def formats_fields(formats, deterministic: bool | None = None) -> dict:
    """``system_fingerprint`` and the ``/v1/models`` formats of an engine's resolved formats (none for a toy); the
    fingerprint ends in ``-deterministic`` where prompts take the decode kernel too (their numerics differ)."""
    if formats is None:
        return {}
    from corral import native

    flags = native.cpu_flags()
    isa = next((name for flag, name in (("amx_bf16", "amx"), ("avx512f", "avx512"), ("avx2", "avx2"))
                if flag in flags), "base")
    return {"system_fingerprint": f"corral-{formats.tag}-{isa}" + ("-deterministic" if deterministic else ""),
            "formats": {"dtype": formats.dtype, "quantization": formats.quantization,
                        "kv_cache_dtype": formats.kv_cache_dtype, "reason": formats.reason}}


def warm_up(compiler) -> None:
    """Before the first request: build what every constrained request shares (the vocabulary's token tables and
    trie, the any-value grammar), so the first one does not pay for it; then move everything alive into the
    garbage collector's permanent generation. A full collection otherwise walks every object the imports, the
    model and the tokenizer made (200,000 with the default model, 90-105 ms here) holding the GIL, stalling every
    stream, at a moment chosen by the allocations of whichever request is compiling (vLLM freezes its heap for the
    same reason). The server runs it before it listens, the in-process ``generate_json`` once for the engine it
    builds itself."""
    from corral.grammar.constraint import Constraint

    if hasattr(compiler, "vocab"):
        compiler.compile(Constraint("json_schema", {"type": "object", "properties": {"a": {}}}))
    gc.collect()
    gc.freeze()


def uvicorn_config(ctx: ServingContext, host: str, port: int, log_level: str, **more):
    """uvicorn's config for ``build_app(ctx)``: its h11 protocol with the connection bounds of ``ctx.config``
    (``corral.api.connections``)."""
    import uvicorn

    from corral.api.connections import connection_cap, guarded_protocol
    from corral.api.server import build_app

    protocol = guarded_protocol(ctx.config.header_timeout_s, connection_cap(ctx.config.max_connections))
    return uvicorn.Config(build_app(ctx), host=host, port=port, log_level=log_level, http=protocol, **more)


class GracefulServer:
    """uvicorn's server, with the shutdown described above."""

    def __init__(self, ctx: ServingContext, host: str, port: int, grace_s: float, log_level: str = "info"):
        import uvicorn

        outer = self

        class _Server(uvicorn.Server):
            def handle_exit(self, sig, frame):  # a signal handler: hand the work to the event loop at once
                if not self.should_exit and outer.loop is not None:
                    outer.loop.call_soon_threadsafe(outer.begin_shutdown)
                super().handle_exit(sig, frame)

            @contextlib.contextmanager
            def capture_signals(self):
                with super().capture_signals():
                    yield
                    # subtle: uvicorn re-raises the signals it caught once it has stopped, and the default SIGTERM
                    # action kills the process before the engine is shut down; the shutdown is handled here
                    self._captured_signals.clear()

        config = uvicorn_config(ctx, host, port, log_level, timeout_graceful_shutdown=grace_s + 0.5)
        self.ctx, self.grace_s, self.server = ctx, grace_s, _Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None

    def run(self) -> None:
        """Warm up, serve until shut down, then stop the engine loop."""
        warm_up(self.ctx.engine.compiler)
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        try:
            await self.server.serve()
        finally:
            self.ctx.engine.shutdown(timeout_s=1.0)

    def begin_shutdown(self) -> None:
        """On the event loop: refuse new requests now, fail the rest after the grace period, and arm the hard
        deadline (a watchdog thread outside the GIL that ends the process if exiting is still not done)."""
        faulthandler.dump_traceback_later(self.grace_s + 1.8, exit=True)
        self.ctx.engine.drain()
        error = ShuttingDownError(f"the server shut down before this request finished (grace period "
                                  f"{self.grace_s:g} s)")
        self.loop.call_later(self.grace_s, self.ctx.engine.fail_all, error)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_background(ctx: ServingContext, host: str = "127.0.0.1", port: int | None = None):
    """Serve ``build_app(ctx)`` with uvicorn in a daemon thread; yield its base URL; stop it (and the engine
    loop) on exit. For notebooks, benchmarks and tests that talk to a real server."""
    import uvicorn

    port = port or free_port(host)
    server = uvicorn.Server(uvicorn_config(ctx, host, port, "warning"))
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

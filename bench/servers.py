"""OpenAI-compatible servers as processes, Corral's or llama.cpp's: started, health-checked, stopped by process id.

A benchmark talks to every engine through the same HTTP API with the same client, so each engine pays the same
serving costs (HTTP, JSON, tokenization, the chat template). Model loading happens in :meth:`Server.start`,
which returns once ``/health`` answers 200, outside any timed window.

    with corral_server(dtype="float32") as corral, llama_server(slots=16) as llama:
        ... corral.url, llama.url ...
"""

import asyncio
import contextlib
import gc
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_SERVER = os.path.join(ROOT, ".venv", "llama.cpp", "build", "bin", "llama-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process (its own process group, so its threads and children stop with it)."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict | None = None, startup_s: float = 300,
                 unset: tuple[str, ...] = ()):
        """``env``: variables set for the server on top of this process's; ``unset``: variables removed."""
        self.name, self.argv, self.port, self.env, self.startup_s = name, argv, port, env, startup_s
        self.unset = unset
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None
        self.log_path = os.path.join("/tmp", f"bench-{name}-{port}.log")

    def start(self) -> "Server":
        log = open(self.log_path, "a")  # appended: a restart keeps the log of the crash before it
        self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                        env={k: v for k, v in {**os.environ, **(self.env or {})}.items()
                                             if k not in self.unset})
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name} did not become healthy within {self.startup_s:g} s")

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None

    def restart(self) -> "Server":
        self.stop()
        return self.start()

    def __enter__(self) -> "Server":
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def corral_server(dtype: str = "float32", threads: int = 2, max_model_len: int = 4096, extra: tuple = (),
                  quantization: str = "none", kv_cache_dtype: str = "auto", label: str | None = None) -> Server:
    """``corral serve`` in the given formats (``auto`` for each: what ``make serve`` picks)."""
    port = free_port()
    argv = [sys.executable, "-m", "corral.cli", "serve", "--port", str(port), "--dtype", dtype, "--quantization",
            quantization, "--kv-cache-dtype", kv_cache_dtype, "--threads", str(threads), "--max-model-len",
            str(max_model_len), "--log-level", "warning", *extra]
    env = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}  # as `make serve` runs it
    return Server(label or f"corral-{dtype}", argv, port, env)


def llama_server(slots: int, threads: int = 2, ctx_per_slot: int = 2048, binary: str = LLAMA_SERVER,
                 model: str | None = None, kv_unified: bool = False) -> Server:
    """llama-server on the same GGUF, ``slots`` parallel slots (continuous batching), each with a context of
    ``ctx_per_slot`` tokens, prompt caching on (its default, as Corral's prefix cache is on). ``kv_unified``:
    one KV buffer for all slots instead of one per slot.

    It runs with OpenMP's default wait policy whatever the caller's environment says: ggml's threads meet at a
    barrier after every operation, and ``OMP_WAIT_POLICY=PASSIVE`` (which suits torch) makes them sleep there,
    4-5x slower decoding on two cores."""
    if not os.path.exists(binary):
        raise FileNotFoundError(f"{binary} is missing: run make bench-extras")
    if model is None:
        sys.path.insert(0, ROOT)
        from corral.models import resolve_model

        model = resolve_model(None).path
    port = free_port()
    argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb",
            str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot),
            "--kv-unified" if kv_unified else "--no-kv-unified", "--cont-batching",
            "--no-webui", "--log-disable"]
    return Server(f"llama-server-np{slots}", argv, port, unset=("OMP_WAIT_POLICY",))


async def closed_loop(server: Server | None, items: list, concurrency: int, send, crashed) -> tuple[list, float, int]:
    """Send every item of ``items`` through ``concurrency`` clients, each sending its next item when its last one
    is answered, to one server that is restarted when it dies. Returns the results in ``items``' order, the wall
    time (restarts taken off it: model loading stays outside the clock) and the number of restarts.

    ``send(client, item)`` returns ``(result, dropped)``: ``dropped`` is ``"connect"`` when no connection was
    made, ``"closed"`` when the connection closed before a whole response, else None (timeouts are failures,
    never retried). A request dropped while the server is alive is sent once more (a server may close a
    keep-alive connection as the client reuses it; OpenAI's client retries these too). If the server died:
    a request that never reached it goes back in the queue; one it was serving is recorded as
    ``crashed(result)``, counted against the server; every client waits while the server is restarted once."""
    queue = list(enumerate(items))
    results: dict[int, object] = {}
    restarting, healthy = asyncio.Lock(), asyncio.Event()
    healthy.set()
    restarts, paused = 0, 0.0

    async def died() -> bool:
        """Whether the server is dead, given a moment to be seen dying (a crash drops the connection first)."""
        for _ in range(20):
            if server is None or not server.is_alive():
                return server is not None
            await asyncio.sleep(0.05)
        return False

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800), limits=limits) as client:
        t0 = time.perf_counter()

        async def client_loop():
            nonlocal restarts, paused
            while queue:
                index, item = queue.pop(0)
                await healthy.wait()
                result, dropped = await send(client, item)
                if dropped and not await died():
                    await healthy.wait()
                    result, dropped = await send(client, item)
                if dropped and await died():
                    async with restarting:
                        if not server.is_alive():
                            healthy.clear()
                            print(f"{server.name} died; restarting it", file=sys.stderr, flush=True)
                            began = time.perf_counter()
                            await asyncio.to_thread(server.restart)
                            restarts, paused = restarts + 1, paused + time.perf_counter() - began
                            healthy.set()
                    if dropped == "connect":  # never reached the dead server: sent again once it is back
                        queue.insert(0, (index, item))
                        continue
                    result = crashed(result)
                results[index] = result

        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        wall = time.perf_counter() - t0 - paused
    return [results[i] for i in sorted(results)], wall, restarts


def llama_server_version(binary: str = LLAMA_SERVER) -> str:
    """Its version and build lines, on one line (the llama.cpp sources of the pinned llama-cpp-python sdist)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    lines = [line.strip() for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    return "; ".join(line for line in lines if line.startswith(("version", "built"))) or "unknown"


def clocked(call, total: list[float]):
    """``call``, adding the seconds each call takes to ``total[0]`` (an in-process bench's timer around a part)."""
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - start
    return timed


@contextlib.contextmanager
def frozen_heap():
    """Everything alive moved out of the garbage collector's walks while the block runs, as ``corral serve`` does
    before it listens (``corral.api.launch.warm_up``): an engine measured in process otherwise has its full
    collections walk the imports' and model's objects (90-105 ms each here), which the server's skip. Thawed
    after, so engines built later in the same process can be collected; a heap frozen before the block (by
    someone else) stays frozen."""
    thaw = gc.get_freeze_count() == 0
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if thaw:
            gc.unfreeze()


def cpu_summary() -> str:
    """The CPU model and the flags that decide which kernels are fast (printed with every result)."""
    model, flags = "unknown", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16",
              "amx_int8")
    have = [f for f in wanted if f in flags]
    return f"{model}, {os.cpu_count()} cores, flags: {' '.join(have) or 'none of ' + ' '.join(wanted)}"


def has_fast_bf16() -> bool:
    """bf16 matmuls have a fast path only with AMX or AVX-512 bf16; on AVX2 alone they are several times slower
    than fp32."""
    summary = cpu_summary()
    return "amx_bf16" in summary or "avx512_bf16" in summary


def dropped_kind(error: Exception) -> str | None:
    """How a request's connection failed (for ``closed_loop``): ``"connect"``, ``"closed"`` or None."""
    if isinstance(error, httpx.ConnectError):
        return "connect"
    if isinstance(error, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        return "closed"
    return None

"""AsyncEngine: the synchronous ``LLMEngine`` driven by one background thread, consumed from asyncio.

Why a thread: ``LLMEngine.step()`` is blocking CPU/GPU work, and the event loop must keep accepting, parsing
and streaming meanwhile. The engine is touched by that one thread only: the event loop sends it commands
(add, abort) through a queue, and it sends each ``RequestOutput`` back to the request's own ``asyncio.Queue``.

Admission is bounded: at most ``max_in_flight`` requests are in flight; one more is refused with
:class:`EngineOverloadedError` (429) rather than queued without end. A consumer that stops listening (a client
that disconnected) aborts its request, which frees its KV blocks at once. Grammar compilation runs in a thread
pool, off the event loop, through the compiler's own cache.
"""

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from corral.errors import CorralError, EngineOverloadedError, InvalidGrammarError
from corral.schemas.prepare import PreparedRequest

logger = logging.getLogger(__name__)


class EngineStepError(CorralError):
    """A step of the engine raised: the requests in flight then fail with a 500, and the loop goes on."""

    status_code = 500
    error_type = "internal_error"


class EngineDeadError(CorralError):
    """The engine loop stopped on an internal error; the server answers 503 until restarted."""

    status_code = 503
    error_type = "service_unavailable"


@dataclass(frozen=True)
class AsyncEngineConfig:
    max_in_flight: int = 320  # running plus waiting requests; one more is a 429 (default: 64 + 256)
    compile_workers: int = 2  # compilation threads; GrammarCompiler is thread-safe and shares its cache

    def __post_init__(self):
        assert self.max_in_flight >= 1 and self.compile_workers >= 1


class _Stream:
    """One request's mailbox: outputs from the engine thread, read by the request's coroutine."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue, self.finished = loop, asyncio.Queue(), False

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, engine, compiler, config: AsyncEngineConfig = AsyncEngineConfig(), observer=None):
        """``engine``: an ``LLMEngine`` (or anything with its interface); ``compiler``: a ``GrammarCompiler``;
        ``observer``: optional ``on_output(request_id, output, now)`` / ``on_stats(stats)`` hooks (metrics)."""
        self.engine, self.compiler, self.config, self.observer = engine, compiler, config, observer
        self._commands: list[tuple] = []
        self._wake = threading.Condition()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        self._stopping = False
        self._stats = engine.stats()
        self._pool = ThreadPoolExecutor(config.compile_workers, thread_name_prefix="corral-compile")
        self._thread = threading.Thread(target=self._run, name="corral-engine", daemon=True)
        self._thread.start()

    # -- the event loop's side ------------------------------------------------------------------------------

    def num_in_flight(self) -> int:
        return len(self._streams)

    def stats(self):
        """The engine's stats as of its last step (read without touching the engine)."""
        return self._stats

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{time.monotonic_ns() & 0xFFFFFF:06x}"

    async def new_guide(self, prepared: PreparedRequest):
        """A fresh guide for the request's constraint (None when unconstrained), compiled off the event loop."""
        if prepared.node is None and prepared.constraint is None:
            return None
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._compile_guide, prepared)

    def _compile_guide(self, prepared: PreparedRequest):
        if prepared.node is not None:
            guide = self.compiler.compile_node(prepared.node).new_guide()
        else:
            guide = self.compiler.compile(prepared.constraint).new_guide()
        vocab = getattr(self.compiler, "vocab", None)
        if guide is not None and vocab is not None:
            # A start state that no token can leave would reach the sampler with nothing to choose; refuse it
            # here, as bad input, rather than fail inside a running batch. (The mask is cached: no extra cost.)
            row = np.zeros(-(-vocab.size // 32), dtype=np.int32)
            guide.fill_mask(row)
            if not row.any() and not guide.is_finished():
                raise InvalidGrammarError("no sequence of this model's tokens can spell the constraint's language")
        return guide

    def check_admission(self, num_requests: int = 1) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead!r}")
        if len(self._streams) + num_requests > self.config.max_in_flight:
            raise EngineOverloadedError(f"the server is at capacity ({self.config.max_in_flight} requests in flight); retry "
                                        "later")

    async def generate(self, request_id: str, prepared: PreparedRequest, guide,
                       params=None) -> AsyncIterator:
        """Yield the request's ``RequestOutput`` s until it finishes. Leaving early (client gone, task cancelled)
        aborts it in the engine. Raises what ``add_request`` raised (for example ``PromptTooLongError``)."""
        self.check_admission()
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._send(("add", request_id, prepared.prompt_token_ids, params or prepared.params, guide))
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    stream.finished = True
                    raise item
                stream.finished = item.finished
                yield item
                if item.finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not stream.finished:
                self._send(("abort", request_id))

    def _send(self, command: tuple) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    def shutdown(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=30)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the engine thread's side ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                        self._wake.wait()
                    if self._stopping:
                        return
                    commands, self._commands = self._commands, []
                for command in commands:
                    self._apply(command)
                if self.engine.has_unfinished_requests():
                    self._step()
                self._stats = self.engine.stats()
                if self.observer is not None:
                    self.observer.on_stats(self._stats)
        except BaseException as err:  # the loop must never die silently: every waiter hears about it
            self._dead = err
            for stream in list(self._streams.values()):
                stream.put(EngineDeadError(f"the engine stopped: {err!r}"))
            raise

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as err:  # one bad step fails the requests in flight, not the server
            logger.exception("engine step failed; failing the %d requests in flight", len(self._streams))
            for request_id, stream in list(self._streams.items()):
                self.engine.abort(request_id)  # frees their blocks; a failure here is fatal (outer handler)
                stream.put(EngineStepError(f"the engine failed while running this request: {err!r}"))
            return
        self._deliver(outputs)

    def _apply(self, command: tuple) -> None:
        if command[0] == "abort":
            self.engine.abort(command[1])
            return
        _, request_id, prompt_ids, params, guide = command
        stream = self._streams.get(request_id)
        if stream is None:
            return  # the client left before the request reached the engine
        try:
            self.engine.add_request(request_id, prompt_ids, params, guide=guide)
        except Exception as err:  # a refused request must not take the loop (and every other request) down
            stream.put(err)

    def _deliver(self, outputs) -> None:
        now = time.monotonic()
        for output in outputs:
            if self.observer is not None:
                self.observer.on_output(output, now)
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)

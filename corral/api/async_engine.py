"""AsyncEngine: the synchronous ``LLMEngine`` driven by one background thread, consumed from asyncio.

Why a thread: ``LLMEngine.step()`` is blocking CPU/GPU work, and the event loop must keep accepting, parsing
and streaming meanwhile. The engine is touched by that one thread only: the event loop sends it commands
(add, abort) through a queue, and it sends each ``RequestOutput`` back to the request's own ``asyncio.Queue``.

Admission is bounded from a request's arrival: :meth:`AsyncEngine.admit` hands out at most ``max_in_flight``
tickets, held while the request waits to compile, compiles, waits for the engine and runs; one more is refused
with :class:`EngineOverloadedError` (429) rather than queued without end. A consumer that stops listening (a
client that disconnected) aborts its request, which frees its KV blocks at once.

Grammar compilation runs in a thread pool, off the event loop, through the compiler's own cache: at most
``max_compiling`` compilations are queued or running (one more is a 429), each under its own budget, which is
cancelled when its request goes away (the client left, the server shuts down), so an abandoned compile stops
within milliseconds and nothing of it reaches the engine.
"""

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from corral import native
from corral.errors import CompileCancelledError, CorralError, EngineOverloadedError
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


class ShuttingDownError(CorralError):
    """The server is shutting down: new requests are refused, and those left at the end of the grace period fail."""

    status_code = 503
    error_type = "service_unavailable"


@dataclass(frozen=True)
class AsyncEngineConfig:
    max_in_flight: int = 320  # requests from arrival to end (compiling, waiting, running); one more is a 429
    compile_workers: int = 2  # compilation threads; GrammarCompiler is thread-safe and shares its cache
    max_compiling: int = 64  # compilations queued or running; one more is a 429

    def __post_init__(self):
        assert self.max_in_flight >= 1 and self.compile_workers >= 1 and self.max_compiling >= 1


class Ticket:
    """One admitted request's share of ``max_in_flight`` (``num`` engine requests), given back once."""

    def __init__(self, engine: "AsyncEngine", num: int):
        self.engine, self.num = engine, num

    def grow(self, num: int) -> None:
        """Hold ``num`` more (a /v1/completions batch, known once its prompts are read); 429 past the bound."""
        self.engine.check_admission(num)
        self.engine.num_admitted += num
        self.num += num

    def release(self) -> None:
        self.engine.num_admitted -= self.num
        self.num = 0


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
        # raised with each command, so that a burst (several tokens in one native call) does not hold it back
        self._interrupt = getattr(engine, "burst_interrupt", None) or _NoInterrupt()
        self._wake = threading.Condition()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        self._stopping = False
        self._draining = False
        self._failure: CorralError | None = None  # set when the grace period of a shutdown is over
        self.num_admitted = 0  # tickets out (event loop only)
        self._budgets: set = set()  # budgets of compilations queued or running (event loop only)
        self._compile_waiters: set = set()  # one future per compile being awaited, failed by fail_all
        self._stats = engine.stats()
        self._pool = ThreadPoolExecutor(config.compile_workers, thread_name_prefix="corral-compile")
        native.release_thread_pool()  # from here on the engine thread computes; this one (it loaded the model) not
        self._thread = threading.Thread(target=self._run, name="corral-engine", daemon=True)
        self._thread.start()

    # -- the event loop's side ------------------------------------------------------------------------------

    def num_in_flight(self) -> int:
        """Requests admitted and not yet ended, whatever they are doing."""
        return self.num_admitted

    def num_compiling(self) -> int:
        """Constraints queued or compiling."""
        return len(self._budgets)

    def stats(self):
        """The engine's stats as of its last step (read without touching the engine)."""
        return self._stats

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{time.monotonic_ns() & 0xFFFFFF:06x}"

    async def compile(self, constraint) -> object:
        """The compiled grammar of ``constraint`` (None when unconstrained). A cache hit is a lookup on the event
        loop (the key was made while the request was prepared); a miss compiles in the pool, its budget's clock
        started when a worker takes it. Cancelling the caller cancels the budget."""
        if constraint is None:
            return None
        self._check_failure()
        grammar = self.compiler.lookup(constraint)
        if grammar is not None:
            return grammar
        if len(self._budgets) >= self.config.max_compiling:
            raise EngineOverloadedError(f"{len(self._budgets)} constraints are compiling or waiting to; retry later")
        budget = self.compiler.new_budget()
        self._budgets.add(budget)
        future = asyncio.get_running_loop().run_in_executor(self._pool, self._compile, constraint, budget,
                                                            time.monotonic())
        future.add_done_callback(lambda _: self._budgets.discard(budget))
        # subtle: at the end of the grace period the caller hears the failure at once, not when the worker next
        # checks its budget (a long native step may not check for a while, and uvicorn's own deadline follows
        # soon after, turning the request's 503 into a 500)
        waiter = asyncio.get_running_loop().create_future()
        self._compile_waiters.add(waiter)
        try:
            await asyncio.wait({future, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if not future.done():
                budget.cancel()
                future.add_done_callback(_drop_result)
                self._check_failure()
            return future.result()
        except asyncio.CancelledError:
            budget.cancel()  # the worker stops at its next check; its result (an error) is dropped
            future.add_done_callback(_drop_result)
            raise
        except CompileCancelledError:
            self._check_failure()  # cancelled by a shutdown: say so
            raise
        finally:
            self._compile_waiters.discard(waiter)

    def _compile(self, constraint, budget, queued_at: float):
        waited = time.monotonic() - queued_at
        if waited > budget.time_s:  # the server is behind, not the constraint too large
            raise EngineOverloadedError(f"the constraint waited {waited:.1f} s to be compiled; retry later")
        budget.start()
        return self.compiler.compile(constraint, budget)

    def admit(self, num_requests: int = 1) -> Ticket:
        """A ticket for a request that has just arrived; 429 when ``max_in_flight`` are admitted, 503 while
        shutting down or after the engine died."""
        self.check_admission(num_requests)
        self.num_admitted += num_requests
        return Ticket(self, num_requests)

    def check_admission(self, num_requests: int = 1) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead!r}")
        if self._draining:
            raise ShuttingDownError("the server is shutting down")
        if self.num_admitted + num_requests > self.config.max_in_flight:
            raise EngineOverloadedError(f"the server is at capacity ({self.config.max_in_flight} requests in flight); "
                                        "retry later")

    def drain(self) -> None:
        """Refuse new requests from now on (shutdown has begun); those admitted go on."""
        self._draining = True

    def fail_all(self, error: CorralError) -> None:
        """End every request still in flight with ``error`` (the grace period is over): compilations are
        cancelled, each stream hears the error and aborts its engine request, and a request that reaches its
        compile or the engine later gets the error there."""
        self._failure = error
        for budget in list(self._budgets):
            budget.cancel()
        for waiter in list(self._compile_waiters):
            if not waiter.done():
                waiter.set_result(None)
        for stream in list(self._streams.values()):
            stream.put(error)

    def _check_failure(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead!r}")
        if self._failure is not None:
            raise self._failure

    async def generate(self, request_id: str, prepared: PreparedRequest, guide,
                       params=None) -> AsyncIterator:
        """Yield the request's ``RequestOutput`` s until it finishes. Leaving early (client gone, task cancelled)
        aborts it in the engine. Raises what ``add_request`` raised (for example ``PromptTooLongError``)."""
        self._check_failure()
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._send(("add", request_id, prepared.prompt_token_ids, params or prepared.params, guide))
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item  # the finally aborts it: unknown ids are ignored, a failed one is freed
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
            self._interrupt.set()  # a running burst ends at its next token: the command waits for no more
            self._wake.notify()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine loop (waiting at most ``timeout_s`` for its step) and cancel every compilation."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        for budget in list(self._budgets):
            budget.cancel()
        self._thread.join(timeout=timeout_s)
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
                    self._interrupt.clear()  # under the lock: a command sent after this raises it again
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
        """Every output of a step to its stream, in one wake-up of the event loop: each wake-up is a write to its
        self-pipe, and the event loop then takes the GIL while this thread wants it back for the next step."""
        now = time.monotonic()
        ready: dict = {}  # event loop -> [(stream, output)]
        for output in outputs:
            if self.observer is not None:
                self.observer.on_output(output, now)
            stream = self._streams.get(output.request_id)
            if stream is not None:
                ready.setdefault(stream.loop, []).append((stream, output))
        for loop, items in ready.items():
            loop.call_soon_threadsafe(_put_all, items)


class _NoInterrupt:
    """What an engine without bursts is interrupted with."""

    def set(self) -> None:
        pass

    def clear(self) -> None:
        pass


def _put_all(ready: list) -> None:
    for stream, output in ready:
        stream.queue.put_nowait(output)


def _drop_result(future) -> None:
    if not future.cancelled():
        future.exception()  # read, so that asyncio does not log an abandoned compile's error as unhandled

"""ServingContext: what every endpoint needs (engine, tokenizer, limits, metrics) and the run of one request.

A run, from the request's arrival to its end:

1. admission: a ticket of ``max_in_flight`` (429 when none is left), held to the very end;
2. preparation off the event loop: the chat template, tokenization, the request limits (``prepare_*``);
3. compilation of the constraint in the compile pool, under one budget for the whole request (a cache hit is a
   lookup on the event loop);
4. the engine: the request is added (one engine request per prompt, each with a guide of the one grammar), and
   its outputs are collected or streamed.

Steps 2 and 3 watch the client: when it disconnects, the run is cancelled (its compile budget too) and nothing of
it reaches the engine; in step 4 a disconnect aborts the engine request and frees its KV blocks.
"""

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from starlette.requests import Request

from corral.api.async_engine import AsyncEngine, Ticket
from corral.api.metrics import ServerMetrics
from corral.engine.sampling_params import BeamSearchParams
from corral.errors import InvalidRequestError, UserInputError
from corral.schemas.limits import RequestLimits
from corral.schemas.prepare import PreparedRequest

_DISCONNECT_POLL_S = 0.25


@dataclass(frozen=True)
class ServerConfig:
    """Server-side limits. ``api_keys`` empty: no authentication; ``protect_all`` also puts ``/metrics`` and the
    API docs behind the keys (by default only ``/v1/*`` needs one). ``default_max_tokens`` None: a request
    without ``max_tokens`` may use the rest of the context window, as with vLLM. ``send_timeout_s``: how long a
    stream may wait for a slow reader to take one event before the request is ended and its blocks freed.
    ``header_timeout_s``, ``body_timeout_s`` and ``max_connections`` bound what a slow or idle client holds (see
    ``corral.api.connections``): a request's headers must arrive within the first of a connection's opening or its
    last response, its body within the second of its headers, and at most the third connections are open.
    ``reject_unknown_keywords``: the default for schema keywords that are no JSON Schema vocabulary (refused,
    or reported as warnings)."""

    model_name: str
    max_model_len: int
    api_keys: tuple[str, ...] = ()
    protect_all: bool = False
    max_body_bytes: int = 4 << 20
    default_max_tokens: int | None = None
    send_timeout_s: float = 30.0
    header_timeout_s: float = 20.0
    body_timeout_s: float = 60.0
    max_connections: int = 1024
    reject_unknown_keywords: bool = False
    limits: RequestLimits = field(default_factory=RequestLimits)
    system_fingerprint: str | None = None  # e.g. "corral-bf16-gguf-kvbf16-avx512": the formats behind the outputs
    formats: dict[str, str] | None = None  # for /v1/models
    decode_step: str | None = None  # native | torch: what runs the steps, for /health and /metrics
    decode_burst: int | None = None  # the most tokens one native call decodes per sequence (None: a toy)
    deterministic: bool | None = None  # EngineConfig.deterministic, for /health and /metrics (None: a toy)

    def __post_init__(self):
        assert self.max_model_len > 0 and self.max_body_bytes > 0 and self.send_timeout_s > 0
        assert self.header_timeout_s > 0 and self.body_timeout_s > 0 and self.max_connections > 0
        assert self.default_max_tokens is None or self.default_max_tokens > 0


@dataclass(frozen=True, eq=False)
class ServingContext:
    engine: AsyncEngine
    tokenizer: object  # corral.models.Tokenizer
    vocabulary: object  # corral.fsm.vocabulary.Vocabulary
    config: ServerConfig
    metrics: ServerMetrics

    def check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise ModelNotServedError(name)

    def admit(self) -> Ticket:
        """Step 1: a ticket for a request that has just arrived (429 or 503 when none can be had)."""
        return self.engine.admit(1)

    async def prepare(self, raw: Request, prepare, req):
        """Step 2: ``prepare(req, tokenizer, ...)`` (``prepare_chat``/``prepare_completion``) in a worker thread,
        with the server's limits, abandoned when the client leaves."""
        config = self.config
        work = functools.partial(prepare, req, self.tokenizer, max_model_len=config.max_model_len,
                                 default_max_tokens=config.default_max_tokens, limits=config.limits,
                                 reject_unknown_keywords=config.reject_unknown_keywords)
        return await unless_disconnected(raw, asyncio.to_thread(work))

    async def compile(self, raw: Request, prepared: PreparedRequest):
        """Step 3: the request's compiled grammar (None when unconstrained), cancelled when the client leaves.
        Its ``warnings`` go into the response."""
        start = time.monotonic()
        try:
            grammar = await unless_disconnected(raw, self.engine.compile(prepared.constraint))
        except UserInputError as err:  # the schema's or grammar's own error: it names the field it came from
            err.param = err.param or prepared.constraint_param
            raise
        if grammar is not None:
            self.metrics.on_compile(time.monotonic() - start)
        return grammar

    async def start(self, raw: Request, prefix: str, prepared: PreparedRequest, grammar,
                    params=None) -> tuple[str, AsyncIterator]:
        """Step 4 up to the first output: the request id and its stream of ``RequestOutput`` s, one guide of
        ``grammar`` per request. Errors before the first output (a prompt the engine can never fit) are raised
        here, so the endpoint can still answer with a status code instead of a broken stream."""
        request_id = self.engine.new_request_id(prefix)
        self.metrics.on_arrival(request_id, time.monotonic())
        guide = None if grammar is None else grammar.new_guide()
        outputs = self.engine.generate(request_id, prepared, guide, params)
        try:
            first = await unless_disconnected(raw, anext(outputs))
        except BaseException:
            self.metrics.on_abandoned(request_id)
            await outputs.aclose()
            raise
        return request_id, _chain(first, outputs, lambda: self.metrics.on_abandoned(request_id))

    async def stream(self, raw: Request, prefix: str, prepared: PreparedRequest,
                     grammar) -> tuple[str, AsyncIterator]:
        """:meth:`start` for a streamed request: each output holds what is new since the previous one (the
        engine's "delta" outputs), so a long stream's last chunk costs what its first did, here and in the
        engine."""
        return await self.start(raw, prefix, prepared, grammar, replace(prepared.params, output_kind="delta"))

    async def collect(self, raw: Request, prefix: str, prepared: PreparedRequest,
                      grammar) -> tuple[str, dict, object]:
        """Run to the end: (request id, the latest ``CompletionOutput`` per choice index, the last output). The
        engine sends the finished output alone: nothing is built or delivered per step for a request nobody
        streams."""
        params = _beam_search_params(prepared) or replace(prepared.params, output_kind="final")
        request_id, outputs = await self.start(raw, prefix, prepared, grammar, params)
        latest: dict = {}
        last = None

        async def drain():
            nonlocal last
            async for out in outputs:
                last = out
                latest.update({c.index: c for c in out.outputs})

        async with contextlib.aclosing(outputs):
            await unless_disconnected(raw, drain())
        return request_id, latest, last


def warnings_of(grammar) -> list[str] | None:
    """What the compiler ignored, for the response (None when nothing)."""
    return list(getattr(grammar, "warnings", ())) or None


def _beam_search_params(prepared: PreparedRequest):
    """The engine's beam-search parameters when the request asks for beam search, else None (its own params).

    Beams run in the engine as a beam group, batched with every other request; the group's hypotheses come back
    as the request's completions, best first."""
    if prepared.strategy.kind != "beam_search":
        return None
    strategy = prepared.strategy
    return BeamSearchParams(beam_width=strategy.width, max_tokens=prepared.params.max_tokens,
                            length_penalty=strategy.length_penalty)


async def _chain(first, rest: AsyncIterator, on_abandon) -> AsyncIterator:
    finished = first.finished
    try:
        yield first
        async for item in rest:
            finished = item.finished
            yield item
    finally:
        await rest.aclose()
        if not finished:
            on_abandon()


async def unless_disconnected(raw: Request, work):
    """The result of ``work`` (an awaitable), or :class:`ClientGoneError` as soon as the client has gone, with
    ``work`` cancelled (a compile's budget with it)."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
                raise ClientGoneError()
        return task.result()
    finally:
        if not task.done():
            task.cancel()


class ClientGoneError(Exception):
    """The client closed the connection; nothing is sent back."""


class ModelNotServedError(InvalidRequestError):
    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, name: str):
        super().__init__(f"The model '{name}' does not exist.", param="model")
        self.code = "model_not_found"

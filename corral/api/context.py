"""ServingContext: what every endpoint needs (engine, tokenizer, limits, metrics) and the run of one request.

A run is: compile the constraint (off the event loop), hand the request to the :class:`AsyncEngine`, and
either collect its final choices or stream them. Collecting watches the client: when it disconnects, the run is
cancelled, which aborts the request in the engine and frees its KV blocks.
"""

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request

from corral.api.async_engine import AsyncEngine
from corral.api.metrics import ServerMetrics
from corral.engine.sampling_params import BeamSearchParams
from corral.errors import InvalidRequestError
from corral.schemas.prepare import PreparedRequest

_DISCONNECT_POLL_S = 0.25


@dataclass(frozen=True)
class ServerConfig:
    """Server-side limits. ``api_keys`` empty: no authentication. ``default_max_tokens`` None: a request without
    ``max_tokens`` may use the rest of the context window, as with vLLM."""

    model_name: str
    max_model_len: int
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 << 20
    default_max_tokens: int | None = None

    def __post_init__(self):
        assert self.max_model_len > 0 and self.max_body_bytes > 0
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

    async def new_guide(self, prepared: PreparedRequest):
        start = time.monotonic()
        guide = await self.engine.new_guide(prepared)
        if guide is not None:
            self.metrics.on_compile(time.monotonic() - start)
        return guide

    async def start(self, prefix: str, prepared: PreparedRequest, params=None) -> tuple[str, AsyncIterator]:
        """Compile, admit and submit: the request id and its stream of ``RequestOutput`` s. Errors before the
        first output (bad constraint, overload, a prompt the engine can never fit) are raised here, so the
        endpoint can still answer with a status code instead of a broken stream."""
        self.engine.check_admission()
        guide = await self.new_guide(prepared)
        request_id = self.engine.new_request_id(prefix)
        self.metrics.on_arrival(request_id, time.monotonic())
        outputs = self.engine.generate(request_id, prepared, guide, params)
        try:
            first = await anext(outputs)
        except BaseException:
            self.metrics.on_abandoned(request_id)
            await outputs.aclose()
            raise
        return request_id, _chain(first, outputs, lambda: self.metrics.on_abandoned(request_id))

    async def collect(self, raw: Request, prefix: str, prepared: PreparedRequest) -> tuple[str, dict, object]:
        """Run to the end: (request id, the latest ``CompletionOutput`` per choice index, the last output)."""
        request_id, outputs = await self.start(prefix, prepared, _beam_search_params(prepared))
        latest: dict = {}
        last = None

        async def drain():
            nonlocal last
            async for out in outputs:
                last = out
                latest.update({c.index: c for c in out.outputs})

        await _unless_disconnected(raw, drain())
        return request_id, latest, last


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


async def _unless_disconnected(raw: Request, work) -> None:
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
                raise ClientGoneError()
        task.result()
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

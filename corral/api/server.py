"""The FastAPI app: OpenAI-compatible routes, error bodies, API keys, the request size limit, metrics.

:func:`build_app` takes a ready :class:`ServingContext`, so tests can serve any engine (the real one, or a fake
with the same interface); :func:`serve_model` builds the real one. Authentication and the size limit are plain
ASGI middleware: Starlette's ``BaseHTTPMiddleware`` would hide client disconnects from the streaming routes,
and those disconnects are what abort a request and free its KV blocks.

Status codes: 400 for anything the caller got wrong (every ``UserInputError``, and body validation), 401 for a
missing or wrong API key, 404 for an unknown model or route, 408 for a body that has not arrived within
``body_timeout_s`` of its headers, 413 for a body over the limit (declared or sent chunked), 429 when
``max_in_flight`` requests are in flight or the compile queue is full, 503 while shutting down or when the engine
loop has died. Every error body has OpenAI's shape.

Keys are compared in constant time. Without ``protect_all`` only ``/v1/*`` needs a key; with it ``/metrics``
and the API docs do too. ``/health`` never does (load balancers probe it).
"""

import asyncio
import hmac
import json

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import Request

from corral import native
from corral.api.context import ClientGoneError, ServingContext
from corral.api.event_stream import EventStream
from corral.api.serving_chat import chat_completion
from corral.api.serving_completions import completion
from corral.errors import CorralError
from corral.schemas.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest
from corral.schemas.common import ErrorResponse
from corral.schemas.completions import Completion, CompletionRequest, Health, ModelCard, ModelList, NativePaths

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 429, 503)}
_STREAM_MODELS = {"/v1/chat/completions": ChatCompletionChunk, "/v1/completions": Completion}


def error_body(status: int, message: str, error_type: str, param: str | None = None,
               code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": error_type, "param": param, "code": code}},
                        status_code=status)


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    first = err.errors()[0]
    if first.get("type") == "json_invalid":
        return f"the body is not JSON: {first.get('ctx', {}).get('error', 'invalid')}", None
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    where = ".".join(loc)
    if first.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {where}", where or None
    return f"{where or 'body'}: {first.get('msg', 'invalid value')}", where or None


class GuardMiddleware:
    """API keys (``Authorization: Bearer <key>``), the request body's size limit and its deadline (the whole body
    within ``body_timeout_s`` of the headers: a client that trickles it is answered 408)."""

    def __init__(self, app, api_keys: tuple[str, ...], max_body_bytes: int, protect_all: bool = False,
                 body_timeout_s: float = 60.0):
        self.app, self.max_body_bytes, self.protect_all = app, max_body_bytes, protect_all
        self.body_timeout_s = body_timeout_s
        self.api_keys = tuple(key.encode() for key in api_keys)

    def needs_key(self, path: str) -> bool:
        return bool(self.api_keys) and (path.startswith("/v1") or (self.protect_all and path != "/health"))

    def key_ok(self, authorization: str) -> bool:
        given = authorization.removeprefix("Bearer ").strip().encode("latin-1")
        ok = False
        for key in self.api_keys:  # every key compared, each in constant time
            ok |= hmac.compare_digest(given, key)
        return ok

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.needs_key(scope["path"]) and not self.key_ok(headers.get("authorization", "")):
            response = error_body(401, "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
                                  "invalid_request_error", code="invalid_api_key")
            return await response(scope, receive, send)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return await too_large(self.max_body_bytes)(scope, receive, send)
        seen, body_done = 0, False
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s

        async def limited_receive():
            nonlocal seen, body_done
            if body_done:  # after the body: the route waits for a disconnect, as long as the response runs
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):  # a timer, not a task (wait_for's)
                    message = await receive()
            except TimeoutError:  # the route answers 408
                raise BodyTimeoutError(self.body_timeout_s) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:  # a chunked body past the limit: the route answers 413
                    raise BodyTooLargeError(self.max_body_bytes)
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        await self.app(scope, limited_receive, send)


def too_large(limit: int) -> JSONResponse:
    return error_body(413, f"The request body is larger than {limit} bytes.", "invalid_request_error",
                      code="request_too_large")


class StrictJSONRequest(Request):
    """A request whose JSON body must be standard JSON: ``NaN`` and ``Infinity``, which Python's parser takes by
    default, are refused, so no request value downstream can be a non-finite number. A body nested past the
    parser's recursion limit is refused with the same error."""

    async def json(self):
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = json.loads(body, parse_constant=_refuse_constant)
            except RecursionError:
                raise json.JSONDecodeError("nested too deeply", body.decode("utf-8", "replace")[:64], 0) from None
        return self._json


def _refuse_constant(name: str):
    raise json.JSONDecodeError(f"{name} is not a JSON number", name, 0)


class StrictJSONRoute(APIRoute):
    def get_route_handler(self):
        handler = super().get_route_handler()

        async def strict(request: Request):
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict


class BodyTimeoutError(HTTPException):
    """Raised while the body is read, as :class:`BodyTooLargeError` is."""

    def __init__(self, timeout_s: float):
        super().__init__(408, f"The request body did not arrive within {timeout_s:g} s of its headers.")


class BodyTooLargeError(HTTPException):
    """Raised while the body is read (FastAPI passes HTTP exceptions through its body parsing)."""

    def __init__(self, limit: int):
        super().__init__(413, f"The request body is larger than {limit} bytes.")
        self.limit = limit


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(_, err: RequestValidationError):
        message, param = _validation_message(err)
        return error_body(400, message, "invalid_request_error", param)

    @app.exception_handler(CorralError)
    async def on_corral(_, err: CorralError):
        status = getattr(err, "status_code", 500)
        return error_body(status, str(err), getattr(err, "error_type", "server_error"), getattr(err, "param", None),
                          getattr(err, "code", None))

    @app.exception_handler(Exception)
    async def on_bug(_, err: Exception):  # an internal error still answers in OpenAI's shape
        return error_body(500, f"internal error: {type(err).__name__}", "server_error")

    @app.exception_handler(ClientGoneError)
    async def on_gone(_, err):
        return PlainTextResponse("", status_code=499)

    @app.exception_handler(HTTPException)
    async def on_http(_, err: HTTPException):  # unknown routes, wrong methods, a body past the limit
        if isinstance(err, BodyTooLargeError):
            return too_large(err.limit)
        if isinstance(err, BodyTimeoutError):
            return error_body(408, str(err.detail), "invalid_request_error", code="request_timeout")
        return error_body(err.status_code, str(err.detail), "invalid_request_error")


def _respond(result):
    if isinstance(result, EventStream):
        return result
    return JSONResponse(result.model_dump(mode="json", exclude={"warnings"} if result.warnings is None else None))


def build_app(ctx: ServingContext) -> FastAPI:
    """The OpenAI-compatible app over ``ctx``. Its OpenAPI schema is served at ``/openapi.json``."""
    app = FastAPI(title="Corral", version="0.1.0", description="Structured-output generation, OpenAI-compatible.")
    app.state.ctx = ctx
    app.router.route_class = StrictJSONRoute
    _install_error_handlers(app)

    @app.post("/v1/chat/completions", response_model=ChatCompletion,
              responses={**_ERRORS, 200: {"content": {"text/event-stream": {}}}})
    async def chat(req: ChatCompletionRequest, raw: Request):
        return _respond(await chat_completion(ctx, req, raw))

    @app.post("/v1/completions", response_model=Completion,
              responses={**_ERRORS, 200: {"content": {"text/event-stream": {}}}})
    async def completions(req: CompletionRequest, raw: Request):
        return _respond(await completion(ctx, req, raw))

    @app.get("/v1/models", response_model=ModelList, responses={401: {"model": ErrorResponse}})
    async def models():
        return ModelList(data=[ModelCard(id=ctx.config.model_name, max_model_len=ctx.config.max_model_len,
                                         formats=ctx.config.formats)])

    @app.get("/health", response_model=Health, responses={503: {"model": ErrorResponse}})
    async def health():
        ctx.engine.check_admission(0)
        return Health(native=NativePaths(**native.status()), decode_step=ctx.config.decode_step,
                      decode_burst=ctx.config.decode_burst, deterministic=ctx.config.deterministic)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        text = ctx.metrics.render(ctx.engine.num_in_flight(), ctx.engine.num_compiling())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    app.openapi = lambda: _openapi_with_stream_events(app)
    app.add_middleware(GuardMiddleware, api_keys=ctx.config.api_keys, max_body_bytes=ctx.config.max_body_bytes,
                       protect_all=ctx.config.protect_all, body_timeout_s=ctx.config.body_timeout_s)
    return app


def _openapi_with_stream_events(app: FastAPI) -> dict:
    """FastAPI's document, plus the schema of each streamed SSE event: a chunk, an error body, or ``[DONE]``."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in _STREAM_MODELS.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
            components.update(body.pop("$defs", {}))
            components[f"{model.__name__}Event"] = body
            payload = {"anyOf": [{"$ref": f"#/components/schemas/{model.__name__}Event"},
                                 {"$ref": "#/components/schemas/ErrorResponse"}]}
            # One SSE event: its data is JSON text (a chunk or an error body) or the final ``[DONE]``.
            events = {"type": "object", "required": ["data"], "properties": {
                "event": {"const": "message"},
                "data": {"type": "string", "anyOf": [{"const": "[DONE]"}, {
                    "contentMediaType": "application/json", "contentSchema": payload}]}}}
            schema["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"] = {"schema": events}
        app.openapi_schema = schema
    return app.openapi_schema

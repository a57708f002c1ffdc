"""The FastAPI app: OpenAI-compatible routes, error bodies, API keys, the request size limit, metrics.

:func:`build_app` takes a ready :class:`ServingContext`, so tests can serve any engine (the real one, or a fake
with the same interface); :func:`serve_model` builds the real one. Authentication and the size limit are plain
ASGI middleware: Starlette's ``BaseHTTPMiddleware`` would hide client disconnects from the streaming routes,
and those disconnects are what abort a request and free its KV blocks.

Status codes: 400 for anything the caller got wrong (every ``UserInputError``, and body validation), 401 for a
missing or wrong API key, 404 for an unknown model, 413 for a body over the limit, 429 when the queue is full,
503 when the engine loop has died.
"""

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.requests import Request

from corral.api.context import ClientGoneError, ServingContext
from corral.api.serving_chat import chat_completion
from corral.api.serving_completions import completion
from corral.errors import CorralError
from corral.schemas.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest
from corral.schemas.common import ErrorResponse
from corral.schemas.completions import Completion, CompletionRequest, Health, ModelCard, ModelList

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}
_STREAM_MODELS = {"/v1/chat/completions": ChatCompletionChunk, "/v1/completions": Completion}


def error_body(status: int, message: str, error_type: str, param: str | None = None,
               code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": error_type, "param": param, "code": code}},
                        status_code=status)


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    first = err.errors()[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    where = ".".join(loc)
    if first.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {where}", where or None
    return f"{where or 'body'}: {first.get('msg', 'invalid value')}", where or None


class GuardMiddleware:
    """API keys (``Authorization: Bearer <key>`` on ``/v1/*``) and the request body size limit."""

    def __init__(self, app, api_keys: tuple[str, ...], max_body_bytes: int):
        self.app, self.api_keys, self.max_body_bytes = app, frozenset(api_keys), max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_keys and scope["path"].startswith("/v1"):
            if headers.get("authorization", "").removeprefix("Bearer ").strip() not in self.api_keys:
                response = error_body(401, "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
                                      "invalid_request_error", code="invalid_api_key")
                return await response(scope, receive, send)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return await self._too_large(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope, receive, send):
        response = error_body(413, f"The request body is larger than {self.max_body_bytes} bytes.",
                              "invalid_request_error", code="request_too_large")
        await response(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


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


def _respond(result):
    if hasattr(result, "model_dump"):
        return JSONResponse(result.model_dump(mode="json"))
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def build_app(ctx: ServingContext) -> FastAPI:
    """The OpenAI-compatible app over ``ctx``. Its OpenAPI schema is served at ``/openapi.json``."""
    app = FastAPI(title="Corral", version="0.1.0", description="Structured-output generation, OpenAI-compatible.")
    app.state.ctx = ctx
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
        return ModelList(data=[ModelCard(id=ctx.config.model_name, max_model_len=ctx.config.max_model_len)])

    @app.get("/health", response_model=Health, responses={503: {"model": ErrorResponse}})
    async def health():
        ctx.engine.check_admission(0)
        return Health()

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    app.openapi = lambda: _openapi_with_stream_events(app)
    app.add_middleware(GuardMiddleware, api_keys=ctx.config.api_keys, max_body_bytes=ctx.config.max_body_bytes)
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

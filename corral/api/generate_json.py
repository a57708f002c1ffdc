"""``corral.generate_json`` and a small function-calling helper, in-process or against a running server.

Both speak the chat-completions request shape. With ``base_url`` the request goes over HTTP to a Corral (or any
OpenAI-compatible, structured-output capable) server; without, it runs on an embedded engine created on first
use and kept for the process. Building that engine also freezes the process's heap out of the garbage collector,
as ``corral serve`` does (``corral.api.launch.warm_up``): objects alive then, the caller's too, are never walked
by a collection again, so a cycle among them that later becomes garbage is not freed. An engine passed as
``engine=`` changes nothing of the kind. The result is checked again here (``jsonschema`` or the pydantic model): the
engine's guarantee is the contract, the check is the receipt. Greedy decoding is the default (``temperature=0``)
since extraction wants the most likely value, not a sample; without ``max_tokens`` the output may use the rest of
the context window (the grammar, not a token budget, ends a JSON value).
"""

import json
import threading
from typing import Any, NamedTuple

import httpx
import jsonschema

from corral.errors import CorralError

_embedded_lock = threading.Lock()
_embedded: dict = {}


class IncompleteOutputError(CorralError):
    """The output stopped before the constraint was complete (``max_tokens`` reached, or an engine error)."""


class ParsedCall(NamedTuple):
    name: str
    arguments: dict


_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")


def _closed(schema):
    """A pydantic schema with its objects closed (``additionalProperties: false``) where it says nothing, as
    OpenAI's client does for ``parse``: the model's fields are what is wanted, not whatever else would validate."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(sub) for sub in out[key]]
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _schema_of(schema_or_model) -> tuple[dict | bool, type | None]:
    if isinstance(schema_or_model, type) and hasattr(schema_or_model, "model_json_schema"):
        return _closed(schema_or_model.model_json_schema()), schema_or_model
    return schema_or_model, None


def _messages(prompt: str | list[dict], system: str | None) -> list[dict]:
    if isinstance(prompt, list):
        return prompt
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def _embedded_engine(model: str | None):
    with _embedded_lock:
        if model not in _embedded:
            from corral.api.launch import build_compiler, build_engine, engine_max_model_len, warm_up
            from corral.engine import EngineConfig

            engine = build_engine(EngineConfig(model=model, dtype="auto", quantization="auto"))  # as corral serve
            compiler = build_compiler(engine)
            warm_up(compiler)  # as the server does: no full collection of the model's objects mid-generation
            _embedded[model] = (engine, compiler, engine_max_model_len(engine), threading.Lock())
        return _embedded[model]


def _run_embedded(body: dict, model: str | None, engine) -> dict:
    from corral.schemas.chat import ChatCompletionRequest
    from corral.schemas.prepare import prepare_chat

    engine, compiler, max_model_len, lock = _embedded_engine(model) if engine is None else _wrapped(engine)
    req = ChatCompletionRequest(model="embedded", **body)
    prepared = prepare_chat(req, engine.tokenizer, max_model_len=max_model_len)
    guide = None if prepared.constraint is None else compiler.compile(prepared.constraint).new_guide()
    with lock:  # the engine is single-threaded; the embedded path serialises its callers
        result = engine.generate([prepared.prompt_token_ids], prepared.params, guides=[guide])[0]
    out = min(result.outputs, key=lambda o: o.index)
    return {"text": out.text, "finish_reason": out.finish_reason, "tool_mode": prepared.tool_mode}


def _wrapped(engine):
    with _embedded_lock:
        if id(engine) not in _embedded:
            from corral.api.launch import build_compiler, engine_max_model_len

            # the caller built this engine and decides how its process is tuned: no heap freeze here (the
            # default engine is ours, and is served as corral serve serves it)
            _embedded[id(engine)] = (engine, build_compiler(engine), engine_max_model_len(engine), threading.Lock())
        return _embedded[id(engine)]


def _run_remote(body: dict, base_url: str, api_key: str | None, model: str | None, timeout: float) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # Accept the server root and the OpenAI client's form (".../v1") alike.
    root = base_url.rstrip("/").removesuffix("/v1")
    with httpx.Client(base_url=root, headers=headers, timeout=timeout) as client:
        if model is None:
            models = client.get("/v1/models")
            models.raise_for_status()
            model = models.json()["data"][0]["id"]
        response = client.post("/v1/chat/completions", json={"model": model, **body})
    if response.status_code != 200:
        raise _remote_error(response)
    choice = response.json()["choices"][0]
    return {"message": choice["message"], "finish_reason": choice["finish_reason"]}


def _remote_error(response: httpx.Response) -> CorralError:
    from corral.errors import InvalidRequestError

    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    error = InvalidRequestError if response.status_code == 400 else CorralError
    return error(f"server answered {response.status_code}: {message}")


def _chat(body: dict, base_url, api_key, model, timeout, engine) -> tuple[str | None, list[ParsedCall], str]:
    """(content, tool calls, finish_reason) of one chat completion, embedded or remote."""
    from corral.schemas.tools import split_tool_calls

    if base_url is None:
        run = _run_embedded(body, model, engine)
        content, calls = (split_tool_calls(run["text"]) if run["tool_mode"] != "none" else (run["text"], []))
        parsed = [ParsedCall(name, json.loads(args)) for name, args in calls]
        reason = "tool_calls" if parsed and run["finish_reason"] == "stop" else run["finish_reason"]
        return content, parsed, reason
    run = _run_remote(body, base_url, api_key, model, timeout)
    message = run["message"]
    parsed = [ParsedCall(c["function"]["name"], json.loads(c["function"]["arguments"]))
              for c in message.get("tool_calls") or ()]
    return message.get("content"), parsed, run["finish_reason"]


def generate_json(schema_or_model, prompt: str | list[dict], *, base_url: str | None = None,
                  api_key: str | None = None, model: str | None = None, system: str | None = None,
                  timeout: float = 600.0, engine=None, **sampling) -> Any:
    """Generate one JSON value that matches ``schema_or_model`` (a JSON Schema dict, or a pydantic model class).

    Returns the parsed value (a dict for object schemas), or an instance of the pydantic model. ``sampling``
    takes the chat-completions parameters (``max_tokens``, ``temperature``, ``seed``, ``top_p``, ...).
    ``engine``: an ``LLMEngine`` to run on in-process instead of the lazily created default one (whose creation
    freezes the process's heap: see the module's docstring).
    Raises ``UserInputError`` subclasses for a bad schema, :class:`IncompleteOutputError` when the output was cut.
    """
    schema, model_cls = _schema_of(schema_or_model)
    body = {"messages": _messages(prompt, system), "temperature": 0.0, **sampling,
            "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}}
    content, _, reason = _chat(body, base_url, api_key, model, timeout, engine)
    if reason != "stop":
        raise IncompleteOutputError(f"the output ended with finish_reason={reason!r} before the JSON value was "
                                    f"complete; raise max_tokens. Partial output: {content!r:.200}")
    if model_cls is not None:
        return model_cls.model_validate_json(content)
    value = json.loads(content)
    jsonschema.validate(value, schema)
    return value


def call_tools(tools: list[dict], prompt: str | list[dict], *, tool_choice: str | dict = "required",
               parallel: bool = False, base_url: str | None = None, api_key: str | None = None,
               model: str | None = None, system: str | None = None, timeout: float = 600.0, engine=None,
               **sampling) -> tuple[str | None, list[ParsedCall]]:
    """Tools in (OpenAI ``tools`` entries), parsed calls out: ``(text, [ParsedCall(name, arguments), ...])``.
    With ``tool_choice='auto'`` the model may answer in text instead; the text is then returned, with no calls."""
    body = {"messages": _messages(prompt, system), "temperature": 0.0, **sampling,
            "tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel}
    content, calls, reason = _chat(body, base_url, api_key, model, timeout, engine)
    if reason not in ("stop", "tool_calls"):
        raise IncompleteOutputError(f"the output ended with finish_reason={reason!r}; raise max_tokens")
    return content, calls

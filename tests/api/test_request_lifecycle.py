"""A request's life in the gateway, on a scripted engine and the real compiler: a client that leaves while its
schema compiles, a stream whose reader stops reading, a chunked body past the limit, keys on the other routes.
Oracles: the engine's own record of what was added and aborted, its block count, and the admission counters."""

import asyncio
import json
import socket
import time

import httpx
import pytest

from corral.api.server import build_app
from corral.errors import CompileCancelledError
from corral.fsm.compiler import GrammarCompiler
from corral.fsm.vocabulary import Vocabulary
from corral.models import load_tokenizer

from api_fakes import FakeEngine
from api_serving import make_context, running_server

MSG = [{"role": "user", "content": "hi"}]
BIG = {"type": "object", "properties": {f"p{i}": {"type": "integer", "minimum": i} for i in range(4_000)}}
# 4,000 optional members (under the 5,000-property cap, and quadratic to build): compiles for seconds, then is refused


class RecordingCompiler(GrammarCompiler):
    """The real compiler, remembering how each compile ended."""

    def __init__(self, vocab):
        super().__init__(vocab, time_budget_s=60)
        self.endings = []

    def compile(self, constraint, budget=None):
        try:
            grammar = super().compile(constraint, budget)
        except Exception as err:
            self.endings.append(type(err))
            raise
        self.endings.append("ok")
        return grammar


class SlowEngine(FakeEngine):
    def step(self):
        time.sleep(0.01)
        return super().step()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def server(tok):
    vocab = Vocabulary.from_tokenizer(tok)
    engine, compiler = SlowEngine(tok, lambda prompt, params: "word " * 2000, vocabulary=vocab), RecordingCompiler(vocab)
    ctx = make_context(engine, compiler, tok, vocab, api_keys=("sk-test",), protect_all=True, send_timeout_s=0.5,
                       max_body_bytes=4 << 20)
    with running_server(ctx) as url:
        yield url, engine, compiler, ctx


HEADERS = {"Authorization": "Bearer sk-test"}


def _wait(condition, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_a_client_that_leaves_while_its_schema_compiles_leaves_nothing_behind(server):
    url, engine, compiler, ctx = server
    added = len(engine.added)
    body = {"model": "test-model", "messages": MSG, "max_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": BIG}}}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up (and closes the connection) after 1 s
        httpx.post(url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=httpx.Timeout(30, read=1.0))
    gone = time.monotonic()
    assert _wait(lambda: ctx.engine.num_compiling() == 0 and ctx.engine.num_in_flight() == 0)
    assert time.monotonic() - gone < 2  # the compile stopped: it was cancelled, not finished
    assert _wait(lambda: compiler.endings and compiler.endings[-1] is CompileCancelledError)
    assert len(engine.added) == added and not engine.requests and engine.stats().num_kv_blocks_used == 0


async def _stalled_stream(app, body: bytes) -> list[dict]:
    """Drive one streaming request through the ASGI app with a client that takes the headers and nothing more:
    every body send blocks for ever. Returns what was sent before the app gave up."""
    sent, request_sent = [], False

    async def receive():
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client never disconnects; it just stops reading

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body":
            await asyncio.Event().wait()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",  # uvicorn's
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
             "headers": [(b"content-type", b"application/json"), (b"authorization", b"Bearer sk-test"),
                         (b"content-length", str(len(body)).encode())]}
    await asyncio.wait_for(app(scope, receive, send), timeout=20)
    return sent


def test_a_reader_that_stops_reading_loses_its_request_after_the_send_timeout(server):
    url, engine, _, ctx = server
    aborted = len(engine.aborted)
    body = json.dumps({"model": "test-model", "messages": MSG, "max_tokens": 1500, "stream": True}).encode()
    start = time.monotonic()
    sent = asyncio.run(_stalled_stream(build_app(ctx), body))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert time.monotonic() - start < 5  # 0.5 s timeout; the request alone would run 1,500 steps of 10 ms
    assert _wait(lambda: len(engine.aborted) > aborted and not engine.requests)
    assert ctx.engine.num_in_flight() == 0 and engine.stats().num_kv_blocks_used == 0


def test_a_chunked_body_past_the_limit_is_413(server):
    url = server[0]
    host, port = url.removeprefix("http://").split(":")
    chunk = b"x" * 65536
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-test\r\n"
                     b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            for _ in range(80):  # 5 MB, past the 4 MB limit; the server may answer (and close) before the end
                sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    error = json.loads(payload.split(b"\r\n")[-3] if b"chunked" in head.lower() else payload)["error"]
    assert error["code"] == "request_too_large" and "larger than 4194304 bytes" in error["message"]


def test_protect_all_puts_metrics_and_docs_behind_the_key_but_not_health(server):
    url = server[0]
    for path in ("/metrics", "/docs", "/openapi.json"):
        assert httpx.get(url + path).status_code == 401
        assert httpx.get(url + path, headers=HEADERS).status_code == 200
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/nowhere", headers=HEADERS).json()["error"]["message"] == "Not Found"


def test_nan_in_a_body_is_refused(server):
    text = '{"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
    response = httpx.post(server[0] + "/v1/chat/completions", content=text, headers={
        **HEADERS, "Content-Type": "application/json"})
    assert response.status_code == 400 and "NaN is not a JSON number" in response.json()["error"]["message"]


@pytest.mark.parametrize("extra, param, message", [
    ({"guided_regex": "a{2147483648}"}, "guided_regex", "past the limit of 1000000"),
    ({"structured_outputs": {"grammar": 'root ::= [z-a]'}}, "structured_outputs.grammar", "reversed"),
    ({"guided_json": "[" * 100_000}, "guided_json", "nests too deeply"),
    ({"guided_choice": []}, "guided_choice", "at least one choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "keyword 'type' at '#'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nowhere"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters", "points to nothing"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
      "tool_choice": "auto", "response_format": {"type": "json_schema", "json_schema": {
          "name": "x", "schema": {"type": "strin"}}}}, "response_format", "keyword 'type' at '#'"),
])
def test_a_constraints_own_error_names_the_field_it_came_from(server, extra, param, message):
    """Errors found in a constraint, while it is read or compiled, name the request field that holds it (they
    named none before)."""
    url = server[0]
    body = {"model": "test-model", "messages": MSG, "max_tokens": 5, **extra}
    response = httpx.post(url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param, error

"""Connections a slow or idle client cannot hold (``corral.api.connections`` and the body deadline): over raw
sockets against the gateway on a scripted engine, with bounds small enough to meet in a test."""

import json
import socket
import time

import httpx
import pytest

from corral.fsm.vocabulary import Vocabulary
from corral.models import load_tokenizer

from api_fakes import FakeCompiler, FakeEngine
from api_serving import make_context, running_server

HEADER_TIMEOUT_S, BODY_TIMEOUT_S, MAX_CONNECTIONS = 0.6, 0.8, 6
REQUEST = json.dumps({"model": "test-model", "prompt": "hi", "max_tokens": 4}).encode()


@pytest.fixture(scope="module")
def server():
    tok = load_tokenizer()
    ctx = make_context(FakeEngine(tok, lambda prompt_ids, params: "ok"), FakeCompiler(), tok,
                       Vocabulary.from_tokenizer(tok), header_timeout_s=HEADER_TIMEOUT_S,
                       body_timeout_s=BODY_TIMEOUT_S, max_connections=MAX_CONNECTIONS)
    with running_server(ctx) as url:
        yield url


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    return sock


def read_until_closed(sock: socket.socket, limit_s: float = 5.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed (seconds from the call)."""
    start, data = time.monotonic(), b""
    sock.settimeout(limit_s)
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data, time.monotonic() - start
        data += chunk


def post_head(length: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {length}\r\n\r\n").encode()


def status_and_body(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(server):
    with connect(server) as sock:
        data, after = read_until_closed(sock)
    assert data == b"" and HEADER_TIMEOUT_S * 0.8 < after < HEADER_TIMEOUT_S + 2


def test_half_a_header_gets_a_408_and_the_connection_closes(server):
    with connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-le")
        data, after = read_until_closed(sock)
    status, body = status_and_body(data)
    assert status == 408 and body["error"]["code"] == "request_timeout" and "headers" in body["error"]["message"]
    assert after < HEADER_TIMEOUT_S + 2


def test_a_trickled_body_gets_a_408_once_its_deadline_passes(server):
    with connect(server) as sock:
        sock.sendall(post_head(len(REQUEST)))
        start = time.monotonic()
        for byte in REQUEST[:6]:  # a byte every 0.2 s: each in time for the header bound, none for the body's
            sock.sendall(bytes([byte]))
            time.sleep(0.2)
        data, _ = read_until_closed(sock)
        after = time.monotonic() - start
    status, body = status_and_body(data)
    assert status == 408 and body["error"]["code"] == "request_timeout" and "body" in body["error"]["message"]
    assert BODY_TIMEOUT_S * 0.8 < after < BODY_TIMEOUT_S + 2


def test_requests_in_time_are_served_on_one_keep_alive_connection(server):
    """Two requests, each body sent in two parts, the second request after a pause shorter than the header
    bound: both answered 200 on the same connection, which then closes once idle."""
    with connect(server) as sock:
        for _ in range(2):
            sock.sendall(post_head(len(REQUEST)) + REQUEST[:10])
            time.sleep(BODY_TIMEOUT_S / 3)
            sock.sendall(REQUEST[10:])
            sock.settimeout(5)
            response = b""
            while b"\r\n\r\n" not in response or not response.rstrip().endswith(b"}"):
                response += sock.recv(65536)
            status, body = status_and_body(response)
            assert status == 200 and body["choices"][0]["text"] == "ok"
            time.sleep(HEADER_TIMEOUT_S / 3)
        data, _ = read_until_closed(sock)
    assert data == b""


def test_past_the_connection_cap_a_new_connection_gets_a_503_and_the_rest_go_on(server):
    held = [connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.1)  # each accepted before the next test connection
        with connect(server) as extra:
            data, _ = read_until_closed(extra)
        status, body = status_and_body(data)
        assert status == 503 and body["error"]["code"] == "too_many_connections"
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)  # the server sees them go
    assert httpx.get(server + "/health", timeout=5).status_code == 200

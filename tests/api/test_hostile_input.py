"""Hostile input against a real ``corral serve`` process (the CLI, the real model, the real compiler).

Oracles: the server must keep answering ``/health`` while each hostile request is handled (a probe thread asks
every 50 ms; p99 under 250 ms), and every hostile request must end within the compile budget plus 1 s with a
typed 400 or a valid answer. Admission counts a request from its arrival, and SIGTERM ends the process within
the grace period plus 2 s whatever it is compiling. The patterns here make Python's ``re`` backtrack for minutes
(``^(a+)+$`` against 40 ``a`` and a ``!``); answers are checked by structure, never with ``re``.
"""

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from corral.api.launch import free_port

pytestmark = pytest.mark.slow

BUDGET_S = 3.0
MAX_TOOLS = 24  # the test server's bound: 24 non-trivial tools still fit the model's context in the prompt
MODEL = "SmolLM2-135M-Instruct"


def _start(*flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "corral.cli", "serve", "--port", str(port), "--log-level",
                             "warning", "--max-model-len", "4096", *flags], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"corral serve exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("corral serve did not start within 180 s")


@pytest.fixture(scope="module")
def server():
    proc, url = _start("--compile-time-budget-s", str(BUDGET_S), "--max-in-flight", "4",
                       "--max-tools", str(MAX_TOOLS))
    yield url
    proc.kill()
    proc.wait()


PROBE_SCRIPT = """
import sys, time, httpx
with httpx.Client(timeout=10) as client:
    while True:
        start = time.monotonic()
        try:
            status = client.get(sys.argv[1] + "/health").status_code
        except httpx.HTTPError as err:
            status = repr(err)
        print(time.monotonic() - start, status, flush=True)
        time.sleep(max(0.0, 0.05 - (time.monotonic() - start)))
"""


class Probe:
    """GET /health every 50 ms from a process of its own (so nothing of the test process's own work, its
    garbage collections or its serializing of a 2 MB body, shows in the latencies)."""

    def __init__(self, url: str):
        self.url, self.latencies, self.failures = url, [], []
        self._proc = None
        self._reader = None

    def _read(self) -> None:
        for line in self._proc.stdout:
            seconds, status = line.split(maxsplit=1)
            self.latencies.append(float(seconds))
            if status.strip() != "200":
                self.failures.append(status.strip())

    def __enter__(self):
        self._proc = subprocess.Popen([sys.executable, "-c", PROBE_SCRIPT, self.url], stdout=subprocess.PIPE,
                                      text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._wait_for(1)
        return self

    def __exit__(self, *exc):
        self._wait_for(len(self.latencies) + 1)  # one probe at least after the request ended
        self._proc.kill()
        self._proc.wait()
        self._reader.join(timeout=5)

    def _wait_for(self, num: int) -> None:
        deadline = time.monotonic() + 30
        while len(self.latencies) < num and time.monotonic() < deadline:
            time.sleep(0.005)

    def p99(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _chat(url: str, body: dict | bytes, timeout: float = 60) -> tuple[httpx.Response, float]:
    """POST a chat request (a body from :func:`_encode`, or a dict to encode)."""
    content = body if isinstance(body, bytes) else _encode(body)
    start = time.monotonic()
    response = httpx.post(url + "/v1/chat/completions", content=content, timeout=timeout,
                          headers={"Content-Type": "application/json"})
    return response, time.monotonic() - start


def _encode(body: dict) -> bytes:
    """A chat request's JSON; a ``RawSchema`` in ``body`` is spliced in as JSON text (too deep for json.dumps)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 24,
            "temperature": 0, **body}
    text = json.dumps(body, default=lambda raw: raw.marker)
    for raw in _raw_parts(body):
        text = text.replace(json.dumps(raw.marker), raw.text)
    return text.encode()


class RawSchema:
    def __init__(self, text: str):
        self.text, self.marker = text, f"raw-{id(self)}"


def _raw_parts(value):
    if isinstance(value, RawSchema):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _raw_parts(item)


def _schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


EVIL_NAME = "a" * 36 + "b"  # ^(a|aa)*$ fails on it only after trying every split


def _ok_names(content: str) -> bool:
    value = json.loads(content)
    return isinstance(value.get(EVIL_NAME), bool) and set(value) == {EVIL_NAME}


def _word_keys(content: str) -> bool:
    value = json.loads(content)
    return set(value) == {"ok"} and isinstance(value["ok"], int)


def _big_props(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer", "minimum": i} for i in range(n)},
            "required": [f"p{i}" for i in range(0, n, 2)]}


def _slow_props(n: int) -> dict:
    """Optional members only, under the declared-property cap: seconds to build (quadratic), then refused."""
    return {"type": "object", "properties": {f"p{i}": {"type": "integer", "minimum": i} for i in range(n)}}


def _nested(depth: int) -> RawSchema:
    return RawSchema('{"type":"object","required":["a"],"properties":{"a":' * depth + '{"type":"integer"}'
                     + "}}" * depth)


NAME_SCHEMA = {"type": "object", "patternProperties": {"^(a|aa)*$": {"type": "integer"}},
               "properties": {EVIL_NAME: {"type": "boolean"}}, "required": [EVIL_NAME], "additionalProperties": False}
WORDS_SCHEMA = {"type": "object", "propertyNames": {"pattern": "^(\\w+\\s?)*$"},
                "properties": {"word " * 20 + "!": {"type": "integer"}, "ok": {"type": "integer"}},
                "required": ["ok"], "additionalProperties": False}

# (name, body, the check of a 200's content or None when a 400 is the only right answer)
CASES = [
    ("enum against ^(a+)+$", _schema({"enum": ["a" * 40 + "!", "aaa"], "pattern": "^(a+)+$"}),
     lambda content: content == '"aaa"'),
    ("const against (.*a){12}", _schema({"const": "a" * 11 + "c" * 30, "pattern": "(.*a){12}"}), None),
    ("declared name against patternProperties", _schema(NAME_SCHEMA), _ok_names),
    ("declared names against propertyNames", _schema(WORDS_SCHEMA), _word_keys),
    ("the same as tool parameters", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": NAME_SCHEMA}}], "tool_choice": "required"}, "tool_call"),
    ("20,000 enum members under a pattern", _schema({"enum": [f"v{i}" for i in range(20_000)],
                                                     "pattern": "^v(1|2|3)+$", "maxLength": 3}),
     lambda content: json.loads(content) in {"v1", "v2", "v3", "v11", "v12", "v13", "v21", "v22", "v23", "v31",
                                             "v32", "v33"}),
    ("a 2 MB schema", _schema(_big_props(38_000)), None),
    ("a oneOf bomb", _schema({"allOf": [{"oneOf": [{"type": "integer"}, {"minimum": i}]} for i in range(20)]}),
     None),
    ("a $ref chain 10,000 deep", _schema({"$defs": {**{f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(10_000)},
                                                    "d10000": {"type": "integer"}}, "$ref": "#/$defs/d0"}), None),
    ("a body nested 3,000 deep (past the JSON parser)", _schema(_nested(3_000)), None),
    ("a schema nested 400 deep (past the compiler)", _schema(_nested(400)), None),
    ("(a{1000}){1000}", {"structured_outputs": {"regex": "(a{1000}){1000}"}}, lambda content: set(content) == {"a"}),
    ("a counted repeat of every character", {"structured_outputs": {"regex": "[\\u0000-\\U0010ffff]{100000}"}},
     "length"),  # nothing can end it within max_tokens
    ("(x+x+)+y", {"structured_outputs": {"regex": "(x+x+)+y"}}, lambda content: set(content) <= {"x", "y"}),
    # counts past the automaton's 32-bit ones, in each syntax that takes one (they were 500s)
    ("a regex count of 2**31", {"structured_outputs": {"regex": "a{2147483648}"}}, None),
    ("a regex count of 2**63", {"guided_regex": "x{1,9223372036854775808}"}, None),
    ("a GBNF count of 2**31", {"structured_outputs": {"grammar": 'root ::= "a"{2147483648}'}}, None),
    ("a Lark terminal count of 2**31", {"structured_outputs": {"grammar": 'start: A\nA: "a" ~ 2147483648'}}, None),
    ("a Lark regex count of 2**31", {"guided_grammar": "start: /a{2147483648}/"}, None),
    # a schema sent as JSON text that Python's parser cannot take (they were 500s)
    ("a schema as JSON text nested 100,000 deep", {"guided_json": "[" * 100_000}, None),
    ("a schema as JSON text with a 5,000-digit integer", {"guided_json": '{"const": ' + "7" * 5_000 + "}"}, None),
]
REGEX_CASES = {"(a{1000}){1000}", "(x+x+)+y"}  # their checks hold for a truncated output too


@pytest.mark.parametrize("name, body, check", CASES, ids=[c[0] for c in CASES])
def test_hostile_requests_end_in_time_and_health_keeps_answering(server, name, body, check):
    content = _encode(body)
    with Probe(server) as probe:
        response, seconds = _chat(server, content)
    assert seconds < BUDGET_S + 1, f"{name}: {seconds:.2f} s"
    assert probe.p99() < 0.25 and not probe.failures, (name, probe.p99(), probe.failures)
    if check is None:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
        if "nested" in name:
            assert "nest" in error["message"], error["message"]
        return
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    if check == "tool_call":
        assert choice["finish_reason"] in ("tool_calls", "length")
        if choice["finish_reason"] == "tool_calls":
            assert _ok_names(choice["message"]["tool_calls"][0]["function"]["arguments"])
    elif check == "length":
        assert choice["finish_reason"] == "length" and choice["message"]["content"]
    elif choice["finish_reason"] == "stop" or name in REGEX_CASES:
        assert check(choice["message"]["content"]), choice["message"]["content"]


def test_siblings_of_the_largest_seed_answer_beside_another_request(server):
    """n = 2 with seed 2**64 - 1, the largest the API takes: the second sibling's seed passed torch's range and
    failed the engine step, with it every request in flight (a 500 for both)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        top = pool.submit(_chat, server, {"n": 2, "seed": 2**64 - 1, "temperature": 1.0, "max_tokens": 8})
        plain = pool.submit(_chat, server, {"max_tokens": 8})
        (top, _), (plain, _) = top.result(), plain.result()
    assert top.status_code == 200 and len(top.json()["choices"]) == 2, top.text
    assert plain.status_code == 200, plain.text


def _tool(i: int) -> dict:
    return {"type": "function", "function": {"name": f"tool_{i}", "description": f"Tool {i}.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                         f"days_{i}": {"type": "integer", "minimum": 1, "maximum": 14},
                                         "when": {"type": "string", "format": "date"}},
        "required": ["city", f"days_{i}"], "additionalProperties": False}}}


def test_tools_at_the_bound_compile_and_past_it_are_refused(server):
    bodies = [_encode({"tools": [_tool(i) for i in range(n)], "max_tokens": 8}) for n in (MAX_TOOLS, MAX_TOOLS + 1)]
    with Probe(server) as probe:
        at_bound, seconds = _chat(server, bodies[0])
        past, _ = _chat(server, bodies[1])
    assert at_bound.status_code == 200, at_bound.text
    assert seconds < 30  # a prompt of some 3,000 tokens is prefilled on the CPU
    assert past.status_code == 400 and f"at most {MAX_TOOLS} tools" in past.json()["error"]["message"]
    assert past.json()["error"]["param"] == "tools"
    assert probe.p99() < 0.25 and not probe.failures


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_admission_counts_requests_from_arrival(server):
    """max_in_flight=4: four constrained requests whose schemas take a second or more to compile are admitted,
    and three more sent while the first four are still compiling (two) or waiting to (two) get exactly three
    429s: a request counts from its arrival, not from when it reaches the engine."""
    def slow(i: int):  # distinct schemas (no compile is a cache hit), about a second each to compile
        schema = {"title": f"admission {i}", "anyOf": [
            {"type": "object", "properties": {f"k{j}": {"const": j}}, "required": [f"k{j}"]} for j in range(1000)]}
        return _chat(server, {**_schema(schema), "max_tokens": 4})[0]

    with concurrent.futures.ThreadPoolExecutor(7) as pool:
        first = [pool.submit(slow, i) for i in range(4)]
        deadline = time.monotonic() + 30
        # one reading per look: a second one could come after the first compiles (about a second each) finished
        while (compiling := _metric(server, "corral:num_requests_compiling")) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert compiling == 4  # none of the four is at the engine yet
        extra = [pool.submit(slow, 10 + i) for i in range(3)]
        extra_codes = [f.result().status_code for f in extra]
        first_codes = [f.result().status_code for f in first]
    assert extra_codes == [429, 429, 429]
    assert all("at capacity (4 requests in flight)" in f.result().json()["error"]["message"] for f in extra)
    assert first_codes == [200, 200, 200, 200]
    assert _metric(server, "corral:num_requests_in_flight") == 0


def test_unknown_keywords_are_warned_about_or_refused(server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLenght": 3}}, "required": ["name"]}
    response, _ = _chat(server, _schema(schema))
    assert response.status_code == 200
    assert response.json()["warnings"] == [
        "unknown keyword 'maxLenght' at '#/properties/name' ignored: not JSON Schema vocabulary, so it constrains "
        "nothing (did you mean 'maxLength'?)"]
    strict = {**_schema(schema), "structured_outputs": {"reject_unknown_keywords": True}}
    response, _ = _chat(server, strict)
    assert response.status_code == 400
    assert "keyword 'maxLenght' at '#/properties/name'" in response.json()["error"]["message"]


def test_sigterm_during_a_hostile_compile_exits_within_the_grace_period():
    proc, url = _start("--compile-time-budget-s", "60", "--shutdown-grace-s", "1")
    answers = []
    try:
        compiling = threading.Thread(target=lambda: answers.append(_chat(url, _schema(_slow_props(4_000)),
                                                                         timeout=120)[0]), daemon=True)
        compiling.start()
        deadline = time.monotonic() + 30
        while _metric(url, "corral:num_requests_compiling") < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _metric(url, "corral:num_requests_compiling") == 1
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.TransportError):  # new requests are refused at once
            httpx.get(url + "/health", timeout=1)
        assert proc.wait(timeout=10) == 0  # a clean exit, not the watchdog's
        # the grace period, then the interpreter's exit: 1.7-2.1 s idle, 3.27 once on a loaded 2-core machine (the 503
        # below, not this bound, is what shows the compile was cancelled rather than waited for)
        assert time.monotonic() - start < 1 + 3
        compiling.join(timeout=5)
        # the compile (seconds more to go) was cancelled at the end of the grace period, and its client told so
        assert answers and answers[0].status_code == 503, answers and answers[0].text
        assert "shut down before this request finished" in answers[0].json()["error"]["message"]
    finally:
        proc.kill()

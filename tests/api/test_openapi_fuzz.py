"""schemathesis against the server's own OpenAPI document: no 500 and no response outside the documented schemas.

The engine is the fake (generation speed is not what this checks), but it picks its tokens with the real Sampler
from random logits under the request's own parameters, and the compiler is the real one, so generated sampling
knobs, ``response_format`` schemas, regexes and tool ``parameters`` all go through the real code. The
run is bounded: a fixed number of examples per operation, each with a short output budget.
"""

import json

import httpx
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                 status_code_conformance)

from corral.fsm.compiler import GrammarCompiler
from corral.fsm.vocabulary import Vocabulary
from corral.models import load_tokenizer

from api_fakes import FakeEngine
from api_serving import make_context, running_server

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def base_url():
    tok = load_tokenizer()
    vocab = Vocabulary.from_tokenizer(tok)
    engine = FakeEngine(tok, lambda prompt, params: "ok", vocabulary=vocab, sample=True)
    # A short context bounds every generated request's output (max_tokens past it is a 400).
    ctx = make_context(engine, GrammarCompiler(vocab, time_budget_s=2.0), tok, vocab, default_max_tokens=8,
                       max_model_len=96)
    with running_server(ctx) as url:
        yield url


def check_events(body: str, document: dict, path: str) -> None:
    """Each SSE event's JSON against the documented event schema (``contentSchema`` is not checked by
    schemathesis, JSON Schema makes it an annotation), and the stream ends with ``[DONE]``."""
    events = [line.removeprefix("data: ") for line in body.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    content = document["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    payload = {**content["properties"]["data"]["anyOf"][1]["contentSchema"], "components": document["components"]}
    for event in events[:-1]:
        jsonschema.validate(json.loads(event), payload)


@pytest.mark.parametrize("path, method, examples", [
    ("/v1/chat/completions", "POST", 60), ("/v1/completions", "POST", 40), ("/v1/models", "GET", 3),
    ("/health", "GET", 3), ("/metrics", "GET", 3)])
def test_openapi_operations_hold_their_contract(base_url, path, method, examples):
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    document = httpx.get(base_url + "/openapi.json").json()
    operation = schema[path][method]
    seen_statuses = []

    # derandomize: the cases are a fixed function of the test, so CI sees the same ones every run (an unseeded
    # run once drew 40 completions that all failed validation, and the 200 check below failed by chance)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy())
    def check(case):
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = "test-model"  # else nearly every case would stop at the 404 for the model name
        response = case.call(base_url=base_url, timeout=30)
        seen_statuses.append(response.status_code)
        case.validate_response(response, checks=CHECKS)
        if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
            check_events(response.text, document, path)

    check()
    assert seen_statuses and all(code in (200, 400, 404, 413, 429) for code in seen_statuses), seen_statuses
    print(path, {code: seen_statuses.count(code) for code in sorted(set(seen_statuses))})
    assert 200 in seen_statuses  # the run reached the generation path, not only the validation errors

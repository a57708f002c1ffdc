"""The gateway over real HTTP with the official openai client, on a scripted engine: wire shapes, errors with
their status and message, streaming, disconnects, overload and metrics. The model-backed twin is test_e2e.py."""

import json
import time

import httpx
import openai
import pytest

from corral.fsm.vocabulary import Vocabulary
from corral.models import load_tokenizer

from api_fakes import FakeCompiler, FakeEngine
from api_serving import make_context, running_server

MSG = [{"role": "user", "content": "hi"}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city":"Paris"}}</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class SlowEngine(FakeEngine):
    def step(self):
        time.sleep(0.02)
        return super().step()


def script(prompt_ids, params):
    return CALL if params.max_tokens == 77 else '{"a": 1}' if params.max_tokens < 100 else "word " * 300


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def server(tok):
    engine, compiler = SlowEngine(tok, script), FakeCompiler()
    ctx = make_context(engine, compiler, tok, Vocabulary.from_tokenizer(tok), api_keys=("sk-test",),
                       max_body_bytes=20_000, max_in_flight=4)
    with running_server(ctx) as url:
        yield url, engine, compiler, ctx


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="sk-test", max_retries=0)


def test_chat_completion_shape_and_usage(client, tok):
    out = client.chat.completions.create(model="test-model", messages=MSG, max_tokens=20, logprobs=True,
                                         top_logprobs=0)
    assert out.choices[0].message.content == '{"a": 1}' and out.choices[0].finish_reason == "stop"
    assert [t.token for t in out.choices[0].logprobs.content] == [tok.decode([i]) for i in tok.encode('{"a": 1}')]
    prompt = tok.encode(tok.apply_chat_template(MSG))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), len(tok.encode('{"a": 1}')))
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_constraint_reaches_the_compiler_and_tools_become_tool_calls(client, server):
    compiler = server[2]
    client.chat.completions.create(model="test-model", messages=MSG, max_tokens=20,
                                   extra_body={"structured_outputs": {"regex": "[a-z]+"}})
    assert compiler.compiled[-1].kind == "regex" and compiler.compiled[-1].value == "[a-z]+"
    out = client.chat.completions.create(model="test-model", messages=MSG, max_tokens=77, tools=[WEATHER],
                                         tool_choice="required")
    call = out.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None


def test_streamed_tool_call_deltas(client):
    stream = client.chat.completions.create(model="test-model", messages=MSG, max_tokens=77, tools=[WEATHER],
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert "".join(c.function.arguments for c in calls) == '{"city":"Paris"}'
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_completions_endpoint_with_echo_and_batch(client, tok):
    out = client.completions.create(model="test-model", prompt=["Hello", "Bye"], max_tokens=20, n=2, echo=True)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == ['Hello{"a": 1}'] * 2 + ['Bye{"a": 1}'] * 2
    assert out.usage.prompt_tokens == len(tok.encode("Hello")) + len(tok.encode("Bye"))


@pytest.mark.parametrize("kwargs, status, message", [
    ({"model": "gpt-4"}, 404, "The model 'gpt-4' does not exist."),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, 400,
     "a request takes one constraint, this one names 2: 'guided_regex' and 'guided_choice'"),
    ({"extra_body": {"guided_rgx": "a"}}, 400, "Unrecognized request argument supplied: guided_rgx"),
    ({"extra_body": {"structured_outputs": {"jsn": {}}}}, 400,
     "Unrecognized request argument supplied: structured_outputs.jsn"),
    ({"max_tokens": 5000}, 400, "This model's maximum context length is 2048 tokens"),
    ({"temperature": 3}, 400, "temperature: Input should be less than or equal to 2"),
    ({"tool_choice": "required"}, 400, "'tool_choice' needs 'tools'"),
    ({"messages": [{"role": "user", "content": "x" * 30_000}]}, 413, "larger than 20000 bytes"),
])
def test_errors_have_openai_bodies(client, kwargs, status, message):
    body = {"model": "test-model", "messages": MSG, "max_tokens": 5, **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(**body)
    assert info.value.status_code == status
    assert message in info.value.body["message"] and info.value.body["type"] == "invalid_request_error"


def test_api_key_is_required(server):
    bad = openai.OpenAI(base_url=server[0] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="Incorrect API key provided"):
        bad.models.list()
    health = httpx.get(server[0] + "/health").json()  # health is open
    assert health["status"] == "ok" and health["native"]["mask_path"] in ("native", "python")
    good = openai.OpenAI(base_url=server[0] + "/v1", api_key="sk-test", max_retries=0)
    assert [m.id for m in good.models.list().data] == ["test-model"]


def test_disconnect_aborts_and_overload_is_429(server):
    url, engine, _, ctx = server
    headers = {"Authorization": "Bearer sk-test"}
    body = {"model": "test-model", "messages": MSG, "max_tokens": 1000, "stream": True}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
        streams = [http.stream("POST", "/v1/chat/completions", json=body) for _ in range(4)]
        lines = [s.__enter__().iter_lines() for s in streams]  # subtle: a dropped iterator closes its response
        assert all(next(it).startswith("data: ") for it in lines)  # each request is running
        full = http.post("/v1/chat/completions", json={**body, "stream": False})
        assert full.status_code == 429 and "at capacity (4 requests in flight)" in full.json()["error"]["message"]
        for s in streams:
            s.__exit__(None, None, None)  # the clients leave mid-stream
    deadline = time.monotonic() + 10
    while (engine.requests or ctx.engine.num_in_flight()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.requests and ctx.engine.num_in_flight() == 0 and len(engine.aborted) >= 4


def test_the_engine_sends_only_the_final_output_of_a_request_nobody_streams(server, client):
    """A request nobody streams gets its finished output alone; a streamed one, what each step added alone."""
    engine = server[1]
    out = client.chat.completions.create(model="test-model", messages=MSG, max_tokens=20)
    assert engine.added[-1][2].output_kind == "final" and out.choices[0].message.content == '{"a": 1}'
    out = client.completions.create(model="test-model", prompt="hi", max_tokens=20)
    assert engine.added[-1][2].output_kind == "final" and out.choices[0].text == '{"a": 1}'
    chunks = list(client.chat.completions.create(model="test-model", messages=MSG, max_tokens=20, stream=True,
                                                 logprobs=True, stream_options={"include_usage": True}))
    assert engine.added[-1][2].output_kind == "delta" and len(chunks) > 3
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.delta.content or "" for p in pieces) == '{"a": 1}'
    tokens = [t for p in pieces if p.logprobs is not None for t in p.logprobs.content]
    assert "".join(t.token for t in tokens) == '{"a": 1}' and chunks[-1].usage.completion_tokens == len(tokens)
    chunks = list(client.completions.create(model="test-model", prompt="hi", max_tokens=20, stream=True, logprobs=1,
                                            stream_options={"include_usage": True}))
    assert engine.added[-1][2].output_kind == "delta"
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in pieces) == '{"a": 1}'
    assert sum(len(p.logprobs.tokens) for p in pieces) == chunks[-1].usage.completion_tokens > 3


def test_metrics_use_vllm_names(server, client):
    client.chat.completions.create(model="test-model", messages=MSG, max_tokens=20)
    text = httpx.get(server[0] + "/metrics").text
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert f'{name}{{model_name="test-model"' in text, name
    rows = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert int(rows['vllm:request_success_total{model_name="test-model",finished_reason="stop"}']) >= 1
    assert int(rows['vllm:generation_tokens_total{model_name="test-model"}']) >= len('{"a": 1}') // 4
    from corral import native

    paths = native.status()  # which mask path and kernels run, as /health says too
    assert rows[f'corral:native_info{{model_name="test-model",mode="{paths["mode"]}",'
                f'mask_path="{paths["mask_path"]}",kernels="{paths["kernels"]}",qmatmul="{paths["qmatmul"] or "none"}",'
                f'decode_step="none",decode_burst="none",deterministic="none"}}'] == "1"  # a toy: no decode step


@pytest.mark.parametrize("suffix", ["", "/v1", "/v1/"])
def test_generate_json_takes_the_server_root_or_the_openai_base_url(server, suffix):
    import corral

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    value = corral.generate_json(schema, "hi", base_url=server[0] + suffix, api_key="sk-test", max_tokens=20)
    assert value == {"a": 1}

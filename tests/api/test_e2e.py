"""End to end on the real model: the official openai client against a live Corral server on a loopback port.

Oracles: ``jsonschema`` (every completed constrained output validates), the tool's ``parameters`` schema (every
call's arguments validate), the chat template (a tool round trip's prompt is exactly its rendering), and the
engine's own block accounting (no KV block is left in use after clients leave mid-stream).
"""

import asyncio
import json
import time

import httpx
import jsonschema
import openai
import pydantic
import pytest

from corral.api.launch import ServeOptions, build_context, build_engine
from corral.engine import EngineConfig
from corral.schemas.chat import ChatMessage, Tool
from corral.schemas.tools import template_messages

from api_serving import running_server

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 99}},
         "required": ["ok", "n"], "additionalProperties": False}


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    population: int


@pytest.fixture(scope="module")
def live():
    engine = build_engine(EngineConfig(max_model_len=1024, num_kv_blocks=512))
    ctx = build_context(engine, options=ServeOptions(default_max_tokens=64))
    with running_server(ctx) as url:
        yield url, ctx, engine


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live[0] + "/v1", api_key="unused", max_retries=0, timeout=300)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_parse_returns_the_pydantic_object(client, live):
    out = client.chat.completions.parse(model=live[1].config.model_name, response_format=City, max_tokens=40,
                                        messages=ask("Name a large city and its population, as JSON."),
                                        temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, City)
    jsonschema.validate(json.loads(choice.message.content), City.model_json_schema())
    assert out.usage.completion_tokens >= 5


def test_tool_call_round_trip(client, live):
    model, tok = live[1].config.model_name, live[1].tokenizer
    messages = ask("What is the weather in Paris, in celsius?")
    first = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=40, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    history = messages + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    second = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], tool_choice="none",
                                            max_tokens=12, temperature=0)
    assert second.choices[0].message.tool_calls is None and second.choices[0].message.content
    rendered = tok.apply_chat_template(template_messages([ChatMessage.model_validate(m) for m in history],
                                                         [Tool.model_validate(WEATHER)], native=False))
    assert f'"arguments": {call.function.arguments}}}</tool_call>' in rendered
    assert second.usage.prompt_tokens == len(tok.encode(rendered))
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # the first turn's prefix was reused


def test_streaming_tool_call(client, live):
    stream = client.chat.completions.create(model=live[1].config.model_name, messages=ask("Weather in Oslo?"),
                                            tools=[WEATHER], tool_choice={"type": "function",
                                                                          "function": {"name": "get_weather"}},
                                            parallel_tool_calls=False, max_tokens=40, stream=True, temperature=0,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    pieces = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert pieces[0].function.name == "get_weather" and pieces[0].id.startswith("call_")
    assert all(p.index == 0 for p in pieces) and len(pieces) > 2  # the arguments arrive in several deltas
    arguments = json.loads("".join(p.function.arguments or "" for p in pieces))
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    tok = live[1].tokenizer
    rendered = tok.apply_chat_template(template_messages([ChatMessage(role="user", content="Weather in Oslo?")],
                                                         [Tool.model_validate(WEATHER)], native=False))
    usage = chunks[-1].usage
    assert usage.prompt_tokens == len(tok.encode(rendered))
    assert usage.completion_tokens >= len(pieces)  # at most one argument delta per generated token


def test_drafts_change_no_streamed_tool_call_and_show_in_usage(client, live):
    """The same call with drafts off and on: the same arguments, deltas of several tokens (their logprobs ride
    together) through the tool-call stream parser, and the drafts counted in usage."""
    def stream(switches: dict):
        chunks = list(client.chat.completions.create(
            model=live[1].config.model_name, messages=ask("Weather in Lisbon, in celsius?"), tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False,
            max_tokens=40, stream=True, temperature=0, logprobs=True, stream_options={"include_usage": True},
            extra_body=switches))
        pieces = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
        tokens_per_chunk = [len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs]
        return "".join(p.function.arguments or "" for p in pieces), tokens_per_chunk, chunks[-1].usage

    off_args, off_counts, off_usage = stream({"jump_forward": False, "speculation": False})
    on_args, on_counts, on_usage = stream({"jump_forward": True, "speculation": True})
    assert on_args == off_args
    jsonschema.validate(json.loads(on_args), WEATHER["function"]["parameters"])
    assert max(off_counts) == 1 and max(on_counts) > 1
    assert off_usage.completion_tokens == on_usage.completion_tokens == sum(on_counts)
    spec_off, spec_on = off_usage.model_extra["speculation"], on_usage.model_extra["speculation"]
    assert spec_off["draft_tokens"] == 0 and spec_off["forward_passes"] == off_usage.completion_tokens
    assert spec_on["forced_tokens"] > 0
    assert spec_on["forward_passes"] == on_usage.completion_tokens - spec_on["accepted_tokens"]
    details = on_usage.completion_tokens_details
    assert details.accepted_prediction_tokens == spec_on["accepted_tokens"]
    assert details.rejected_prediction_tokens == spec_on["draft_tokens"] - spec_on["accepted_tokens"]


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}}, "(keyword 'type' at '#/properties/a')"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "(keyword 'uniqueItems' at '#')"),
    ({"extra_body": {"guided_regex": "a(?=b)"}}, "at offset 1 in regex 'a(?=b)'"),
    ({"extra_body": {"guided_grammar": 'start: "a" item\nitem: "b" | missing'}},
     "Lark grammar: rule 'item' uses 'missing', which is not defined (line 2)"),
    ({"extra_body": {"structured_outputs": {"grammar": 'root ::= [z-a]'}}}, "GBNF grammar: the range 'z'-'a' is "
                                                                            "reversed (line 1)"),
    ({"messages": ask("word " * 1100)}, "This model's maximum context length is 1024 tokens"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/nowhere"}}}}}], "tool_choice": "required"},
     "tools[0] ('f') parameters: $ref '#/nowhere' points to nothing"),
])
def test_bad_constraints_are_400_naming_the_place(client, live, body, message):
    request = {"model": live[1].config.model_name, "messages": ask("hi"), "max_tokens": 5, **body}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**request)
    assert message in info.value.body["message"], info.value.body["message"]


ARITH = r"""
?start: sum
?sum: product | sum ("+" | "-") product
?product: atom | product ("*" | "/") atom
?atom: INT | "(" sum ")"
%import common.INT
%ignore " "
"""
ARITH_GBNF = r"""
root ::= sum
sum ::= product (ws ("+" | "-") ws product)*
product ::= atom (ws ("*" | "/") ws atom)*
atom ::= [0-9]+ | "(" ws sum ws ")"
ws ::= " "*
"""


@pytest.mark.parametrize("grammar, stream", [(ARITH, False), (ARITH_GBNF, True)])
def test_a_grammar_constrains_the_output_streamed_or_not(client, live, grammar, stream):
    import lark

    oracle = lark.Lark(ARITH, parser="lalr")
    request = dict(model=live[1].config.model_name, messages=ask("Write an arithmetic expression."),
                   max_tokens=40, extra_body={"structured_outputs": {"grammar": grammar}}, temperature=1.0, seed=3)
    if stream:
        text, reason = "", None
        for chunk in client.chat.completions.create(stream=True, **request):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
    else:
        choice = client.chat.completions.create(**request).choices[0]
        text, reason = choice.message.content, choice.finish_reason
    assert text
    if reason == "stop":
        oracle.parse(text)
    else:  # cut by max_tokens: a prefix of the language, which lark reads up to its end
        assert reason == "length"
        parser = oracle.parse_interactive(text)
        parser.exhaust_lexer()


async def _one_client(aclient, model: str, index: int, leaves: bool) -> tuple[str, str | None]:
    if leaves:  # a long constrained output, abandoned after three chunks
        stream = await aclient.chat.completions.create(model=model, messages=ask(f"Say ab {index}"), max_tokens=100,
                                                       stream=True, extra_body={"guided_regex": "(ab){50}"})
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.close()
        return "", "left"
    stream = await aclient.chat.completions.create(
        model=model, messages=ask(f"Is {index} even? Answer as JSON."), max_tokens=24, stream=True,
        temperature=1.0, seed=index,
        response_format={"type": "json_schema", "json_schema": {"name": "small", "schema": SMALL}})
    text, reason = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def test_32_concurrent_streams_with_8_leaving_leak_no_blocks(live):
    url, ctx, engine = live

    async def run():
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(_one_client(aclient, ctx.config.model_name, i, i % 4 == 0)
                                          for i in range(32)))
        finally:
            await aclient.close()

    results = asyncio.run(run())
    assert sum(reason == "left" for _, reason in results) == 8
    finished = [text for text, reason in results if reason == "stop"]
    # SMALL's longest value, {"ok":false,"n":99}, is 19 characters: even at one token each it fits 24 tokens.
    assert len(finished) == 24, results
    for text in finished:
        jsonschema.validate(json.loads(text), SMALL)
    deadline = time.monotonic() + 60
    while (engine.has_unfinished_requests() or ctx.engine.num_in_flight()) and time.monotonic() < deadline:
        time.sleep(0.1)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0)
    assert ctx.metrics.finished.get("abort", 0) >= 8


def test_beam_search_over_a_choice_returns_every_choice_best_first(client, live):
    out = client.chat.completions.create(model=live[1].config.model_name, messages=ask("Is the sky blue?"),
                                         max_tokens=8, n=2, extra_body={"use_beam_search": True,
                                                                        "guided_choice": ["yes", "no"]})
    assert sorted(c.message.content for c in out.choices) == ["no", "yes"]  # the language has just these two
    assert all(c.finish_reason == "stop" for c in out.choices)


def test_generate_json_and_call_tools_against_the_server(live, tmp_path, capsys):
    import corral
    from corral import cli

    url = live[0]
    point = corral.generate_json(SMALL, "Is 4 even? Answer as JSON.", base_url=url, max_tokens=24)
    jsonschema.validate(point, SMALL)
    text, calls = corral.call_tools([WEATHER], "Weather in Rome?", base_url=url, max_tokens=40)
    assert text is None and [c.name for c in calls] == ["get_weather"]
    jsonschema.validate(calls[0].arguments, WEATHER["function"]["parameters"])
    schema_file = tmp_path / "small.json"
    schema_file.write_text(json.dumps(SMALL))
    assert cli.main(["generate", "--schema", str(schema_file), "--base-url", url, "--max-tokens", "24",
                     "Is 7 even? Answer as JSON."]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), SMALL)


def test_the_formats_are_in_the_fingerprint_and_the_model_card(client, live):
    """The number formats change greedy outputs from one machine to another, so every response says which ran."""
    formats = live[2].formats
    assert (formats.dtype, formats.quantization, formats.kv_cache_dtype) == ("float32", "none", "float32")
    out = client.chat.completions.create(model=live[1].config.model_name, max_tokens=2, messages=ask("Hi"))
    assert out.system_fingerprint.startswith("corral-fp32-none-kvfp32-")
    card = httpx.get(live[0] + "/v1/models").json()["data"][0]
    assert card["formats"]["quantization"] == "none" and card["formats"]["dtype"] == "float32"
    stream = client.chat.completions.create(model=live[1].config.model_name, max_tokens=2, messages=ask("Hi"),
                                            stream=True)
    assert {chunk.system_fingerprint for chunk in stream} == {out.system_fingerprint}

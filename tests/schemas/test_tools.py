"""Tool calls: the free-text language, prompt rendering, reading calls back, and streaming deltas."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corral.errors import InvalidRequestError
from corral.grammar.constraint import Constraint
from corral.schemas.chat import ChatMessage, NamedToolChoice, Tool
from corral.schemas.limits import RequestLimits
from corral.schemas.tool_stream import ToolCallStream
from corral.schemas.tools import (check_tool_limits, split_tool_calls, template_messages, tools_constraint,
                                  write_call)

WEATHER = Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})


def test_template_messages_without_native_tools_write_them_into_the_system_message():
    messages = [ChatMessage(role="developer", content="Be brief."), ChatMessage(role="user", content="Paris?"),
                ChatMessage(role="assistant", tool_calls=[{"id": "c1", "function": {
                    "name": "get_weather", "arguments": '{"city":"Paris"}'}}]),
                ChatMessage(role="tool", tool_call_id="c1", content="sunny")]
    out = template_messages(messages, [WEATHER], native=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool"]
    assert out[0]["content"].startswith("Be brief.\n\nYou can call functions.")
    assert '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city":"Paris"}}</tool_call>'
    assert out[3]["content"] == "<tool_response>sunny</tool_response>"


def test_native_templates_get_structured_tool_calls():
    messages = [ChatMessage(role="assistant", tool_calls=[{"id": "c1", "function": {
        "name": "f", "arguments": '{"a": 1}'}}])]
    out = template_messages(messages, [WEATHER], native=True)
    assert out == [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "c1", "function": {"name": "f", "arguments": {"a": 1}}}]}]


def test_split_tool_calls_reads_back_what_write_call_wrote():
    text = "Let me check." + write_call("get_weather", '{"city":"Paris"}') + "\n" + write_call("f", "{}")
    assert split_tool_calls(text) == ("Let me check.", [("get_weather", '{"city":"Paris"}'), ("f", "{}")])
    assert split_tool_calls("plain answer") == ("plain answer", [])
    assert split_tool_calls(write_call("f", '{"a":[1,{"b":2}]}')) == (None, [("f", '{"a":[1,{"b":2}]}')])


def test_arguments_python_cannot_parse_stay_text_not_errors():
    """A call whose arguments hold an integer past Python's digit limit, or nest past its parser, is skipped when
    read back from an output, and an assistant message's such arguments reach a native template as text (each
    raised out of the request before: a 500)."""
    huge, deep = '{"n": ' + "7" * 5000 + "}", "[" * 100_000
    assert split_tool_calls(write_call("f", huge)) == (None, [])
    assert split_tool_calls("<tool_call>" + deep + "</tool_call>") == (None, [])
    for arguments in (huge, deep):
        messages = [ChatMessage(role="assistant", tool_calls=[{"id": "c1", "function": {
            "name": "f", "arguments": arguments}}])]
        out = template_messages(messages, [WEATHER], native=True)
        assert out[0]["tool_calls"][0]["function"]["arguments"] == arguments


def test_named_tool_choice_must_name_a_given_tool():
    with pytest.raises(InvalidRequestError, match="tool_choice names 'nope', which is not in 'tools'"):
        tools_constraint([WEATHER], NamedToolChoice(function={"name": "nope"}), parallel=False, answer=None)
    with pytest.raises(InvalidRequestError, match="'tool_choice' needs 'tools'"):
        tools_constraint([], "required", parallel=False, answer=None)


def test_tools_become_one_plain_constraint():
    answer = Constraint("json_schema", {"type": "integer"}, whitespace="flexible")
    auto = tools_constraint([WEATHER, WEATHER], None, parallel=True, answer=answer, reject_unknown_keywords=True)
    assert auto.kind == "tools" and auto.whitespace == "flexible" and auto.reject_unknown_keywords
    assert auto.value == {"tools": [{"index": i, "name": "get_weather", "parameters": WEATHER.function.parameters}
                                    for i in (0, 1)],
                          "mode": "auto", "parallel": True, "answer": {"kind": "json_schema", "value": {"type": "integer"}}}
    named = tools_constraint([WEATHER], NamedToolChoice(function={"name": "get_weather"}), parallel=False,
                             answer=answer)
    assert named.value["mode"] == "required" and named.value["answer"] is None  # the answer is a later turn's
    assert tools_constraint([WEATHER], "none", parallel=False, answer=answer) is answer


def test_tool_limits_name_the_limit():
    limits = RequestLimits(max_tools=1, max_tools_bytes=100)
    with pytest.raises(InvalidRequestError, match="at most 1 tools are allowed, this request has 2"):
        check_tool_limits([WEATHER, WEATHER], limits)
    with pytest.raises(InvalidRequestError, match="past the limit of 100"):
        check_tool_limits([WEATHER], limits)
    check_tool_limits([WEATHER], RequestLimits(max_tools=1))


def _replay(text: str, cuts: list[int]):
    stream, pieces, start = ToolCallStream(), [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        pieces += stream.feed(text[start:cut])
        start = cut
    pieces += stream.finish()
    content = "".join(p.content for p in pieces if p.content is not None)
    calls: dict[int, list] = {}
    for p in pieces:
        if p.call_index is not None:
            if p.name is not None:
                assert p.call_index not in calls and p.call_id.startswith("call_")
                calls[p.call_index] = [p.name, ""]
            calls[p.call_index][1] += p.arguments or ""
    return content or None, [tuple(calls[i]) for i in sorted(calls)]


TEXTS = ["no calls at all < <tool <tool_cal",
         "Sure." + write_call("get_weather", '{"city":"Pa}ris"}'),
         write_call("a", '{"x":{"y":{}}}') + "\n" + write_call("b", "{}"),
         write_call("f", '{"s":"</tool"}')]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(0, 80), max_size=12))
def test_streamed_deltas_add_up_to_the_whole_reading(text, cuts):
    assert _replay(text, [c for c in cuts if c < len(text)]) == split_tool_calls(text)


def test_a_truncated_call_streams_its_partial_arguments():
    stream = ToolCallStream()
    pieces = stream.feed('<tool_call>{"name": "f", "arguments": {"a": 1') + stream.finish()
    assert [(p.name, p.arguments) for p in pieces] == [("f", ""), (None, '{"a": 1')]

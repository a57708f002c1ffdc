"""Tool calls: the free-text language, prompt rendering, reading calls back, and streaming deltas."""

import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corral.errors import InvalidRequestError
from corral.grammar.regex_ast import to_python_regex
from corral.schemas.chat import ChatMessage, Tool
from corral.schemas.tool_stream import ToolCallStream
from corral.schemas.tools import split_tool_calls, template_messages, text_without, tools_node, write_call

WEATHER = Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})


@pytest.mark.parametrize("word", ["<ab>", "<tool_call>"])
def test_text_without_is_exactly_the_texts_that_avoid_the_word(word):
    pattern = re.compile(to_python_regex(text_without(word)), re.DOTALL)
    alphabet = sorted(set(word)) + ["x"]
    for n in range(6):
        for chars in itertools.product(alphabet, repeat=n):
            text = "".join(chars)
            assert bool(pattern.fullmatch(text)) == (word not in text), text
    near_misses = ["é ✓ " + word[:-1] + " " + word[0] + word[:-1], word[0] * 3 + word[1:-1]]
    assert all(pattern.fullmatch(t) for t in near_misses)
    assert not pattern.fullmatch("é" + word[0] + word + "x") and not pattern.fullmatch(word)


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


def test_named_tool_choice_must_name_a_given_tool():
    with pytest.raises(InvalidRequestError, match="tool_choice names 'nope', which is not in 'tools'"):
        from corral.schemas.chat import NamedToolChoice
        tools_node([WEATHER], NamedToolChoice(function={"name": "nope"}), parallel=False, answer=None)
    with pytest.raises(InvalidRequestError, match="'tool_choice' needs 'tools'"):
        tools_node([], "required", parallel=False, answer=None)


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

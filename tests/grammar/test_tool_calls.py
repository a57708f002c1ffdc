"""The tool-call language: the free text that never spells the call's opening, and calls checked end to end."""

import itertools
import re

import pytest

from corral.grammar.regex_ast import to_python_regex
from corral.grammar.regex_match import fullmatch
from corral.grammar.tool_calls import text_without, tool_calls_node
from corral.grammar.json_schema import schema_to_node
from corral.errors import InvalidSchemaError


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


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}


def _tools(mode, parallel=False):
    return {"tools": [{"index": 0, "name": "weather", "parameters": CITY}, {"index": 1, "name": "now",
                                                                           "parameters": None}],
            "mode": mode, "parallel": parallel, "answer": None}


def test_required_calls_and_auto_text():
    call = '<tool_call>{"name": "weather", "arguments": {"city":"Paris"}}</tool_call>'
    now = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    required = tool_calls_node(_tools("required"), schema_to_node, None)
    assert fullmatch(required, call) and fullmatch(required, now)
    assert not fullmatch(required, "Hi " + call) and not fullmatch(required, call + "\n" + now)
    assert fullmatch(tool_calls_node(_tools("required", parallel=True), schema_to_node, None), call + "\n" + now)
    auto = tool_calls_node(_tools("auto"), schema_to_node, None)
    assert fullmatch(auto, "Let me look. " + call) and fullmatch(auto, "No call needed.")
    assert not fullmatch(auto, '<tool_call>{"name": "weather", "arguments": {"town":"Paris"}}</tool_call>')


def test_a_bad_parameters_schema_names_its_tool():
    value = _tools("required")
    value["tools"][1]["parameters"] = {"type": "strange"}
    with pytest.raises(InvalidSchemaError, match=r"tools\[1\] \('now'\) parameters: 'type' must be") as info:
        tool_calls_node(value, schema_to_node, None)
    assert info.value.param == "tools[1].function.parameters"

"""Which constraint a request names: exact Constraint values, and 400s for two at once or unknown keys."""

import pydantic
import pytest

from corral.errors import InvalidGrammarError, InvalidRequestError, InvalidSchemaError
from corral.grammar.constraint import Constraint
from corral.schemas.chat import ChatCompletionRequest
from corral.schemas.completions import CompletionRequest
from corral.schemas.constraints import request_constraint

MSG = [{"role": "user", "content": "hi"}]


def chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=MSG, **body)


def schema(value, **options) -> Constraint:
    """A request's JSON Schema constraint: objects get their declared properties only unless it says otherwise."""
    return Constraint("json_schema", value, **{"disable_additional_properties": True, **options})


@pytest.mark.parametrize("body, expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, Constraint("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}},
     schema({"type": "integer"})),
    ({"structured_outputs": {"json": {"type": "string"}}}, schema({"type": "string"})),
    ({"structured_outputs": {"json": '{"type": "null"}'}}, schema({"type": "null"})),
    ({"structured_outputs": {"json": {"type": "object"}, "disable_additional_properties": False}},
     schema({"type": "object"}, disable_additional_properties=False)),
    ({"structured_outputs": {"regex": "a+"}}, Constraint("regex", "a+")),
    ({"structured_outputs": {"choice": ["b", "a", "b"]}}, Constraint("choice", ["a", "b"])),
    ({"structured_outputs": {"grammar": "start: \"x\""}}, Constraint("grammar", "start: \"x\"")),
    ({"structured_outputs": {"json_object": True}}, Constraint("json_object")),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": False}},
     Constraint("regex", "a", whitespace="indented")),
    ({"guided_json": {"type": "boolean"}}, schema({"type": "boolean"})),
    ({"guided_regex": "[0-9]+"}, Constraint("regex", "[0-9]+")),
    ({"guided_choice": ["yes", "no"]}, Constraint("choice", ["no", "yes"])),
    ({"guided_grammar": "start: \"y\""}, Constraint("grammar", "start: \"y\"")),
    ({"response_format": {"type": "grammar", "grammar": "root ::= \"z\""}}, Constraint("grammar", "root ::= \"z\"")),
])
def test_each_source_gives_its_constraint(body, expected):
    assert request_constraint(chat(**body)) == expected


def test_a_grammar_response_format_needs_its_text():
    with pytest.raises(InvalidRequestError, match="response_format of type 'grammar' needs 'grammar'"):
        request_constraint(chat(response_format={"type": "grammar"}))


def test_completions_take_the_same_constraints():
    req = CompletionRequest(model="m", prompt="p", guided_regex="x")
    assert request_constraint(req) == Constraint("regex", "x")


@pytest.mark.parametrize("body, names", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "'response_format' and 'guided_regex'"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}},
     "'structured_outputs.regex' and 'structured_outputs.choice'"),
    ({"guided_json": {}, "guided_choice": ["a"]}, "'guided_json' and 'guided_choice'"),
    ({"structured_outputs": {"json_object": True}, "guided_grammar": "g"},
     "'structured_outputs.json_object' and 'guided_grammar'"),
])
def test_two_constraints_are_refused(body, names):
    with pytest.raises(InvalidRequestError, match=f"one constraint, this one names 2: {names}"):
        request_constraint(chat(**body))


@pytest.mark.parametrize("body, field", [
    ({"guided_jsn": {}}, "guided_jsn"),
    ({"structured_outputs": {"regx": "a"}}, "regx"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": True, "extra": 1}}},
     "extra"),
    ({"response_format": {"type": "xml"}}, "type"),
])
def test_unknown_constraint_keys_do_not_validate(body, field):
    with pytest.raises(pydantic.ValidationError, match=field):
        chat(**body)


def test_malformed_values_are_refused_with_their_parameter():
    with pytest.raises(InvalidSchemaError, match="'guided_json' is not valid JSON"):
        request_constraint(chat(guided_json="{nope"))
    with pytest.raises(InvalidSchemaError, match="must be a JSON Schema"):
        request_constraint(chat(guided_json="[1, 2]"))
    with pytest.raises(InvalidGrammarError, match="'guided_choice' must list at least one choice"):
        request_constraint(chat(guided_choice=[]))
    with pytest.raises(InvalidRequestError, match="needs 'json_schema.schema'"):
        request_constraint(chat(response_format={"type": "json_schema"}))
    with pytest.raises(InvalidRequestError, match="guided_whitespace_pattern"):
        request_constraint(chat(guided_whitespace_pattern=" *"))

"""``corral.generate_json`` and ``corral.call_tools`` in-process (embedded engine), and the one-shot CLI's
argument handling. Their remote path (``base_url=``) is exercised against a live server in test_e2e.py."""

import json

import jsonschema
import pydantic
import pytest

import corral
from corral.api.generate_json import IncompleteOutputError
from corral.engine import EngineConfig, LLMEngine
from corral.errors import InvalidSchemaError

pytestmark = pytest.mark.slow

POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
         "required": ["x", "y"], "additionalProperties": False}


class Colour(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    hex: str = pydantic.Field(pattern=r"^#[0-9a-f]{6}$")


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(max_model_len=512, num_kv_blocks=128))


def test_schema_in_validated_dict_out(engine):
    value = corral.generate_json(POINT, "A point with x=3 and y=4, as JSON.", engine=engine, max_tokens=30)
    jsonschema.validate(value, POINT)
    assert set(value) == {"x", "y"}


def test_pydantic_model_in_instance_out(engine):
    value = corral.generate_json(Colour, "The colour red, as JSON with its hex code.", engine=engine, max_tokens=30)
    assert isinstance(value, Colour) and len(value.hex) == 7


def test_truncation_and_bad_schemas_raise(engine):
    with pytest.raises(IncompleteOutputError, match="finish_reason='length'"):
        corral.generate_json({"type": "array", "items": {"type": "integer"}, "minItems": 40}, "Numbers.",
                             engine=engine, max_tokens=5)
    with pytest.raises(InvalidSchemaError, match="keyword 'type' at '#/properties/a'"):
        corral.generate_json({"properties": {"a": {"type": 7}}}, "x", engine=engine)


def test_call_tools_returns_parsed_calls(engine):
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}}
    text, calls = corral.call_tools([tool], "Add 2 and 3.", engine=engine, max_tokens=40)
    assert text is None and len(calls) == 1 and calls[0].name == "add"
    jsonschema.validate(calls[0].arguments, tool["function"]["parameters"])


def test_cli_generate_prints_the_value(engine, tmp_path, capsys, monkeypatch):
    from corral import cli
    from corral.api import generate_json as module

    schema_file = tmp_path / "point.json"
    schema_file.write_text(json.dumps(POINT))
    monkeypatch.setattr(module, "_embedded_engine", lambda model: module._wrapped(engine))
    assert cli.main(["generate", "--schema", str(schema_file), "--max-tokens", "30", "A point, as JSON."]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), POINT)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "nope"}))
    assert cli.main(["generate", "--schema", str(bad), "x"]) == 1
    assert "corral: 'type' must be one of" in capsys.readouterr().err


def test_pydantic_schemas_are_closed_where_they_say_nothing():
    from corral.api.generate_json import _closed

    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {}},
                                               "open": {"type": "object", "additionalProperties": True}},
              "$defs": {"B": {"properties": {"x": {}}}}, "anyOf": [{"properties": {}}]}
    assert _closed(schema) == {
        "type": "object", "additionalProperties": False,
        "properties": {"properties": {"type": "object", "properties": {}, "additionalProperties": False},
                       "open": {"type": "object", "additionalProperties": True}},
        "$defs": {"B": {"properties": {"x": {}}, "additionalProperties": False}},
        "anyOf": [{"properties": {}, "additionalProperties": False}]}

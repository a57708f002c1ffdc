"""``corral.generate_json`` in-process (embedded engine) and the one-shot CLI. The remote path (``base_url=``)
and ``corral.call_tools`` run against a live server in test_e2e.py."""

import json

import jsonschema
import pydantic
import pytest

import corral
from corral.api.generate_json import IncompleteOutputError
from corral.engine import EngineConfig, LLMEngine
from corral.errors import InvalidSchemaError

pytestmark = pytest.mark.slow

# Small outputs on purpose: a handful of tokens each keeps the real model's share of the test time small.
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}


class Digit(pydantic.BaseModel):
    digit: int = pydantic.Field(ge=0, le=9)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(max_model_len=512, num_kv_blocks=128))


def test_schema_in_validated_dict_out(engine):
    value = corral.generate_json(FLAG, "Is water wet? Answer as JSON.", engine=engine, max_tokens=12)
    jsonschema.validate(value, FLAG)
    assert set(value) == {"ok"}


def test_pydantic_model_in_instance_out(engine):
    value = corral.generate_json(Digit, "Pick a digit, as JSON.", engine=engine, max_tokens=12)
    assert isinstance(value, Digit) and 0 <= value.digit <= 9


def test_truncation_and_bad_schemas_raise(engine):
    with pytest.raises(IncompleteOutputError, match="finish_reason='length'"):
        corral.generate_json({"type": "array", "items": {"type": "integer"}, "minItems": 40}, "Numbers.",
                             engine=engine, max_tokens=2)
    with pytest.raises(InvalidSchemaError, match="keyword 'type' at '#/properties/a'"):
        corral.generate_json({"properties": {"a": {"type": 7}}}, "x", engine=engine)


def test_cli_generate_prints_the_value(engine, tmp_path, capsys, monkeypatch):
    from corral import cli
    from corral.api import generate_json as module

    schema_file = tmp_path / "flag.json"
    schema_file.write_text(json.dumps(FLAG))
    monkeypatch.setattr(module, "_embedded_engine", lambda model: module._wrapped(engine))
    assert cli.main(["generate", "--schema", str(schema_file), "--max-tokens", "12", "Is fire hot? JSON."]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), FLAG)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "nope"}))
    assert cli.main(["generate", "--schema", str(bad), "x"]) == 1
    assert "corral: 'type' must be one of" in capsys.readouterr().err


def test_the_default_embedded_engine_is_warmed_up_and_its_heap_frozen(engine, monkeypatch):
    """The engine ``generate_json`` builds for itself is served as ``corral serve`` serves: its shared grammar
    tables built, then everything alive moved out of the garbage collector's walks (a full collection of the
    model's and tokenizer's objects took 90-185 ms here, every stream stalled). An engine the caller passes in is
    left alone: that process's heap is the caller's."""
    import gc

    from corral.api import generate_json as module
    from corral.api import launch

    monkeypatch.setattr(launch, "build_engine", lambda config: engine)
    assert gc.get_freeze_count() == 0
    try:
        module._embedded.pop(id(engine), None)  # earlier tests wrapped it: take the first-call path again
        module._wrapped(engine)
        assert gc.get_freeze_count() == 0
        _, compiler, _, _ = module._embedded_engine("frozen-test")
        assert gc.get_freeze_count() > 0
        assert compiler.vocab is engine.vocabulary
    finally:
        gc.unfreeze()
        module._embedded.pop("frozen-test", None)


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

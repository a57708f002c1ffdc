"""Recursive JSON Schemas through the context-free path: no depth limit, the same soundness, jsonschema as oracle."""

import json
import random

import jsonschema
import pytest
from hypothesis import given, settings, strategies as st

from corral.fsm.compiler import CompiledCFG, CompiledGrammar, GrammarCompiler
from corral.fsm.random_walk import random_document, single_byte_tokens
from corral.fsm.vocabulary import Vocabulary
from corral.grammar.constraint import Constraint

TREE = {"$defs": {"node": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "value": {"type": "integer"},
    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3}},
    "required": ["name", "children"], "additionalProperties": False}}, "$ref": "#/$defs/node"}
# A value that is a string, a number, an {"$oid": ...} object or a document of further values: the lexemes of the
# first alternatives start like the last one's "{", which only an exact lexer keeps apart.
DOCUMENT = {"definitions": {
    "value": {"anyOf": [{"type": "string"}, {"type": "number"}, {"$ref": "#/definitions/oid"},
                        {"$ref": "#/definitions/document"}]},
    "oid": {"type": "object", "properties": {"$oid": {"type": "string"}}, "required": ["$oid"],
            "additionalProperties": False},
    "document": {"type": "object", "patternProperties": {"^[a-z]+$": {"$ref": "#/definitions/value"}},
                 "additionalProperties": False}},
    "$ref": "#/definitions/document"}


@pytest.fixture(scope="module")
def vocab():
    words = [b'{"', b'":', b'",', b'"}', b'[]', b'[{"', b'"name', b'children', b'}]', b'$oid']
    return Vocabulary.from_token_bytes([bytes([b]) for b in range(256)] + [b"<eos>"] + words, eos_token_ids=[256])


@pytest.fixture(scope="module")
def compiler(vocab):
    return GrammarCompiler(vocab)


def accepts(grammar, text: str) -> bool:
    guide = grammar.new_guide()
    return all(guide.advance(b) for b in text.encode()) and guide.is_accepting()


def tree(depth: int, width: int = 1) -> dict:
    node = {"name": "leaf", "children": []}
    for level in range(depth - 1):
        node = {"name": f"n{level}", "value": -level, "children": [node] * width}
    return node


def test_a_recursive_schema_nests_without_a_limit_and_stays_exact(compiler):
    grammar = compiler.compile(Constraint("json_schema", TREE))
    assert isinstance(grammar, CompiledCFG)
    for depth in (1, 2, 5, 30, 60):
        document = json.dumps(tree(depth), separators=(",", ":"))
        jsonschema.validate(json.loads(document), TREE)
        assert accepts(grammar, document), depth
    for bad in [{"name": "a"}, {"name": "a", "children": [{"name": "b"}]},
                {"name": "a", "children": [], "extra": 1}, {"name": "toolongname", "children": []},
                {"name": "a", "children": [tree(2)] * 4}, tree(30) | {"value": 1.5}]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, TREE)
        assert not accepts(grammar, json.dumps(bad, separators=(",", ":"))), bad
    deep_bad = json.dumps(tree(30), separators=(",", ":")).replace('"leaf"', '"leaf","x":1')
    assert not accepts(grammar, deep_bad)


def test_any_values_inside_a_recursive_schema_nest_without_a_limit(compiler):
    schema = {"$defs": {"node": {"type": "object", "properties": {"meta": {}, "kids": {"type": "array", "items": {
        "$ref": "#/$defs/node"}}}, "required": ["kids"], "additionalProperties": False}}, "$ref": "#/$defs/node"}
    grammar = compiler.compile(Constraint("json_schema", schema))
    deep_meta = {"x": [[[[[[[[{"y": [[[[1]]]]}]]]]]]]]}  # past the regular path's any-value depth of 5
    good = {"kids": [{"meta": deep_meta, "kids": []}]}
    jsonschema.validate(good, schema)
    assert accepts(grammar, json.dumps(good, separators=(",", ":")))
    assert not accepts(grammar, json.dumps(good, separators=(",", ":")).replace("[1]", "[1,]"))
    assert not accepts(grammar, '{"kids":[],"other":1}')


def test_lexemes_that_start_alike_are_kept_apart(compiler):
    grammar = compiler.compile(Constraint("json_schema", DOCUMENT))
    for good in ['{}', '{"a":"x"}', '{"a":{"$oid":"x"}}', '{"a":{"b":{"c":1}}}', '{"a":{"b":{"$oid":"y"}},"c":2}']:
        jsonschema.validate(json.loads(good), DOCUMENT)
        assert accepts(grammar, good), good
    for bad in ['{"a":{"$oid":1}}', '{"A":1}', '{"a":{"$oid":"x","b":1}}', '{"a":[]}']:
        assert not accepts(grammar, bad), bad


def test_schemas_without_recursion_or_open_values_keep_the_regular_path(compiler):
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}, "b": {"$ref": "#/$defs/x"}},
              "$defs": {"x": {"type": "integer"}}, "additionalProperties": False}
    assert isinstance(compiler.compile(Constraint("json_schema", schema)), CompiledGrammar)


def nested(depth: int):
    value = "leaf"
    for level in range(depth):
        value = {"k": value} if level % 2 else [value, 1]
    return value


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"meta": {}}, "additionalProperties": False},  # a {} value
    {"type": "object", "properties": {"id": {"type": "integer"}}},  # an undeclared member's value
    {"type": "array", "items": True},
    {"type": "object", "properties": {"meta": {"type": "object"}}, "required": ["meta"]},
], ids=["empty-schema", "undeclared", "items-true", "open-object"])
def test_open_values_nest_without_a_limit(compiler, vocab, schema):
    grammar = compiler.compile(Constraint("json_schema", schema))
    assert isinstance(grammar, CompiledCFG)
    deep = nested(30)
    document = {"object": {"meta": {"x": deep}}, "array": [deep]}[schema["type"]]
    if schema["type"] == "object" and "id" in schema["properties"]:
        document = {"id": 1, "x": deep}
    jsonschema.validate(document, schema)
    text = json.dumps(document, separators=(",", ":"))
    assert accepts(grammar, text)
    assert not accepts(grammar, text.replace('"leaf"', '"leaf",'))  # a trailing comma 30 levels down
    assert not accepts(grammar, text.replace('"leaf"', "leaf"))
    if "id" in schema.get("properties", {}):  # declared members keep their schema beside open ones
        assert not accepts(grammar, '{"id":"x","y":{}}') and accepts(grammar, '{"id":2,"y":{}}')
    for seed in range(5):
        walked = random_document(grammar, vocab, single_byte_tokens(vocab), random.Random(seed))
        if walked is not None:
            jsonschema.validate(json.loads(walked), schema)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_random_walks_validate(compiler, vocab, seed):
    for schema in (TREE, DOCUMENT):
        grammar = compiler.compile(Constraint("json_schema", schema, whitespace="flexible"))
        document = random_document(grammar, vocab, single_byte_tokens(vocab), random.Random(seed))
        if document is not None:
            jsonschema.validate(json.loads(document), schema)

"""ValueChecker against ``jsonschema`` on generated schemas and values, and its bounds on the inputs that made
the server hang: backtracking patterns, an ``anyOf`` chain that a naive validator walks 2^depth times, a large
``enum``."""

import time

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corral.errors import GrammarTooComplexError, InvalidSchemaError
from corral.grammar.json_schema import schema_to_node
from corral.grammar.node_builder import NodeBuilder
from corral.grammar.regex_ast import EMPTY
from corral.grammar.regex_match import fullmatch
from corral.grammar.schema_compiler import SchemaCompiler

KEYS = st.sampled_from(["a", "b", "ab"])
TEXT = st.text(alphabet="abx1", max_size=4)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([0.5, 1.0, -2.5]), TEXT)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(KEYS, inner, max_size=3)), max_leaves=6)
# Patterns whose ECMA-262 and Python readings agree on these texts (no newline in them, so '$' means the same).
PATTERNS = st.sampled_from(["^a", "b$", "a+b", "^[ab]*$", "\\d", "x|y", "^(a+)+$"])


def _leaf():
    return st.one_of(
        st.booleans(),
        st.builds(lambda t: {"type": t}, st.sampled_from(["null", "boolean", "integer", "number", "string",
                                                          "array", "object", ["string", "integer"]])),
        st.builds(lambda k, n: {k: n}, st.sampled_from(["minimum", "maximum", "exclusiveMinimum",
                                                        "exclusiveMaximum"]), st.integers(-2, 2)),
        st.builds(lambda k, n: {k: n}, st.sampled_from(["minLength", "maxLength", "minItems", "maxItems",
                                                        "minProperties", "maxProperties"]), st.integers(0, 2)),
        st.builds(lambda p: {"pattern": p}, PATTERNS),
        st.builds(lambda m: {"multipleOf": m}, st.sampled_from([2, 0.5, 3])),
        st.builds(lambda v: {"enum": v}, st.lists(VALUES, min_size=1, max_size=3)),
        st.builds(lambda v: {"const": v}, VALUES),
        st.builds(lambda names: {"required": names}, st.lists(KEYS, max_size=2, unique=True)),
        st.just({"uniqueItems": True}),
    )


def _extend(inner):
    return st.one_of(
        st.builds(lambda s: {"properties": s}, st.dictionaries(KEYS, inner, max_size=2)),
        st.builds(lambda p, s: {"patternProperties": {p: s}}, PATTERNS, inner),
        st.builds(lambda p, a: {"properties": p, "additionalProperties": a}, st.dictionaries(KEYS, inner, max_size=2),
                  inner),
        st.builds(lambda s: {"propertyNames": s}, inner),
        st.builds(lambda s: {"items": s}, inner),
        st.builds(lambda p, s: {"prefixItems": p, "items": s}, st.lists(inner, min_size=1, max_size=2), inner),
        st.builds(lambda s: {"contains": s}, inner),
        st.builds(lambda k, ss: {k: ss}, st.sampled_from(["anyOf", "oneOf", "allOf"]),
                  st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda s: {"not": s}, inner),
        st.builds(lambda i, t, e: {"if": i, "then": t, "else": e}, inner, inner, inner),
        st.builds(lambda s: {"dependentSchemas": {"a": s}}, inner),
        st.just({"dependentRequired": {"a": ["b"]}}),
        st.builds(lambda a, b: {**a, **b} if isinstance(a, dict) and isinstance(b, dict) else a, inner, inner),
    )


SCHEMAS = st.recursive(_leaf(), _extend, max_leaves=6)


def _checker(root):
    compiler = SchemaCompiler(root, NodeBuilder(), EMPTY, lenient=False, warnings=[])
    return compiler.checker


@settings(max_examples=1500, deadline=None, derandomize=True)
@given(SCHEMAS, st.lists(VALUES, min_size=1, max_size=4))
def test_agrees_with_jsonschema(schema, values):
    checker = _checker(schema)
    oracle = jsonschema.Draft202012Validator(schema)
    for value in values:
        assert checker.satisfies(value, schema, "#") == oracle.is_valid(value), (schema, value)


@pytest.mark.parametrize("schema, values", [
    ({"oneOf": [{"type": "integer"}, {"minimum": 2}]}, [1, 2, 1.5, "x"]),
    ({"oneOf": [True, {"type": "string"}]}, ["x", 1]),
    ({"anyOf": [{"maxLength": 1}, {"pattern": "^a"}], "not": {"const": "a"}}, ["a", "ab", "b", "bb"]),
    ({"contains": {"type": "string"}}, [["a"], [1, "b"], [1], []]),
    ({"uniqueItems": True}, [[1, 1.0], [1, True], [{"a": 1}, {"a": 1.0}], [[1], [2]]]),
    ({"items": [{"type": "string"}], "additionalItems": False}, [["a"], ["a", 1], [1]]),
    ({"dependencies": {"a": ["b"], "b": {"required": ["c"]}}}, [{"a": 1}, {"a": 1, "b": 2}, {"b": 1, "c": 2}]),
])
def test_keyword_table_agrees_with_jsonschema(schema, values):
    checker = _checker(schema)
    # tuple 'items' and 'dependencies' are draft 7's words; Corral reads every draft's
    draft7 = "dependencies" in schema or isinstance(schema.get("items"), list)
    oracle = (jsonschema.Draft7Validator if draft7 else jsonschema.Draft202012Validator)(schema)
    verdicts = [checker.satisfies(value, schema, "#") for value in values]
    assert verdicts == [oracle.is_valid(value) for value in values]
    assert True in verdicts and False in verdicts  # each row tells the keyword's two sides apart


def test_refs_and_draft4_integers_agree_with_jsonschema():
    schema = {"$defs": {"pos": {"type": "integer", "minimum": 1}},
              "properties": {"n": {"$ref": "#/$defs/pos"}, "m": {"$ref": "#/$defs/pos", "maximum": 3}}}
    checker = _checker(schema)
    for value in [{"n": 1}, {"n": 0}, {"m": 4}, {"m": 2.0}, {"n": 1.5}]:
        assert checker.satisfies(value, schema, "#") == jsonschema.Draft202012Validator(schema).is_valid(value)
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer"}
    assert _checker(draft4).satisfies(2.0, draft4, "#") is jsonschema.Draft4Validator(draft4).is_valid(2.0) is False


def test_a_regex_with_a_count_past_the_compile_bound_is_still_a_regex():
    """format: regex asks whether a value is a regex; a count past what Corral compiles (1,000,000) is still one."""
    schema = {"type": "string", "format": "regex"}
    checker = _checker(schema)
    assert checker.satisfies("a{1000001}", schema, "#") and checker.satisfies("a{" + "9" * 5000 + "}", schema, "#")
    assert not checker.satisfies("a{2,1}", schema, "#")


def test_multiple_of_reads_decimals_as_written():
    schema = {"multipleOf": 0.1}  # binary floats would say 0.3 is no multiple of 0.1
    assert _checker(schema).satisfies(0.3, schema, "#")
    assert not _checker(schema).satisfies(0.35, schema, "#")


def test_an_exponential_any_of_chain_costs_its_size():
    depth = 40  # a naive validator tries both branches at every level: 2^40 checks
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 1}", "minimum": 0}]}
            for i in range(depth)}
    defs[f"d{depth}"] = {"type": "string"}
    schema = {"$defs": defs, "enum": [1, 2, "x"], "$ref": "#/$defs/d0"}
    start = time.process_time()
    checker = _checker(schema)
    assert [v for v in schema["enum"] if checker.satisfies(v, schema, "#")] == ["x"]
    assert time.process_time() - start < 2
    assert checker.fuel.spent < 10_000


@pytest.mark.parametrize("schema, kept", [
    ({"enum": ["a" * 40 + "!", "aaa"], "pattern": "^(a+)+$"}, ["aaa"]),
    ({"enum": ["a" * 5000, "ab"], "pattern": "(a|aa)*b"}, ["ab"]),
    ({"enum": [["x"] * 20_000, ["x", "y"]], "uniqueItems": True}, [["x", "y"]]),
    ({"enum": ["me@example.com", "@no", "a@" + "b" * 5000]}, None),
])
def test_hostile_enum_members_compile_fast(schema, kept):
    import json

    start = time.process_time()
    node = schema_to_node(schema)
    assert time.process_time() - start < 3
    for member in schema["enum"]:
        expected = kept is None or member in kept
        assert fullmatch(node, json.dumps(member, ensure_ascii=False, separators=(",", ":"))) == expected


def test_the_work_of_a_large_enum_is_linear_in_its_size():
    """Counted in fuel, which is deterministic: re-checking each member against its own 'enum' (as jsonschema
    did, 229 s for 20,000 members) would be quadratic."""
    spent = []
    for size in (5_000, 20_000):
        schema = {"enum": list(range(size)), "minimum": 10}
        checker = _checker(schema)
        assert sum(checker.satisfies(v, schema, "#") for v in schema["enum"]) == size - 10
        spent.append(checker.fuel.spent)
    assert spent[1] < 5 * spent[0]


def test_property_names_run_on_the_matcher():
    schema = {"type": "object", "propertyNames": {"pattern": "^(a|aa)*$"},
              "properties": {"a" * 30 + "b": {"type": "integer"}, "aaa": {"type": "integer"}}}
    node = schema_to_node(schema)
    assert fullmatch(node, '{"aaa":1}')
    assert not fullmatch(node, '{"' + "a" * 30 + 'b":1}')


def test_fuel_ends_a_check_that_would_run_long():
    schema = {"enum": ["a" * 20_000], "pattern": "(a{1000}){1000}"}  # quadratic: every offset stays alive
    with pytest.raises(GrammarTooComplexError, match="steps"):
        schema_to_node(schema)


def test_an_invalid_pattern_is_named():
    with pytest.raises(InvalidSchemaError, match="patternProperties"):
        schema_to_node({"patternProperties": {"(": {}}, "properties": {"a": {}}})

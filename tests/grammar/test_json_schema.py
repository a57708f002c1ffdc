"""JSON Schema → AST, keyword by keyword: exact acceptance of hand-picked instances, agreement with ``jsonschema``
on every instance the AST accepts, and every refusal pinned to its message."""

import json
import re

import jsonschema
import pytest
from hypothesis import given, settings, strategies as st

from corral.errors import (GrammarTooComplexError, InvalidSchemaError, UnknownKeywordError, UnsupportedSchemaError,
                           UserInputError)
from corral.grammar.json_schema import schema_to_node
from corral.grammar.regex_ast import Intersect, to_python_regex
from corral.grammar.regex_match import fullmatch


def _printable_size(node, memo) -> float:
    """Size of the tree the DAG ``node`` prints as (inf with an ``Intersect``, which does not print)."""
    if id(node) not in memo:
        if isinstance(node, Intersect):
            size = float("inf")
        else:
            children = getattr(node, "parts", None) or getattr(node, "options", None) or ()
            inner = getattr(node, "node", None)
            size = 1 + sum(_printable_size(c, memo) for c in (*children, *([inner] if inner is not None else [])))
        memo[id(node)] = size
    return memo[id(node)]


_PRINTED: dict[int, tuple] = {}  # id -> (node kept alive, compiled pattern or None)


def accepts(node, text: str) -> bool:
    """Both oracles agree: Python's ``re`` on the printed AST and the reference matcher. ``re`` only sees ASTs that
    print (no ``Intersect``) to a small tree: it needs about a minute to compile an 850k-character pattern."""
    verdict = fullmatch(node, text)
    if id(node) not in _PRINTED:
        printed = to_python_regex(node) if _printable_size(node, {}) < 3000 else None
        _PRINTED[id(node)] = (node, re.compile(printed) if printed else None)
    pattern = _PRINTED[id(node)][1]
    if pattern is not None:
        assert bool(pattern.fullmatch(text)) == verdict, text
    return verdict


def check(schema, good=(), bad=(), texts_good=(), texts_bad=(), whitespace="compact", declared_only=False):
    node = schema_to_node(schema, whitespace=whitespace, declared_only=declared_only)
    separators = (",", ":") if whitespace == "compact" else (", ", ": ")
    for value in good:
        assert jsonschema.validate(value, schema) is None
        assert accepts(node, json.dumps(value, separators=separators)), value
    for value in bad:
        assert not accepts(node, json.dumps(value, separators=separators)), value
    for text in texts_good:
        assert jsonschema.validate(json.loads(text), schema) is None
        assert accepts(node, text), text
    for text in texts_bad:
        assert not accepts(node, text), text


# ---- scalars -------------------------------------------------------------------------------------------------

def test_type_and_type_lists():
    check({"type": "null"}, good=[None], bad=[0, False, ""])
    check({"type": "boolean"}, good=[True, False], bad=[None, 1])
    check({"type": ["string", "null"]}, good=["a", None], bad=[1, [], {}])


def test_integer_bounds_are_exact():
    schema = {"type": "integer", "minimum": -3, "exclusiveMaximum": 120}
    check(schema, good=list(range(-3, 120)), bad=[-4, 120, 1000, -30, 1.5], texts_bad=["01", "-0", "1.0", "1e2"])
    check({"type": "integer", "minimum": 0.5, "maximum": 2.5}, good=[1, 2], bad=[0, 3])
    check({"type": "integer", "exclusiveMinimum": True, "minimum": 5, "$schema":
           "http://json-schema.org/draft-04/schema#"}, good=[6, 60], bad=[5, 4, -6])


def test_number_bounds_are_exact_without_exponents():
    schema = {"type": "number", "minimum": 0, "exclusiveMaximum": 1}
    check(schema, good=[0, 0.5, 0.999, 0.0], bad=[1, 1.0, -0.1, 1.5, 10], texts_good=["0.25", "0"],
          texts_bad=["-0", "1.00", "5e-1"])
    check({"type": "number", "minimum": -90.5, "maximum": 90.5}, good=[-90.5, 90.5, 0, 45.25],
          bad=[-90.51, 90.500001, 100])
    check({"type": "number", "exclusiveMinimum": 0.1}, good=[0.11, 1, 1000.5], bad=[0.1, 0.09, -1],
          texts_bad=["0.10000000000000000555"])


def test_unbounded_number_grammar():
    check({"type": "number"}, good=[0, -1.5, 1e-05, 1e16, 12345678901234567890],
          texts_good=["-0", "1E+2", "0.0"], texts_bad=["01", "1.", ".5", "+1", "1e", "NaN"])


def test_multiple_of():
    check({"type": "integer", "multipleOf": 5}, good=[0, 5, -5, 1235, 100], bad=[1, 6, -7, 1234])
    check({"type": "integer", "multipleOf": 4}, good=[0, 4, 8, 100, 1024, -12], bad=[2, 6, 102, -2])
    check({"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 30}, good=[0, 7, 14, 21, 28],
          bad=[1, 35, -7])
    check({"type": "integer", "multipleOf": 10, "minimum": 15, "maximum": 1000}, good=[20, 1000, 500],
          bad=[10, 1010, 25])


def test_strings_count_decoded_characters():
    schema = {"type": "string", "minLength": 2, "maxLength": 3}
    check(schema, good=["ab", "abc", "é\n", "\U0001F600x", '"\\'], bad=["a", "abcd", ""])
    check(schema, texts_good=['"\\u00e9\\u00E9"', '"\\ud83d\\ude00a"', '"\\/\\t"', '"é\\n"'],
          texts_bad=['"\\u00e9"', '"\\ud83d"', '"a\\x"', '"a\nb"', '"\\ud83d\\ude00"'])


def test_pattern_is_a_search_over_the_decoded_value():
    check({"type": "string", "pattern": "^[a-c]+$"}, good=["abc", "a"], bad=["abd", ""],
          texts_good=['"\\u0061b"'], texts_bad=['"a\\n"'])
    check({"type": "string", "pattern": "x\\d"}, good=["x1", "aax9bb"], bad=["x", "xa1"])
    check({"type": "string", "pattern": "^a", "maxLength": 3}, good=["a", "abc"], bad=["abcd", "ba"])


@pytest.mark.parametrize("name, good, bad", [
    ("date", ["2024-02-29", "2000-02-29", "1999-12-31"], ["2023-02-29", "1900-02-29", "2021-04-31", "2021-1-01"]),
    ("date-time", ["2021-01-01T10:00:00Z", "2021-06-30t23:59:59.5+05:30"], ["2021-01-01 10:00:00Z",
                                                                           "2021-01-01T24:00:00Z"]),
    ("time", ["10:00:00Z", "23:59:59.123-01:00"], ["10:00:00", "10:60:00Z"]),
    ("duration", ["P1Y2M", "PT5M", "P3W", "P1DT2H"], ["PT", "P", "P1H", "1Y"]),
    ("email", ["a.b@c.com", "x+y@host"], ["a@", "@b.com", "a b@c.com"]),
    ("hostname", ["example.com", "a-b.c"], ["-a.com", "a..b", "a_b.com"]),
    ("ipv4", ["1.2.3.4", "255.255.255.255"], ["256.1.1.1", "01.2.3.4", "1.2.3"]),
    ("ipv6", ["::1", "1:2:3:4:5:6:7::", "::ffff:1.2.3.4", "fe80::1"], ["1::2::3", "fe80::1%eth0", ":::"]),
    ("uuid", ["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000"]),
    ("uri", ["http://example.com/a?b#c", "mailto:a@b.c", "http://[::1]:80/"], ["a b", "//x", "/relative"]),
    ("uri-reference", ["http://x.org", "/relative/path?q", "#frag", ""], ["a b", "%zz"]),
])
def test_formats(name, good, bad):
    node = schema_to_node({"type": "string", "format": name})
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for text in good:
        assert accepts(node, json.dumps(text)), text
        assert checker.conforms(text, name), text  # formats jsonschema does not check conform trivially
    for text in bad:
        assert not accepts(node, json.dumps(text)), text


def test_unknown_formats_are_annotations_with_a_warning():
    warnings = []
    node = schema_to_node({"type": "string", "format": "topic"}, warnings=warnings)
    assert accepts(node, '"anything"')
    assert warnings == ["format 'topic' at '#' is not checked (an annotation)"]


def test_enum_and_const():
    check({"enum": ["a", 1, None, [1, 2], {"k": "é"}]}, good=["a", 1, None, [1, 2], {"k": "é"}],
          bad=["b", 2, [2, 1], {"k": "e"}])
    check({"type": "string", "enum": ["a", 1, "bb"], "maxLength": 1}, good=["a"], bad=[1, "bb"])
    check({"const": "x\"y"}, good=['x"y'], bad=["xy"])
    check({"enum": [{"a": 1, "b": [True]}]}, good=[{"a": 1, "b": [True]}], whitespace="flexible")
    # members are judged by jsonschema against every other keyword, 'not' and 'oneOf' included
    check({"allOf": [{"enum": [1.5, 1, 3]}, {"not": {"anyOf": [{"type": "integer"}, {"minimum": 2}]}}]},
          good=[1.5], bad=[1, 3])


# ---- objects and arrays ----------------------------------------------------------------------------------------

def test_properties_in_schema_order_optional_ones_omissible():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
              "required": ["b"], "additionalProperties": False}
    check(schema, good=[{"b": "x"}, {"a": 1, "b": "x"}], bad=[{"a": 1}, {}, {"a": 1, "b": "x", "c": 1},
                                                              {"a": "1", "b": "x"}],
          texts_bad=['{"b":"x","a":1}', '{"a":1,"b":"x",}', '{,"b":"x"}'])


def test_additional_properties_default_allows_undeclared_members_after_declared_ones():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    check(schema, good=[{}, {"a": 1}, {"a": 1, "z": [1, {"k": None}]}, {"z": "s"}],
          bad=[{"a": "x"}, {"z": 1, "a": "x"}], texts_bad=['{"a":1,"a":"x"}'])
    check({"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
          good=[{"a": "s", "b": 1}], bad=[{"a": "s", "b": "s"}])


def test_declared_only_leaves_out_the_members_the_standards_default_alone_allows():
    """``declared_only`` (generation's ``disable_additional_properties``): an object that declares properties and
    says nothing of ``additionalProperties`` or ``patternProperties`` gets those only; everything else is as
    without it, and each language is still within the schema's (``check`` validates every good value)."""
    declared = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}
    check(declared, good=[{"a": 1}, {"a": 1, "b": "x"}], bad=[{"a": 1, "z": 2}, {"a": 1, "b": "x", "z": 2}],
          declared_only=True)
    check(declared, good=[{"a": 1, "z": 2}], declared_only=False)
    explicit = [({"additionalProperties": True}, {"a": 1, "z": [2]}),
                ({"additionalProperties": {"type": "integer"}}, {"a": 1, "z": 2}),
                ({"patternProperties": {"^z": {}}}, {"a": 1, "z": 2})]
    for extra, value in explicit:  # undeclared members the schema itself allows stay allowed
        check({**declared, **extra}, good=[value], declared_only=True)
    # an object that declares nothing is any object, and one whose minProperties needs more than it declares keeps
    # the undeclared ones (else nothing would be left)
    check({"type": "object"}, good=[{"z": 1}, {}], declared_only=True)
    check({"type": "object", "properties": {"a": {}}, "minProperties": 2}, good=[{"a": 1, "z": 2}],
          declared_only=True)
    # nested objects, items, and the positive schemas a negation becomes are narrowed alike, never widened
    check({"type": "array", "items": declared}, good=[[{"a": 1}]], bad=[[{"a": 1, "z": 0}]], declared_only=True)
    check({"not": {"type": "object", "properties": {"a": {"type": "integer"}}}}, good=[{"a": "x"}, 3],
          bad=[{"a": 1}, {"a": 1, "z": "x"}], declared_only=True)
    check({"oneOf": [declared, {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
          good=[{"a": 1, "b": "x"}, {"b": 1}], bad=[{"a": 1, "b": 2}], declared_only=True)


def test_undeclared_member_keys_other_than_the_declared_names_in_every_spelling():
    # declared members come first (see the default-policy test above); then any key but "ab" and "é", however spelled
    schema = {"type": "object", "properties": {"ab": {"type": "integer"}, "é": {"type": "integer"}},
              "additionalProperties": {"type": "string"}}
    check(schema, good=[{"ab": 1, "é": 2, "a": "s", "abc": "s", "b\u00e9": "s", "\u4e2d": "s", "\U0001f600": "s"},
                        {"ée": "s", "\u00e8": "s"}],
          bad=[{"ab": "s"}, {"é": "s"}, {"a": 1}],
          texts_good=['{"\\u00e8":"s"}', '{"a\\u00e9":"s"}', '{"\\ud83d\\ude00":"s"}'],
          texts_bad=['{"a\\u0062":"s"}', '{"\\u00e9":"s"}', '{"\\u00E9":"s"}', '{"\\u0061b":"s"}'])


def test_pattern_properties_and_property_names():
    check({"type": "object", "patternProperties": {"^x-": {"type": "integer"}}, "additionalProperties": False},
          good=[{}, {"x-a": 1, "x-b": 2}], bad=[{"y": 1}, {"x-a": "s"}])
    check({"type": "object", "propertyNames": {"maxLength": 2}}, good=[{"ab": 1}], bad=[{"abc": 1}])
    # a declared property that a pattern also matches must satisfy both schemas
    check({"type": "object", "properties": {"x-a": {"minimum": 3}}, "patternProperties": {"^x-": {"maximum": 5}}},
          good=[{"x-a": 4}], bad=[{"x-a": 6}, {"x-a": 2}])


def test_repeated_extra_keys_never_make_up_min_properties():
    schema = {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}
    # '{"a":1,"a":2}' is one member to a validator; so only one extra member counts, which leaves nothing here
    with pytest.raises(InvalidSchemaError, match="accepts no value at all"):
        schema_to_node(schema)
    check({"type": "object", "properties": {"k": {}}, "required": ["k"], "additionalProperties": {"type": "integer"},
           "minProperties": 2}, good=[{"k": 0, "a": 1}], bad=[{"k": 0}])


def test_min_and_max_properties():
    schema = {"type": "object", "properties": {"a": {}, "b": {}, "c": {}}, "minProperties": 1,
              "maxProperties": 2, "additionalProperties": False}
    check(schema, good=[{"a": 1}, {"b": 1, "c": 2}], bad=[{}, {"a": 1, "b": 2, "c": 3}])


def test_arrays_items_prefix_items_and_counts():
    check({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
          good=[[1], [1, 2, 3]], bad=[[], [1, 2, 3, 4], ["a"]])
    check({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
          good=[[], ["a"], ["a", 1]], bad=[[1], ["a", 1, 2]])
    check({"type": "array", "items": [{"type": "string"}], "additionalItems": {"type": "integer"},
           "$schema": "http://json-schema.org/draft-07/schema#"}, good=[["a", 1, 2]], bad=[["a", "b"]])
    check({"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 1},
          good=[[], [1]], bad=[[1, 1]])


def test_contains_and_its_negation():
    check({"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 5}, "maxItems": 3},
          good=[[5], [1, 7], [1, 2, 9]], bad=[[], [1, 2], [1, 2, 3, 9], ["x", 6]])
    check({"type": "array", "not": {"items": {"type": "integer"}}}, good=[["x"], [1, None]], bad=[[], [1, 2]])
    check({"not": {"contains": {"type": "string"}}}, good=[[], [1, 2]], bad=[["x"], [1, "y"], 5])


def test_indented_whitespace_accepts_pretty_printing_within_its_bounds():
    """'indented' (a request's ``disable_any_whitespace: false``): nothing, a space, or one or two line breaks then
    at most 20 spaces or tabs between tokens: ``json.dumps`` with any indent up to 20 columns, nothing wider."""
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "object"}}, "b": {}}}
    value = {"a": [{"c": [1, {"d": None}]}], "b": "x"}
    node = schema_to_node(schema, whitespace="indented")
    for indent in (None, 1, 2, 4, "\t"):
        assert accepts(node, json.dumps(value, indent=indent)), indent
    assert accepts(node, json.dumps(value, separators=(",", ":")))
    assert accepts(node, '{\n\n' + ' ' * 20 + '"b": 1}') and accepts(node, '{ "b" : 1 }')
    for text in ('{\n' + ' ' * 21 + '"b": 1}', '{\n\n\n"b": 1}', '{  "b": 1}', '{\r\n"b": 1}', ' {"b": 1}',
                 '{"b": 1}\n', '{ \n"b": 1}'):
        assert not accepts(node, text), text
    # five levels of four spaces: the deepest this policy indents
    assert accepts(node, json.dumps({"a": [{"c": [[1]]}]}, indent=4))
    assert not accepts(node, json.dumps({"a": [{"c": [[[1]]]}]}, indent=4))


def test_flexible_whitespace_accepts_json_dumps_separators_and_bounded_runs():
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}}
    check(schema, good=[{"a": [1, 2]}, {"a": []}, {}], whitespace="flexible",
          texts_good=['{"a":[1,2]}', '{ "a" :\n[ 1 ,2 ] }', '{    }'],
          texts_bad=[' {"a":[1]}', '{"a":[1]} ', '{     "a":[1]}', '{\f"a":[1]}'])
    node = schema_to_node(schema, whitespace="flexible", max_whitespace=1)
    assert accepts(node, '{ "a": [1, 2]}') and not accepts(node, '{  "a": [1]}')


def test_dumps_whitespace_is_exactly_json_dumps_separators():
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}},
                                               "b": {"enum": [{"x": [1, 2]}]}}, "additionalProperties": {}}
    values = [{"a": [1, 2], "b": {"x": [1, 2]}}, {"a": []}, {}, {"a": [3], "z": {"k": [None, {"q": 1}]}}]
    check(schema, good=values, whitespace="dumps",
          texts_bad=['{"a":[1, 2]}', '{"a": [1,2]}', '{ "a": [1]}', '{"a": [1] }', '{"a":  [1]}'])
    node = schema_to_node({"type": "array", "contains": {"const": 2}}, whitespace="dumps")
    assert accepts(node, json.dumps([1, 2, 3])) and not accepts(node, "[1,2]")


# ---- composition and references ------------------------------------------------------------------------------

def test_all_of_merges_exactly():
    schema = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                         "additionalProperties": False},
                        {"properties": {"a": {"minimum": 3}, "b": {}}}]}
    check(schema, good=[{"a": 3}], bad=[{"a": 2}, {"a": 3, "b": 1}, {}])
    check({"allOf": [{"type": ["integer", "string"]}, {"type": ["number"]}, {"maximum": 5}]},
          good=[5, -1], bad=["a", 6, 1.5])


def test_any_of_and_disjoint_one_of():
    check({"anyOf": [{"type": "integer", "maximum": 0}, {"type": "integer", "minimum": 10}]},
          good=[-3, 0, 10], bad=[5])
    check({"oneOf": [{"type": "string"}, {"type": "integer"}]}, good=["s", 1], bad=[None])
    tagged = {"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}},
                         "required": ["kind"]},
                        {"type": "object", "properties": {"kind": {"const": "b"}}, "required": ["kind"]}]}
    check(tagged, good=[{"kind": "a", "x": 1}, {"kind": "b"}], bad=[{"kind": "c"}, {"kind": "a", "x": "s"}])


def test_overlapping_one_of_branches_exclude_each_other():
    schema = {"type": "object", "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}
    check(schema, good=[{"a": 1}, {"b": 2}, {"a": 1, "c": 3}], bad=[{}, {"a": 1, "b": 2}, {"c": 1}])
    # 3.5 is valid too, but 'not integer' is compiled without the non-integral numbers (a narrowing)
    check({"oneOf": [{"type": "integer"}, {"minimum": 3}]}, good=[1, 2, "s", None], bad=[3, 4, 100, 3.5])


def test_refs_local_and_recursive_unrolled():
    schema = {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}},
                                 "additionalProperties": False}},
              "$ref": "#/$defs/node"}
    check(schema, good=[{}, {"next": {}}, {"next": {"next": {}}}], bad=[{"next": 1}])
    # MAX_REF_DEPTH = 4 expansions of the definition along a path: four nested objects, not five
    assert accepts(schema_to_node(schema), '{"next":{"next":{"next":{}}}}')
    assert not accepts(schema_to_node(schema), '{"next":{"next":{"next":{"next":{}}}}}')
    check({"definitions": {"a~b/c": {"type": "integer"}}, "items": {"$ref": "#/definitions/a~0b~1c"},
           "type": "array"}, good=[[1]], bad=[["x"]])
    check({"id": "classpath:///schemas/entry.json#", "definitions": {"a": {"type": "integer"}},
           "properties": {"p": {"$ref": "#/definitions/a"}}, "type": "object"}, good=[{"p": 1}], bad=[{"p": "x"}])
    check({"$schema": "http://json-schema.org/draft-07/schema#", "$id": "http://x.org/root.json",
           "definitions": {"s": {"$id": "#str", "type": "string"}},
           "properties": {"p": {"$ref": "#str"}}, "type": "object"}, good=[{"p": "x"}], bad=[{"p": 1}])


def test_not_is_pushed_down_to_positive_schemas():
    check({"not": {"type": ["string", "object"]}}, good=[1, None, [1], True, 2.5], bad=["s", {}])
    check({"type": "integer", "not": {"enum": [1, 2.0]}}, good=[0, 3, 12, -1], bad=[1, 2])
    check({"type": "string", "not": {"const": "a"}}, good=["b", "", "ab"], bad=["a"], texts_bad=['"\\u0061"'])
    check({"type": "object", "not": {"required": ["a", "b"]}}, good=[{}, {"a": 1}, {"b": 1, "c": 2}],
          bad=[{"a": 1, "b": 2}])
    check({"not": {"minimum": 3}}, good=[2, 2.999, -5], bad=[3, 3.5, "x", None])
    check({"not": {"anyOf": [{"type": "string"}, {"type": "null"}]}}, good=[1, True], bad=["s", None])
    check({"not": {"not": {"type": "integer"}}}, good=[1, -4], bad=["x", 1.5])
    check({"type": "object", "properties": {"k": {"type": "integer"}},
           "not": {"properties": {"k": {"maximum": 5}}}}, good=[{"k": 6}], bad=[{}, {"k": 5}, {"k": "x"}])
    check({"$schema": "http://json-schema.org/draft-04/schema#",
           "not": {"type": "integer", "exclusiveMinimum": True, "minimum": 5}}, good=[5, 4, "x"], bad=[6, 100])


def test_dependencies_hold_when_their_property_is_present():
    check({"type": "object", "properties": {"a": {}, "b": {}, "c": {}}, "dependencies": {"a": ["b"]}},
          good=[{}, {"b": 1}, {"a": 1, "b": 2}, {"c": 1}], bad=[{"a": 1}, {"a": 1, "c": 2}])
    check({"type": "object", "dependentSchemas": {"a": {"properties": {"b": {"type": "integer"}}}},
           "properties": {"a": {}, "b": {}}}, good=[{"b": "s"}, {"a": 1, "b": 2}], bad=[{"a": 1, "b": "s"}])
    check({"dependentRequired": {"a": ["b"]}}, good=[1, "s", {"b": 1}], bad=[{"a": 1}])


def test_if_then_else():
    check({"if": {"type": "integer"}, "then": {"minimum": 3}, "else": {"type": "string"}},
          good=[3, 10, "s"], bad=[2, None, [1]])
    check({"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "x": {}},
           "if": {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["x"]}},
          good=[{"kind": "a", "x": 1}, {"kind": "b"}, {"x": 1}], bad=[{"kind": "a"}, {}])


def test_boolean_schemas_and_empty_schema():
    check(True, good=[1, "x", [1, [2, [3]]], {"a": {"b": None}}, None])
    check({"type": "object", "properties": {"a": False}}, good=[{}], bad=[{"a": 1}])


# ---- refusals and errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("schema, message", [
    ({"not": {"type": "string", "pattern": "a"}},
     r"'not' over 'pattern' is not supported \(keyword 'not' at '#/not'\)"),
    ({"not": {"oneOf": [{}]}}, r"'not' over 'oneOf' is not supported"),
    ({"properties": {"a": {"unevaluatedItems": False}}},
     r"'unevaluatedItems' is not supported \(keyword 'unevaluatedItems' at '#/properties/a'\)"),
    ({"if": {"pattern": "^a"}, "then": {"maxLength": 3}}, r"'not' over 'pattern' is not supported"),
    ({"contains": {}, "minContains": 2}, r"'minContains'/'maxContains' are not supported \(keyword 'minContains'"),
    ({"unevaluatedProperties": False}, r"'unevaluatedProperties' is not supported"),
    ({"type": "array", "uniqueItems": True}, r"'uniqueItems: true' is not supported unless at most one item"),
    ({"type": "number", "multipleOf": 0.01}, r"a fractional 'multipleOf' is not supported"),
    ({"type": "integer", "multipleOf": 7}, r"'multipleOf: 7' without tight bounds is not supported"),
    ({"oneOf": [{"type": "string"}, {"pattern": "^a"}]},
     r"oneOf branches 0 and 1 may both match one value, and branch 1 cannot be negated \('not' over 'pattern'"),
    ({"type": "string", "pattern": "a(?=b)"}, r"pattern: lookahead is not supported.*keyword 'pattern' at '#'"),
    ({"$ref": "http://example.com/s.json"}, r"points outside this schema document"),
])
def test_unsupported_keywords_are_refused_with_keyword_and_pointer(schema, message):
    with pytest.raises(UnsupportedSchemaError, match=message):
        schema_to_node(schema)


def test_lenient_ignores_unsupported_keywords_and_reports_them():
    warnings = []
    node = schema_to_node({"type": "integer", "not": {"multipleOf": 3}, "unevaluatedProperties": False},
                          lenient=True, warnings=warnings)
    assert accepts(node, "3")
    assert warnings == ["'unevaluatedProperties' is not supported (keyword 'unevaluatedProperties' at '#'): ignored",
                        "'not' over 'multipleOf' is not supported (keyword 'not' at '#/not'): ignored"]


def test_unknown_keywords_are_reported_with_their_pointer_or_refused():
    schema = {"type": "object", "x-vendor": 1, "nullable": True, "discriminator": {"propertyName": "a"},
              "properties": {"a": {"type": "string", "maxLenght": 3}, "b": {"type": "integer", "divisibleBy": 2}}}
    warnings = []
    node = schema_to_node(schema, warnings=warnings)
    assert accepts(node, '{"a":"longer than three","b":3}')  # an unknown keyword constrains nothing
    assert warnings == [
        "unknown keyword 'maxLenght' at '#/properties/a' ignored: not JSON Schema vocabulary, so it constrains "
        "nothing (did you mean 'maxLength'?)",
        "unknown keyword 'divisibleBy' at '#/properties/b' ignored: not JSON Schema vocabulary, so it constrains "
        "nothing"]
    with pytest.raises(UnknownKeywordError, match=r"did you mean 'maxLength'.*keyword 'maxLenght' at "
                                                  r"'#/properties/a'"):
        schema_to_node(schema, reject_unknown_keywords=True)
    schema_to_node({"type": "string", "x-order": 1, "nullable": True}, reject_unknown_keywords=True)  # not reported


def test_warnings_are_capped_with_a_count():
    warnings = []
    schema_to_node({"properties": {f"p{i}": {f"bad{i}": 1} for i in range(80)}}, warnings=warnings)
    assert len(warnings) == 51 and warnings[-1] == "... and 30 more warnings"


@pytest.mark.parametrize("schema, message", [
    ({"type": "strin"}, r"'type' must be one of null, boolean.*keyword 'type' at '#'"),
    ({"properties": {"a": {"minLength": -1}}}, r"'minLength' must be a non-negative integer.*'#/properties/a'"),
    ({"required": "a"}, r"'required' must be an array of strings"),
    ({"anyOf": []}, r"'anyOf' must be a non-empty array of schemas"),
    ({"$ref": "#/definitions/missing"}, r"points to nothing \(dangling reference\)"),
    ({"$ref": "#nowhere"}, r"names no anchor"),
    ({"definitions": {"a": {"$ref": "#/definitions/a"}}, "$ref": "#/definitions/a"}, r"\$ref cycle"),
    ({"type": "string", "pattern": "a("}, r"pattern: .*keyword 'pattern' at '#'"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, r"accepts no value at all.*bounds leave no integer"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, r"accepts no value at all.*no type in common"),
    ({"enum": [1, 2], "type": "string"}, r"no 'enum'/'const' value satisfies"),
    ({"type": "object", "required": ["a"], "additionalProperties": False},
     r"required property 'a' can have no value"),
    ({"type": "string", "minLength": 3, "maxLength": 2}, r"minLength exceeds maxLength"),
    ({"minimum": float("nan")}, r"the schema is not JSON"),
    ({"enum": ["a"], "pattern": "("}, r"pattern: .*keyword 'pattern' at '#'"),
    ({"not": {}}, r"accepts no value at all"),
    ({"not": {"anyOf": [{"type": "string"}, {"maxLength": 2}]}}, r"accepts no value at all"),
    ({"const": {1, 2}}, r"the schema is not JSON"),
    ("string", r"a schema must be a JSON object or a boolean"),
])
def test_malformed_schemas_raise_invalid_schema_error(schema, message):
    with pytest.raises(InvalidSchemaError, match=message):
        schema_to_node(schema)


def test_building_runs_under_a_time_budget():
    with pytest.raises(GrammarTooComplexError, match=r"ran past its time budget of 0.001 s"):
        schema_to_node({"enum": [f"value {i}" for i in range(3000)]}, time_budget_s=0.001)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("schema", [
    {"enum": list(range(200_000))},
    {"type": "string", "maxLength": 10_000_000},
    {"type": "array", "minItems": 5_000_000},
    {"allOf": [{"anyOf": [{"type": "object", "required": [f"{letter}{i}"]} for i in range(12)]}
               for letter in "abcde"]},
])
def test_gigantic_schemas_fail_fast_with_a_typed_error(schema):
    expected = r"more than \d+ automaton nodes|past the limit of 1000000|more than 2000 alternatives"
    with pytest.raises(GrammarTooComplexError, match=expected):
        schema_to_node(schema)


@pytest.mark.parametrize("schema, error, message", [
    *(({keyword: 10**400}, GrammarTooComplexError, r"a count of about 10\^399 .*past the limit of 1000000")
      for keyword in ("minLength", "maxLength", "minItems", "maxItems", "maxProperties")),
    ({"type": "integer", "multipleOf": 3 * 10**400}, UnsupportedSchemaError, r"'multipleOf: about 10\^400' without"),
    ({"maximum": -10**400}, UnsupportedSchemaError, r"beyond the float range.*keyword 'maximum'"),
    ({"type": "number", "exclusiveMinimum": 10**400}, UnsupportedSchemaError,
     r"beyond the float range.*keyword 'minimum'"),
])
def test_integers_past_the_float_range_give_typed_errors(schema, error, message):
    """Counts and multipleOf read through float() and overflowed (a 500); an error names the number shortly."""
    with pytest.raises(error, match=message):
        schema_to_node(schema)


def test_a_multiple_of_past_the_float_range_is_exact():
    node = schema_to_node({"type": "integer", "multipleOf": 10**400})
    assert fullmatch(node, "0") and fullmatch(node, "1" + "0" * 400) and fullmatch(node, "-3" + "0" * 400)
    assert not fullmatch(node, "1" + "0" * 399) and not fullmatch(node, "1" + "0" * 399 + "1")


@pytest.mark.parametrize("schema, message", [
    ({"not": {"required": 5}}, r"'required' must be an array of strings \(keyword 'required' at '#/not'\)"),
    ({"not": {"properties": False}}, r"'properties' must be an object whose values are schemas"),
    ({"not": {"$ref": 1}}, r"'\$ref' must be a string"),
    ({"not": {"not": 5}}, r"'not' must be a schema .*at '#/not'"),
    ({"not": {"type": [[]]}}, r"'type' must be one of"),
    ({"not": {"enum": None}}, r"'enum' must be an array"),
    ({"not": {"anyOf": 1}}, r"'anyOf' must be a non-empty array of schemas"),
    ({"not": {"maxLength": 1.5}}, r"'maxLength' must be a non-negative integer \(keyword 'maxLength' at '#/not'\)"),
    ({"not": {"allOf": [{"required": [1]}]}}, r"'required' must be an array of strings .*'#/not/allOf/0'"),
    ({"$defs": {"a": {"minProperties": "x"}}, "not": {"$ref": "#/$defs/a"}}, r"'minProperties' .*'#/\$defs/a'"),
])
def test_a_negated_schema_has_its_keywords_checked(schema, message):
    """A schema under 'not' is negated, never built, so its values reached the negation unchecked (a 500, or a
    value refused elsewhere compiled silently)."""
    with pytest.raises(InvalidSchemaError, match=message):
        schema_to_node(schema)


_KEYWORDS = ["type", "enum", "const", "properties", "required", "additionalProperties", "patternProperties",
             "propertyNames", "minProperties", "maxProperties", "items", "prefixItems", "contains", "minContains",
             "maxContains", "minItems", "maxItems", "uniqueItems", "minLength", "maxLength", "pattern", "format",
             "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "anyOf", "oneOf", "allOf",
             "not", "$ref", "$defs", "definitions", "if", "then", "else", "dependentRequired", "dependentSchemas"]
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 12), st.sampled_from([10**400, -10**400, 2**63, 1e308]),
                    st.floats(allow_nan=False, allow_infinity=False),
                    st.sampled_from(["string", "a+", "#", "#/$defs/a", "date", "a("]))
_ANY = st.recursive(_VALUES, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(st.sampled_from(["a", "b"]), inner, max_size=2)),
                    max_leaves=4)


def _wrapped(children):
    """A schema built around smaller ones: under not/allOf/anyOf/properties/items, or beside other keywords."""
    return st.one_of(st.builds(lambda c: {"not": c}, children), st.builds(lambda c: {"allOf": [c]}, children),
                     st.builds(lambda c, d: {"anyOf": [c, d]}, children, children),
                     st.builds(lambda c: {"type": "object", "properties": {"a": c}}, children),
                     st.builds(lambda c: {"items": c, "$defs": {"a": c}}, children),
                     st.builds(lambda c, extra: {**c, **extra} if isinstance(c, dict) else c, children,
                               st.dictionaries(st.sampled_from(_KEYWORDS), _ANY, max_size=2)))


@settings(max_examples=600, deadline=None, database=None, derandomize=True)
@given(st.recursive(st.dictionaries(st.sampled_from(_KEYWORDS), _ANY, max_size=3), _wrapped, max_leaves=6))
def test_any_schema_gives_a_node_or_a_typed_error(schema):
    """Keywords with values of every type (integers past float's range, wrong-typed values under 'not', ...) give
    an automaton or a 400-kind error, never another exception (a 500)."""
    try:
        schema_to_node(schema, time_budget_s=2.0)
    except UserInputError:
        pass

"""JSON string spellings: every spelling of a decoded language is accepted, nothing else, checked against
``json.loads`` on generated bodies; and the reference matcher agrees with Python's ``re``."""

import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from corral.grammar.json_strings import (ANY_CHAR, intersect_chars, length_node, spell, string_literal,
                                         string_node)
from corral.grammar.node_builder import NodeBuilder
from corral.grammar.regex_ast import Alt, CharSet, Concat, Repeat, to_python_regex
from corral.grammar.regex_match import fullmatch
from corral.grammar.regex_parser import parse_regex

_UNITS = ['a', 'é', '\\"', '\\\\', '\\/', '\\n', '\\t', '\\u0041', '\\u00E9', '\\ud83d\\ude00', '😀', '\\ud83d',
          '"', '\\', '\n', '\\x', '\\u12', 'Z', ' ']


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_UNITS), max_size=6), st.integers(0, 4), st.integers(0, 5))
def test_length_counts_decoded_characters_exactly(units, low, extra):
    body = "".join(units)
    text = f'"{body}"'
    node = string_node(NodeBuilder(), length_node(NodeBuilder(), low, low + extra))
    try:
        value = json.loads(text)
        valid = low <= len(value) <= low + extra and not any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    except json.JSONDecodeError:
        valid = False
    assert fullmatch(node, text) == valid, text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(_UNITS), max_size=5))
def test_pattern_applies_to_the_decoded_value(units):
    pattern = "^[A-Za-zé😀]+$"
    reference = "^[A-Za-zé😀]+\\Z"  # ECMA's $ is the end of the text; Python's also matches before a final newline
    text = '"' + "".join(units) + '"'
    node = string_node(NodeBuilder(), parse_regex(pattern, flavor="ecma", search=True))
    try:
        value = json.loads(text)
        valid = re.search(reference, value) is not None
    except json.JSONDecodeError:
        valid = False
    assert fullmatch(node, text) == valid, text


def test_spelling_of_astral_ranges_uses_surrogate_pairs():
    b = NodeBuilder()
    node = spell(b, CharSet.of((0x1F600, 0x1F64F), (0x10000, 0x10001)))
    for cp in (0x1F600, 0x1F64F, 0x10000, 0x10001):
        escaped = json.dumps(chr(cp))[1:-1]
        assert fullmatch(node, escaped) and fullmatch(node, escaped.upper().replace("\\U", "\\u"))
        assert fullmatch(node, chr(cp))
    for cp in (0x1F5FF, 0x1F650, 0x10002):
        assert not fullmatch(node, json.dumps(chr(cp))[1:-1]) and not fullmatch(node, chr(cp))


_ONE_UNITS = _UNITS + ['b', '\\u0061', '\\u0062', '\\u00e9', '\\u00C9', '\x7f', '\\u007F', '\\u0080', '\\uE000',
                       '\\uFFFF', '\\uD83D\\uDE01', '\\ud800\\udc00', '\\b', '\\f', '\\r', '\u2028']


def test_spelling_of_a_class_across_ascii_is_exact():
    # such a class spells as its ASCII half or the rest (the escape hatch of a property-name trie)
    excluded = "a\n\"é😀"
    chars = intersect_chars(CharSet.chars(excluded).negate(), ANY_CHAR)
    node = spell(NodeBuilder(), chars)
    for unit in _ONE_UNITS:
        try:
            value = json.loads(f'"{unit}"')
            valid = len(value) == 1 and value not in excluded and not 0xD800 <= ord(value) <= 0xDFFF
        except json.JSONDecodeError:
            valid = False
        assert fullmatch(node, unit) == valid, unit


def test_string_literal_spells_as_json_dumps_or_raw():
    node = string_literal(NodeBuilder(), 'é"\n')
    assert fullmatch(node, json.dumps('é"\n')) and fullmatch(node, json.dumps('é"\n', ensure_ascii=False))
    assert not fullmatch(node, '"\\u00e9\\u0022\\n"')


_ATOMS = st.sampled_from([CharSet.chars("a"), CharSet.chars("ab"), CharSet.of((98, 100)), ANY_CHAR])


def _trees(children):
    return st.one_of(st.lists(children, min_size=1, max_size=3).map(lambda p: Concat(tuple(p))),
                     st.lists(children, min_size=2, max_size=3).map(lambda o: Alt(tuple(o))),
                     st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
                         lambda t: Repeat(t[0], t[1], t[1] + t[2])),
                     children.map(lambda n: Repeat(n, 0, None)))


@settings(max_examples=300, deadline=None)
@given(st.recursive(_ATOMS, _trees, max_leaves=8), st.text(alphabet="abcd", max_size=6))
def test_reference_matcher_agrees_with_python_re(node, text):
    assert fullmatch(node, text) == bool(re.fullmatch(to_python_regex(node), text))

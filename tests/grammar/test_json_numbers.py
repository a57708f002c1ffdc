"""Digit-range and decimal-range regexes against brute force: every integer in a window, and random decimals
parsed the way ``jsonschema`` parses them (int or binary64 float)."""

import json
import random
import re
from fractions import Fraction

import pytest

from corral.grammar.json_numbers import integer_range, number_node, number_range
from corral.grammar.node_builder import NodeBuilder
from corral.grammar.regex_ast import to_python_regex


def _compile(node) -> re.Pattern:
    return re.compile(to_python_regex(node))


@pytest.mark.parametrize("low, high", [(0, 100), (-5, 17), (None, -3), (7, None), (-123, None), (None, None),
                                       (0, 0), (99, 1001), (-1000, -999), (3, 2), (-19, -10)])
def test_integer_range_matches_exactly_the_integers_in_range(low, high):
    pattern = _compile(integer_range(NodeBuilder(), low, high))
    for n in range(-1500, 1500):
        inside = (low is None or n >= low) and (high is None or n <= high)
        assert bool(pattern.fullmatch(str(n))) == inside, n
    for text in ("-0", "01", "+1", "1.0", ""):
        assert not pattern.fullmatch(text)


def test_integer_range_with_huge_bounds():
    low, high = 10 ** 20 - 3, 10 ** 21 + 5
    pattern = _compile(integer_range(NodeBuilder(), low, high))
    for n in (low - 1, low, low + 1, 10 ** 20, 10 ** 21, high, high + 1, 5 * 10 ** 20):
        assert bool(pattern.fullmatch(str(n))) == (low <= n <= high), n


BOUNDS = [(0, False, 1, False), (0, True, None, False), (-90, False, 90, False), (0.1, True, 2.5, True),
          (None, False, -1.5, False), (-0.25, False, 0.25, True), (1.5, False, None, False), (0, True, 1e-3, False)]


@pytest.mark.parametrize("low, low_strict, high, high_strict", BOUNDS)
def test_number_range_agrees_with_float_comparison(low, low_strict, high, high_strict):
    node = number_range(NodeBuilder(), None if low is None else Fraction(low), low_strict,
                        None if high is None else Fraction(high), high_strict)
    pattern = _compile(node)
    rng = random.Random(7)
    specials = [0, 1, -1, 0.1, 90, -90, 2.5, 0.25, -0.25, 1.5, -1.5, 1e-3, 0.0009999, 0.001]
    for _ in range(4000):
        value = rng.choice(specials) if rng.random() < 0.2 else round(rng.uniform(-200, 200), rng.choice([0, 1, 2, 5]))
        for text in {json.dumps(value), json.dumps(float(value))}:
            parsed = json.loads(text)
            inside = ((low is None or (parsed > low if low_strict else parsed >= low))
                      and (high is None or (parsed < high if high_strict else parsed <= high)))
            accepted = bool(pattern.fullmatch(text))
            assert not accepted or inside, text  # sound: never a value outside the bounds
            if inside and "e" not in text and text != "-0.0":
                assert accepted, text  # exact on the spellings it keeps (no exponent, no negative zero)


def test_number_range_rejects_decimals_that_round_onto_an_exclusive_bound():
    pattern = _compile(number_range(NodeBuilder(), Fraction(0.1), True, None, False))
    assert not pattern.fullmatch("0.1000000000000000055511151231257827")  # parses to the float 0.1
    assert pattern.fullmatch("0.10000000000000002")


def test_plain_number_grammar():
    pattern = _compile(number_node(NodeBuilder()))
    for text in ("0", "-0", "12", "1.5", "-0.25e-3", "1E+2", "1e5"):
        assert pattern.fullmatch(text), text
    for text in ("01", "1.", ".5", "+1", "1e", "--1", "NaN", "Infinity"):
        assert not pattern.fullmatch(text), text

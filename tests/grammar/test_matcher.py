"""Matcher against its oracles: Python's ``re`` on generated patterns, the reference matcher on ``Intersect``, and
its fuel on the patterns that make ``re`` backtrack for minutes."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corral.errors import GrammarTooComplexError
from corral.grammar.matcher import Fuel, Matcher
from corral.grammar.regex_ast import Intersect
from corral.grammar.regex_match import fullmatch as reference_fullmatch
from corral.grammar.regex_parser import parse_regex

from regex_strategies import TEXTS, regexes


@settings(max_examples=400, deadline=None)
@given(regexes(), st.lists(TEXTS, min_size=1, max_size=6))
def test_search_agrees_with_re_search(pattern, texts):
    matcher = Matcher()  # one matcher for all texts: its memoized derivatives are shared, as in a compile
    node = parse_regex(pattern, search=True)
    for text in texts:
        theirs = re.search(pattern.replace("$", "\\Z"), text) is not None
        assert matcher.fullmatch(node, text) == theirs, (pattern, text)


@settings(max_examples=200, deadline=None)
@given(regexes(), regexes(), st.lists(TEXTS, min_size=1, max_size=6))
def test_intersection_agrees_with_the_reference_matcher(left, right, texts):
    matcher = Matcher()
    node = Intersect((parse_regex(left, search=True), parse_regex(right, search=True)))
    for text in texts:
        assert matcher.fullmatch(node, text) == reference_fullmatch(node, text), (left, right, text)


@pytest.mark.parametrize("pattern, text", [
    ("^(a+)+$", "a" * 40 + "!"),
    ("(a|aa)*b", "a" * 5000),
    ("(.*a){12}", "a" * 11 + "b" * 2000),
    ("^(\\w+\\s?)*$", "word " * 200 + "!"),
    ("(x+x+)+y", "x" * 3000),
])
def test_backtracking_patterns_are_linear(pattern, text):
    matcher = Matcher()
    node = parse_regex(pattern, flavor="ecma", search=True)
    assert matcher.fullmatch(node, text) is False
    # a few derivatives per distinct state, then memo hits: the work does not grow with the text
    assert matcher.fuel.spent < 2_000
    half = Matcher()
    half.fullmatch(node, text[:len(text) // 2])
    assert matcher.fuel.spent <= 2 * half.fuel.spent + 100  # twice the text, at most twice the work


def test_counted_repeats_stay_counters():
    matcher = Matcher()
    node = parse_regex("a{1000}b{2,3}", flavor="ecma")
    assert matcher.fullmatch(node, "a" * 1000 + "bb")
    assert not matcher.fullmatch(node, "a" * 999 + "bb")
    assert matcher.fuel.spent < 20_000


def test_fuel_runs_out_on_a_quadratic_search_and_names_the_limit():
    matcher = Matcher(Fuel(limit=100_000))
    node = parse_regex("(a{1000}){1000}", flavor="ecma", search=True)  # every start offset stays alive
    with pytest.raises(GrammarTooComplexError, match="more than 100000 steps"):
        matcher.fullmatch(node, "a" * 5000)


def test_fuel_calls_the_time_check():
    calls = []
    matcher = Matcher(Fuel(limit=10**9, check_time=lambda: calls.append(1)))
    matcher.fullmatch(parse_regex("(a{1000}){1000}", flavor="ecma", search=True), "a" * 500)
    assert len(calls) == matcher.fuel.spent // 4096 > 0

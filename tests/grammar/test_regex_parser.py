"""parse_regex against Python's own ``re``: the AST printed back must accept exactly what the pattern accepts."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corral.errors import InvalidRegexError, UnsupportedRegexError
from corral.grammar.regex_ast import to_python_regex
from corral.grammar.regex_parser import parse_regex

from regex_strategies import TEXTS, regexes

def _agree_fullmatch(pattern: str, text: str) -> None:
    ours = re.fullmatch(to_python_regex(parse_regex(pattern)), text) is not None
    # subtle: Python's '$' also matches before a final newline; Corral's '$' is the end of the text.
    theirs = re.fullmatch(pattern.replace("$", "\\Z"), text) is not None
    assert ours == theirs, (pattern, text)


@settings(max_examples=400, deadline=None)
@given(regexes(), st.lists(TEXTS, min_size=1, max_size=6))
def test_fullmatch_agrees_with_re(pattern, texts):
    for text in texts:
        _agree_fullmatch(pattern, text)


@settings(max_examples=300, deadline=None)
@given(regexes(), st.lists(TEXTS, min_size=1, max_size=6))
def test_search_agrees_with_re_search(pattern, texts):
    node = to_python_regex(parse_regex(pattern, search=True))
    for text in texts:
        theirs = re.search(pattern.replace("$", "\\Z"), text) is not None
        assert (re.fullmatch(node, text, re.DOTALL) is not None) == theirs, (pattern, text)


@pytest.mark.parametrize("pattern, good, bad", [
    ("a{2,3}", ["aa", "aaa"], ["a", "aaaa"]),
    ("x{,2}", ["", "xx"], ["xxx"]),  # Python reads {,n} as {0,n}
    ("a{x}", ["a{x}"], ["a"]),  # not a quantifier: literal braces
    ("(^a|b)c", ["ac", "bc"], ["c"]),
    ("a^b|c", ["c"], ["ab", "a^b"]),
    ("a$b", [], ["ab", "a$b"]),
    ("\\Aab\\Z", ["ab"], ["a"]),
    ("[\\d-]+", ["1-2"], ["a"]),
    ("(?#note)a", ["a"], [""]),
    ("(?P<g>a)b", ["ab"], ["a"]),
])
def test_python_flavor_table(pattern, good, bad):
    for text in good + bad:
        _agree_fullmatch(pattern, text)
        assert (re.fullmatch(to_python_regex(parse_regex(pattern)), text) is not None) == (text in good)


@pytest.mark.parametrize("pattern, good, bad", [
    ("\\d+", ["123"], ["١٢", "1a"]),  # ASCII digits only in ECMA
    ("\\w", ["a", "_"], ["é"]),
    ("\\s", [" ", "\u00a0", "\ufeff"], ["x"]),
    (".", ["a", "é"], ["\n", "\r", "\u2028"]),
    ("[]", [], ["", "a"]),  # ECMA: the empty class
    ("\\u{1F600}", ["\U0001F600"], ["a"]),
    ("\\cJ", ["\n"], ["c"]),
    ("\\0", ["\0"], ["0"]),
    ("(?<h>b)c", ["bc"], ["b"]),
])
def test_ecma_flavor_table(pattern, good, bad):
    node = to_python_regex(parse_regex(pattern, flavor="ecma"))
    for text in good + bad:
        assert (re.fullmatch(node, text, re.DOTALL) is not None) == (text in good), (pattern, text)


def test_search_semantics_respects_anchors():
    node = to_python_regex(parse_regex("^ab|c$", flavor="ecma", search=True))
    assert [bool(re.fullmatch(node, t, re.DOTALL)) for t in ["abx", "xab", "xc", "cx"]] == [True, False, True, False]


@pytest.mark.parametrize("pattern, message, offset", [
    ("a(?=b)", "lookahead", 1),
    ("(?!b)", "negative lookahead", 0),
    ("x(?<=b)", "lookbehind", 1),
    ("(?<!b)", "negative lookbehind", 0),
    ("(a)\\1", "backreference", 3),
    ("(?P<n>a)(?P=n)", "backreference", 8),
    ("(?<n>a)\\k<n>", "backreference", 7),
    ("a\\b", "word boundary", 1),
    ("\\B", "word boundary", 0),
    ("(?>a)", "atomic group", 0),
    ("a*+", "possessive quantifier", 2),
    ("(?i)a", "inline flag group", 0),
    ("(^a)*", "anchor inside a repetition", 0),
    ("(?(1)a|b)", "conditional group", 0),
    ("\\N{DIGIT ONE}", "named character escape", 0),
])
def test_unsupported_constructs_name_the_construct_and_offset(pattern, message, offset):
    with pytest.raises(UnsupportedRegexError, match=re.escape(f"{message} is not supported") + f".*at offset {offset} "):
        parse_regex(pattern)


@pytest.mark.parametrize("pattern, message, offset", [
    ("(ab", "missing \\), unterminated subpattern", 0),
    ("ab)", "unbalanced parenthesis", 2),
    ("[ab", "unterminated character set", 0),
    ("a**", "multiple repeat", 2),
    ("*a", "nothing to repeat", 0),
    ("x{3,1}", "min repeat greater than max repeat", 1),
    ("[z-a]", "bad character range", 2),
    ("\\xZ1", "incomplete escape, expected 2 hex digits", 0),
    ("\\q", "bad escape \\\\q", 0),
    ("a\\", "bad escape \\(end of pattern\\)", 1),
])
def test_malformed_patterns_raise_invalid_regex(pattern, message, offset):
    with pytest.raises(InvalidRegexError, match=f"{message} at offset {offset} "):
        parse_regex(pattern)
    with pytest.raises(re.error):
        re.compile(pattern)


def test_non_string_pattern_is_a_typed_error():
    with pytest.raises(InvalidRegexError, match="must be a string"):
        parse_regex(5)


@pytest.mark.parametrize("text, syntax", [
    ("a{1000001}", "regex"), ("a{2147483648}", "regex"), ("x{1,9223372036854775808}", "regex"),
    ('root ::= "a"{2147483648}', "gbnf"), ('root ::= "a"{1,9223372036854775808}', "gbnf"),
    ('start: "a" ~ 2147483648', "lark"), ('start: A\nA: "a" ~ 1..9223372036854775808', "lark"),
    ("start: /a{2147483648}/", "lark"), ("a{" + "1" * 5000 + "}", "regex"),  # past Python's int() digit limit
    ('root ::= "a"{' + "9" * 5000 + "}", "gbnf"), ('start: "a" ~ 1..' + "9" * 5000, "lark"),
])
def test_repeat_counts_past_the_limit_are_refused_where_they_are_written(text, syntax):
    """Every syntax bounds a count as schemas do (1,000,000): past 2**31 a count overflowed the native automaton's
    32-bit ones, a 500 instead of a 400."""
    from corral.errors import InvalidGrammarError
    from corral.grammar.gbnf_grammar import parse_gbnf
    from corral.grammar.lark_grammar import parse_lark
    parse, error = {"regex": (parse_regex, InvalidRegexError), "gbnf": (parse_gbnf, InvalidGrammarError),
                    "lark": (parse_lark, InvalidGrammarError)}[syntax]
    with pytest.raises(error, match="past the limit of 1000000") as info:
        parse(text)
    if "5000" in str(info.value) or len(text) > 4000:
        assert "(5000 digits)" in str(info.value)  # the count itself is cut in the message
    assert parse_regex("a{1000000}") is not None and parse_regex("a{0001000000}") is not None


@pytest.mark.parametrize("text", ['root ::= "a"{2,1}', 'start: A\nA: "x"{3,2}', 'start: A\nA: "a"~2..1'])
def test_a_reversed_count_inside_a_terminal_is_refused(text):
    """A reversed count in a rule was refused, but one inside a terminal reached an assert (a 500)."""
    from corral.errors import InvalidGrammarError
    from corral.grammar.gbnf_grammar import parse_gbnf
    from corral.grammar.lark_grammar import parse_lark
    with pytest.raises(InvalidGrammarError, match="the maximum is below the minimum"):
        (parse_gbnf if "::=" in text else parse_lark)(text)

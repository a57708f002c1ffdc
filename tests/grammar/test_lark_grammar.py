"""The Lark front-end: the dialect it reads (checked by what the grammar accepts), and the errors it names."""

import pytest
from hypothesis import given, settings, strategies as st

from corral.errors import InvalidGrammarError, UserInputError
from corral.fsm.compiler import GrammarCompiler
from corral.fsm.vocabulary import Vocabulary
from corral.grammar.constraint import Constraint
from corral.grammar.gbnf_grammar import parse_gbnf
from corral.grammar.lark_grammar import parse_lark
from corral.grammar.regex_ast import literal

EOS = 256


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(Vocabulary.from_token_bytes([bytes([b]) for b in range(256)] + [b"<eos>"],
                                                       eos_token_ids=[EOS]))


def language(compiler, text: str, good: list[str], bad: list[str]) -> None:
    grammar = compiler.compile(Constraint("grammar", text))
    for document in good + bad:
        guide = grammar.new_guide()
        accepted = all(guide.advance(b) for b in document.encode()) and guide.is_accepting()
        assert accepted == (document in good), document


@pytest.mark.parametrize("text, good, bad", [
    ('start: "a" | "b" "c"', ["a", "bc"], ["b", "ac", ""]),
    ('start: "a"\n    | "b"\n\n    | "c"  // a comment\n', ["a", "b", "c"], ["ab"]),
    ('start: x+\nx: "a" ["b"]', ["a", "ab", "aab", "abab"], ["", "b", "abb"]),
    ('start: ("a" "b")* "c"?', ["", "ab", "abab", "abc", "c"], ["a", "ba", "cc"]),
    ('start: "a"~3', ["aaa"], ["aa", "aaaa"]),
    ('start: "a"~2..3', ["aa", "aaa"], ["a", "aaaa"]),
    ('start: "a"{2,}', ["aa", "aaaaa"], ["a"]),
    ('start: "a"{,2}', ["", "a", "aa"], ["aaa"]),
    ('start: "x"{3}', ["xxx"], ["xx"]),
    ('start: D+\nD: "0".."9"', ["0", "42"], ["a", ""]),
    ('start: "AbC"i', ["abc", "ABC", "aBc"], ["abd"]),
    ('start: "ski"i', ["SKI", "\u017fki", "s\u212ai", "sk\u0131", "sk\u0130"], ["sk\u00ed"]),  # as re/lark fold
    ('start: /[a-c]+/i', ["aB", "CCC"], ["d"]),
    ('start: /a.b/s', ["a\nb", "axb"], ["ab"]),
    ('start: /a.b/', ["axb"], ["a\nb"]),
    ('start: "\\n" "\\u00e9" "\\""', ['\né"'], ["\\n"]),
    ('?start: item -> alias\n!item: "a"\n_sep: ","', ["a"], [","]),
    ('start: A\nA: B "-" B\nB: /[0-9]+/', ["1-2", "10-20"], ["1-", "-2"]),
    ('start: INT ("," INT)*\n%import common.INT\n%import common.WS\n%ignore WS', ["1", "1, 2 ,3"], ["1,", ","]),
    ('start: NUM\n%import common.SIGNED_NUMBER -> NUM', ["-1.5e3", "+2", ".5"], ["1e", "--1"]),
    ('start: WORD+\n%import common (WORD, WS)\n%ignore WS', ["ab cd", " ab "], ["a1"]),
    ('start: CNAME\n%import common.CNAME\nDIGIT: "x"', ["a1", "_b9"], ["1a", "-"]),  # a user's DIGIT stays theirs
    ('start: C_COMMENT\n%import common.C_COMMENT', ["/* a * b */", "/**/", "/***/"], ["/* a */ */", "/* a"]),
    ('start: ESCAPED_STRING\n%import common.ESCAPED_STRING', ['"a\\"b"', '""'], ['"a"b"', '"a\nb"']),
    ('start: "a" b\nb: "b"\nunused: undefined_rule', ["ab"], ["a"]),
    ('%llguidance {}\nstart: "a"', ["a"], ["b"]),
    # llguidance's lexeme options: a rule of terminals becomes one lazy lexeme
    ('start: f_foo* f_end\nf_end: TEXT\nTEXT: /(.|\\n)+/\nf_foo_hd[lazy]: /(.|\\n)*/ "<fn"\n'
     'f_foo: f_foo_hd "=foo>" /[0-9]+/ "</fn>"',
     ["hello", "a<fn=foo>12</fn>rest", "x<fn=foo>1</fn>y<fn=foo>2</fn>.", "\n<fn=foo>3</fn>?"],
     ["a<fn=bar>", "a<fn=foo>x</fn>", "a<fn=foo>1</fn>"]),
    ('start: item+\nitem[suffix=";"]: /[a-z;]+/', ["a;", "ab;c;", ";;"], ["a", "ab", ";"]),
    ('start: item+\nitem[suffix=/[.!]/, capture]: /[a-z]+/', ["ab.", "a!b."], ["ab", "ab.!"]),
    ('start: item+\nitem[suffix=END]: /[a-z]+/\nEND: "." | "!"', ["ab.", "a!b."], ["ab", "ab.!"]),
    # stop=: the rule does not keep its stop, whose text is read again as the start of what follows
    ('start: with_stop "<end>" "x"\nwith_stop[stop="<end>"]: /[a-z<>]*/', ["foo<end>x", "<end>x"],
     ["foo<end><end>x", "foox", "foo<end>"]),
    ('start: para+\npara: line "\\n"\nline[stop="\\n", temperature=0.7]: /[a-z ]*/',
     ["ab\n", "a b\ncd\n", "ab\n\n"], ["ab", "\nx", "ab\nc"]),
    ('start: A ".!"\nA[stop="."]: /[a-z]+/', ["ab.!"], ["ab.", "ab!", "ab..!"]),
    # terminals that match the empty string (llguidance allows them): nothing, or the terminal's other text
    ('start: A "!"\nA: "a"?', ["!", "a!"], ["aa!", "a"]),
    ('start: /a*/ "b" TEXT\nTEXT: /(.|\\n)*/', ["b", "aab", "ab\nx y"], ["a", ""]),
    ('start: x "!"\nx[lazy]: /a*/', ["!"], ["a!"]),  # lazy and empty: it ends before its first byte
    ('start: "a" "" "b"\n%ignore /[ ]*/', ["ab", "a b", " a  b "], ["a", "a-b"]),
    # a hidden stop's text is read once as a stop: it cannot also end an empty lexeme after it (which would loop)
    ('start: line* "!"\nline[stop="\\n"]: /[a-z]*/', ["!"], ["ab\n!", "\n!", "ab"]),
    ('start: (line "\\n")* "!"\nline[stop="\\n"]: /[a-z]*/', ["!", "ab\n!", "\n\n!"], ["ab!", "ab\n"]),
])
def test_the_dialect(compiler, text, good, bad):
    language(compiler, text, good, bad)


def test_inline_json_nests_without_a_limit_and_keeps_its_lexemes_exact(compiler):
    grammar = 'start: "<" %json {"type": "object", "properties": {"a": {}}, "required": ["a"]} ">"'
    deep = "[" * 40 + "1" + "]" * 40
    good = ['<{"a":1}>', '<{"a":{"b":[{}]}}>', '<{"a":' + deep + '}>', '<{"a":null,"c":{"d":[true]}}>']
    bad = ['<{"a":' + deep[:-1] + '}>', '<{}>', '<{"a":1,}>', '<{"a":[1 2]}>']
    language(compiler, grammar, good, bad)


@pytest.mark.parametrize("text, message", [
    ('start: "a" missing', r"rule 'start' uses 'missing', which is not defined \(line 1\)"),
    ('start: "a"\nstart: "b"', r"'start' is defined twice \(line 2\)"),
    ('begin: "a"', r"no start rule 'start'"),
    ('start: A\nA: "a" A', r"terminal A is defined through itself \(A -> A\); a recursive structure must be a rule "
                           r"\(line 2\)"),
    ('start: "a" start', r"rule 'start' can never finish"),
    ('start: "a" (', r"expected '\)' to close the group, found 'nl' \(line 1\)"),
    ('start: "a"\n  "b" : c', r"expected a rule, a terminal or a %directive, found '\"b\"' \(line 2\)"),
    ('start: "a" "b" : c', r"unexpected ':' \(line 1\)"),
    ('start: sep{"a", ","}\nsep{x, s}: x (s x)*', r"'sep\{...\}' uses a template; templates are not supported \(line 1\)"),
    ('%import foo.BAR\nstart: BAR', r"only the 'common' grammar is bundled \(line 1\)"),
    ('%import common.NOPE\nstart: NOPE', r"common.NOPE does not exist"),
    ('start: /a(?=b)/', r"lookahead is not supported at offset 1 .* \(line 1\)"),
    ('start: /a\\1/', r"a backreference is not supported at offset 1 in regex 'a\\\\1' \(line 1\)"),
    ('start: A\nA[stop=""]: /.*/', r'stop="" on \'A\' \(the end of sequence as the stop\) is not supported.*\(line 2\)'),
    ('start: a\na[stop=/x+/]: /.*/', r"stop= on 'a' takes a string here.* \(line 2\)"),
    ('start: a\na[max_tokens=10]: /.*/', r"max_tokens= on 'a' is not supported: it bounds tokens, not text"),
    ('start: a\na[lazy]: "x" b\nb: "y"', r"rule 'a' has lexeme options .* but it uses 'b', which is a rule"),
    ('start: a\na[stop="x", suffix="y"]: /[a-z]+/', r"'a' has both stop= and suffix=; it takes one of them"),
    ('start: a\na[flavour="x"]: "x"', r"unknown attribute 'flavour' on 'a' \(line 2\)"),
    ('start: "a"{3,1}', r"the maximum is below the minimum"),
    ('start: "a"{300000}', r"rule 'start' repeats at least 300000 times"),
    ('start: "a"{100000} "b"{100000} "c"{100}', r"more than 200000 symbols \(rule 'start'"),
    ('start: A\nA: B\nB: start', r"terminal B uses 'start', which is a rule"),
    ('start: %json {"type": ', r"the JSON after %json/%llguidance does not parse"),
    ('start: "a"\n%override start: "b"', r"%override is not supported"),
    ('start: "a" @', r"unexpected character '@' \(line 1\)"),
    ('start: T\nT.2147483648: "a"', r"the priority 2147483648 of 'T' is past the limit of \+-1000000 \(line 2\)"),
    ('start: T\nT.-' + "9" * 5000 + ': "a"', r"the priority -99999999999\.\.\.\(5001 digits\) of 'T'"),
])
def test_errors_name_the_rule_and_the_line(text, message):
    with pytest.raises(InvalidGrammarError, match=message):
        parse_lark(text, json_node=lambda schema: None)


def test_priorities_at_the_limit_compile_and_order_the_lexer(compiler):
    """Past int32 a priority overflowed the native lexer's table (a 500); up to the limit it still orders terminals."""
    for low, high in [("-1000000", "1000000"), ("0", "999999")]:
        text = f'start: NAME | IF "!"\nNAME.{low}: /[a-z]+/\nIF.{high}: "if"'
        language(compiler, text, ["if!", "iff", "x"], ["if"])


def test_nested_counts_share_their_inner_rule(compiler):
    grammar = parse_lark('start: ("a"{1000}){1000} "b"')  # a million a's in 2,000 symbols, not a million
    assert sum(len(rhs) + 1 for _, rhs in grammar.productions) < 10_000
    language(compiler, 'start: ("ab"{3}){2} "c"', ["abababababab" + "c"], ["ababababab" + "c"])


def test_a_grammar_whose_rules_need_terminals_that_match_nothing_is_refused(compiler):
    with pytest.raises(InvalidGrammarError, match="can never finish"):
        compiler.compile(Constraint("grammar", "%declare X\nstart: X"))
    language(compiler, '%declare X\nstart: X | "a"', ["a"], ["X", ""])


def test_an_ignored_option_is_a_warning():
    grammar = parse_lark('start: a\na[temperature=0.5]: /[a-z]+/ "."')
    assert any("temperature= on 'a' (line 2) is ignored" in w for w in grammar.warnings)


def test_rules_that_derive_nothing_are_dropped_with_a_warning():
    grammar = parse_lark('start: "a" | loop\nloop: "b" loop')
    assert grammar.warnings == ("rule 'loop' derives no finite text; the alternatives that use it are dropped",)


_PIECES = ['start', ': ', '"a"', '"b"i', '/[a-z]+/', '/(?:x|y)*z/s', 'A', 'b', ' | ', '\n', '\n  | ', '(', ')', '[',
           ']', '*', '+', '?', '~', ' 2', '..', '3', '{', '}', ',', '%ignore ', '%import common.WS', '%declare X',
           '->', '.', '<|end|>', '<[5]>', '%json {"type": "string"}', '"\\', '::=', 'root', '\\x4', '#', '//']


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=30))
def test_any_text_gives_a_grammar_or_a_typed_error(pieces):
    text = "".join(pieces)
    for parse in (lambda: parse_lark(text, json_node=lambda schema: literal("j")), lambda: parse_gbnf(text)):
        try:
            parse()
        except UserInputError:
            pass

"""The GBNF front-end: llama.cpp's syntax, its character-level language, and the errors it names."""

import pytest

from corral.errors import InvalidGrammarError
from corral.fsm.compiler import GrammarCompiler
from corral.fsm.vocabulary import Vocabulary
from corral.grammar.constraint import Constraint
from corral.grammar.gbnf_grammar import looks_like_gbnf, parse_gbnf

EOS = 256


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(Vocabulary.from_token_bytes([bytes([b]) for b in range(256)] + [b"<eos>"],
                                                       eos_token_ids=[EOS]))


@pytest.mark.parametrize("text, good, bad", [
    ('root ::= "a" | "bc"', ["a", "bc"], ["b", "abc"]),
    ('root ::= item+\nitem ::= [a-c] [0-9]?', ["a", "a1b", "abc2"], ["", "1", "a12"]),
    ('root ::= [^"\\\\]*', ["", "abc", "é"], ['"', "\\"]),
    ('root ::= "\\x41\\u00e9\\U0001F600\\n\\t\\\\\\""', ['Aé😀\n\t\\"'], ["A"]),
    ('root ::= [a-z]{2,3} "-" [0-9]{2} "." [0-9]{,1} "!" .{1,}', ["ab-12.!x", "abc-99.5!xyz"], ["a-12.!x", "ab-1.!x"]),
    ('root ::= x\nx ::= "(" x ")" | ""', ["", "()", "((()))"], ["(", "())"]),
    ('root ::= a-rule\na-rule ::= "x"   # names may hold dashes\n  | "y"', ["x", "y"], ["xy"]),
    ('root ::= ( "a" \n   | "b" )\n   "c"', ["ac", "bc"], ["c"]),
    ('root ::= [-a] [a-]', ["-a", "a-", "--"], ["b-"]),
])
def test_the_language(compiler, text, good, bad):
    assert looks_like_gbnf(text)
    grammar = compiler.compile(Constraint("grammar", text))
    for document in good + bad:
        guide = grammar.new_guide()
        accepted = all(guide.advance(b) for b in document.encode()) and guide.is_accepting()
        assert accepted == (document in good), document


@pytest.mark.parametrize("text, message", [
    ('root ::= "a" missing', r"rule 'root' uses 'missing', which is not defined \(line 1\)"),
    ('start ::= "a"', r"no start rule 'root'"),
    ('root ::= "a\nb"', r"a string is not closed \(line 1\)"),
    ('root ::= [a-', r"the grammar ends inside a string or a character class"),
    ('root ::= [ab', r"a character class is not closed"),
    ('root ::= "ab\\', r"the grammar ends inside a string or a character class"),
    ('root ::= [z-a]', r"the range 'z'-'a' is reversed"),
    ('root ::= ( "a"', r"a group is not closed with '\)'"),
    ('root ::= "a"{x}', r"bad repetition"),
    ('root ::= "\\q"', r"unknown escape \\q"),
    ('root ::= "\\x4"', r"\\x needs 2 hex digits"),
    ('root ::= "a" root', r"rule 'root' can never finish"),
    ('root ::= "a"\nroot ::= "b"', r"'root' is defined twice \(line 2\)"),
    ('root ::= "a" }', r"unexpected '\}' \(line 1\)"),
])
def test_errors_name_the_rule_and_the_line(text, message):
    with pytest.raises(InvalidGrammarError, match=message):
        parse_gbnf(text)


def test_lark_text_is_not_taken_for_gbnf():
    assert not looks_like_gbnf('start: "a" "::=" b\nb: "x"')

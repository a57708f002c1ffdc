"""The context-free path: masks against advance, lark as the oracle of what is accepted, bounds, special tokens."""

import json
import random
import time

import lark
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from corral.budget import Budget
from corral.errors import GrammarTooComplexError
from corral.fsm.cfg_guide import CFGIndex, ParseSession
from corral.fsm.compiler import CompiledCFG, GrammarCompiler
from corral.fsm.vocabulary import Vocabulary
from corral.grammar.constraint import Constraint
from corral.grammar.lark_grammar import parse_lark

EOS = 256
SPECIAL = 257
# Multi-byte tokens that cross lexemes in the grammars below (a quote and what follows, a number and a comma).
WORDS = [b'{"', b'":', b'",', b'"}', b'true', b'null', b', "', b'12', b'3,', b'],', b'[{', b' +', b'(1', b'ab',
         b'SELECT', b' FROM', b'e5', b'.5', b'\\"', b'x"', b'"]}']

JSON_LARK = r"""
start: value
?value: object | array | ESCAPED_STRING | SIGNED_NUMBER | "true" | "false" | "null"
array: "[" [value ("," value)*] "]"
object: "{" [pair ("," pair)*] "}"
pair: ESCAPED_STRING ":" value
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS
"""
ARITH_LARK = r"""
?start: sum
?sum: product | sum "+" product | sum "-" product
?product: atom | product "*" atom | product "/" atom
?atom: NUMBER | "-" atom | NAME "(" [sum ("," sum)*] ")" | "(" sum ")"
NAME: /[a-z]+/
%import common.NUMBER
%ignore " "
"""


@pytest.fixture(scope="module")
def vocab():
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>", b"<|end|>"] + WORDS
    return Vocabulary.from_token_bytes(tokens, special_ids=[EOS, SPECIAL], eos_token_ids=[EOS])


@pytest.fixture(scope="module")
def compiler(vocab):
    return GrammarCompiler(vocab)


def allowed_ids(guide, vocab) -> set[int]:
    row = np.zeros(-(-vocab.size // 32), dtype=np.int32)
    guide.fill_mask(row)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab.size]
    return set(np.flatnonzero(bits).tolist())


def accepts(grammar, text: str) -> bool:
    guide = grammar.new_guide()
    for byte in text.encode():
        if not guide.advance(byte):
            return False
    return guide.is_accepting()


def test_a_token_is_allowed_exactly_when_its_bytes_are_allowed_one_by_one(compiler, vocab):
    grammar = compiler.compile(Constraint("grammar", JSON_LARK))
    guide = grammar.new_guide()
    for byte in b'{"ab": [12, 3.5e5, {"x": null}], "c": "d\\"e"}':
        allowed = allowed_ids(guide, vocab)
        for token_id in range(258, vocab.size):
            probe = guide.copy()
            one_by_one = all(probe.advance(b) for b in vocab.token_bytes[token_id])
            assert (token_id in allowed) == one_by_one, (vocab.token_bytes[token_id], guide.configs)
            assert (token_id in allowed) == guide.copy().advance(token_id)
        assert (EOS in allowed) == guide.is_accepting()
        assert guide.advance(byte)
    assert EOS in allowed_ids(guide, vocab) and guide.is_accepting()


@pytest.mark.parametrize("text, parser", [(JSON_LARK, "lalr"), (ARITH_LARK, "lalr")])
def test_documents_are_accepted_exactly_when_lark_parses_them(compiler, text, parser):
    grammar = compiler.compile(Constraint("grammar", text))
    oracle = lark.Lark(text, parser=parser)
    documents = ['{}', '[]', '{"a": 1}', '[1, [2, [3]], {"b": "c"}]', '{"a" 1}', '[1,]', '-1.5e3', '"x\\ny"',
                 '{"a": tru}', '[[[[]]]]', '{"a":1,"b":2}', ' [ 1 , 2 ] ', '[1 2]', '1 + 2 * (3 - f(x, 4))',
                 '-(-1)', '1 +', 'f()', 'f(1,)', '2 * * 3', '((1))', '1.5 / 2.', 'ab(1) + c']
    for document in documents:
        try:
            oracle.parse(document)
            parsed = True
        except lark.exceptions.LarkError:
            parsed = False
        assert accepts(grammar, document) == parsed, document


@settings(max_examples=60, deadline=None)
@given(st.randoms(use_true_random=False))
def test_random_walks_end_in_text_lark_parses(compiler, vocab, rng):
    grammar = compiler.compile(Constraint("grammar", ARITH_LARK))
    oracle = lark.Lark(ARITH_LARK, parser="lalr")
    guide, out = grammar.new_guide(), b""
    for step in range(40):
        allowed = allowed_ids(guide, vocab)
        assert allowed, out  # never an empty mask
        if EOS in allowed and (step > 20 or rng.random() < 0.2):
            break
        token_id = rng.choice(sorted(allowed - {EOS}) or [EOS])
        assert guide.advance(token_id)
        out += vocab.token_bytes[token_id]
    else:
        return  # no finish within the walk's length: nothing to check
    oracle.parse(out.decode())


def test_masks_hold_across_lexeme_boundaries_ignore_runs_and_case_flags(compiler):
    grammar = compiler.compile(Constraint("grammar", r"""
        start: "select"i NAME ("," NAME)* "from"i NAME
        NAME: /[a-z_]+/
        %ignore /[ \t]+/
    """))
    for good in ["select a from t", "SELECT a, b FROM t", "SeLeCt a,b   from t", "select x\tfrom y"]:
        assert accepts(grammar, good), good
    for bad in ["select from t", "select a, from t", "select a from", "select A from t", "select a fro t"]:
        assert not accepts(grammar, bad), bad
    assert accepts(grammar, "selecta from t")  # a contextual lexer splits it, as lark's does


def test_greedy_lexing_lazy_lexemes_and_priorities(compiler):
    greedy = compiler.compile(Constraint("grammar", 'start: A "x"\nA: /a+/'))
    assert accepts(greedy, "aaax") and not accepts(greedy, "x")
    lazy = compiler.compile(Constraint("grammar", 'start: A B\nA[lazy]: /a+/\nB: /a*b/'))
    # lazy: A ends at its first match, so the rest must be B
    assert accepts(lazy, "ab") and accepts(lazy, "aab") and accepts(lazy, "aaab") and not accepts(lazy, "a")
    keyword = compiler.compile(Constraint("grammar", 'start: NAME | IF "!"\nNAME: /[a-z]+/\nIF.2: "if"'))
    # both match "if"; the higher priority reading is the one the parser gets
    assert accepts(keyword, "if!") and not accepts(keyword, "if") and accepts(keyword, "iff")


def test_gbnf_is_exact_at_the_character_level(compiler):
    # a lexer would have to guess where [a-z]* stops; GBNF's language has no lexer
    grammar = compiler.compile(Constraint("grammar", 'root ::= [a-z]* "x" [0-9]{2,3}'))
    for good in ["x12", "abx123", "xxx99"]:
        assert accepts(grammar, good), good
    for bad in ["x1", "abx1234", "ab12", ""]:
        assert not accepts(grammar, bad), bad


def test_inline_json_schemas_are_lexemes(compiler):
    grammar = compiler.compile(Constraint("grammar", 'start: "call " %json {"type": "object", "properties": '
                                                     '{"n": {"type": "integer"}}, "required": ["n"], '
                                                     '"additionalProperties": false} "!"'))
    assert accepts(grammar, 'call {"n":5}!') and not accepts(grammar, 'call {"n":"5"}!')
    assert not accepts(grammar, 'call {}!')


def test_special_tokens_are_allowed_exactly_where_the_grammar_names_them(compiler, vocab):
    grammar = compiler.compile(Constraint("grammar", 'start: "a"+ <|end|> "b"'))
    guide = grammar.new_guide()
    assert SPECIAL not in allowed_ids(guide, vocab)
    assert guide.advance(ord("a")) and SPECIAL in allowed_ids(guide, vocab)
    assert guide.copy().advance(ord("a"))
    assert guide.advance(SPECIAL) and allowed_ids(guide, vocab) == {ord("b")}
    assert guide.advance(ord("b")) and allowed_ids(guide, vocab) == {EOS}
    plain = compiler.compile(Constraint("grammar", 'start: "a"+'))
    assert not plain.new_guide().advance(SPECIAL)


def test_forced_bytes_run_to_the_first_choice(compiler):
    grammar = compiler.compile(Constraint("grammar", 'start: "hello, " NAME "!"\nNAME: /[a-z]+/'))
    guide = grammar.new_guide()
    assert guide.forced_bytes() == b"hello, "
    for byte in b"hello, bo":
        guide.advance(byte)
    assert guide.forced_bytes() == b""


def test_copy_and_rollback_restore_every_earlier_state(compiler, vocab):
    grammar = compiler.compile(Constraint("grammar", JSON_LARK))
    guide = grammar.new_guide()
    text = b'[1, {"a": [true, null]}, "x"]'
    masks = []
    for byte in text:
        masks.append(allowed_ids(guide, vocab))
        assert guide.advance(byte)
    branch = guide.copy()
    assert not branch.advance(ord("x")) and branch.is_error() and not guide.is_error()
    for k in range(len(text), 0, -1):
        guide.rollback(1)
        assert allowed_ids(guide, vocab) == masks[k - 1]


def test_a_probe_answers_as_a_copy_from_any_point_of_a_document(compiler, vocab):
    """``probe()`` keeps the current configuration alone (a copy's history grows with the document): at every
    point its mask is the guide's, what it takes or refuses leaves the guide where it was, and it rolls back its
    own advances and no further."""
    grammar = compiler.compile(Constraint("grammar", JSON_LARK))
    guide = grammar.new_guide()
    for byte in b'[1, {"a": [true, null]}, "x"]':
        probe = guide.probe()
        assert len(probe.configs) == 1 and allowed_ids(probe, vocab) == allowed_ids(guide, vocab)
        assert probe.advance(byte)
        probe.rollback(1)
        assert allowed_ids(probe, vocab) == allowed_ids(guide, vocab)
        with pytest.raises(AssertionError):
            probe.rollback(1)
        assert guide.advance(byte) and not guide.is_error()
    refused = guide.probe()
    assert not refused.advance(ord("x")) and refused.is_error() and not guide.is_error()
    assert guide.probe().is_accepting()


def test_an_ambiguous_grammar_ends_with_the_fuel_error_not_a_stall(vocab):
    grammar = parse_lark('start: x\nx: x x | x x x | "a"')  # Catalan-many parses of a^n: cubic Earley
    budget = Budget()
    budget.mask_fuel = 20_000
    index = CFGIndex(grammar, vocab, budget)
    guide = CompiledCFG(index).new_guide()
    start = time.perf_counter()
    for step in range(2000):
        if not guide.advance(ord("a")):
            break
    assert guide.is_error() and "too ambiguous" in guide.error
    assert 50 < step < 2000 and time.perf_counter() - start < 20


def test_the_session_bounds_its_configurations(vocab):
    repeat = CFGIndex(parse_lark('start: A+\nA: /[a-z]/'), vocab, Budget())
    session = ParseSession(repeat, max_configs=50)
    config = session.start
    for _ in range(100):  # a repeat comes back to the same Earley set: nothing grows
        config = session.advance(config, ord("q"))
        session.mask(config)
    nested = CFGIndex(parse_lark('start: "(" start ")" | "x"'), vocab, Budget())
    session = ParseSession(nested, max_configs=50)
    config = session.start
    with pytest.raises(GrammarTooComplexError, match="cap of 50 states"):
        for _ in range(100):  # every level of nesting is a new set (its origin differs)
            config = session.advance(config, ord("("))
            session.mask(config)


def test_nested_structures_have_no_depth_limit(compiler):
    grammar = compiler.compile(Constraint("grammar", JSON_LARK))
    deep = "[" * 300 + "1" + "]" * 300
    assert accepts(grammar, deep) and not accepts(grammar, deep + "]")
    assert json.loads(deep)


def test_masks_are_the_same_for_every_request_of_a_grammar(compiler, vocab):
    grammar = compiler.compile(Constraint("grammar", ARITH_LARK))
    rng = random.Random(7)
    first, second = grammar.new_guide(), grammar.new_guide()
    for _ in range(15):
        allowed = allowed_ids(first, vocab)
        assert allowed == allowed_ids(second, vocab)
        token_id = rng.choice(sorted(allowed - {EOS}))
        assert first.advance(token_id) and second.advance(token_id)


def test_advance_as_takes_a_probes_configurations_along_a_document(compiler, vocab):
    """A guide that takes each byte by the step of a probe that walked the document ahead of it ends every step
    in the configuration its own advance reaches; a probe made elsewhere is not taken."""
    grammar = compiler.compile(Constraint("grammar", JSON_LARK))
    text = b'[1, {"a": [true, null]}, "x"]'
    guide, reference = grammar.new_guide(), grammar.new_guide()
    probe = guide.probe()
    for byte in text:
        assert probe.advance(byte)
    for index, byte in enumerate(text):
        assert guide.advance_as(byte, probe, index) and reference.advance(byte)
        assert guide.configs == reference.configs and allowed_ids(guide, vocab) == allowed_ids(reference, vocab)
    base = grammar.new_guide()  # configurations are numbered per parse session: its copies share it
    forged = base.probe()
    assert forged.advance(ord("[")) and forged.advance(ord("1"))
    forged.configs[2] = 999  # a next configuration no advance gives: seen only where it is taken
    early = base.copy()
    assert early.advance(ord("[")) and early.advance_as(ord("1"), forged, 1) and early.configs[-1] == 999
    forged.configs[1] = 998
    other = grammar.new_guide()  # another session's guide: its numbers are not the probe's, so it asks its own
    assert other.advance_as(ord("["), forged, 0) and other.configs[-1] != 998
    forged.configs[1] = early.configs[1]
    moved, reference = base.copy(), base.copy()
    for byte in b"[1,":
        assert reference.advance(byte)
    assert moved.advance(ord("[")) and moved.advance(ord("1"))
    assert moved.advance_as(ord(","), forged, 1) and moved.configs == reference.configs  # not where it stood
    assert not grammar.new_guide().advance_as(ord("x"), grammar.new_guide().probe(), 0)

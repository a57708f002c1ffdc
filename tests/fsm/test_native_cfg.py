"""The native context-free core (``native_cfg.py``, ``corral/csrc/cfg.cpp``) against its oracle, the Python
``ParseSession``: the same masks, advances, acceptance, live bytes and forced bytes at every step, on the bundled
grammar corpus with the default model's vocabulary and on random walks over a toy vocabulary; its bounds; its
argument checks; the GIL released during a mask."""

import json
import os
import random

import numpy as np
import pytest

from corral import native
from corral.budget import Budget
from corral.errors import GrammarTooComplexError
from corral.fsm.cfg_guide import CFGGuide, CFGIndex, ParseSession
from corral.fsm.compiler import GrammarCompiler
from corral.fsm.native_cfg import NativeParseSession, new_session
from corral.fsm.vocabulary import Vocabulary
from corral.grammar.constraint import Constraint
from corral.grammar.lark_grammar import parse_lark

pytestmark = pytest.mark.skipif(native.mode() == "off" or native.module() is None,
                                reason="the native module is off or missing")
CORPUS = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "grammars")
# (grammar, format): every Lark grammar of the corpus, and the GBNF twins whose oracle runs fast enough here
CASES = [(name, "lark") for name in ("json", "arithmetic", "sql", "c_like", "pgn", "yaml_flow", "tool_call")] + \
        [(name, "gbnf") for name in ("json", "pgn", "yaml_flow")]
EOS, SPECIAL = 256, 257
TOY_GRAMMARS = [
    r"""start: value
?value: "{" [pair ("," pair)*] "}" | "[" [value ("," value)*] "]" | ESCAPED_STRING | SIGNED_NUMBER | "null"
pair: ESCAPED_STRING ":" value
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS""",
    r"""?start: sum
?sum: product | sum "+" product | sum "-" product
?product: atom | product "*" atom
?atom: NUMBER | NAME "(" [sum ("," sum)*] ")" | "(" sum ")"
NAME: /[a-z]+/
%import common.NUMBER
%ignore " "
""",
    'start: "say " WORD (" " WORD)* <|end|> "!"\nWORD: /[a-z]+/',
    'start: item+\nitem: A | B\nA: /a+?/\nB: "ab"',  # a lazy lexeme beside a greedy one
    'root ::= ("x" | "xy") ("y" | "yz")* "!"',  # GBNF: exact lexing, several readings at once
    # llguidance's lexeme options: a hidden stop read again after its lexeme, a suffix, a lazy rule
    'start: (line "\\n")+ end\nline[stop="\\n"]: /[a-z "]*/\nend[suffix=/[.!]/]: /[a-z]+/',
    'start: call* TEXT\nTEXT: /[^<]+/\nhead[lazy]: /[a-z ]*/ "<f"\ncall: head "=" /[0-9]+/ ">"',
    'start: line* "!"\nline[stop="\\n"]: /[a-z]*/',  # a stop's text read again must not end another line
]


def _step_equal(ours: CFGGuide, oracle: CFGGuide, words: int) -> None:
    a, b = np.zeros(words, dtype=np.int32), np.zeros(words, dtype=np.int32)
    oracle.fill_mask(a)
    ours.fill_mask(b)
    assert np.array_equal(a, b), np.flatnonzero(a != b)[:8]
    assert ours.is_accepting() == oracle.is_accepting()
    assert ours.is_finished() == oracle.is_finished()
    assert ours.forced_bytes() == oracle.forced_bytes()


@pytest.fixture(scope="module")
def real():
    from corral.models import load_tokenizer

    tokenizer = load_tokenizer()
    vocab = Vocabulary.from_tokenizer(tokenizer)
    return tokenizer, vocab, GrammarCompiler(vocab)


@pytest.mark.parametrize("name,ext", CASES, ids=[f"{n}.{e}" for n, e in CASES])
def test_native_masks_equal_the_oracle_along_the_corpus_documents(real, name, ext):
    tokenizer, vocab, compiler = real
    with open(os.path.join(CORPUS, f"{name}.json")) as f:
        entry = json.load(f)
    with open(os.path.join(CORPUS, f"{name}.{ext}")) as f:
        index = compiler.compile(Constraint("grammar", f.read())).index
    words = index.tables.num_words
    rng = random.Random(name)
    docs = rng.sample(entry["valid"], 6) + rng.sample(entry["invalid"], 6)
    for doc in docs:
        ours, oracle = CFGGuide(NativeParseSession(index)), CFGGuide(ParseSession(index))
        for token_id in [*tokenizer.encode(doc, add_special_tokens=False), vocab.eos_token_ids[0]]:
            _step_equal(ours, oracle, words)
            assert ours.forced_bytes() == oracle.forced_bytes()
            assert ours.advance(token_id) == oracle.advance(token_id)
            if oracle.is_error():
                break
        assert ours.is_error() == oracle.is_error() and ours.is_accepting() == oracle.is_accepting()


# Open objects (any-value members: the context-free path) whose lexemes hold repeat pieces: string bodies,
# bounded ones, free-form keys beside declared names, a pattern's body, any-values nested inside.
PIECE_SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "note": {"type": "string", "maxLength": 6},
                                      "meta": {}}, "required": ["name"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "object", "properties": {
        "key": {"type": "string"}, "value": {"type": "string", "minLength": 2}}}}}},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[a-z ]+$"}},
     "additionalProperties": True},
]
PIECE_DOCS = ['{"name": "Ada Lovelace", "note": "first", "meta": {"born": [1815, {"in": "London"}]}, "x": "y"}',
              '{"name": "", "note": "toolong!", "extra": {"a": {"b": {"c": {"d": {"e": {"f": "deep"}}}}}}}',
              '{"tags": [{"key": "colour", "value": "blue", "more": [1, 2, {"k": "v"}]}, {"key": "k"}]}',
              '{"code": "AB-hello world", "other": {"nested": {"n": "s"}}, "code2": "CAPS"}']


@pytest.mark.parametrize("schema", PIECE_SCHEMAS, ids=["strings", "keys", "patterns"])
def test_native_masks_with_repeat_pieces_equal_the_oracle(real, schema):
    tokenizer, vocab, compiler = real
    compiled = compiler.compile(Constraint("json_schema", schema, whitespace="flexible"))
    index = compiled.index
    words = index.tables.num_words
    rng = random.Random(json.dumps(schema))
    walks = [tokenizer.encode(doc, add_special_tokens=False) for doc in PIECE_DOCS] + [None] * 6
    for tokens in walks:
        ours, oracle = CFGGuide(NativeParseSession(index)), CFGGuide(ParseSession(index))
        for step in range(60):
            _step_equal(ours, oracle, words)
            if tokens is not None:
                if step >= len(tokens):
                    break
                token_id = tokens[step]
            else:  # a random walk through the allowed tokens
                row = np.zeros(words, dtype=np.int32)
                oracle.fill_mask(row)
                token_id = int(rng.choice(np.flatnonzero(np.unpackbits(row.view(np.uint8),
                                                                       bitorder="little")[:vocab.size])))
            assert ours.advance(token_id) == oracle.advance(token_id)
            if oracle.is_finished():
                break
    assert index.native_index().num_piece_splits > 0  # the walks did take the pieces' facts


@pytest.fixture(scope="module")
def toy():
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>", b"<|end|>"] + \
        [b'{"', b'":', b'",', b'"}', b'null', b', "', b'12', b'3,', b'],', b'[{', b' +', b'(1', b'ab', b'xy', b'yz',
         b'say ', b'aab', b'e5', b'.5', b'\\"', b'x"', b'"]}']
    vocab = Vocabulary.from_token_bytes(tokens, special_ids=[EOS, SPECIAL], eos_token_ids=[EOS])
    return vocab, GrammarCompiler(vocab)


@pytest.mark.parametrize("grammar", TOY_GRAMMARS, ids=["json", "arith", "special", "lazy", "gbnf", "stop", "lazy-rule", "stop-loop"])
def test_native_masks_equal_the_oracle_along_random_walks(toy, grammar):
    vocab, compiler = toy
    index = compiler.compile(Constraint("grammar", grammar)).index
    words = index.tables.num_words
    rng = random.Random(grammar)
    for _ in range(40):
        ours, oracle = CFGGuide(NativeParseSession(index)), CFGGuide(ParseSession(index))
        for _ in range(30):
            _step_equal(ours, oracle, words)
            row = np.zeros(words, dtype=np.int32)
            oracle.fill_mask(row)
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab.size])
            # mostly allowed tokens, now and then any token (the dead path must agree too)
            token_id = int(rng.choice(allowed)) if len(allowed) and rng.random() < 0.9 else rng.randrange(vocab.size)
            assert ours.advance(token_id) == oracle.advance(token_id)
            if oracle.is_finished():
                break
        assert ours.is_error() == oracle.is_error()


def test_the_native_session_bounds_its_configurations_and_its_fuel(toy):
    vocab, _ = toy
    nested = CFGIndex(parse_lark('start: "(" start ")" | "x"'), vocab, Budget())
    session = NativeParseSession(nested, max_configs=50)
    config = session.start
    with pytest.raises(GrammarTooComplexError, match="cap of 50 states"):
        for _ in range(100):  # every level of nesting is a new Earley set (its origin differs)
            config = session.advance(config, ord("("))
            session.mask(config)
    budget = Budget()
    budget.mask_fuel = 20_000
    ambiguous = CFGIndex(parse_lark('start: x\nx: x x | x x x | "a"'), vocab, budget)
    guide = CFGGuide(new_session(ambiguous))
    assert isinstance(guide.session, NativeParseSession)
    for step in range(2000):
        if not guide.advance(ord("a")):
            break
    assert guide.is_error() and "too ambiguous" in guide.error and 50 < step < 2000


def test_forced_bytes_stop_where_the_session_meets_its_configuration_cap(toy):
    """The forced span ends where the walk meets a limit, natively as in the oracle, with no error left behind:
    the guide meets the limit itself where its own moves need it."""
    vocab, _ = toy
    literal = CFGIndex(parse_lark('start: "' + "x" * 200 + '"'), vocab, Budget())
    spans = [session.forced_bytes(session.start, 4096)
             for session in (NativeParseSession(literal, max_configs=50), ParseSession(literal, max_configs=50))]
    assert spans[0] == spans[1] and 0 < len(spans[0]) < 200
    guide = CFGGuide(NativeParseSession(literal, max_configs=50))
    assert guide.forced_bytes() == spans[0] and not guide.is_error()


def test_the_native_session_checks_its_arguments(toy):
    vocab, compiler = toy
    session = compiler.compile(Constraint("grammar", TOY_GRAMMARS[1])).new_guide().session
    words = session.index.tables.num_words
    with pytest.raises(IndexError, match="no configuration"):
        session.native.fill_mask(10_000, np.zeros(words, dtype=np.int32), 1 << 30)
    with pytest.raises(ValueError, match="one mask long"):
        session.native.fill_mask(session.start, np.zeros(words + 1, dtype=np.int32), 1 << 30)
    with pytest.raises(TypeError):
        session.native.fill_mask(session.start, np.zeros(words, dtype=np.int64), 1 << 30)
    with pytest.raises(ValueError, match="byte is 0..255"):
        session.native.move(session.start, 256, 1 << 30)
    with pytest.raises(ValueError, match="sorted"):
        session.native.advance_special(session.start, np.asarray([3, 1], dtype=np.int32), 1 << 30)


def test_the_gil_is_released_during_a_native_grammar_mask(real, released_gil):
    """A hook inside the native mask call waits for a Python thread to release it: only possible without the GIL."""
    _, _, compiler = real
    session = compiler.compile(Constraint("grammar", TOY_GRAMMARS[1])).new_guide().session
    config = session.advance(session.start, list(session.index.vocab.token_bytes).index(b"1"))
    assert config >= 0  # past the start, whose mask was made at compile time
    assert released_gil(lambda: session.mask(config))


def test_new_terms_in_the_terminals_automata_are_bounded_per_call(toy):
    """A terminal whose automaton makes new derivative terms as it reads (nested counted repeats) spends the call's
    fuel in terms too: the sequence ends with the fuel's error; the Python oracle has no such fuel and goes on."""
    vocab, _ = toy
    budget = Budget()
    budget.mask_fuel = 20
    index = CFGIndex(parse_lark("start: X\nX: /(a[ab]{0,30}b){1,40}/"), vocab, budget)
    guide, oracle = CFGGuide(NativeParseSession(index)), CFGGuide(ParseSession(index))
    rng = random.Random(3)
    for _ in range(200):
        byte = ord(rng.choice("ab"))
        if not guide.advance(byte):
            break
        assert oracle.advance(byte)
    assert guide.is_error() and "fuel of 20 new terms" in guide.error, guide.error
    assert not oracle.is_error()

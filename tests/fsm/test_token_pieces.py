"""Repeat pieces: the shared-piece shortcut gives exactly the mask of the plain trie walk, state by state."""

import random

import numpy as np
import pytest

from corral.fsm import derivatives
from corral.budget import Budget
from corral.fsm.compiler import GrammarCompiler
from corral.fsm.derivatives import TermTable
from corral.fsm.token_index import vocab_tables
from corral.fsm.token_pieces import PieceFacts, split_pieces
from corral.fsm.vocabulary import Vocabulary
from corral.grammar.constraint import Constraint
from corral.grammar.regex_parser import parse_regex

_ALPHABET = [b"a", b"b", b"x", b" ", b'"', b"\\", b",", b":", b"{", b"}", b"[", b"]", b"0", b"7", b"u", b"n",
             "é".encode(), b"\xc3", b"\xa9", b"\n"]


def _toy_vocabulary() -> Vocabulary:
    """Every printable ASCII byte, then 1,500 random strings over JSON-ish pieces (quotes, escapes, é and its
    two bytes alone), so tokens cross string ends, split characters and carry escapes."""
    rng = random.Random(7)
    tokens = {bytes([b]) for b in range(0x20, 0x7F)} | set(_ALPHABET)
    while len(tokens) < 1600:
        tokens.add(b"".join(rng.choice(_ALPHABET) for _ in range(rng.randint(2, 6))))
    ordered = sorted(tokens) + [b"<eos>"]
    return Vocabulary.from_token_bytes(ordered, eos_token_ids=[len(ordered) - 1])


VOCAB = _toy_vocabulary()

CONSTRAINTS = [
    Constraint("json_schema", {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                                "tag": {"type": "string", "minLength": 2}},
                               "required": ["name"], "additionalProperties": {"type": "integer"}},
               whitespace="flexible"),  # (an open object's "any" values would take the context-free path)
    Constraint("json_schema", {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 9}}),
    Constraint("json_schema", {"type": "object", "additionalProperties": {"type": "string"}}),
    Constraint("regex", r'[^"\\]{1,4}"(,|\})'),
    # a unit of multi-byte characters (every code point but x) repeated: its mid-character states take no piece
    # (a single unit with no repeat is walked plainly), the states between characters do
    Constraint("regex", r"[^x]{3,}x"),
]


def _reference_mask(index, state: int) -> np.ndarray:
    tables = index.tables
    words = tables.words_of(tables.trie.walk(state, index.dfa))
    return words | tables.eos_words if index.dfa.accepting[state] else words


def random_walk_states(index, vocab: Vocabulary, rng: random.Random, walks: int, mask_of):
    """(state, ``mask_of(state)``) along ``walks`` random token walks from the start (up to 25 tokens each),
    each next token drawn from that mask."""
    for _ in range(walks):
        state = 0
        for _ in range(rng.randint(1, 25)):
            mask = mask_of(state)
            yield state, mask
            bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab.size]
            choices = [t for t in np.flatnonzero(bits).tolist() if t not in vocab.eos_token_ids]
            if not choices:
                break
            state = index.next_state(state, rng.choice(choices))
            assert state >= 0


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=lambda c: str(c.value)[:40])
def test_piece_masks_equal_the_plain_walk_on_random_walks(constraint):
    index = GrammarCompiler(VOCAB).compile(constraint).index
    checked = with_pieces = 0
    for state, mask in random_walk_states(index, VOCAB, random.Random(str(constraint.value)), 40, index.mask):
        assert np.array_equal(mask, _reference_mask(index, state)), (constraint.value, state)
        checked += 1
        with index.dfa.lock:
            pieces, _ = split_pieces(index.dfa.terms, index.dfa.term_of(state), index.tables.piece_facts)
        with_pieces += bool(pieces)
    assert with_pieces >= 10, "the walks must reach states that take the piece shortcut"
    assert checked > with_pieces


def _facts(table: TermTable, unit: int):
    tables = vocab_tables(VOCAB)
    return PieceFacts(table.structure(unit), VOCAB, tables.grammar_ids, tables.columns).at(0)


def test_piece_facts_count_units_and_find_the_exit():
    table = TermTable(Budget())
    letters = table.byte_set(sum(1 << b for b in b"abxun"))
    facts = _facts(table, letters)
    token_id = {data: i for i, data in enumerate(VOCAB.token_bytes)}
    ab = token_id[b"ab"]
    assert facts.never_exits[ab] and facts.units[ab] == 2
    crossing = dict(zip(facts.cross_ids.tolist(), zip(facts.cross_offsets.tolist(), facts.cross_units.tolist())))
    assert crossing[token_id[b'"']] == (0, 0)  # exits at once, at a unit boundary
    tokens_with_quote = [i for i, data in enumerate(VOCAB.token_bytes)
                         if b'"' in data and all(c in b"abxun" for c in data[:data.index(b'"')])]
    for i in tokens_with_quote:
        end = VOCAB.token_bytes[i].index(b'"')
        assert crossing[i] == (end, end)


def test_a_unit_that_is_a_prefix_of_another_is_refused():
    table = TermTable(Budget())
    a = table.byte_set(1 << ord("a"))
    unit = table.alt([a, table.cat(a, a)])  # "a" and "aa": units cannot be counted from the DFA of unit*
    assert _facts(table, unit) is None


@pytest.mark.skipif(derivatives.native_module() is None, reason="native module off or missing")
@pytest.mark.parametrize("offset", [0, 1, 2])
def test_native_and_numpy_piece_walks_agree(monkeypatch, offset):
    table = TermTable(Budget())
    unit = table.from_node(parse_regex(r'[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4}'))  # a JSON string's char
    tables = vocab_tables(VOCAB)
    native = PieceFacts(table.structure(unit), VOCAB, tables.grammar_ids, tables.columns).at(offset)
    monkeypatch.setattr(derivatives, "_NATIVE_CLASS", [None])  # the Python automaton: the numpy walk
    numpy = PieceFacts(table.structure(unit), VOCAB, tables.grammar_ids, tables.columns).at(offset)
    assert native is not None and numpy is not None
    for field in ("never_exits", "units", "cross_ids", "cross_offsets", "cross_units", "cross_bytes"):
        assert np.array_equal(getattr(native, field), getattr(numpy, field)), field
    assert len(native.cross_ids) and native.units.max() >= 2

"""Token masks and guides on toy vocabularies: exact transitions, and agreement with ``re`` token by token."""

import re

import numpy as np
import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from corral.fsm import derivatives
from corral.fsm.compiler import GrammarCompiler
from corral.fsm.vocabulary import Vocabulary
from corral.grammar.constraint import Constraint
from corral.grammar.regex_parser import parse_regex

# ids:       0     1     2      3      4     5     6      7       8        9 (EOS)  10 (special)
TOKENS = [b"a", b"b", b"ab", b"ba", b"c", b"aa", b"abc", b"\"", b"\xc3", b"<eos>", b"<ctl>"]
EOS, SPECIAL = 9, 10


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(Vocabulary.from_token_bytes(TOKENS, special_ids=[SPECIAL], eos_token_ids=[EOS]))


def allowed_ids(guide) -> list[int]:
    row = np.zeros(1, dtype=np.int32)
    guide.fill_mask(row)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return [int(i) for i in np.flatnonzero(bits[:len(TOKENS)])]


def test_exact_masks_and_transitions_for_a_small_regex(compiler):
    guide = compiler.compile(Constraint("regex", "ab*c?")).new_guide()
    assert allowed_ids(guide) == [0, 2, 6]  # a, ab, abc
    assert guide.advance(2) and allowed_ids(guide) == [1, 4, EOS]  # after "ab": b, c, EOS
    assert guide.advance(4) and allowed_ids(guide) == [EOS]
    assert guide.is_accepting() and guide.is_finished()
    assert guide.advance(EOS) and guide.is_finished() and allowed_ids(guide) == [EOS]


def test_invalid_token_enters_error_state_and_rollback_recovers(compiler):
    guide = compiler.compile(Constraint("regex", "a+")).new_guide()
    assert guide.advance(0)
    assert not guide.advance(1)
    assert guide.is_error() and guide.is_finished() and allowed_ids(guide) == []
    assert not guide.advance(0)  # stays in error
    guide.rollback(1)
    assert guide.is_error()
    guide.rollback(1)
    assert not guide.is_error() and allowed_ids(guide) == [0, 5, EOS]


def test_eos_only_in_accepting_states_and_special_never(compiler):
    guide = compiler.compile(Constraint("regex", "(a|<ctl>)b")).new_guide()
    assert allowed_ids(guide) == [0, 2]
    assert not guide.copy().advance(EOS)
    assert not guide.copy().advance(SPECIAL)


def test_copy_is_independent(compiler):
    guide = compiler.compile(Constraint("regex", "ab|ba")).new_guide()
    other = guide.copy()
    assert guide.advance(2)
    assert allowed_ids(other) == [0, 1, 2, 3]
    assert other.advance(3) and other.is_accepting()


def test_a_probe_looks_ahead_from_here_alone(compiler):
    """``probe()``: the same position and answers as a copy, independent of the guide, with no history before
    its start: it rolls back its own advances and no further."""
    guide = compiler.compile(Constraint("regex", "ab*c?")).new_guide()
    assert guide.advance(0) and guide.advance(1)  # "ab"
    probe = guide.probe()
    assert allowed_ids(probe) == allowed_ids(guide.copy()) == [1, 4, EOS]
    assert probe.advance(4) and allowed_ids(probe) == [EOS] and allowed_ids(guide) == [1, 4, EOS]
    probe.rollback(1)
    assert allowed_ids(probe) == [1, 4, EOS]
    with pytest.raises(AssertionError):
        probe.rollback(1)
    refused = guide.probe()
    assert not refused.advance(0) and refused.is_error() and not guide.is_error()  # the refusal stays there


def test_forced_bytes_follow_the_deterministic_span(compiler):
    guide = compiler.compile(Constraint("regex", 'abc(a|b)"')).new_guide()
    assert guide.forced_bytes() == b"abc"
    assert guide.advance(6) and guide.forced_bytes() == b""
    assert guide.advance(1) and guide.forced_bytes() == b'"'


@pytest.mark.parametrize("pattern", ['abc(a|b)"', "(ab){3}c?", '\\{"k": (1|22), "name": "[a-c]{2,4}"\\}', "x{300}y",
                                     "(a|b)*c(ab){2}", "é{2}"])
@pytest.mark.skipif(derivatives.native_table_class() is None, reason="native module off or missing")
def test_forced_bytes_agree_between_the_native_and_the_python_automaton(compiler, pattern):
    """The native span walk and the Python one give the same bytes at every state a random walk meets."""
    from corral.budget import Budget
    from corral.fsm.fsm_guide import FSMGuide
    from corral.fsm.lazy_dfa import LazyDFA
    from corral.fsm.token_index import TokenIndex
    vocab = compiler.vocab
    native = FSMGuide(TokenIndex(LazyDFA(parse_regex(pattern), Budget()), vocab))
    python = FSMGuide(TokenIndex(LazyDFA(parse_regex(pattern), Budget(), terms=derivatives.TermTable()), vocab))
    assert native.index._native is not None and python.index._native is None
    rng, spans = np.random.default_rng(7), 0
    for _ in range(60):
        span = native.forced_bytes()
        assert span == python.forced_bytes()
        spans += bool(span)
        allowed = [t for t in allowed_ids(native) if t != EOS]
        if not allowed:
            break
        token = int(rng.choice(allowed))
        assert native.advance(token) and python.advance(token)
    assert spans, "no state on the walk forced a byte"


@pytest.mark.parametrize("native", [True, False])
def test_forced_bytes_stop_at_the_state_cap_without_an_error(compiler, native):
    from corral.budget import Budget
    from corral.fsm.fsm_guide import FSMGuide
    from corral.fsm.lazy_dfa import LazyDFA
    from corral.fsm.token_index import TokenIndex
    terms = None if native else derivatives.TermTable()
    guide = FSMGuide(TokenIndex(LazyDFA(parse_regex("x{200}"), Budget(max_states=24), terms=terms), compiler.vocab))
    span = guide.forced_bytes()
    assert 0 < len(span) < 200 and set(span) == {ord("x")}
    assert not guide.is_error() and guide.error is None


def test_a_token_may_end_inside_a_utf8_character(compiler):
    guide = compiler.compile(Constraint("regex", "é")).new_guide()
    assert allowed_ids(guide) == [8]  # b"\xc3", the first byte of é; its second byte has no token here
    assert guide.advance(8) and not guide.is_accepting()


def test_choice_and_cache_hit(compiler):
    constraint = Constraint("choice", ["ab", "c"])
    grammar = compiler.compile(constraint)
    assert compiler.compile(Constraint("choice", ["ab", "c"])) is grammar
    assert allowed_ids(grammar.new_guide()) == [0, 2, 4]


# ---- agreement with re, token by token -----------------------------------------------------------------------

ALPHABET_TOKENS = [b"a", b"b", b"c", b"-", b"ab", b"ba", b"bc", b"a-", b"--", b"abc", b"cc", b"\xc3\xa9", b"\xc3",
                   b"\xa9", b"<eos>"]
ALPHABET_EOS = len(ALPHABET_TOKENS) - 1
ATOMS = ["a", "b", "c", "-", "[ab]", "[^a]", ".", "é", "(ab|c)", "[a-c]"]


@pytest.fixture(scope="module")
def alphabet_compiler():
    return GrammarCompiler(Vocabulary.from_token_bytes(ALPHABET_TOKENS, eos_token_ids=[ALPHABET_EOS]))


def _regexes():
    piece = st.builds(lambda a, q: a + q, st.sampled_from(ATOMS), st.sampled_from(["", "*", "+", "?", "{1,2}"]))
    seq = st.lists(piece, min_size=1, max_size=4).map("".join)
    return st.lists(seq, min_size=1, max_size=2).map("|".join)


@settings(max_examples=200, deadline=None)
@given(_regexes(), st.lists(st.sampled_from(range(ALPHABET_EOS)), max_size=6))
def test_token_walk_agrees_with_re_fullmatch(alphabet_compiler, pattern, token_ids):
    """A token is allowed exactly when the bytes so far plus the token can still be completed to a full match
    (``regex``'s partial matching is the prefix oracle), and EOS exactly when ``re.fullmatch`` accepts."""
    guide = alphabet_compiler.compile_node(parse_regex(pattern)).new_guide()
    text = b""
    for token_id in token_ids:
        row = np.zeros(1, dtype=np.int32)
        guide.fill_mask(row)
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")
        assert bool(bits[ALPHABET_EOS]) == _fullmatch(pattern, text), (pattern, text)
        for candidate in range(ALPHABET_EOS):
            assert bool(bits[candidate]) == _viable(pattern, text + ALPHABET_TOKENS[candidate]), (pattern, text)
        if not guide.advance(token_id):
            assert not bits[token_id] and guide.is_error()
            return
        text += ALPHABET_TOKENS[token_id]
    assert guide.is_accepting() == _fullmatch(pattern, text)


def _fullmatch(pattern: str, data: bytes) -> bool:
    try:
        return re.fullmatch(pattern, data.decode("utf-8")) is not None
    except UnicodeDecodeError:
        return False


def _viable(pattern: str, data: bytes) -> bool:
    """Some string starting with ``data`` fullmatches ``pattern``."""
    try:
        return regex.fullmatch(pattern, data.decode("utf-8"), partial=True) is not None
    except UnicodeDecodeError:
        pass
    if data.endswith(b"\xc3"):  # an incomplete two-byte character: try every character it can start
        head = data[:-1].decode("utf-8", errors="strict") if _decodes(data[:-1]) else None
        return head is not None and any(regex.fullmatch(pattern, head + chr(cp), partial=True) is not None
                                        for cp in range(0xC0, 0x100))
    return False


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_advance_as_takes_the_probes_step_where_the_guide_stands_where_the_probe_stood(compiler):
    """``advance_as``: the probe's next state where the guide is at the probe's state before that advance; a
    guide elsewhere, a refused token or a guide of another grammar goes through ``advance`` (its own answer)."""
    grammar = compiler.compile(Constraint("regex", "ab*c?"))
    guide = grammar.new_guide()
    probe = guide.probe()
    assert probe.advance(0) and probe.advance(1) and probe.advance(4)  # "abc"
    reference = grammar.new_guide()
    for index, token in enumerate([0, 1, 4]):
        assert guide.advance_as(token, probe, index) == reference.advance(token)
        assert guide.states == reference.states
    assert guide.advance_as(EOS, probe, 3) and guide.states == reference.states + [-2]  # no step 3: advance
    probe.states[1] = 12345  # a next state no advance gives: seen only where it is taken
    assert grammar.new_guide().advance_as(0, probe, 0) is True
    taken = grammar.new_guide()
    assert taken.advance_as(0, probe, 0) and taken.states[-1] == 12345  # the grammar was not asked
    elsewhere = grammar.new_guide()
    assert elsewhere.advance(0)  # "a": the probe's index 0 starts before it
    assert elsewhere.advance_as(1, probe, 0) and elsewhere.states == reference.states[:3]  # its own advance
    refused = grammar.new_guide().probe()
    assert not refused.advance(4)
    fresh = grammar.new_guide()
    assert not fresh.advance_as(4, refused, 0) and fresh.is_error()
    other = compiler.compile(Constraint("regex", "c")).new_guide()
    assert not other.advance_as(0, grammar.new_guide().probe(), 0) and other.is_error()

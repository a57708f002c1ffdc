"""The lazy derivative DFA against ``re``: byte-level acceptance equals ``re.fullmatch`` on the decoded text."""

import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corral.errors import GrammarTooComplexError
from corral.fsm import derivatives
from corral.budget import Budget
from corral.fsm.lazy_dfa import DEAD, LazyDFA
from corral.fsm.utf8 import utf8_sequences
from corral.grammar.regex_ast import MAX_CODE_POINT, Alt, CharSet, Concat, Intersect, Repeat, literal
from corral.grammar.regex_parser import parse_regex


# Both term tables: the native one (``corral/csrc/terms.cpp``, what LazyDFA uses where it builds) and the pure-Python one
# (the fallback without a compiler); the properties below hold for each.
TABLES = [pytest.param(derivatives.TermTable, id="python"),
          pytest.param(derivatives.native_table_class(), id="native",
                       marks=pytest.mark.skipif(derivatives.native_table_class() is None, reason="native module off or missing"))]


def accepts(dfa: LazyDFA, data: bytes) -> bool:
    state = 0
    for byte in data:
        state = dfa.step(state, byte)
        if state == DEAD:
            return False
    return bool(dfa.accepting[state])


def fullmatch(pattern: str, data: bytes) -> bool:
    try:
        return re.fullmatch(pattern, data.decode("utf-8")) is not None
    except UnicodeDecodeError:
        return False


ATOMS = ["a", "b", "[ab]", "[^a]", ".", "é", "😀", "[a-é]", "\\d", "(ab|ba)"]
TEXT_PIECES = ["a", "b", "é", "😀", "1", "\n", "\xff", "ab"]


def _regexes():
    piece = st.builds(lambda a, q: a + q, st.sampled_from(ATOMS),
                      st.sampled_from(["", "*", "+", "?", "{2}", "{0,3}", "{2,}"]))
    seq = st.lists(piece, min_size=1, max_size=4).map("".join)
    return st.lists(seq, min_size=1, max_size=3).map("|".join)


def _texts():
    chars = st.lists(st.sampled_from(TEXT_PIECES), max_size=6).map("".join).map(lambda t: t.encode("utf-8"))
    cut = st.integers(min_value=0, max_value=3)  # also strings cut inside a UTF-8 character
    return st.builds(lambda data, n: data[:len(data) - n] if n < len(data) else data, chars, cut)


@pytest.mark.parametrize("table", TABLES)
@settings(max_examples=300, deadline=None)
@given(_regexes(), st.lists(_texts(), min_size=1, max_size=8))
def test_acceptance_agrees_with_re_fullmatch(table, pattern, texts):
    _assert_agrees_with_re_fullmatch(table, pattern, texts)


def _assert_agrees_with_re_fullmatch(table, pattern: str, texts: list[bytes]) -> None:
    dfa = LazyDFA(parse_regex(pattern), Budget(), terms=table())
    for data in texts:
        assert accepts(dfa, data) == fullmatch(pattern, data), (pattern, data)


def _wide_alternations():
    """Alternations of 8 to 14 members (derived through the first-byte index of ``derivatives.py``), members
    starting with one byte or with most of them."""
    piece = st.sampled_from(ATOMS + ["[^x]", "[a-z]", "[^xy]*b"])
    member = st.lists(piece, min_size=2, max_size=3).map("".join)
    return st.lists(member, min_size=8, max_size=14).map("|".join)


@pytest.mark.parametrize("table", TABLES)
@settings(max_examples=100, deadline=None)
@given(_wide_alternations(), st.lists(_texts(), min_size=1, max_size=8))
def test_wide_alternations_agree_with_re_fullmatch(table, pattern, texts):
    _assert_agrees_with_re_fullmatch(table, pattern, texts)


@pytest.mark.parametrize("table", TABLES)
@settings(max_examples=150, deadline=None)
@given(_regexes(), _regexes(), st.lists(_texts(), min_size=1, max_size=8))
def test_intersection_is_the_product(table, left, right, texts):
    dfa_node = Intersect((parse_regex(left), parse_regex(right)))
    dfa = LazyDFA(dfa_node, Budget(), terms=table())
    if dfa.is_empty:
        return
    for data in texts:
        assert accepts(dfa, data) == (fullmatch(left, data) and fullmatch(right, data)), (left, right, data)


@pytest.mark.parametrize("table", TABLES)
@settings(max_examples=100, deadline=None)
@given(_regexes(), st.lists(_texts(), min_size=1, max_size=6))
def test_every_built_state_can_still_accept(table, pattern, texts):
    """Trimming: walking any accepted prefix never lands in a state from which acceptance is unreachable."""
    dfa = LazyDFA(parse_regex(pattern), Budget(), terms=table())
    for data in texts:
        state = 0
        for byte in data:
            state = dfa.step(state, byte)
            if state == DEAD:
                break
            assert dfa.terms.is_live(dfa.term_of(state))
            assert (dfa.row(state) >= 0).any() or dfa.accepting[state]


def test_empty_intersection_is_detected():
    digits, letters = parse_regex("[0-9]+"), parse_regex("[a-z]+")
    assert LazyDFA(Intersect((digits, letters)), Budget()).is_empty
    assert not LazyDFA(Intersect((parse_regex("[a-z0-9]+"), parse_regex(".{2}"))), Budget()).is_empty


def test_huge_counted_repeat_is_lazy():
    """maxLength-style counts are not unrolled: compiling costs nothing, and the count is exact."""
    huge = LazyDFA(Repeat(CharSet.of((0, MAX_CODE_POINT)), 0, 100_000), Budget(time_s=1.0))
    assert huge.num_states < 12  # the start state and its successors (one per UTF-8 lead-byte class)
    dfa = LazyDFA(Repeat(CharSet.of((0, MAX_CODE_POINT)), 0, 300), Budget())
    assert accepts(dfa, "é".encode() * 300) and not accepts(dfa, "é".encode() * 301)


def test_surrogates_are_never_encoded():
    dfa = LazyDFA(CharSet.of((0xD000, 0xE000)), Budget())
    assert accepts(dfa, "\ud7ff".encode("utf-8")) and accepts(dfa, "\ue000".encode("utf-8"))
    assert not accepts(dfa, "\ud800".encode("utf-8", "surrogatepass"))


@pytest.mark.parametrize("lo, hi", [(0, 0x7F), (0x80, 0x7FF), (0x7F0, 0x1000), (0xFFF0, 0x10010), (0, MAX_CODE_POINT)])
def test_utf8_sequences_cover_exactly_the_range(lo, hi):
    sequences = list(utf8_sequences(lo, hi))
    for cp in sorted({lo, hi, (lo + hi) // 2, max(lo - 1, 0), min(hi + 1, MAX_CODE_POINT), 0xD800, 0xDFFF}):
        data = chr(cp).encode("utf-8", "surrogatepass")
        covered = any(len(s) == len(data) and all(a <= b <= c for (a, c), b in zip(s, data)) for s in sequences)
        assert covered == (lo <= cp <= hi and not 0xD800 <= cp <= 0xDFFF), hex(cp)


@pytest.mark.parametrize("table", TABLES)
def test_time_budget_raises_instead_of_hanging(table):
    many_words = Alt(tuple(literal(f"word{i}") for i in range(20000)))
    with pytest.raises(GrammarTooComplexError, match="time budget of 0.001 s"):
        budget = Budget(time_s=0.001)
        LazyDFA(many_words, budget, terms=table(budget))


def test_rows_built_after_compilation_never_hit_the_compile_budget():
    """The budget bounds compilation only: decoding later explores new states lazily and must not raise."""
    dfa = LazyDFA(parse_regex("(?:[a-z]{3}-)*[a-z]{0,9000}"), Budget(time_s=0.05))
    time.sleep(0.1)
    assert accepts(dfa, b"abc-def-" * 40 + b"x" * 9000)  # thousands of new terms, past the clock checks


@pytest.mark.parametrize("table", TABLES)
def test_an_intersection_too_large_to_decide_is_treated_as_empty(monkeypatch, table):
    """Past the liveness step limit an intersection counts as empty: the byte leading into it is dead, so no walk
    can reach a state whose continuations are all empty (a mask without tokens)."""
    monkeypatch.setattr(derivatives, "_LIVENESS_STEP_LIMIT", 10)
    slow = Intersect((parse_regex("[a-z]{30}"), parse_regex("[a-y]*")))  # non-empty, but 30 steps deep
    dfa = LazyDFA(Alt((parse_regex("b"), Concat((parse_regex("c"), slow)))), Budget(), terms=table())
    assert dfa.step(0, ord("b")) != DEAD and dfa.step(0, ord("c")) == DEAD
    assert dfa.terms.num_undecided == 1
    monkeypatch.setattr(derivatives, "_LIVENESS_STEP_LIMIT", 5000)
    dfa = LazyDFA(Alt((parse_regex("b"), Concat((parse_regex("c"), slow)))), Budget(), terms=table())
    assert dfa.step(0, ord("c")) != DEAD


@pytest.mark.parametrize("table", TABLES)
def test_a_root_too_large_to_decide_is_refused_not_called_empty(monkeypatch, table):
    monkeypatch.setattr(derivatives, "_LIVENESS_STEP_LIMIT", 10)
    slow = Intersect((parse_regex("[a-z]{30}"), parse_regex("[a-y]*")))
    with pytest.raises(GrammarTooComplexError, match="too large to decide"):
        LazyDFA(slow, Budget(), terms=table())


@pytest.mark.parametrize("table", TABLES)
def test_liveness_of_a_long_concatenation_ending_in_an_intersection_does_not_recurse_per_part(table):
    """Thousands of parts before an intersection (a long literal, then a pattern with a length): the chain is
    walked iteratively, not one Python frame per part."""
    digits = Intersect((parse_regex("[0-9]+"), parse_regex("[0-5]{2}")))
    node = Concat(tuple(literal(c) for c in "ab" * 3000) + (digits,))
    dfa = LazyDFA(node, Budget(), terms=table())
    assert not dfa.is_empty and dfa.step(0, ord("a")) != DEAD


def test_a_length_bound_beside_a_pattern_reuses_one_witness_for_every_remaining_length(monkeypatch):
    """``X{lo,hi} & P``: a witness of d bytes found once serves every ``hi' >= d`` (and ``lo' <= lo``) without a
    new search; below d the search runs again and still finds the language empty where it is."""
    table = derivatives.TermTable()
    unit = table.from_node(parse_regex("[a-z]"))
    pattern = table.from_node(parse_regex("abcd"))  # exactly 4 letters
    assert table.is_live(table.intersect([table.repeat(unit, 0, 100), pattern]))
    searches = []
    explore = table._explore_for_acceptance
    monkeypatch.setattr(table, "_explore_for_acceptance", lambda term: searches.append(term) or explore(term))
    for high in (99, 50, 4):
        assert table.is_live(table.intersect([table.repeat(unit, 0, high), pattern]))
    assert searches == []
    assert not table.is_live(table.intersect([table.repeat(unit, 0, 3), pattern]))
    assert not table.is_live(table.intersect([table.repeat(unit, 5, 9), pattern]))
    assert len(searches) == 2

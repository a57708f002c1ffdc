"""The native trie walk: the same masks as the Python walk, state by state, pieces and lazy derivation included."""

import random
import threading

import numpy as np
import pytest

from corral.fsm import derivatives, native_walk
from corral.fsm.compiler import GrammarCompiler
from corral.fsm.token_index import TokenIndex
from corral.grammar.constraint import Constraint
from corral.fsm.vocabulary import Vocabulary
from tests.fsm.test_token_pieces import CONSTRAINTS, random_walk_states
from tests.fsm.test_token_pieces import VOCAB as PIECES_VOCAB

# tokens that enter a piece state and leave it through another member at once (the walk must go on below them)
_EXTRA = [b'"a",', b'x"a",', b'"a"', b'"u\\"ab', b'"ab"!']
_TOKENS = sorted(set(PIECES_VOCAB.token_bytes[:-1]) | set(_EXTRA))
VOCAB = Vocabulary.from_token_bytes(_TOKENS + [b"<eos>"], eos_token_ids=[len(_TOKENS)])

pytestmark = pytest.mark.skipif(derivatives.native_module() is None, reason="native module off or missing")

MORE = [
    Constraint("regex", r"(ab|a\d{2,5}|[^a]{0,3}x)+"),
    Constraint("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
                               "patternProperties": {"^u": {"type": "string", "pattern": "^[ab]{2}$"}}},
               whitespace="flexible"),
    # pieces beside other members (declared names beside the free-form one; a literal beside a string body)
    Constraint("json_schema", {"type": "object", "properties": {"ab": {"type": "string"}, "b7": {"type": "integer"},
                                                                "u": {"type": "string", "maxLength": 3}},
                               "additionalProperties": {"type": "integer"}}),  # a value "any" would not be regular
    Constraint("regex", r'(x|\\")*"(a",|[^"\\]*"!|u\\"[^"\\]*"!)'),
]


def _python_mask(index: TokenIndex, state: int) -> np.ndarray:
    """The mask by the Python trie walk with no piece shortcut: the plain definition."""
    tables = index.tables
    words = tables.words_of(tables.trie.walk(state, index.dfa))
    return words | tables.eos_words if index.dfa.accepting[state] else words


def _native_mask(index: TokenIndex, state: int) -> np.ndarray:
    words = index._native.walk(state).view(np.int32)
    return words | index.tables.eos_words if index.dfa.accepting[state] else words


@pytest.mark.parametrize("constraint", CONSTRAINTS + MORE, ids=lambda c: str(c.value)[:40])
def test_native_walk_equals_the_plain_walk_on_random_walks(constraint):
    # a fresh index per check order: the native walk runs first, so it meets transitions not yet derived
    index = GrammarCompiler(VOCAB, cache_bytes=0).compile(constraint).index
    assert index._native is not None
    checked = 0
    for state, native in random_walk_states(index, VOCAB, random.Random(str(constraint.value)), 30,
                                            lambda state: _native_mask(index, state)):
        assert np.array_equal(native, _python_mask(index, state)), (constraint.value, state)
        assert np.array_equal(index.mask(state), native)
        checked += 1
    assert checked >= 30
    flags = index.dfa.native.flags_of(index._native.flag_set)
    assert flags.count(native_walk.FLAG_PIECES) or constraint in MORE[:1]


def test_without_the_extension_masks_come_from_the_python_walk(monkeypatch):
    monkeypatch.setattr(derivatives, "_NATIVE_CLASS", [None])
    constraint = CONSTRAINTS[0]
    plain = GrammarCompiler(VOCAB, cache_bytes=0).compile(constraint).index
    assert plain._native is None
    monkeypatch.undo()
    native = GrammarCompiler(VOCAB, cache_bytes=0).compile(constraint).index
    assert native._native is not None
    state_plain = state_native = 0
    for token_id in [VOCAB.token_bytes.index(b"{")] + [VOCAB.token_bytes.index(b'"')] * 2:
        assert np.array_equal(plain.mask(state_plain), native.mask(state_native))
        state_plain, state_native = plain.next_state(state_plain, token_id), native.next_state(state_native, token_id)


def test_an_error_inside_the_pass_reaches_the_caller(monkeypatch):
    from corral.errors import GrammarTooComplexError

    index = GrammarCompiler(VOCAB, cache_bytes=0).compile(CONSTRAINTS[3]).index  # one byte in: a wide state

    def refuse(state):
        raise GrammarTooComplexError("state budget")

    monkeypatch.setattr(index, "piece_split", refuse)  # asked for the first wide state the pass meets
    with pytest.raises(GrammarTooComplexError, match="state budget"):
        index._native.walk(0)
    monkeypatch.undo()
    words = index._native.walk(0)  # the walk is usable again afterwards
    assert np.array_equal(words.view(np.int32) | (index.tables.eos_words if index.dfa.accepting[0] else 0),
                          _python_mask(index, 0))


@pytest.mark.parametrize("constraint", CONSTRAINTS[:3], ids=lambda c: str(c.value)[:40])
def test_walks_of_one_grammar_in_several_threads_at_once(constraint):
    # token paths to many states, found on one index; replayed on a fresh one, whose moves are then derived by
    # several threads' walks at once (each pass holds the automaton's lock; its callbacks run Python)
    explored = GrammarCompiler(VOCAB, cache_bytes=0).compile(constraint).index
    paths, rng = [], random.Random(3)
    for _ in range(40):
        path, state = [], 0
        for _ in range(rng.randint(1, 12)):
            allowed = np.flatnonzero(np.unpackbits(explored.mask(state).view(np.uint8), bitorder="little"))
            allowed = [int(t) for t in allowed if t < VOCAB.size and t not in VOCAB.eos_token_ids]
            if not allowed:
                break
            token = rng.choice(allowed)
            path.append(token)
            state = explored.next_state(state, token)
        paths.append(path)
    index = GrammarCompiler(VOCAB, cache_bytes=0).compile(constraint).index
    states = set()
    for path in paths:
        state = 0
        for token in path:
            states.add(state)
            state = index.next_state(state, token)
        states.add(state)
    states = sorted(states)
    results: dict[int, list] = {}
    start = threading.Barrier(4)

    def work(worker: int) -> None:
        start.wait()
        order = states[worker::2] + states[(worker + 1)::2]  # every state, in two different orders
        results[worker] = [(state, _native_mask(index, state)) for state in order]

    threads = [threading.Thread(target=work, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and len(states) >= 10
    for worker_results in results.values():
        for state, mask in worker_results:
            assert np.array_equal(mask, _python_mask(index, state)), state


_GRAMMAR = r'''
start: value
value: object | array | STRING | NUMBER
object: "{" [pair ("," pair)*] "}"
pair: STRING ":" value
array: "[" [value ("," value)*] "]"
STRING: /"[^"\\]*"/
NUMBER: /-?[0-9]+/
'''


@pytest.mark.parametrize("constraint", CONSTRAINTS + MORE + [Constraint("grammar", _GRAMMAR)],
                         ids=lambda c: str(c.value)[:40])
def test_masks_and_advances_never_take_the_gil_back(constraint):
    # a fresh grammar: its first masks derive moves, grow the automaton's rows and meet wide states and pieces
    # nobody has registered, all inside native calls that released the GIL; none may take it back (no Python
    # callback, no Python object made or touched)
    from corral import native

    module = native.module()
    guide = GrammarCompiler(VOCAB, cache_bytes=0).compile(constraint).new_guide()
    rng = random.Random(str(constraint.value))
    row = np.zeros((VOCAB.size + 31) // 32, dtype=np.int32)
    before, masks = module._gil_taken_back(), 0
    for _ in range(6):
        walk = guide.copy()
        for _ in range(40):
            walk.fill_mask(row)
            masks += 1
            allowed = [t for t in np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist()
                       if t < VOCAB.size and t not in VOCAB.eos_token_ids]
            if not allowed:
                break
            assert walk.advance(rng.choice(allowed))
    assert masks >= 20
    assert module._gil_taken_back() == before


def test_a_walk_registers_the_pieces_it_met_and_the_next_walk_takes_them():
    index = GrammarCompiler(VOCAB, cache_bytes=0).compile(CONSTRAINTS[1]).index  # an array of strings
    states = [state for state, _ in random_walk_states(index, VOCAB, random.Random(5), 30, index._native.walk)]
    assert index.dfa.native.piece_bytes > 0  # some walk met a string body below its root, and registered it
    assert index.nbytes() >= index.dfa.native.piece_bytes
    for state in states:  # walked again, now with every answer registered: the same masks
        assert np.array_equal(_native_mask(index, state), _python_mask(index, state)), state


def _fuel_counted(terms, fuel: int, compute, fallback):
    """``(mask_of, spent, failures)``: ``mask_of(state)`` computes by ``compute``, appending the new terms of each
    mask that completed to ``spent``; one that runs out of ``fuel`` is counted in ``failures`` (its message checked)
    and computed by ``fallback`` instead, so a walk can go on."""
    from corral.errors import GrammarTooComplexError

    spent, failures = [], []

    def mask_of(state):
        before = len(terms)
        try:
            words = compute(state)
        except GrammarTooComplexError as error:
            assert f"fuel of {fuel} new terms" in str(error)
            failures.append(state)
            return fallback(state)
        spent.append(len(terms) - before)
        return words

    return mask_of, spent, failures


def test_the_registrations_after_a_walk_spend_the_fuel_it_left():
    def run(fuel: int) -> tuple[list[int], int, int]:
        """Along the same random walks: the new terms of each mask that completed, the new terms of all
        registrations, and how many masks ran out of fuel."""
        index = GrammarCompiler(VOCAB, cache_bytes=0).compile(CONSTRAINTS[0]).index  # an object of strings
        walk = native_walk.NativeWalk(index._native.native, index, fuel=fuel)
        terms, register = index.dfa.terms, walk._register
        registered = 0

        def counted_register(state, depth):
            nonlocal registered
            before = len(terms)
            try:
                register(state, depth)
            finally:
                registered += len(terms) - before

        walk._register = counted_register
        mask_of, spent, failures = _fuel_counted(terms, fuel, walk.walk, index._native.walk)
        list(random_walk_states(index, VOCAB, random.Random(11), 30, mask_of))
        return spent, registered, len(failures)

    _, registered, failed = run(-1)
    assert registered > 0 and failed == 0  # registrations do derive terms: the bound below is not empty
    for fuel in (6, 20):  # at 20 a registration runs out (without its share of the fuel, one mask spent 27)
        spent, _, failed = run(fuel)
        assert failed > 0 and spent
        assert max(spent) <= fuel  # walk and registrations together


@pytest.mark.parametrize("constraint", CONSTRAINTS[:1] + MORE[:1], ids=lambda c: str(c.value)[:40])
def test_one_fuel_bounds_everything_a_mask_derives(constraint):
    # the index's mask, not the walk alone: the rows of a looping state, the masks of a piece state's other
    # members and the walk all spend the one fuel (before, the rows and the nested masks got none of it)
    def run(fuel: int) -> tuple[list[int], int]:
        index = GrammarCompiler(VOCAB, cache_bytes=0).compile(constraint).index
        index.mask_fuel = fuel

        def unbounded(state):  # the same mask with no cap, to walk on
            index.mask_fuel = -1
            try:
                return index.mask(state)
            finally:
                index.mask_fuel = fuel

        mask_of, spent, failures = _fuel_counted(index.dfa.terms, fuel, index.mask, unbounded)
        list(random_walk_states(index, VOCAB, random.Random(5), 30, mask_of))
        return spent, len(failures)

    unbounded, failed = run(-1)
    assert failed == 0
    fuel = max(unbounded) // 2
    assert fuel > 0
    spent, failed = run(fuel)
    assert failed > 0 and spent
    assert max(spent) <= fuel


def test_a_piece_answer_or_a_walk_of_the_wrong_length_is_refused():
    index = GrammarCompiler(VOCAB, cache_bytes=0).compile(CONSTRAINTS[0]).index
    dfa, trie = index.dfa.native, index._native.native
    flag_set = dfa.new_flag_set(trie.num_words)
    with pytest.raises(ValueError, match="not one mask row"):  # a walk would read the answer's words by token id
        dfa.set_piece_answer(flag_set, 0, 1, -1, np.zeros(trie.num_words - 1, dtype=np.uint32))
    dfa.set_piece_answer(flag_set, 0, 1, -1, np.zeros(trie.num_words, dtype=np.uint32))
    other = dfa.new_flag_set(trie.num_words + 1)
    with pytest.raises(ValueError, match="flag set's rows are not the trie's"):
        dfa.walk_trie(trie.native, 0, other, np.zeros(trie.num_words, dtype=np.uint32), -1)
    with pytest.raises(ValueError):
        dfa.new_flag_set(0)

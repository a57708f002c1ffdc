"""LazyDFA: the byte DFA of a regex AST, built on demand — a state's row is made the first time it is needed.

States are derivative terms (``derivatives.py``): the start state is the whole language, and the row of a state
holds, per byte, the state of its derivative. Schemas whose full DFA runs to tens of thousands of states
(any-value unrolled, long counted repeats) only visit a few hundred of them while a document is generated, so
compiling costs the AST-to-term conversion plus the start state. Dead states never get an id: a derivative whose
language is empty is ``DEAD``, so every state that exists can still reach acceptance (masks are never empty).

Rows are built under a lock; ``trans`` may be reallocated as it grows, so read it after :meth:`ensure` (whole
rows) or through :meth:`gather` / :meth:`next_state` (one byte class at a time; other entries stay unbuilt).

Where the C++ extension builds, ``LazyDFA(...)`` gives a :class:`NativeLazyDFA`: the same automaton with states,
rows and moves in native code over the native term table, which the token walks (``native_walk.py``) extend
without calling back into Python per move. This class is then the fallback and the reference it is tested against.
"""

import functools
import threading

import numpy as np

from corral.errors import GrammarTooComplexError
from corral.budget import Budget
from corral.fsm.derivatives import TermTable, native_table_class, native_module, new_table
from corral.grammar.regex_ast import Node

DEAD = -1
_UNBUILT = -3
_ALL_BYTES = (1 << 256) - 1


@functools.lru_cache(maxsize=4096)
def _bytes_of(mask: int) -> np.ndarray | int:
    """The bytes in a 256-bit mask, as an index into a row: the byte itself when there is one (a scalar store is
    several times cheaper than a fancy-indexed one). Cached: the same classes (string characters, digits) recur
    in every schema."""
    if mask & (mask - 1) == 0:
        return mask.bit_length() - 1
    return np.flatnonzero(np.unpackbits(np.frombuffer(mask.to_bytes(32, "little"), dtype=np.uint8),
                                        bitorder="little"))


@functools.lru_cache(maxsize=4096)
def _fresh_row(covered: int) -> np.ndarray:
    """A row before any move is derived: ``DEAD`` on the bytes outside ``covered``, unbuilt on the others."""
    row = np.full(256, _UNBUILT, dtype=np.int32)
    row[_bytes_of(_ALL_BYTES ^ covered)] = DEAD
    row.setflags(write=False)
    return row


class LazyDFA:
    """State 0 is the start. ``trans`` int32 [capacity, 256]; ``accepting`` bool; rows filled by :meth:`ensure`."""

    def __new__(cls, node: Node | None = None, budget: Budget | None = None, *, terms=None, root: int = 0):
        """A :class:`NativeLazyDFA` when the term table is the native one (``corral/csrc/terms.cpp``)."""
        if cls is LazyDFA:
            native = native_table_class()
            if native is not None and (terms is None or isinstance(terms, native)):
                cls = NativeLazyDFA
        return super().__new__(cls)

    def __init__(self, node: Node | None, budget: Budget, *, terms: TermTable | None = None, root: int = 0):
        """The DFA of ``node``, or (``terms`` and ``root`` given) of a term already in ``terms``."""
        self.terms = terms if terms is not None else new_table(budget)
        self.limits = budget  # its state cap (check_states) holds for the automaton's whole life
        self.max_states = budget.max_states
        if hasattr(self.terms, "max_terms"):  # the native table counts its terms exactly
            self.terms.max_terms = budget.max_terms
        if node is not None:
            root = self.terms.from_node(node)
            if terms is None:  # a table of its own: nothing else converts into it
                self.terms.forget_nodes()
        budget.check_time()
        self.lock = threading.RLock()  # held while the term table or the rows grow
        self._live_bytes: dict[int, list[int]] = {}
        self._setup()
        self.is_empty = not self.terms.is_live(root)
        if self.is_empty and self.terms.num_undecided:
            raise GrammarTooComplexError("the constraint's intersections (allOf, not, pattern with length bounds) are "
                                         "too large to decide whether any value satisfies them")
        if not self.is_empty:
            self.state_of_term(root)
            self.row(0)
        # subtle: the compile budget's clock ends with compilation; rows built later, while decoding, never fail on
        # time. The caps hold for the automaton's whole life (a row past one raises GrammarTooComplexError, and
        # the sequence that needed it ends with that error).
        self.terms.budget = budget.for_decoding()

    def _setup(self) -> None:
        self._state_ids: dict[int, int] = {}
        self._state_terms: list[int] = []
        self.trans = np.full((16, 256), _UNBUILT, dtype=np.int32)
        self.accepting = np.zeros(16, dtype=bool)
        self.built = np.zeros(16, dtype=bool)
        self._classes: dict[int, list[int]] = {}

    @property
    def num_states(self) -> int:
        return len(self._state_terms)

    def ensure(self, states: np.ndarray) -> np.ndarray:
        """Build the rows of ``states`` (an int array of live states); returns the current ``trans``."""
        missing = states[~self.built[states]]
        if len(missing):
            with self.lock:
                self._build_rows(np.unique(missing).tolist())
        return self.trans

    def gather(self, states: np.ndarray, bytes_: np.ndarray) -> np.ndarray:
        """``trans[states, bytes_]``, deriving only the byte classes asked for: a trie walk below the first byte
        meets a handful of bytes per state, so most of a row is never needed."""
        out = self.trans[states, bytes_]
        missing = out == _UNBUILT
        if missing.any():
            with self.lock:
                self._derive_moves(np.unique((states[missing].astype(np.int64) << 8) | bytes_[missing]).tolist())
            out = self.trans[states, bytes_]
        return out

    def _build_rows(self, states: list[int]) -> None:
        for state in states:
            if not self.built[state]:
                self._build_row(state)

    def _derive_moves(self, pairs: list[int]) -> None:
        """Derive the moves ``state << 8 | byte``."""
        for pair in pairs:
            self._build_byte(pair >> 8, pair & 255)

    def next_state(self, state: int, byte: int) -> int:
        """One transition, deriving only its byte class if needed."""
        following = int(self.trans[state, byte])
        if following == _UNBUILT:
            with self.lock:
                self._build_byte(state, byte)
            following = int(self.trans[state, byte])
        return following

    def states_left(self) -> np.ndarray:
        """The states some move has been derived out of (int64, ascending)."""
        return np.asarray(sorted(self._classes), dtype=np.int64)

    def row(self, state: int) -> np.ndarray:
        if not self.built[state]:
            with self.lock:
                if not self.built[state]:
                    self._build_row(state)
        return self.trans[state]

    def live_bytes(self, state: int) -> list[int]:
        """The bytes that do not kill ``state``, ascending (cached)."""
        live = self._live_bytes.get(state)
        if live is None:
            live = self._live_bytes[state] = np.flatnonzero(self.row(state) >= 0).tolist()
        return live

    def state_of_term(self, term: int) -> int:
        """The state whose language is ``term``'s (made if new; reachable or not), or ``DEAD``."""
        with self.lock:
            return self._state_of(term)

    def term_of(self, state: int) -> int:
        return self._state_terms[state]

    def step(self, state: int, byte: int) -> int:
        return self.next_state(state, byte)

    def _state_of(self, term: int) -> int:
        state = self._state_ids.get(term)
        if state is None:
            if not self.terms.is_live(term):
                return DEAD
            self.limits.check_states(len(self._state_terms))
            state = self._state_ids[term] = len(self._state_terms)
            self._state_terms.append(term)
            self._grow(state + 1)
            self.accepting[state] = self.terms.nullable[term]
        return state

    def _grow(self, size: int) -> None:
        capacity = len(self.built)
        if size <= capacity:
            return
        capacity = max(size, 2 * capacity)
        trans = np.full((capacity, 256), _UNBUILT, dtype=np.int32)
        trans[:len(self.trans)] = self.trans
        self.trans = trans
        self.accepting = np.concatenate([self.accepting, np.zeros(capacity - len(self.accepting), dtype=bool)])
        self.built = np.concatenate([self.built, np.zeros(capacity - len(self.built), dtype=bool)])

    def _build_row(self, state: int) -> None:
        for cls in self._classes_of(state):
            lowest = (cls & -cls).bit_length() - 1
            if self.trans[state, lowest] == _UNBUILT:
                self._build_class(state, cls)
        self.built[state] = True

    def _classes_of(self, state: int) -> list[int]:
        """The byte classes of ``state`` (cached); the first call marks the bytes outside them all dead."""
        classes = self._classes.get(state)
        if classes is None:
            classes = self._classes[state] = self.terms.byte_classes(self._state_terms[state])
            covered = 0
            for cls in classes:
                covered |= cls
            if covered != _ALL_BYTES:  # no move of the row is derived before its classes are known
                self.trans[state] = _fresh_row(covered)
        return classes

    def _build_class(self, state: int, cls: int) -> None:
        term = self._state_terms[state]
        following = self._state_of(self.terms.derivative(term, (cls & -cls).bit_length() - 1))
        self.trans[state, _bytes_of(cls)] = following  # after _state_of: it may have reallocated trans

    def _build_byte(self, state: int, byte: int) -> None:
        if self.trans[state, byte] != _UNBUILT:
            return
        for cls in self._classes_of(state):
            if (cls >> byte) & 1:
                self._build_class(state, cls)
                return


class NativeLazyDFA(LazyDFA):
    """The same automaton with its states, rows and moves in native code (``corral/csrc/terms.cpp``, over the
    native term
    table): deriving a move is one call, and the token walks derive the moves they meet without leaving C++.
    ``trans``, ``accepting`` and ``built`` are numpy views of the native buffers, renewed when those grow (read
    them after a call that may derive)."""

    def _setup(self) -> None:
        self.native = native_module().Dfa(self.terms)
        self.native.max_states = self.max_states
        self._generation = -1
        self.refresh()

    def refresh(self) -> None:
        """Renew the views after the native buffers grew."""
        generation = self.native.generation  # read first: a growth after it only makes the next refresh renew
        if generation != self._generation:
            trans, accepting, built, capacity = self.native.buffers()
            self.trans = np.frombuffer(trans, dtype=np.int32).reshape(capacity, 256)
            self.accepting = np.frombuffer(accepting, dtype=bool)
            self.built = np.frombuffer(built, dtype=bool)
            self._generation = generation

    @property
    def num_states(self) -> int:
        return self.native.num_states

    def _build_rows(self, states: list[int]) -> None:
        try:
            for state in states:
                self.native.build_row(state)
        finally:  # a limit met mid-way (the fuel, the state cap) may leave the buffers grown
            self.refresh()

    def _derive_moves(self, pairs: list[int]) -> None:
        try:
            for pair in pairs:
                self.native.next_state(pair >> 8, pair & 255)
        finally:
            self.refresh()

    def next_state(self, state: int, byte: int) -> int:
        with self.lock:
            try:
                following = self.native.next_state(state, byte)
            finally:
                self.refresh()
        return following

    step = next_state

    def states_left(self) -> np.ndarray:
        return np.asarray(self.native.states_left(), dtype=np.int64)

    def row(self, state: int) -> np.ndarray:
        if not self.built[state]:
            with self.lock:
                try:
                    self.native.build_row(state)
                finally:
                    self.refresh()
        return self.trans[state]

    def state_of_term(self, term: int) -> int:
        with self.lock:
            try:
                state = self.native.state_of(term)
            finally:
                self.refresh()
        return state

    def term_of(self, state: int) -> int:
        return self.native.term_of(state)


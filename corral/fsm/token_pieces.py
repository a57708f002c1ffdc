"""Repeat pieces: the context-independent part of a token mask, computed once per vocabulary and piece.

A state whose term is ``X{lo,hi} R`` (a JSON string body: ``X`` one spelled character, ``R`` the closing quote
and the rest of the document; a bounded ``maxLength`` body; the free-form member of a property-name
alternation) would walk nearly the whole vocabulary, and with a counted repeat every position is a new state.
But what a token does inside ``X*`` depends on ``X`` alone. Walking every token once through the small DFA of
``X*`` gives, per token:

- it never leaves ``X*``: the number of units of ``X`` it starts (``units``);
- it dies at byte ``exit``: whether the DFA was back at its start there (a unit boundary), and how many units
  were complete.

When ``first(X)`` and ``first(R)`` share no byte the split between the repeat and ``R`` is unique, so exactly:

    allowed(t) = (never exits and units <= hi) or (exits at a boundary, lo <= units <= hi, t[exit:] in Pref(R))

The first part is a few vectorised comparisons per state; the second walks only the tokens that can cross the
piece's end (a few hundred), once per ``R``, whatever position of the repeat the state is at. This is XGrammar's
context-independent token split, expressed on derivative terms. The same facts for token bytes from offset ``d``
on (one walk per piece and offset, on first use) let a trie walk that meets a piece ``d`` bytes into a token
(after a string's opening quote, one character into a property name's free-form member) take that whole subtree
at once, in the walk's state's other members' stead.

Unit counting is exact only when a complete unit always returns the DFA of ``X*`` to its start term (no unit is a
prefix of another, as with spelled JSON characters); a piece whose DFA reaches another accepting state is marked
unusable and its states take the plain trie walk. Left out: intersections (``pattern`` with ``maxLength``).
"""

import threading

import numpy as np

from corral.fsm import native_walk
from corral.budget import Budget
from corral.fsm.derivatives import _ALT, _CAT, TermTable, new_table
from corral.fsm.lazy_dfa import LazyDFA

# A piece whose first bytes are at most this many is narrow: the trie walk visits few nodes there anyway.
MIN_PIECE_BYTES = 32
# A piece most tokens leave into a rest that takes them (a UTF-8 continuation byte before any character) saves
# nothing: the crossing walk would be the whole trie walk, without the trie's shared prefixes.
MAX_CROSSING_TOKENS = 4096


class PieceTokens:
    """Facts about one piece ``X`` for every token's bytes from ``offset`` on (arrays indexed by token id; a
    token no longer than ``offset`` never exits and starts no unit)."""

    def __init__(self, never_exits: np.ndarray, units: np.ndarray, exits: np.ndarray, at_boundary: np.ndarray,
                 byte_matrix: np.ndarray):
        self.never_exits = never_exits
        self.units = units
        self.cross_ids = np.flatnonzero((exits >= 0) & at_boundary)
        self.cross_offsets = exits[self.cross_ids].astype(np.intp)  # where the bytes after the piece begin
        self.cross_units = units[self.cross_ids]
        self.cross_bytes = byte_matrix[self.cross_ids, self.cross_offsets]  # the first byte after the piece
        self.unbounded_words = np.packbits(never_exits, bitorder="little").view(np.int32)
        self.max_units = int(units[never_exits].max(initial=0))
        self._bounded_words: dict[int, np.ndarray] = {}
        self._crossing_nodes: tuple[np.ndarray, np.ndarray] | None = None

    def crossing_nodes(self, trie, token_bytes) -> tuple[np.ndarray, np.ndarray]:
        """The trie nodes where tokens leave the piece at a unit boundary (each token's prefix up to its exit),
        ascending and without repeats, and the units before each (int32 arrays; computed once)."""
        if self._crossing_nodes is None:
            found: dict[int, int] = {}
            child_of = trie.child_of
            for token_id, offset, units in zip(self.cross_ids.tolist(), self.cross_offsets.tolist(),
                                               self.cross_units.tolist()):
                node = 0
                for byte in token_bytes[token_id][:offset]:
                    node = child_of[node << 8 | byte]
                found[node] = units  # one prefix, one count
            nodes = sorted(found)
            self._crossing_nodes = (np.asarray(nodes, dtype=np.int32),
                                    np.asarray([found[node] for node in nodes], dtype=np.int32))
        return self._crossing_nodes

    def bounded_words(self, high: int) -> np.ndarray:
        """Bitmask words of the tokens that never exit and start at most ``high`` units (read-only, cached: every
        position of a counted repeat asks for its own bound, and the bounds recur in every schema)."""
        if high >= self.max_units:
            return self.unbounded_words
        words = self._bounded_words.get(high)
        if words is None:
            words = np.packbits(self.never_exits & (self.units <= high), bitorder="little").view(np.int32)
            words.setflags(write=False)
            self._bounded_words[high] = words
        return words


class PieceFacts:
    """The DFA of ``X*`` for one piece and its :class:`PieceTokens` per offset (offset ``d`` serves a trie walk
    that meets the piece ``d`` bytes into a token), computed on first use and shared by every grammar."""

    def __init__(self, structure, vocab, grammar_ids: np.ndarray, columns: list[np.ndarray]):
        table = new_table(Budget(time_s=float("inf")))
        star = table.repeat(table.from_structure(structure), 0, None)
        self.dfa = LazyDFA(None, Budget(time_s=float("inf")), terms=table, root=star)
        self.vocab, self.grammar_ids, self.columns = vocab, grammar_ids, columns
        self._at: dict[int, PieceTokens | None] = {}
        self._crossing_counts: dict[int, int] = {}
        self._lock = threading.Lock()

    def at(self, offset: int) -> PieceTokens | None:
        """The facts for token bytes from ``offset`` on; ``None`` when units cannot be counted exactly."""
        if offset not in self._at:
            with self._lock:
                if offset not in self._at:
                    self._at[offset] = self._walk(offset)
        return self._at[offset]

    def num_crossing(self, first_mask: int) -> int:
        """How many tokens leave the piece (at offset 0) on a byte of ``first_mask``: the walk a rest starting
        with those bytes costs."""
        count = self._crossing_counts.get(first_mask)
        if count is None:
            table = np.unpackbits(np.frombuffer(first_mask.to_bytes(32, "little"), dtype=np.uint8),
                                  bitorder="little").astype(bool)
            count = self._crossing_counts[first_mask] = int(np.count_nonzero(table[self.at(0).cross_bytes]))
        return count

    def _walk(self, offset: int) -> PieceTokens | None:
        dfa, lengths = self.dfa, self.vocab.lengths
        size = (self.vocab.size + 31) // 32 * 32  # whole bitmask words
        units = np.zeros(size, dtype=np.int32)
        exits = np.full(size, -1, dtype=np.int32)
        at_boundary = np.zeros(size, dtype=bool)
        ids = self.grammar_ids[lengths[self.grammar_ids] > offset]
        if native_walk.available(dfa):
            units[ids], exits[ids], at_boundary[ids] = native_walk.walk_tokens(
                dfa, self.vocab.byte_matrix, lengths, ids, np.full(len(ids), offset), 0)
            # whole rows of the states the tokens passed through, as the numpy walk's steps build them: the
            # check below looks for accepting states among their successors
            dfa.ensure(dfa.states_left())
        else:
            self._walk_numpy(ids, offset, units, exits, at_boundary)
        if dfa.accepting[1:dfa.num_states].any():
            return None
        never_exits = np.zeros(size, dtype=bool)
        never_exits[self.grammar_ids] = True
        never_exits[exits >= 0] = False
        return PieceTokens(never_exits, units, exits, at_boundary, self.vocab.byte_matrix)

    def _walk_numpy(self, ids: np.ndarray, offset: int, units: np.ndarray, exits: np.ndarray,
                    at_boundary: np.ndarray) -> None:
        """``native_walk.walk_tokens`` level by level in numpy (without the native module)."""
        dfa, lengths = self.dfa, self.vocab.lengths
        states = np.zeros(len(ids), dtype=np.int32)
        for depth in range(offset, len(self.columns)):
            running = lengths[ids] > depth
            ids, states = ids[running], states[running]
            if not len(ids):
                break
            at_start = states == 0
            next_states = dfa.ensure(states)[states, self.columns[depth][ids]]
            dead = next_states < 0
            exits[ids[dead]] = depth
            at_boundary[ids[dead]] = at_start[dead]
            alive = ~dead
            units[ids[alive]] += at_start[alive]
            ids, states = ids[alive], next_states[alive]


class Piece:
    """One member ``X{lo,hi} R`` of a state's term, with ``X``'s shared token facts."""

    __slots__ = ("facts", "low", "high", "rest")

    def __init__(self, facts: PieceFacts, low: int, high: int | None, rest: int):
        self.facts, self.low, self.high, self.rest = facts, low, high, rest


def split_pieces(terms: TermTable, term: int, facts_of) -> tuple[list[Piece], list[int]]:
    """The members of ``term`` that are wide repeat pieces, and the other members (their union is ``term``).
    Members are an alternation's, one level of ``(a|b) R = a R | b R`` included. ``facts_of(structure)``
    returns the shared :class:`PieceFacts` of a piece."""
    if terms.first_mask(term).bit_count() <= MIN_PIECE_BYTES:
        return [], [term]
    pieces, others = [], []
    for member in terms.args[term] if terms.kind[term] == _ALT else (term,):
        piece = _as_piece(terms, member, facts_of)
        if piece is None:
            head, tail = terms.args[member] if terms.kind[member] == _CAT else (None, None)
            if head is None or terms.kind[head] != _ALT:
                others.append(member)
                continue
            parts = [terms.cat(option, tail) for option in terms.args[head]]  # distributed, one level
            found = [_as_piece(terms, part, facts_of) for part in parts]
            if all(piece is None for piece in found):
                others.append(member)  # keep the member whole: its state may exist already
                continue
            others += [part for part, piece in zip(parts, found) if piece is None]
            pieces += [piece for piece in found if piece]
        elif piece is not False:
            pieces.append(piece)
    return pieces, others


def _as_piece(terms: TermTable, member: int, facts_of):
    """A :class:`Piece`, ``None`` when ``member`` is not one, ``False`` when its language is empty."""
    shape = terms.piece_shape(member, MIN_PIECE_BYTES)
    if not shape:
        return shape
    unit, low, high, rest = shape
    structure = terms.structure(unit)
    if structure is None:  # the process's structure ids are spent: walk it plainly
        return None
    facts = facts_of(structure)
    if facts.at(0) is None or facts.num_crossing(terms.first_mask(rest)) > MAX_CROSSING_TOKENS:
        return None
    return Piece(facts, low, high, rest)

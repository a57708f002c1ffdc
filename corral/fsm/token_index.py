"""TokenIndex: a byte DFA lifted to tokens. Per state, the bitmask of tokens whose bytes keep the DFA alive.

A token is allowed in state ``s`` exactly when walking its bytes from ``s`` never hits a dead move; because the
DFA is trimmed, the state it ends in can still reach acceptance. EOS is allowed exactly in accepting states;
special tokens never. Masks are computed lazily, once per state, and cached in the (shared, immutable in
meaning) index, so the decoding hot path is a row copy.

How a mask is computed (all vectorised over the vocabulary, see :class:`VocabTables`):

- trie walk (``token_trie.py``): tokens sharing a prefix take each DFA step once, level by level, and a branch
  is dropped at its first dead byte, so structural states cost a handful of trie nodes;
- repeat pieces (``token_pieces.py``), tried first on wide states: a member ``X{lo,hi} R`` of the state's term
  (string bodies, bounded or not, and the free-form member of a property-name alternation) takes its tokens from
  facts about ``X`` computed once per vocabulary, plus a walk of the few tokens that cross into ``R``, cached per
  ``R``; the other members' mask is the mask of their own state;
- self-loop shortcut: tokens whose bytes all lie in ``s``'s self-loop byte set stay in ``s`` (string bodies,
  digit runs). Those sets recur across schemas, so the split of the vocabulary by such a set is cached per
  vocabulary, and only the tokens outside it are walked, token by token with compaction of the live ones.
"""

import threading

import numpy as np

from corral.errors import GrammarTooComplexError
from corral.fsm import native_walk
from corral.fsm.derivatives import native_module
from corral.fsm.lazy_dfa import DEAD, LazyDFA
from corral.fsm.token_pieces import Piece, PieceFacts, PieceTokens, split_pieces
from corral.fsm.token_trie import TokenTrie
from corral.fsm.vocabulary import Vocabulary

_FEW_TOKENS = 256
# Piece facts kept per vocabulary (each about 0.3 MB per offset used at 49k tokens); a real workload has a few
# dozen pieces (string characters, loose and exact; pattern classes).
_MAX_PIECES = 64
# A state whose self-loop covers at least this many bytes uses the self-loop shortcut.
_LOOP_SHORTCUT_MIN_BYTES = 24
# Piece masks kept per token index (6 kB each at 49k tokens), least recently used dropped first.
_PIECE_WORDS_CACHED = 64


class VocabTables:
    """Per-vocabulary arrays shared by every grammar compiled for it (built once, about 0.1 s for 49k tokens)."""

    def __init__(self, vocab: Vocabulary):
        self.vocab = vocab
        self.num_words = (vocab.size + 31) // 32
        excluded = np.zeros(vocab.size, dtype=bool)
        excluded[list(vocab.special_ids | set(vocab.eos_token_ids))] = True
        excluded |= vocab.lengths == 0
        ids = np.flatnonzero(~excluded)
        matrix = vocab.byte_matrix
        self.grammar_ids = ids
        self.columns = [np.ascontiguousarray(matrix[:, k]).astype(np.intp) for k in range(matrix.shape[1])]
        self.lengths = vocab.lengths
        self.eos_words = self.words_of(np.asarray(vocab.eos_token_ids, dtype=np.int64))
        self._byte_sets: np.ndarray | None = None
        self._trie: TokenTrie | None = None
        self._native_trie: native_walk.NativeTrie | None = None
        self._loop_splits: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
        self._pieces: dict[tuple, PieceFacts] = {}
        self._lock = threading.Lock()

    def words_of(self, token_ids: np.ndarray) -> np.ndarray:
        """The int32 bitmask row with exactly ``token_ids`` set."""
        native = native_module()  # its or_bits sets the bits in one pass
        if native is not None:
            words = np.zeros(self.num_words, dtype=np.int32)
            native.or_bits(words, token_ids)
            return words
        if len(token_ids) <= _FEW_TOKENS:  # most structural masks: skip the full-width bool array and packbits
            by_word: dict[int, int] = {}
            for token_id in token_ids.tolist():
                by_word[token_id >> 5] = by_word.get(token_id >> 5, 0) | (1 << (token_id & 31))
            words = np.zeros(self.num_words, dtype=np.uint32)
            if by_word:
                words[list(by_word)] = list(by_word.values())
            return words.view(np.int32)
        bits = np.zeros(self.num_words * 32, dtype=bool)
        bits[token_ids] = True
        return np.packbits(bits, bitorder="little").view(np.int32)

    @property
    def trie(self) -> TokenTrie:
        if self._trie is None:
            with self._lock:
                if self._trie is None:
                    self._trie = TokenTrie(self.vocab.token_bytes, self.grammar_ids)
        return self._trie

    @property
    def native_trie(self) -> native_walk.NativeTrie:
        """The trie in the native walk's layout."""
        if self._native_trie is None:
            trie = self.trie
            with self._lock:
                if self._native_trie is None:
                    self._native_trie = native_walk.NativeTrie(trie, self.num_words)
        return self._native_trie

    def loop_split(self, loop_bytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For a byte set: (bitmask words of the tokens made only of those bytes, ids of all other tokens)."""
        key = np.packbits(loop_bytes).tobytes()
        split = self._loop_splits.get(key)
        if split is None:
            with self._lock:
                if self._byte_sets is None:
                    self._byte_sets = self._token_byte_sets()
            outside_bits = ~np.packbits(loop_bytes, bitorder="little").view(np.uint64)
            is_inside = ~((self._byte_sets & outside_bits) != 0).any(axis=1)
            split = (self.words_of(self.grammar_ids[is_inside]), self.grammar_ids[~is_inside])
            self._loop_splits[key] = split
        return split

    def piece_facts(self, structure) -> PieceFacts:
        """The shared token facts of a repeat piece (``token_pieces.py``), by the piece's term structure."""
        facts = self._pieces.get(structure)
        if facts is None:
            with self._lock:
                facts = self._pieces.setdefault(structure, PieceFacts(structure, self.vocab, self.grammar_ids,
                                                                      self.columns))
                while len(self._pieces) > _MAX_PIECES:  # oldest first; grammars holding one keep it alive
                    del self._pieces[next(iter(self._pieces))]
        return facts

    def _token_byte_sets(self) -> np.ndarray:
        """uint64 [len(grammar_ids), 4]: the 256-bit set of bytes each grammar token contains."""
        bits = np.zeros((len(self.grammar_ids), 256), dtype=bool)
        lengths = self.lengths[self.grammar_ids]
        for k, column in enumerate(self.columns):
            rows = np.flatnonzero(lengths > k)
            bits[rows, column[self.grammar_ids[rows]]] = True
        return np.packbits(bits, axis=1, bitorder="little").view(np.uint64)


_TABLES: dict[str, VocabTables] = {}
_TABLES_LOCK = threading.Lock()


def vocab_tables(vocab: Vocabulary) -> VocabTables:
    """The shared tables of ``vocab`` (cached by vocabulary hash)."""
    with _TABLES_LOCK:
        tables = _TABLES.get(vocab.hash)
        if tables is None:
            tables = _TABLES[vocab.hash] = VocabTables(vocab)
        return tables


class TokenIndex:
    """State × token → state over a :class:`LazyDFA`, with lazily computed, cached per-state masks."""

    def __init__(self, dfa: LazyDFA, vocab: Vocabulary):
        assert not dfa.is_empty, "an empty language has no token index"
        self.dfa, self.vocab, self.tables = dfa, vocab, vocab_tables(vocab)
        self._masks: dict[int, np.ndarray] = {}
        self._crossings: dict[tuple[int, int], tuple[PieceTokens, np.ndarray]] = {}
        self._piece_words: dict[tuple, np.ndarray] = {}
        self._splits: dict[int, tuple[list[Piece], int] | None] = {}
        self._eos_ids = frozenset(vocab.eos_token_ids)
        self._token_bytes = vocab.token_bytes
        self._special_ids = vocab.special_ids
        self._fuel = dfa.terms.budget.mask_fuel
        self.on_growth = None  # called after each new mask (set by the compile cache while this is cached)
        self._native = (native_walk.NativeWalk(self.tables.native_trie, self, self._fuel)
                        if native_walk.available(dfa) else None)

    @property
    def mask_fuel(self) -> int:
        """The new terms one mask may derive (-1: no cap)."""
        return self._fuel

    @mask_fuel.setter
    def mask_fuel(self, fuel: int) -> None:
        self._fuel = fuel
        if self._native is not None:
            self._native.fuel = fuel

    @property
    def num_states(self) -> int:
        """States determinized so far (the automaton grows as it is explored)."""
        return self.dfa.num_states

    def nbytes(self) -> int:
        """Memory held now: the transition rows, the masks computed so far (and the piece masks registered with
        the native walk), and the derivative terms."""
        pieces = self.dfa.native.piece_bytes if self._native is not None else 0
        return (self.dfa.trans.nbytes + (len(self._masks) * self.tables.num_words * 4 + pieces)
                + self.dfa.terms.nbytes())

    def is_accepting(self, state: int) -> bool:
        return bool(self.dfa.accepting[state])

    def row(self, state: int) -> np.ndarray:
        """The 256 next states of ``state`` (``DEAD`` where a byte is not allowed)."""
        return self.dfa.row(state)

    def forced_bytes(self, state: int, limit: int) -> bytes:
        """The bytes every continuation from ``state`` starts with: while the state is not accepting and exactly
        one byte keeps it alive, that byte, at most ``limit`` of them. A limit of the grammar met while building a
        row on the way ends the span there."""
        dfa = self.dfa
        if self._native is not None:  # one native call for the whole span
            with dfa.lock:
                try:
                    return dfa.native.forced(state, limit)
                finally:
                    dfa.refresh()
        out = bytearray()
        try:
            while state >= 0 and not dfa.accepting[state] and len(out) < limit:
                live = dfa.live_bytes(state)  # (cached per state)
                if len(live) != 1:
                    break
                out.append(live[0])
                state = int(dfa.row(state)[live[0]])
        except GrammarTooComplexError:
            pass
        return bytes(out)

    def mask(self, state: int) -> np.ndarray:
        """int32 bitmask words of the tokens allowed in ``state`` (shared: never write into it)."""
        mask = self._masks.get(state)
        if mask is None:
            mask = self._masks[state] = self._compute_mask(state)
            grew = self.on_growth
            if grew is not None:  # the compile cache re-counts this grammar's bytes (its bound holds throughout)
                grew()
        return mask

    def next_state(self, state: int, token_id: int) -> int:
        """The state after ``token_id`` (EOS and special tokens are not walked here), or ``DEAD``. An id past the
        vocabulary (a model's padding rows: a prompt may hold one, and prompt lookup may draft it) spells
        nothing, so it is refused."""
        if token_id in self._special_ids or token_id in self._eos_ids or not 0 <= token_id < len(self._token_bytes):
            return DEAD
        if self._native is not None:  # one native call, the GIL released while it derives
            with self.dfa.lock:
                following = self.dfa.native.advance(state, self._token_bytes[token_id])
                self.dfa.refresh()
            return following
        step = self.dfa.step
        for byte in self._token_bytes[token_id]:
            state = step(state, byte)
            if state < 0:
                return DEAD
        return state

    def _compute_mask(self, state: int) -> np.ndarray:
        if self._native is not None:  # one fuel (per thread) for all this mask derives natively: rows, pieces, walk
            with native_walk.mask_fuel(self._fuel):
                return self._mask_of(state)
        terms = self.dfa.terms
        with self.dfa.lock:  # the Python table's fuel is this mask's while it runs (a mask inside it shares it)
            outer = terms.fuel >= 0
            if not outer:
                terms.fuel = terms.fuel_given = self._fuel
            try:
                return self._mask_of(state)
            finally:
                if not outer:
                    terms.fuel = -1

    def _mask_of(self, state: int) -> np.ndarray:
        tables = self.tables
        words = self._piece_mask(state)
        if words is None:
            row = self.dfa.row(state)
            loop = row == state
            if np.count_nonzero(loop) >= _LOOP_SHORTCUT_MIN_BYTES:
                inside_words, outside_ids = tables.loop_split(loop)
                words = inside_words | tables.words_of(self._walk(state, outside_ids))
            elif self._native is not None:
                words = self._native.walk(state).view(np.int32)
            else:
                words = tables.words_of(tables.trie.walk(state, self.dfa, self))
        if self.dfa.accepting[state]:
            words = words | tables.eos_words
        # Never empty when the vocabulary spells every single byte (all real ones do); a toy vocabulary that
        # lacks the bytes a state needs can leave a state with no token, which the guide reports as an error.
        words.setflags(write=False)
        return words

    def piece_split(self, state: int) -> tuple[list[Piece], int] | None:
        """The wide repeat pieces among ``state``'s members and the state of the other members (``DEAD`` when
        none), or ``None`` when it has no piece (cached)."""
        split = self._splits.get(state, False)
        if split is False:
            dfa, terms = self.dfa, self.dfa.terms
            with dfa.lock:
                pieces, others = split_pieces(terms, dfa.term_of(state), self.tables.piece_facts)
                split = None
                if pieces:
                    split = pieces, dfa.state_of_term(terms.alt(others)) if others else DEAD
            self._splits[state] = split
        return split

    def _piece_mask(self, state: int) -> np.ndarray | None:
        """The mask as a union over the state's members: repeat pieces by their shared token facts, the other
        members by their own (cached) mask. ``None`` when the state has no wide repeat piece."""
        split = self.piece_split(state)
        if split is None:
            return None
        pieces, other_state = split
        words = self.mask(other_state).copy() if other_state != DEAD else np.zeros(self.tables.num_words, np.int32)
        for piece in pieces:
            words |= self.piece_words(piece, 0)
        return words

    def piece_words(self, piece: Piece, offset: int) -> np.ndarray | None:
        """int32 bitmask words of every token whose bytes from ``offset`` on ``piece`` allows (inside it, or
        leaving it into its rest); ``None`` when its facts at this offset are not exact. A few recent ones are
        cached: every position of a counted repeat has its own bounds."""
        tokens = piece.facts.at(offset)
        if tokens is None:
            return None
        key = (id(tokens), self.dfa.state_of_term(piece.rest), piece.low, piece.high)
        words = self._piece_words.pop(key, None)
        if words is None:
            inside = tokens.unbounded_words if piece.high is None else tokens.bounded_words(piece.high)
            words = inside | self.tables.words_of(tokens.cross_ids[self._crossing_ok(piece, tokens)])
            words.setflags(write=False)
            while len(self._piece_words) >= _PIECE_WORDS_CACHED:
                del self._piece_words[next(iter(self._piece_words))]
        self._piece_words[key] = words  # (re)inserted last: the dict's order is least recently used first
        return words

    def piece_subtree_ids(self, piece: Piece, offset: int, token_ids: np.ndarray) -> np.ndarray | None:
        """Of ``token_ids`` (tokens whose first ``offset`` bytes led to a state holding ``piece``), those the
        piece allows; ``None`` when its facts at this offset are not exact."""
        words = self.piece_words(piece, offset)
        if words is None:
            return None
        return token_ids[(words.view(np.uint32)[token_ids >> 5] >> (token_ids & 31).astype(np.uint32)) & 1 == 1]

    def _crossing_ok(self, piece: Piece, tokens: PieceTokens) -> np.ndarray:
        """Over ``tokens.cross_ids``: the piece's count bounds hold where the token leaves it, and the bytes after
        are a prefix of the rest's language (that walk cached per offset and rest: every position of a counted
        repeat shares it)."""
        rest_state = self.dfa.state_of_term(piece.rest)
        key = (id(tokens), rest_state)
        known = self._crossings.get(key)
        crossing = known[1] if known is not None else None
        if crossing is None:
            if rest_state == DEAD:
                crossing = np.zeros(len(tokens.cross_ids), dtype=bool)
            elif self._native is not None:  # natively all of them: most die at the first byte
                crossing = self._walk_suffixes(rest_state, tokens.cross_ids, tokens.cross_offsets)
            else:
                crossing = np.zeros(len(tokens.cross_ids), dtype=bool)
                row = self.dfa.row(rest_state)
                walked = np.flatnonzero(row[tokens.cross_bytes] >= 0)  # most die at the first byte after the piece
                crossing[walked] = self._walk_suffixes(rest_state, tokens.cross_ids[walked],
                                                       tokens.cross_offsets[walked])
            self._crossings[key] = (tokens, crossing)  # holding ``tokens`` keeps its id from being reused
        crossing = crossing & (tokens.cross_units >= piece.low)
        if piece.high is not None:
            crossing &= tokens.cross_units <= piece.high
        return crossing

    def _walk_suffixes(self, state: int, token_ids: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Whether each token's bytes from its offset on, walked from ``state``, never hit a dead move."""
        lengths, matrix, gather = self.tables.lengths, self.vocab.byte_matrix, self.dfa.gather
        if self._native is not None:
            _, exits, _ = native_walk.walk_tokens(self.dfa, matrix, lengths, token_ids, offsets, state)
            return exits < 0
        allowed = np.zeros(len(token_ids), dtype=bool)
        at = np.arange(len(token_ids))
        states = np.full(len(token_ids), state, dtype=np.int32)
        depth = 0
        while len(at):
            states = gather(states, matrix[token_ids[at], offsets[at] + depth])
            alive = states != DEAD
            at, states = at[alive], states[alive]
            depth += 1
            ended = lengths[token_ids[at]] == offsets[at] + depth
            allowed[at[ended]] = True
            at, states = at[~ended], states[~ended]
        return allowed

    def _walk(self, state: int, token_ids: np.ndarray) -> np.ndarray:
        """The subset of ``token_ids`` whose bytes, walked from ``state``, never hit a dead move."""
        lengths, columns, gather = self.tables.lengths, self.tables.columns, self.dfa.gather
        live_ids = token_ids
        states = np.full(len(live_ids), state, dtype=np.int32)
        allowed = []
        for depth, column in enumerate(columns):
            states = gather(states, column[live_ids])
            alive = states != DEAD
            live_ids, states = live_ids[alive], states[alive]
            ended = lengths[live_ids] == depth + 1
            allowed.append(live_ids[ended])
            live_ids, states = live_ids[~ended], states[~ended]
            if not len(live_ids):
                break
        return np.concatenate(allowed) if allowed else live_ids

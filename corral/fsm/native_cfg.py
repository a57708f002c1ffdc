"""The context-free parse in native code: :class:`NativeParseSession` is :class:`ParseSession` with its lexer,
Earley table, configurations and token walk in C++ (``corral/csrc/cfg.cpp``).

Each call is coarse (a whole mask, a whole token's advance, the bytes that may follow), releases the GIL for its
whole length and never calls back into Python, so a grammar's mask is computed while the model runs. It computes
the masks, advances and acceptance ``ParseSession`` computes (the same algorithm, errors and bounds; its walk is
depth first, so Earley set and lexer state ids are numbered in another order);
``ParseSession`` stays as the oracle the tests compare it with, and as the path ``CORRAL_NATIVE=off`` runs.

What the native side holds per compiled grammar (``CFGIndex.native_index``): the terminals' automata (the lexer's
``NativeLazyDFA`` objects, shared), the lexer's states and moves, the productions, the special tokens' rows and
the sub-walks per (trie node, lexer state) (``ROOT_WALK_CACHE_BYTES`` of them); per session: the Earley sets,
configurations, moves and masks.
"""

import numpy as np

from corral import native
from corral.fsm.cfg_guide import MAX_CONFIGS, CFGIndex, ParseSession
from corral.fsm.earley import MAX_TABLE_ITEMS
from corral.fsm.lazy_dfa import DEAD
from corral.fsm.token_pieces import MIN_PIECE_BYTES, split_pieces


def new_session(index: CFGIndex, max_configs: int = MAX_CONFIGS):
    """A native session where the native module has the grammar's automata, else the Python one."""
    if index.native_index() is not None:
        return NativeParseSession(index, max_configs)
    return ParseSession(index, max_configs)


class NativeParseSession:
    """One request's parse (shared by the copies of its guides), in native code; the interface CFGGuide uses."""

    def __init__(self, index: CFGIndex, max_configs: int = MAX_CONFIGS):
        self.index, self.lock = index, index.lock
        with self.lock:
            self.native = native.module().CfgSession(index.native_index(), max_configs, MAX_TABLE_ITEMS,
                                                     index.mask_fuel)
        self.start = self.native.start
        self._words = index.tables.num_words

    def fill_mask(self, config: int, row: np.ndarray) -> None:
        index = self.index
        if config == self.start and index.start_mask is not None:
            row[:] = index.start_mask
        else:
            pending = self.native.unregistered_roots(config)
            if pending:
                register_pieces(index, pending)
            self.native.fill_mask(config, row, index.mask_fuel)

    def mask(self, config: int) -> np.ndarray:
        row = np.zeros(self._words, dtype=np.int32)
        self.fill_mask(config, row)
        row.setflags(write=False)
        return row

    def advance(self, config: int, token_id: int) -> int:
        index = self.index
        specials = index.special_of_token.get(token_id)
        if specials is not None:
            terminals = np.asarray(sorted(specials), dtype=np.int32)
            return self.native.advance_special(config, terminals, index.mask_fuel)
        vocab = index.vocab
        # an id past the vocabulary (a model's padding rows, which a prompt may hold) spells nothing
        if token_id in vocab.special_ids or not 0 <= token_id < len(vocab.token_bytes):
            return DEAD
        return self.native.advance(config, vocab.token_bytes[token_id], index.mask_fuel)

    def move(self, config: int, byte: int) -> int:
        return self.native.move(config, byte, self.index.mask_fuel)

    def is_accepting(self, config: int) -> bool:
        return self.native.is_accepting(config, self.index.mask_fuel)

    def specials_allowed(self, config: int) -> frozenset[int]:
        return frozenset(self.native.specials_allowed(config, self.index.mask_fuel))

    def forced_bytes(self, config: int, limit: int) -> bytes:
        return self.native.forced(config, limit, self.index.mask_fuel)

    def live_bytes(self, config: int) -> np.ndarray:
        return np.asarray(self.native.live_bytes(config, self.index.mask_fuel), dtype=np.int64)

    def readings(self, config: int) -> tuple[tuple[int, int], ...]:
        with self.lock:
            return self.native.readings(config)

    def sets_between_lexemes(self, config: int) -> list[int]:
        return list(self.native.sets_between_lexemes(config, self.index.mask_fuel))


def register_pieces(index: CFGIndex, states) -> None:
    """Tell the native lexer which of ``states`` (a mask's root states) hold repeat pieces, and which of the
    states one byte further do, so that their walks take the pieces' shared token facts instead of the trie
    (``cfg.cpp``'s ``PieceTokens``; each member split as the regular path splits a state,
    ``token_pieces.split_pieces``). Called before a mask that starts from them, under the grammar's lock; each
    state is asked once per offset."""
    native_index = index.native_index()
    for state in states:
        _register(index, native_index, state, 0)
        live, following = native_index.lexer_moves(state, index.mask_fuel)
        if live > MIN_PIECE_BYTES:  # a narrow state's walk is a few trie nodes anyway
            for after in following:
                _register(index, native_index, after, 1)


def _register(index: CFGIndex, native_index, state: int, offset: int) -> None:
    is_start, members = native_index.lexer_members(state)
    other, pieces = [], []
    if not is_start and not index.grammar.greedy:
        for terminal, q in zip(members[::2], members[1::2]):
            rest_of_member, found = _split(index, native_index, terminal, q, offset)
            pieces += found
            if rest_of_member != DEAD:
                other += [terminal, rest_of_member]
    native_index.set_pieces(state, offset, np.asarray(other, dtype=np.int32), pieces)


def _split(index: CFGIndex, native_index, terminal: int, state: int, offset: int) -> tuple[int, list]:
    """One member: (the automaton state of its parts that are no piece, or DEAD; [(terminal, tokens id, low, high
    or -1, rest state)]). Where the plain walk is the one to take, the member whole and no pieces."""
    dfa = index.lexer.dfas[terminal]
    with dfa.lock:
        found, others = split_pieces(dfa.terms, dfa.term_of(state), index.tables.piece_facts)
    pieces = []
    for piece in found:
        tokens = piece.facts.at(offset)
        rest = dfa.state_of_term(piece.rest)
        # no facts at offset 0, or a rest that may be empty (the lexeme could end at any unit boundary: exits
        # the facts do not list)
        if tokens is None or rest == DEAD or dfa.accepting[rest]:
            return state, []
        pieces.append((terminal, _tokens_id(index, native_index, tokens), piece.low,
                       -1 if piece.high is None else piece.high, rest))
    if not pieces:
        return state, []
    with dfa.lock:
        return (dfa.state_of_term(dfa.terms.alt(others)) if others else DEAD), pieces


def _tokens_id(index: CFGIndex, native_index, tokens) -> int:
    """The native id of one piece's token facts in this grammar's index (registered on first use)."""
    known = index.piece_tokens_ids.get(id(tokens))
    if known is None:
        nodes, units = tokens.crossing_nodes(index.tables.trie, index.vocab.token_bytes)
        never = tokens.never_exits.view(np.uint8)
        known = index.piece_tokens_ids[id(tokens)] = (tokens, native_index.add_piece_tokens(
            tokens.unbounded_words, tokens.units, never, nodes, units, tokens.max_units))
    return known[1]

"""The token-trie walk in native code: a state's mask at native speed, derivations included, with the GIL
released for the whole walk, so a mask is computed while the model runs.

The walk is one pass over the vocabulary trie (``token_trie.py``, nodes numbered in preorder) from one DFA state
(``corral/csrc/terms.cpp``, ``Dfa::walk_trie``): each node looks the move on its byte up in the automaton's rows,
from the state its parent reached, deriving it in place when it is not built yet; a dead move skips the node's whole
subtree, a live one lists the tokens that end at the node and goes on below it. The walk never calls Python. What
needs the vocabulary's piece facts (``token_pieces.py``) is registered between walks:

- whether a wide state (one whose first bytes are many; a narrow one is plain without asking) holds repeat pieces;
- for a state holding pieces, met after ``depth`` bytes of a token: the pieces' shared mask at that depth and the
  state of the other members. The node's subtree takes its tokens from the mask and the pass goes on below it in
  the other members' state.

A walk that meets a wide state or a depth nobody has registered walks that subtree plainly (the same tokens, found
node by node) and returns it; :meth:`NativeWalk.walk` then registers it, so the walks after take the pieces. No node
is visited twice in a walk. Its work is bounded: ``fuel`` caps the new terms one mask may derive (the walk and the
registrations after it, which spend what the walk left), and the
automaton's state cap and the table's term cap hold as well; past one, the walk raises
:class:`~corral.errors.GrammarTooComplexError` (the native ``LimitError``) naming the limit. The registered answers
count in the grammar's memory, and past 4,096 exact ones a flag set registers "walk plainly" instead (terms.cpp,
``MAX_EXACT_ANSWERS``). The trie is copied into the native module once per vocabulary and checked there (preorder,
depths, id ranges), so a walk never reads out of bounds. Why: the trie walk in numpy costs a few us per numpy call
and per trie level, and deriving the moves in Python cost about as much again; the first masks of wide states were
the slow tail of time-between-masks. Without the native module (``CORRAL_NATIVE=off``) the automaton is the Python
one and the Python walk is used.

The same code walks tokens one by one (:func:`walk_tokens`) for the walks that are per token rather than per
trie node: a piece's facts over the whole vocabulary, and the tokens that cross a piece's end into its rest.
"""

import threading
from contextlib import contextmanager

import numpy as np

from corral import native

FLAG_PLAIN, FLAG_PIECES = 1, 2
INHERIT_FUEL = -2  # walk_trie's fuel argument: spend what this thread's mask has left

_mask_scope = threading.local()


@contextmanager
def mask_fuel(fuel: int):
    """Everything this thread derives natively inside the block (walks, rows, registrations) spends one fuel of
    ``fuel`` new terms (-1: no cap). Nested blocks (a mask computed while computing another) share the outer one,
    so a mask's fuel covers the masks it is made from."""
    if getattr(_mask_scope, "active", False):
        yield
        return
    module = native.module()
    before, before_given = module.set_thread_fuel(fuel, fuel)
    _mask_scope.active = True
    try:
        yield
    finally:
        _mask_scope.active = False
        module.set_thread_fuel(before, before_given)


def available(dfa) -> bool:
    """Whether ``dfa`` is a native automaton, which the native walks need."""
    return hasattr(dfa, "native")


class NativeTrie:
    """The trie's arrays in the layout the C++ walk reads (built once per vocabulary)."""

    def __init__(self, trie, num_words: int):
        """``num_words``: the int32 words of a bitmask row over the whole vocabulary."""
        self.trie = trie
        # the ids that end exactly at node n lead its preorder run: subtree_ids[subtree_start[n]:own_end[n]]
        own_counts = (trie.node_token >= 0).astype(np.int64)
        for node, extra in trie.duplicate_ids.items():
            own_counts[node] += len(extra)
        own_start = np.ascontiguousarray(trie.subtree_start, dtype=np.int64)
        self.native = native.module().Trie(
            np.ascontiguousarray(trie.node_byte, dtype=np.int32), np.ascontiguousarray(trie.depth, dtype=np.int32),
            np.ascontiguousarray(trie.subtree_end_node, dtype=np.int32),
            np.where(own_counts > 1, -2, trie.node_token).astype(np.int32), own_start, own_start + own_counts,
            np.ascontiguousarray(trie.subtree_end, dtype=np.int64),
            np.ascontiguousarray(trie.subtree_ids, dtype=np.int32),
            trie.children(np.zeros(1, dtype=np.int64)).astype(np.int32), num_words)
        self.num_words = num_words


class NativeWalk:
    """One token index's walks over its native automaton, with the state flags it has settled (a flag set of the
    automaton, since the flags depend on the vocabulary's piece facts)."""

    def __init__(self, native: NativeTrie, index, fuel: int = -1):
        """``fuel``: the new terms one walk may derive (-1: no cap)."""
        self.native, self.index, self.fuel = native, index, fuel
        self.flag_set = index.dfa.native.new_flag_set(native.num_words)

    def walk(self, state: int) -> np.ndarray:
        """The uint32 bitmask words of the tokens whose bytes, walked from ``state``, never hit a dead move;
        pieces met below the root resolve from their shared facts, as the Python walk does. The registrations after
        the walk spend the fuel it left: the whole mask is under one fuel."""
        dfa = self.index.dfa
        words = np.zeros(self.native.num_words, dtype=np.uint32)
        with dfa.lock, mask_fuel(self.fuel):
            try:
                unregistered, _ = dfa.native.walk_trie(self.native.native, state, self.flag_set, words, INHERIT_FUEL)
            finally:
                dfa.refresh()
            try:
                for met, depth in unregistered:
                    self._register(met, depth)
            finally:
                dfa.refresh()
        return words

    def _register(self, state: int, depth: int) -> None:
        """Settle whether ``state`` holds repeat pieces, and if it does, its answer after ``depth`` bytes: the
        state of the other members (``DEAD`` when none) and the pieces' mask words at that depth (None when a
        piece's facts are not exact there: then it is walked plainly)."""
        index, native = self.index, self.index.dfa.native
        split = index.piece_split(state)
        native.set_flag(self.flag_set, state, FLAG_PLAIN if split is None else FLAG_PIECES)
        if split is None:
            return
        pieces, other_state = split
        allowed = None
        for piece in pieces:
            piece_words = index.piece_words(piece, depth)
            if piece_words is None:
                allowed = None
                break
            allowed = piece_words if allowed is None else allowed | piece_words
        native.set_piece_answer(self.flag_set, state, depth, other_state, allowed)
        index.dfa.refresh()


def walk_tokens(dfa, byte_matrix: np.ndarray, lengths: np.ndarray, ids: np.ndarray, offsets: np.ndarray,
                start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Walk each token of ``ids`` from its byte ``offsets[k]`` on through the native ``dfa`` from state ``start``,
    deriving moves as they are met. Per token: the bytes taken at ``start`` (int32), where a dead move came (int32,
    -1 never), and whether that was at ``start`` (bool). ``byte_matrix`` (uint8) and ``lengths`` (int32) are the
    vocabulary's, C-contiguous."""
    n = len(ids)
    ids_offsets = np.empty((2, n), dtype=np.int64)
    ids_offsets[0], ids_offsets[1] = ids, offsets
    out = np.empty((3, n), dtype=np.int32)
    if n:
        with dfa.lock:
            dfa.native.walk_tokens(byte_matrix, lengths, ids_offsets, start, out)
            dfa.refresh()
    return out[0], out[1], out[2].astype(bool)


"""The token-trie walk in native code: a state's mask at native speed, derivations included.

The walk is one pass over the vocabulary trie (``token_trie.py``, nodes numbered in preorder) from one DFA state
(``term_table.cpp``, ``Dfa::walk_trie``): each node looks the move on its byte up in the automaton's rows, from the
state its parent reached, deriving it in place when it is not built yet; a dead move skips the node's whole
subtree, a live one lists the tokens that end at the node and goes on below it. Python is called only for what
needs the vocabulary's piece facts:

- a node with children reached in a wide state not yet flagged (a state whose first bytes are few is plain
  without asking): Python settles whether it holds repeat pieces (``token_pieces.py``);
- a node reached in a state that holds pieces: Python answers, for that state and depth, the pieces' shared mask
  and the state of the other members; the node's subtree takes its tokens from the mask and the pass goes on
  below it in the other members' state. Answers are kept for the rest of the pass (by state and depth).

So a walk costs one native pass over the live part of the trie and one call per wide state and piece met; no
node is visited twice. Why: the trie walk in numpy costs a few us per numpy call and per trie level, and deriving
the moves in Python cost about as much again; the first masks of wide states were the slow tail of
time-between-masks. Without a C++ compiler (``CORRAL_CPU_KERNELS=0``) the automaton is the Python one and the
Python walk is used.

The same code walks tokens one by one (:func:`walk_tokens`) for the walks that are per token rather than per
trie node: a piece's facts over the whole vocabulary, and the tokens that cross a piece's end into its rest.
"""

import threading

import numpy as np

FLAG_PLAIN, FLAG_PIECES = 1, 2


def available(dfa) -> bool:
    """Whether ``dfa`` is a native automaton, which the native walks need."""
    return hasattr(dfa, "native")


def _ptr(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


class NativeTrie:
    """The trie's arrays in the layout the C++ walk reads (built once per vocabulary)."""

    def __init__(self, trie, num_words: int):
        """``num_words``: the int32 words of a bitmask row over the whole vocabulary."""
        assert int(trie.depth.max()) < 1000, "a token longer than the walk's depth stack"
        self.trie = trie
        self.node_byte = np.ascontiguousarray(trie.node_byte, dtype=np.int32)
        self.node_depth = np.ascontiguousarray(trie.depth, dtype=np.int32)
        self.node_end = np.ascontiguousarray(trie.subtree_end_node, dtype=np.int32)
        # the ids that end exactly at node n lead its preorder run: subtree_ids[subtree_start[n]:own_end[n]]
        own_counts = (trie.node_token >= 0).astype(np.int64)
        for node, extra in trie.duplicate_ids.items():
            own_counts[node] += len(extra)
        self.own_start = np.ascontiguousarray(trie.subtree_start, dtype=np.int64)
        self.own_end = self.own_start + own_counts
        self.own_ids = np.ascontiguousarray(trie.subtree_ids, dtype=np.int32)
        self.node_token = np.where(own_counts > 1, -2, trie.node_token).astype(np.int32)
        self.subtree_end = np.ascontiguousarray(trie.subtree_end, dtype=np.int64)
        self.roots = trie.children(np.zeros(1, dtype=np.int64)).astype(np.int32)
        self.num_words = num_words
        self.pointers = [_ptr(a) for a in (self.node_byte, self.node_depth, self.node_end, self.node_token,
                                           self.own_start, self.own_end, self.subtree_end, self.own_ids,
                                           self.roots)]
        self._local = threading.local()

    def buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """This thread's scratch of the walk, shared by every grammar's: the output words and the tokens found
        (every token at most once, and one spare)."""
        held = getattr(self._local, "buffers", None)
        if held is None:
            held = self._local.buffers = (np.zeros(self.num_words, dtype=np.uint32),
                                          np.empty(len(self.own_ids) + 1, dtype=np.int32))
        return held


class NativeWalk:
    """One token index's walks over its native automaton: the state flags it has settled (a flag set of the
    automaton, since the flags depend on the vocabulary's piece facts), and per thread the pass's buffers."""

    def __init__(self, native: NativeTrie, index):
        self.native, self.index = native, index
        self.flag_set = index.dfa.native.new_flag_set()
        self._local = threading.local()

    def _flag(self, state: int) -> int:
        return FLAG_PIECES if self.index.piece_split(state) is not None else FLAG_PLAIN

    def walk(self, state: int) -> np.ndarray:
        """The uint32 bitmask words of the tokens whose bytes, walked from ``state``, never hit a dead move;
        pieces met below the root resolve from their shared facts, as the Python walk does."""
        run = getattr(self._local, "run", None)
        if run is None:
            run = self._local.run = _Pass(self)
        dfa = self.index.dfa
        run.words.fill(0)
        with dfa.lock:
            dfa.native.walk_trie(run.setup_pointer, state, self.flag_set, self._flag, run.on_piece)
            dfa.refresh()
        return run.words.copy()


class _Pass:
    """One thread's state for the passes of a :class:`NativeWalk`: the arrays the native side reads."""

    def __init__(self, walk: NativeWalk):
        self.walk = walk
        native = walk.native
        self.words, found = native.buffers()  # the pass's output (copied out after it), and its scratch
        self.setup = np.asarray(native.pointers + [len(native.roots), _ptr(self.words), _ptr(found)],
                                dtype=np.int64)
        self.setup_pointer = _ptr(self.setup)

    def on_piece(self, state: int, depth: int) -> tuple[int, np.ndarray | None]:
        """The pass reached a state holding repeat pieces after ``depth`` bytes: the state of the other members
        (``DEAD`` when none) and the pieces' mask words at that depth (None when a piece's facts are not exact
        there: then it walks on plainly)."""
        index = self.walk.index
        pieces, other_state = index.piece_split(state)
        allowed = None
        for piece in pieces:
            piece_words = index.piece_words(piece, depth)
            if piece_words is None:
                allowed = None
                break
            allowed = piece_words if allowed is None else allowed | piece_words
        return other_state, allowed  # the pass holds the mask until it ends


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


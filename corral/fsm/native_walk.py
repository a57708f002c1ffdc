"""The token-trie walk in C++: a state's mask at native speed, with the lazy DFA still derived in Python.

The walk is one pass over the vocabulary trie (``token_trie.py``, nodes numbered in preorder) from one DFA state:
each node looks the move on its byte up in the lazy DFA's ``trans`` table, from the state its parent reached; a
dead move skips the node's whole subtree, a live one lists the tokens that end at the node and goes on below it.
Two things need Python, and the pass calls back into it where they come up, then goes on:

- a move the lazy DFA has not derived yet, or one into a state not yet looked at: Python derives the move's byte
  class and settles whether the state it leads to holds repeat pieces (``token_pieces.py``);
- a node reached in a state that holds pieces: Python answers, for that state and depth, the pieces' shared mask
  and the state of the other members; the node's subtree takes its tokens from the mask and the pass goes on
  below it in the other members' state. Answers are kept for the rest of the pass (by state and depth).

So a walk costs one native pass over the live part of the trie, one Python derivation per new move (the same
derivations the Python walk makes) and one call per piece met; no node is visited twice.

Why: the trie walk in numpy costs a few µs per numpy call and per trie level; the first mask of a wide state (a
string body under a pattern, the start of any JSON value) took milliseconds that way, and those first masks are
the slow tail of time-between-masks. An earlier form of this walk handed unknown moves back in batches and
resumed from them; its Python bookkeeping between rounds cost more than the pass. Without a C++ compiler
(``CORRAL_CPU_KERNELS=0``) the Python walk is used.

State flags (``int8`` per DFA state): 0 not yet asked, 1 plain, 2 holds repeat pieces.

The same library walks tokens one by one (:func:`walk_tokens`) for the walks that are per token rather than per
trie node: a piece's facts over the whole vocabulary, and the tokens that cross a piece's end into its rest.
"""

import ctypes
import threading

import numpy as np

from corral.kernels.cpu_build import CompiledLibrary

FLAG_UNKNOWN, FLAG_PLAIN, FLAG_PIECES = 0, 1, 2
_FAILED = -4  # a callback raised: the pass stops and Python re-raises

_SOURCE = r"""
#include <cstdint>
#include <unordered_map>
#include <utility>

typedef int32_t (*move_fn)(int32_t state, int32_t byte, int32_t flag_it);
typedef int32_t (*piece_fn)(int32_t state, int32_t depth);

// Nodes are numbered in preorder, so the subtree of node n is the run n .. end[n] - 1 and a walk is one pass
// over it: a node's parent state sits in a per-depth stack, a dead move skips the whole subtree.
// ctx: [0] trans [rows, 256] (UNBUILT -3, DEAD -1), [1] flags [rows], [2] the mask of the last piece answer (0
// when the pieces are not exact there), [3] the status (0, or -4 when a callback failed); the callbacks may
// reallocate trans and flags, so both are read again after each. node_token: the id ending at the node, -1
// none, -2 several (then own_ids[own_start[n]:own_end[n]]); own_ids[own_start[n]:subtree_end[n]] are all the
// ids at or below n.
// setup: the addresses of node_byte, node_depth, node_end, node_token (int32), own_start, own_end, subtree_end
// (int64), own_ids, roots (int32), then n_roots, then words (uint32, or-ed into) and found (int32 scratch).
// One array instead of seventeen arguments: ctypes converts each argument of each call.
extern "C" void walk_trie(const int64_t* setup, int64_t* ctx, int32_t state, move_fn move, piece_fn piece) {
    const int32_t* node_byte = reinterpret_cast<const int32_t*>(setup[0]);
    const int32_t* node_depth = reinterpret_cast<const int32_t*>(setup[1]);
    const int32_t* node_end = reinterpret_cast<const int32_t*>(setup[2]);
    const int32_t* node_token = reinterpret_cast<const int32_t*>(setup[3]);
    const int64_t* own_start = reinterpret_cast<const int64_t*>(setup[4]);
    const int64_t* own_end = reinterpret_cast<const int64_t*>(setup[5]);
    const int64_t* subtree_end = reinterpret_cast<const int64_t*>(setup[6]);
    const int32_t* own_ids = reinterpret_cast<const int32_t*>(setup[7]);
    const int32_t* roots = reinterpret_cast<const int32_t*>(setup[8]);
    const int64_t n_roots = setup[9];
    uint32_t* words = reinterpret_cast<uint32_t*>(setup[10]);
    int32_t* found = reinterpret_cast<int32_t*>(setup[11]);
    int64_t* status = ctx + 3;
    const int32_t* trans = reinterpret_cast<const int32_t*>(ctx[0]);
    const int8_t* flags = reinterpret_cast<const int8_t*>(ctx[1]);
    std::unordered_map<int64_t, std::pair<const uint32_t*, int32_t>> answers;
    int32_t stack[1024];
    int64_t n_found = 0;
    status[0] = 0;
    for (int64_t p = 0; p < n_roots; ++p) {
        const int32_t top = roots[p], end = node_end[top], base = node_depth[top] - 1;
        stack[0] = state;
        int32_t i = top;
        while (i < end) {
            const int32_t level = node_depth[i] - base;  // 1 at top
            const int32_t parent = stack[level - 1];
            int32_t t = trans[int64_t(parent) * 256 + node_byte[i]];
            int8_t flag = t >= 0 ? flags[t] : 0;
            const bool leaf = node_end[i] == i + 1;  // only a node with children needs its state's flag
            if (__builtin_expect(t == -3 || (t >= 0 && flag == 0 && !leaf), 0)) {
                t = move(parent, node_byte[i], !leaf);
                if (t == -4) { status[0] = -4; return; }
                trans = reinterpret_cast<const int32_t*>(ctx[0]);
                flags = reinterpret_cast<const int8_t*>(ctx[1]);
                flag = t >= 0 ? flags[t] : 0;
            }
            if (t < 0) {
                i = node_end[i];
                continue;
            }
            const int32_t id = node_token[i];
            found[n_found] = id;  // listed now, set below: bits or-ed in here, in trie order, stalled the walk
            n_found += id >= 0;
            if (__builtin_expect(id == -2, 0)) {
                for (int64_t j = own_start[i]; j < own_end[i]; ++j) found[n_found++] = own_ids[j];
            }
            stack[level] = t;
            if (__builtin_expect(flag == 2, 0)) {
                const int64_t key = (int64_t(t) << 16) | node_depth[i];
                auto known = answers.find(key);
                if (known == answers.end()) {
                    const int32_t other = piece(t, node_depth[i]);
                    if (other == -4) { status[0] = -4; return; }
                    trans = reinterpret_cast<const int32_t*>(ctx[0]);
                    flags = reinterpret_cast<const int8_t*>(ctx[1]);
                    const uint32_t* mask = reinterpret_cast<const uint32_t*>(ctx[2]);
                    known = answers.emplace(key, std::make_pair(mask, other)).first;
                }
                const uint32_t* allowed = known->second.first;
                if (allowed != nullptr) {  // exact: the subtree from the pieces' mask, below it the other members
                    for (int64_t j = own_start[i]; j < subtree_end[i]; ++j) {
                        const int32_t below = own_ids[j];
                        words[below >> 5] |= allowed[below >> 5] & (1u << (below & 31));
                    }
                    if (known->second.second < 0) {
                        i = node_end[i];
                        continue;
                    }
                    stack[level] = known->second.second;
                }
            }
            ++i;
        }
    }
    for (int64_t j = 0; j < n_found; ++j) words[found[j] >> 5] |= 1u << (found[j] & 31);
}

// Each token's bytes from offsets[k] on, walked from state `start` until a dead move: units[k] counts the bytes
// taken at `start`, exits[k] is where it died (-1 never), at_start[k] (0/1) whether it died at `start`. tokens is
// the [*, width] byte matrix; ids_offsets is ids[n] then offsets[n]; out is units[n], exits[n], at_start[n].
// ctx: [0] trans as walk_trie's, [1] the status; move as walk_trie's (its flag argument unused).
extern "C" void walk_tokens(int64_t* ctx, const uint8_t* tokens, int64_t width, const int32_t* lengths,
                            const int64_t* ids_offsets, int64_t n, int32_t start, int32_t* out, move_fn move) {
    const int32_t* trans = reinterpret_cast<const int32_t*>(ctx[0]);
    const int64_t* ids = ids_offsets;
    const int64_t* offsets = ids_offsets + n;
    int32_t* units = out;
    int32_t* exits = out + n;
    int32_t* at_start = out + 2 * n;
    ctx[1] = 0;
    for (int64_t k = 0; k < n; ++k) {
        const int64_t id = ids[k];
        const uint8_t* bytes = tokens + id * width;
        int32_t state = start, count = 0;
        exits[k] = -1;
        at_start[k] = 0;
        for (int32_t depth = int32_t(offsets[k]); depth < lengths[id]; ++depth) {
            int32_t next = trans[int64_t(state) * 256 + bytes[depth]];
            if (next == -3) {
                next = move(state, bytes[depth], 0);
                if (next == -4) { ctx[1] = -4; return; }
                trans = reinterpret_cast<const int32_t*>(ctx[0]);
            }
            if (next < 0) {
                exits[k] = depth;
                at_start[k] = state == start;
                break;
            }
            count += state == start;
            state = next;
        }
        units[k] = count;
    }
}
"""

_P = ctypes.c_void_p
MOVE = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32)
PIECE = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int32, ctypes.c_int32)
_LIBRARY = CompiledLibrary("trie_walk", _SOURCE, {
    "walk_trie": [_P, _P, ctypes.c_int32, MOVE, PIECE],
    "walk_tokens": [_P, _P, ctypes.c_int64, _P, _P, ctypes.c_int64, ctypes.c_int32, _P, MOVE],
})


def library():
    """The compiled walk, or None (no compiler, or ``CORRAL_CPU_KERNELS=0``)."""
    return _LIBRARY.load()


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
    """One DFA's walks (per TokenIndex): the state flags it has settled so far. Each thread has its own pass
    state (:class:`_Pass`), so walks of one grammar may run in several threads at once."""

    def __init__(self, lib, native: NativeTrie, index):
        self.lib, self.native, self.index = lib, native, index
        self.flags = np.zeros(64, dtype=np.int8)
        self._local = threading.local()

    def _grow_flags(self, size: int) -> None:
        grown = np.zeros(max(2 * len(self.flags), size), dtype=np.int8)
        grown[:len(self.flags)] = self.flags
        self.flags = grown

    def _flag(self, state: int) -> int:
        if state >= len(self.flags):
            self._grow_flags(state + 1)
        flag = self.flags[state]
        if flag == FLAG_UNKNOWN:
            flag = self.flags[state] = FLAG_PIECES if self.index.piece_split(state) is not None else FLAG_PLAIN
        return int(flag)

    def walk(self, state: int) -> np.ndarray:
        """The uint32 bitmask words of the tokens whose bytes, walked from ``state``, never hit a dead move;
        pieces met below the root resolve from their shared facts, as the Python walk does."""
        run = getattr(self._local, "run", None)
        if run is None:
            run = self._local.run = _Pass(self)
        run.point()
        words = run.words
        words.fill(0)
        try:
            self.lib.walk_trie(run.setup_pointer, run.context_pointer, state, run.move, run.piece)
        finally:
            run.answers.clear()
        if run.context[3] == _FAILED:
            error, run.error = run.error, None
            raise error
        return words.copy()


class _Pass:
    """One thread's state for the passes of a :class:`NativeWalk`: the context the C++ side reads, the arrays it
    points at (held while a pass may read them), the piece masks handed to it, an error a callback caught, and
    the callbacks themselves (kept alive here: C holds only their addresses)."""

    def __init__(self, walk: NativeWalk):
        self.walk = walk
        self.context = np.zeros(4, dtype=np.int64)
        self.context_pointer = _ptr(self.context)
        self.trans: np.ndarray | None = None
        self.flags: np.ndarray | None = None
        self.answers: list[np.ndarray] = []
        self.error: BaseException | None = None
        self.move = MOVE(self.on_move)
        self.piece = PIECE(self.on_piece)
        native = walk.native
        self.words, found = native.buffers()  # the pass's output (copied out after it), and its scratch
        self.setup = np.asarray(native.pointers + [len(native.roots), _ptr(self.words), _ptr(found)],
                                dtype=np.int64)
        self.setup_pointer = _ptr(self.setup)

    def point(self) -> None:
        """Point the pass at the current ``trans`` and flags (either may have been reallocated); the flags
        cover every row, since the pass reads the flag of any state a move leads to."""
        walk = self.walk
        trans = walk.index.dfa.trans
        if len(walk.flags) < len(trans):
            walk._grow_flags(len(trans))
        if trans is not self.trans:
            self.trans = trans
            self.context[0] = _ptr(trans)
        if walk.flags is not self.flags:
            self.flags = walk.flags
            self.context[1] = _ptr(self.flags)

    def on_move(self, state: int, byte: int, flag_it: int) -> int:
        """The pass met an underived move, or one into a state it has no flag for: derive it and, when the pass
        goes on below (``flag_it``), flag the state it leads to. A token's last byte needs no flag: whether a
        state holds pieces only changes how the subtree below is walked."""
        try:
            following = self.walk.index.dfa.next_state(state, byte)
            if following >= 0 and flag_it:
                self.walk._flag(following)
            self.point()
            return following
        except BaseException as error:  # noqa: BLE001 - must not unwind through C; re-raised by walk()
            self.error = error
            return _FAILED

    def on_piece(self, state: int, depth: int) -> int:
        """The pass reached a state holding repeat pieces after ``depth`` bytes: point it at the pieces' mask at
        that depth (0 when a piece's facts are not exact there: then it walks on plainly) and return the state
        of the other members (``DEAD`` when none)."""
        try:
            index = self.walk.index
            pieces, other_state = index.piece_split(state)
            allowed = None
            for piece in pieces:
                piece_words = index.piece_words(piece, depth)
                if piece_words is None:
                    allowed = None
                    break
                allowed = piece_words if allowed is None else allowed | piece_words
            if allowed is None:
                self.context[2] = 0
            else:
                self.answers.append(allowed)  # piece_words' cache may drop it before the pass ends
                self.context[2] = _ptr(allowed)
            self.point()
            return other_state
        except BaseException as error:  # noqa: BLE001 - must not unwind through C; re-raised by walk()
            self.error = error
            return _FAILED


def walk_tokens(lib, dfa, byte_matrix: np.ndarray, lengths: np.ndarray, ids: np.ndarray, offsets: np.ndarray,
                start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Walk each token of ``ids`` from its byte ``offsets[k]`` on through ``dfa`` from state ``start``, deriving
    moves as they are met. Per token: the bytes taken at ``start`` (int32), where a dead move came (int32, -1
    never), and whether that was at ``start`` (bool). ``byte_matrix`` (uint8) and ``lengths`` (int32) are the
    vocabulary's, C-contiguous; they are long-lived, so their addresses are looked up once."""
    held = [dfa.trans]  # what C reads: kept alive here, and swapped when a derivation reallocates it
    context = np.asarray([_ptr(held[0]), 0], dtype=np.int64)
    error = []

    def on_move(state: int, byte: int, _flag_it: int) -> int:
        try:
            following = dfa.next_state(state, byte)
            if dfa.trans is not held[0]:
                held[0] = dfa.trans
                context[0] = _ptr(held[0])
            return following
        except BaseException as exc:  # noqa: BLE001 - must not unwind through C; re-raised below
            error.append(exc)
            return _FAILED

    callback = MOVE(on_move)
    n = len(ids)
    ids_offsets = np.empty((2, n), dtype=np.int64)
    ids_offsets[0], ids_offsets[1] = ids, offsets
    out = np.empty((3, n), dtype=np.int32)
    lib.walk_tokens(_ptr(context), _vocab_pointer(byte_matrix, np.uint8), byte_matrix.shape[1],
                    _vocab_pointer(lengths, np.int32), _ptr(ids_offsets), n, start, _ptr(out), callback)
    if error:
        raise error[0]
    return out[0], out[1], out[2].astype(bool)


_VOCAB_ARRAYS: dict[int, tuple[np.ndarray, int]] = {}


def _vocab_pointer(array: np.ndarray, dtype) -> int:
    """The address of a long-lived vocabulary array (held here, so its id is never reused while cached)."""
    known = _VOCAB_ARRAYS.get(id(array))
    if known is None or known[0] is not array:
        assert array.dtype == dtype and array.flags.c_contiguous, "a vocabulary array in the walk's layout"
        if len(_VOCAB_ARRAYS) >= 16:
            _VOCAB_ARRAYS.clear()
        known = _VOCAB_ARRAYS[id(array)] = (array, _ptr(array))
    return known[1]

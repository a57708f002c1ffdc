"""The token-trie walk in C++: a state's mask at native speed, with the lazy DFA still derived in Python.

The walk is one pass over the vocabulary trie (``token_trie.py``, nodes numbered in preorder) from one DFA state:
each node looks the move on its byte up in the lazy DFA's ``trans`` table, from the state its parent reached; a
dead move skips the node's whole subtree, a live one lists the tokens that end at the node and goes on below it.
The lazy DFA has not derived every move yet, and some states need Python's judgement (repeat pieces,
``token_pieces.py``), so the pass does not stop there: it hands such nodes back, Python derives the moves (or
fills the subtrees from the pieces' shared masks) and the pass resumes from exactly those nodes. Each resumption
only goes deeper, so a walk costs one native pass over the live part of the trie plus one Python derivation per
new move, the same derivations the Python walk made.

Why: the trie walk in numpy costs a few µs per numpy call and per trie level; the first mask of a wide state (a
string body under a pattern, the start of any JSON value) took milliseconds that way, and those first masks are
the slow tail of time-between-masks. Without a C++ compiler (``CORRAL_CPU_KERNELS=0``) the Python walk is used.

State flags (``int8`` per DFA state): 0 not yet asked, 1 plain, 2 holds repeat pieces (the walk stops there).
"""

import ctypes
import threading

import numpy as np

from corral.kernels.cpu_build import CompiledLibrary

FLAG_UNKNOWN, FLAG_PLAIN, FLAG_PIECES = 0, 1, 2

_SOURCE = r"""
#include <cstdint>

// Nodes are numbered in preorder, so the subtree of node n is the run n .. end[n] - 1 and a walk is one pass
// over it: a node's parent state sits in a per-depth stack, a dead move skips the whole subtree.
// trans is [rows, 256], flags [rows]; UNBUILT is -3, DEAD -1. node_token: the id ending at the node, -1 none,
// -2 several (then own_ids[own_start[n]:own_end[n]]). Input: (node, state of its parent) pairs, one subtree each.
extern "C" void walk_trie(
    const int32_t* trans, const int8_t* flags,
    const int32_t* node_byte, const int32_t* node_depth, const int32_t* node_end, const int32_t* node_token,
    const int64_t* own_start, const int64_t* own_end, const int32_t* own_ids,
    const int32_t* in_node, const int32_t* in_state, int64_t n_in,
    uint32_t* words, int32_t* found,
    int32_t* pend_node, int32_t* pend_state, int32_t* special_node, int32_t* special_state, int64_t* counts) {
    int32_t stack[1024];
    int64_t n_pend = 0, n_special = 0, n_found = 0;
    for (int64_t p = 0; p < n_in; ++p) {
        const int32_t top = in_node[p], end = node_end[top], base = node_depth[top] - 1;
        stack[0] = in_state[p];
        int32_t i = top;
        while (i < end) {
            const int32_t level = node_depth[i] - base;  // 1 at top
            const int32_t parent = stack[level - 1];
            const int32_t t = trans[int64_t(parent) * 256 + node_byte[i]];
            stack[level] = t;
            if (t == -1) {
                i = node_end[i];
                continue;
            }
            const int8_t flag = t < 0 ? 0 : flags[t];
            if (__builtin_expect(flag != 1, 0)) {
                if (flag == 0) {  // not derived yet, or a state Python has not looked at: hand it back
                    pend_node[n_pend] = i;
                    pend_state[n_pend] = parent;
                    ++n_pend;
                    i = node_end[i];
                    continue;
                }
                special_node[n_special] = i;  // holds repeat pieces: Python fills the subtree
                special_state[n_special] = t;
                ++n_special;
            }
            const int32_t id = node_token[i];
            found[n_found] = id;  // listed now, set below: bits or-ed in here, in trie order, stalled the walk
            n_found += id >= 0;
            if (__builtin_expect(id == -2, 0)) {
                for (int64_t j = own_start[i]; j < own_end[i]; ++j) found[n_found++] = own_ids[j];
            }
            i = flag == 1 ? i + 1 : node_end[i];
        }
    }
    for (int64_t j = 0; j < n_found; ++j) words[found[j] >> 5] |= 1u << (found[j] & 31);
    counts[0] = n_pend;
    counts[1] = n_special;
}

// For each node: the tokens at or below it (one preorder run of ids) that ``allowed`` holds.
extern "C" void set_subtree_bits(uint32_t* words, const uint32_t* allowed, const int64_t* subtree_start,
                                 const int64_t* subtree_end, const int32_t* subtree_ids, const int32_t* nodes,
                                 int64_t n) {
    for (int64_t p = 0; p < n; ++p) {
        for (int64_t j = subtree_start[nodes[p]]; j < subtree_end[nodes[p]]; ++j) {
            const int32_t id = subtree_ids[j];
            words[id >> 5] |= allowed[id >> 5] & (1u << (id & 31));
        }
    }
}
"""

_P = ctypes.c_void_p
_I = ctypes.c_int64
_LIBRARY = CompiledLibrary("trie_walk", _SOURCE, {
    "walk_trie": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _P, _P, _P, _P, _P, _P, _P],
    "set_subtree_bits": [_P, _P, _P, _P, _P, _P, _I],
})


def library():
    """The compiled walk, or None (no compiler, or ``CORRAL_CPU_KERNELS=0``)."""
    return _LIBRARY.load()


def _ptr(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


class NativeTrie:
    """The trie's arrays in the layout the C++ walk reads (built once per vocabulary)."""

    def __init__(self, trie):
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
        self.num_nodes = trie.num_nodes
        self._local = threading.local()
        self.root_children = self.children(np.zeros(1, dtype=np.int64))
        self.pointers = [_ptr(a) for a in (self.node_byte, self.node_depth, self.node_end, self.node_token,
                                           self.own_start, self.own_end, self.own_ids)]
        self.subtree_pointers = [_ptr(a) for a in (self.own_start, self.subtree_end, self.own_ids)]

    def buffers(self) -> tuple[tuple[np.ndarray, ...], list[int]]:
        """This thread's buffers of the walk (tokens found, nodes handed back, counts; nodes and states in) and
        their addresses. A walk's inputs are disjoint subtrees and it hands back at most one entry per node."""
        held = getattr(self._local, "buffers", None)
        if held is None:
            arrays = (np.empty(len(self.own_ids) + 1, dtype=np.int32),  # every token at most once, and one spare
                      *(np.empty(self.num_nodes, dtype=np.int32) for _ in range(4)), np.zeros(2, dtype=np.int64),
                      *(np.empty(self.num_nodes, dtype=np.int32) for _ in range(2)))  # the walk's input
            held = self._local.buffers = (arrays, [_ptr(a) for a in arrays])
        return held

    def children(self, nodes: np.ndarray) -> np.ndarray:
        """The child nodes of ``nodes`` (int32, the walk's input type)."""
        return self.trie.children(nodes).astype(np.int32)


class NativeWalk:
    """One DFA's walks (per TokenIndex): the state flags it has settled so far."""

    def __init__(self, lib, native: NativeTrie, index):
        self.lib, self.native, self.index = lib, native, index
        self.flags = np.zeros(64, dtype=np.int8)

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

    def walk(self, state: int, words: np.ndarray) -> None:
        """OR into ``words`` (uint32 bitmask) the tokens whose bytes, walked from ``state``, never hit a dead
        move; pieces met below the root resolve from their shared facts, as the Python walk does."""
        native, dfa, lib = self.native, self.index.dfa, self.lib
        buffers, pointers = native.buffers()
        _, pend_node, pend_state, special_node, special_state, counts, in_node, in_state = buffers
        outputs = [_ptr(words), *pointers[:6]]
        in_pointers = pointers[6:]
        n_in = len(native.root_children)
        in_node[:n_in] = native.root_children
        in_state[:n_in] = state
        trans = trans_pointer = flags = flags_pointer = None
        while n_in:
            if dfa.trans is not trans:  # reallocated as the DFA grew
                trans = dfa.trans
                trans_pointer = _ptr(trans)
                if len(self.flags) < len(trans):  # the walk reads a flag for every row
                    self._grow_flags(len(trans))
            if self.flags is not flags:
                flags = self.flags
                flags_pointer = _ptr(flags)
            lib.walk_trie(trans_pointer, flags_pointer, *native.pointers, *in_pointers, n_in, *outputs)
            n_pend, n_special = int(counts[0]), int(counts[1])
            next_nodes, next_states = [], []
            if n_pend:
                ns, ss = pend_node[:n_pend].copy(), pend_state[:n_pend].copy()
                pairs = np.unique((ss.astype(np.int64) << 8) | native.node_byte[ns])  # many nodes, few moves
                for pair in pairs.tolist():
                    following = dfa.next_state(pair >> 8, pair & 255)
                    if following >= 0:
                        self._flag(following)
                next_nodes.append(ns)
                next_states.append(ss)
            if n_special:
                self._resolve(special_node[:n_special].copy(), special_state[:n_special].copy(), words,
                              next_nodes, next_states)
            n_in = 0
            for nodes_part, states_part in zip(next_nodes, next_states):  # disjoint subtrees: at most one per node
                in_node[n_in:n_in + len(nodes_part)] = nodes_part
                in_state[n_in:n_in + len(nodes_part)] = states_part
                n_in += len(nodes_part)

    def _resolve(self, nodes: np.ndarray, states: np.ndarray, words: np.ndarray, next_nodes: list,
                 next_states: list) -> None:
        """Nodes reached in states that hold repeat pieces: the pieces' tokens below them come from the shared
        facts; the walk goes on below them in the state of the other members (or, when the facts are not exact
        at that depth, plainly in the state itself)."""
        index, native = self.index, self.native
        for state in np.unique(states).tolist():
            split = index.piece_split(state)
            in_state = nodes[states == state]
            depths = native.node_depth[in_state]
            exact, found = True, []
            for depth in np.unique(depths).tolist():
                at = np.ascontiguousarray(in_state[depths == depth])
                for piece in split[0]:
                    allowed = index.piece_words(piece, depth)
                    if allowed is None:
                        exact = False
                        break
                    found.append((allowed, at))
                if not exact:
                    break
            if exact:
                for allowed, at in found:
                    self.lib.set_subtree_bits(_ptr(words), _ptr(allowed), *native.subtree_pointers, _ptr(at), len(at))
                continue_state = split[1]
            else:
                continue_state = state  # walk below these nodes plainly, as if the state held no piece
            if continue_state < 0:
                continue
            below = native.children(in_state.astype(np.int64))
            if len(below):
                next_nodes.append(below)
                next_states.append(np.full(len(below), continue_state, dtype=np.int32))

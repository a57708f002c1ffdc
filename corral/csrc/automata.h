// What the context-free core (cfg.cpp) uses of terms.cpp: the vocabulary trie in its checked layout, and one
// terminal automaton's moves. Borrowed from the Python objects, which the caller keeps alive.
#pragma once

#include "common.h"

#include <cstdint>

namespace corral_native {

// One trie node as the context-free walk reads it: one stream of 12-byte records instead of four arrays.
struct TrieNode {
    int32_t end;         // the subtree is this node .. end - 1 (preorder)
    int32_t token;       // as node_token
    int32_t depth_byte;  // depth << 8 | byte
};

struct TrieView {
    const TrieNode* nodes;
    const int32_t* node_byte;
    const int32_t* node_depth;  // the root 0, its children 1, ...
    const int32_t* node_end;    // preorder: the subtree of node n is n .. node_end[n] - 1
    const int32_t* node_token;  // the id ending at the node, -1 none, -2 several (own_ids[own_start:own_end])
    const int32_t* own_ids;
    const int32_t* roots;       // the first-level nodes
    const int64_t* own_start;
    const int64_t* own_end;
    int64_t num_nodes, num_roots, num_words;
    const int64_t* subtree_end;  // own_ids[own_start[n]:subtree_end[n]] are the ids at or below node n
};

// False, with a TypeError set, when `object` is not a corral._native.Trie.
bool trie_view(PyObject* object, TrieView* out);

// A corral._native.Dfa's automaton, or null with a TypeError set.
void* dfa_of(PyObject* object);
// The move of `state` on `byte` (DEAD = -1 when the terminal cannot go on), derived when not built yet, under the
// automaton's table lock. `fuel`: the new terms the caller may still make (-1: no cap), decremented here; past it,
// or past the automaton's caps, throws PyFailure with LimitError set (`fuel_given` is named in the message).
int32_t dfa_next(void* dfa, int32_t state, int byte, int64_t* fuel, int64_t fuel_given);
bool dfa_accepting(void* dfa, int32_t state);
int32_t dfa_num_states(void* dfa);

void add_cfg(nb::module_& m);

}  // namespace corral_native

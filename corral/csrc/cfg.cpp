// The context-free core: cfg_guide.py's lexer, Earley parser and token walk in C++, behind a few coarse calls
// (a whole mask, a whole token's advance) that release the GIL and never call back into Python (but for the
// compile budget's clock, which the terminals' automata check while a grammar compiles).
//
// CfgIndex is what every session of one compiled grammar shares: the terminals' automata (terms.cpp's Dfa, one
// per terminal), the lexer's interned states and their byte moves, the productions, and per lexer state the
// *root walk*: the tokens whose bytes stay inside the lexeme (a bitmask row) and the trie nodes where the lexeme
// may end inside a token. CfgSession is one request's parse (shared by the copies of its guides): interned Earley
// sets (a parse state is the id of its last set), interned configurations (sets of readings (Earley set, lexer
// state)), their byte moves and their masks. The algorithm, its names and its error messages are those of
// cfg_guide.py, earley.py and cfg_lexer.py, which stay as the oracle the tests compare this with.
//
// Bounds: a lexer state cap per grammar, a configuration cap and an Earley item cap per session, and per call
// (one mask, one advance) a fuel of Earley work and as many new derivative terms in the terminals' automata; past
// one the call raises LimitError naming it.
//
// Threads: the Python side calls every entry point under the compiled grammar's lock (CFGIndex.lock), so the
// shared lexer is never mutated by two threads at once; the GIL is released for the whole call.

#include "automata.h"
#include "common.h"
#include "row_table.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace corral_native {
namespace {

constexpr int32_t DEAD = -1, UNBUILT = -3;
constexpr uint8_t ACCEPTING = 1, FORKS = 2, LAZY_END = 4;

using Ints = std::vector<int32_t>;  // sorted, distinct: a set of terminals

struct IntsHash {
    size_t operator()(const Ints& v) const {
        uint64_t h = 0xCBF29CE484222325ull ^ v.size();
        for (int32_t x : v) {
            h = (h ^ uint64_t(uint32_t(x))) * 0x100000001B3ull;
            h ^= h >> 29;
        }
        return size_t(h);
    }
};

Ints intersection(const Ints& a, const Ints& b) {
    Ints out;
    std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
    return out;
}

[[noreturn]] void limit(const std::string& message) {
    WithGil gil;
    PyErr_SetString(LimitError, message.c_str());
    throw PyFailure();
}

// A map from non-negative int64 keys to int32 values by open addressing: one probe is usually one cache line,
// where std::unordered_map's lookup chases a bucket and a node. Keys are never removed. With `stamped`, clear()
// forgets every key in O(1) (the slots of older generations count as free), for the per-mask sets.
struct FlatMap {
    std::vector<int64_t> keys;
    std::vector<int32_t> values;
    std::vector<uint32_t> stamps;
    uint32_t stamp = 1;
    size_t size = 0;

    static size_t slot_of(int64_t key, size_t mask) {  // splitmix64's finalizer: every key bit reaches the low bits
        uint64_t x = uint64_t(key);
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
        x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
        return size_t(x ^ (x >> 31)) & mask;
    }
    bool live(size_t k) const { return stamps[k] == stamp; }
    // The value of `key`, or null.
    const int32_t* find(int64_t key) const {
        if (keys.empty()) return nullptr;
        const size_t mask = keys.size() - 1;
        for (size_t k = slot_of(key, mask);; k = (k + 1) & mask) {
            if (!live(k)) return nullptr;
            if (keys[k] == key) return &values[k];
        }
    }
    // Inserts `key` with `value` unless present; whether it was inserted.
    bool insert(int64_t key, int32_t value) {
        if (2 * (size + 1) > keys.size()) rehash(std::max<size_t>(64, keys.size() * 2));
        const size_t mask = keys.size() - 1;
        for (size_t k = slot_of(key, mask);; k = (k + 1) & mask) {
            if (!live(k)) {
                keys[k] = key;
                values[k] = value;
                stamps[k] = stamp;
                ++size;
                return true;
            }
            if (keys[k] == key) return false;
        }
    }
    void clear() {
        if (++stamp == 0) {
            std::fill(stamps.begin(), stamps.end(), 0u);
            stamp = 1;
        }
        size = 0;
    }
    int64_t nbytes() const { return int64_t(keys.size()) * 16; }

  private:
    void rehash(size_t capacity) {
        std::vector<int64_t> old_keys(capacity, 0);
        std::vector<int32_t> old_values(capacity, 0);
        std::vector<uint32_t> old_stamps(capacity, 0u);
        old_keys.swap(keys);
        old_values.swap(values);
        old_stamps.swap(stamps);
        const uint32_t old_stamp = stamp;
        stamp = 1;
        size = 0;
        for (size_t k = 0; k < old_keys.size(); ++k)
            if (old_stamps[k] == old_stamp) insert(old_keys[k], old_values[k]);
    }
};

// ---------------------------------------------------------------------------------------------------- the lexer

// The walk of the trie below one node from one lexer state, within the lexeme: the tokens whose bytes (below
// the node) stay inside it, and the nodes where it may end inside a token. It depends on the node and the lexer
// state only, so one is kept per (node, state) for every session of the grammar; the root's is the mask of a
// lexeme's inside. Many tokens: a bitmask row; few: their ids.
struct SubWalk {
    Ints ids;
    std::vector<uint32_t> words;
    // The exits grouped by (lexer state before the byte, byte), which is all the parser is asked about: nodes
    // group_start[g] .. group_start[g + 1] - 1 of exit_node share group g's state and byte.
    Ints exit_node, group_state, group_start;
    std::vector<uint8_t> group_byte;
    std::vector<uint8_t> group_ends;  // the byte cannot go on in the lexeme (the lexeme surely ends before it)
    int64_t nbytes() const {  // the struct, its vectors' buffers and allocator overhead, and its map slot
        return int64_t(sizeof(SubWalk) + 32 * 7 + 32 + ids.capacity() * 4 + words.capacity() * 4 +
                       exit_node.capacity() * 4 + (group_state.capacity() + group_start.capacity()) * 4 +
                       group_byte.capacity() + group_ends.capacity());
    }
    void mark(uint32_t* out, int64_t num_words) const {
        if (!words.empty()) {
            for (int64_t w = 0; w < num_words; ++w) out[w] |= words[w];
        } else {
            for (int32_t id : ids) out[id >> 5] |= 1u << (id & 31);
        }
    }
    // keyed: (state << 41 | byte << 33 | ends << 32 | node), grouped by state and byte
    void group(std::vector<int64_t>& keyed) {
        std::sort(keyed.begin(), keyed.end());
        for (size_t k = 0; k < keyed.size(); ++k) {
            const int64_t key = keyed[k] >> 32;
            if (k == 0 || key != (keyed[k - 1] >> 32)) {
                group_state.push_back(int32_t(key >> 9));
                group_byte.push_back(uint8_t((key >> 1) & 255));
                group_ends.push_back(uint8_t(key & 1));
                group_start.push_back(int32_t(k));
            }
            exit_node.push_back(int32_t(keyed[k] & 0xFFFFFFFF));
        }
        group_start.push_back(int32_t(keyed.size()));
    }
};

struct Lexer {
    std::vector<void*> dfas;  // per terminal; null: a special token or a terminal no text matches
    Ints priority;
    std::vector<uint8_t> lazy, exact;
    std::vector<std::string> replay;  // per terminal: the text of its hidden stop, read again after it ends
    bool greedy = true;
    int64_t max_states = 200000, walk_budget = 64 << 20;
    int64_t term_fuel = -1, term_fuel_given = -1;  // new derivative terms this call may still make (-1: no cap)
    // What the memory accounting reads, kept as running totals: CFGIndex.nbytes() runs on other threads, without
    // the grammar's lock, so it must never walk the containers that a mask may be growing.
    std::atomic<int64_t> walk_bytes{0}, state_bytes{0};
    std::atomic<int32_t> num_states{0};

    std::vector<Ints> members;  // per state: terminal, automaton state, terminal, ... (terminals ascending)
    std::vector<Ints> accepts;  // per state: the terminals a lexeme ending here matches (top priority only)
    std::vector<uint8_t> is_start;
    std::vector<uint8_t> kind;  // per state: ACCEPTING | FORKS | LAZY_END
    RowTable moves{UNBUILT};  // [state * 256 + byte]
    std::unordered_map<Ints, int32_t, IntsHash> ids;     // members + is_start
    std::unordered_map<Ints, int32_t, IntsHash> starts;  // allowed terminals -> state
    std::deque<SubWalk> walks;  // kept sub-walks (a deque: references stay valid as it grows)
    FlatMap walk_ids;           // node * 2^18 + lexer state (the cap keeps states below 2^18) -> index in walks

    // Repeat pieces (token_pieces.py). A lexer state whose one terminal is inside X{lo,hi} R (a JSON string
    // body, the free-form member of a property-name alternation) would walk nearly the whole trie at the root,
    // and every position of a document is a new state. What a token does inside X* depends on X alone, so
    // Python registers, per such state, the pieces' shared token facts and the state of the other members
    // (set_pieces); the state's root walk is then the facts' rows, the walks of the few tokens that leave X* into
    // R (each from the trie node where it leaves), and the other members' walk. Only where lexing is not greedy
    // (JSON Schema and GBNF grammars): there every lexeme end forks, so the walks of a state's members, taken
    // apart, are together the walk of the state.
    struct PieceTokens {
        const uint32_t* unbounded = nullptr;   // bitmask row: the tokens that never leave X*
        const int32_t* units = nullptr;        // per token: the units of X it starts
        const uint8_t* never_exits = nullptr;  // per token
        Ints cross_node, cross_units;          // where tokens leave X* at a unit boundary, and the units before
        int32_t max_units = 0;                 // over the tokens that never leave
    };
    struct PieceRef {
        int32_t tokens, low, high, rest;  // high -1: no bound; rest: the lexer state of R
    };
    struct PieceSplit {
        int32_t other = -1;  // the lexer state of the other members, -1 none
        std::vector<PieceRef> pieces;
    };
    std::vector<PieceTokens> piece_tokens;
    // per state, met at the root (offset 0) and one byte into a token (offset 1; only under a root walk): 0 not
    // registered, 1 no pieces, 2 a split in `splits`, keyed state << 1 | offset
    std::vector<int8_t> piece_status[2];
    std::unordered_map<int64_t, PieceSplit> splits;

    int32_t intern(Ints state_members, bool start) {
        Ints key = state_members;
        key.push_back(start);
        auto found = ids.find(key);
        if (found != ids.end()) return found->second;
        const int32_t state = int32_t(members.size());
        if (state >= max_states)
            limit("the grammar's lexer reached its cap of " + std::to_string(max_states) + " states");
        Ints matched;
        if (!start) {
            int32_t top = INT32_MIN;
            for (size_t k = 0; k < state_members.size(); k += 2)
                if (dfa_accepting(dfas[state_members[k]], state_members[k + 1]))
                    top = std::max(top, priority[state_members[k]]);
            for (size_t k = 0; k < state_members.size(); k += 2)
                if (dfa_accepting(dfas[state_members[k]], state_members[k + 1]) && priority[state_members[k]] == top)
                    matched.push_back(state_members[k]);
        }
        bool lazy_match = false, exact_match = false;
        for (int32_t j : matched) {
            lazy_match |= lazy[j] != 0;
            exact_match |= exact[j] != 0;
        }
        members.push_back(std::move(state_members));
        is_start.push_back(start);
        piece_status[0].push_back(0);
        piece_status[1].push_back(0);
        // a lexeme ending here matches something; it may end here while it could go on (exact lexing); a lazy
        // terminal ends it here
        kind.push_back(uint8_t((matched.empty() ? 0 : ACCEPTING) | (!matched.empty() && (!greedy || exact_match) ? FORKS : 0) |
                               (greedy && lazy_match ? LAZY_END : 0)));
        state_bytes += int64_t(256 * 4 + 3 * 64 + 8 * (members.back().size() + matched.size()) + 96);
        accepts.push_back(std::move(matched));
        moves.add_row(max_states);
        ids.emplace(std::move(key), state);
        num_states = state + 1;
        return state;
    }

    int32_t start(const Ints& allowed) {
        auto found = starts.find(allowed);
        if (found != starts.end()) return found->second;
        Ints state_members;
        for (int32_t j : allowed)
            if (dfas[j] != nullptr) {
                state_members.push_back(j);
                state_members.push_back(0);
            }
        const int32_t state = intern(std::move(state_members), true);
        starts.emplace(allowed, state);
        return state;
    }

    int32_t move(int32_t state, int byte) {
        const int32_t known = moves.data()[size_t(state) * 256 + byte];
        if (known != UNBUILT) return known;
        Ints following;
        const Ints& from = members[state];
        for (size_t k = 0; k < from.size(); k += 2) {
            const int32_t q = dfa_next(dfas[from[k]], from[k + 1], byte, &term_fuel, term_fuel_given);
            if (q >= 0) {
                following.push_back(from[k]);
                following.push_back(q);
            }
        }
        const int32_t found = following.empty() ? DEAD : intern(std::move(following), false);
        moves.data()[size_t(state) * 256 + byte] = found;
        return found;
    }

    bool accepting(int32_t state) const { return kind[state] & ACCEPTING; }
    bool forks(int32_t state) const { return kind[state] & FORKS; }
    bool lazy_end(int32_t state) const { return kind[state] & LAZY_END; }

    // The walk below `node` from `state`, kept while the cache has room (else built into `scratch`): one
    // preorder pass over the subtree, each node's parent state in a per-depth stack, a move that leaves the lexeme
    // skipping the node's own subtree.
    const SubWalk& sub_walk(int32_t node, int32_t state, const TrieView& trie, SubWalk& scratch) {
        const int64_t key = (int64_t(node) << 18) | state;
        if (const int32_t* found = walk_ids.find(key)) return walks[size_t(*found)];
        SubWalk walk;
        // Below the root, a subtree is small: its tokens are listed; the root's are marked in a row directly.
        const bool wide = node == 0;
        const int64_t num_ids = wide && piece_status[0][state] == 2 ? piece_walk(walk, state, trie)
                                                                 : plain_walk(walk, node, state, trie);
        if (wide && num_ids <= trie.num_words / 8) {  // few: kept as ids
            for (int64_t w = 0; w < trie.num_words; ++w)
                for (uint32_t bits = walk.words[w]; bits; bits &= bits - 1)
                    walk.ids.push_back(int32_t(w * 32 + __builtin_ctz(bits)));
            std::vector<uint32_t>().swap(walk.words);
        } else if (!wide && num_ids > trie.num_words / 8) {  // many: a row
            walk.words.assign(size_t(trie.num_words), 0);
            for (int32_t id : walk.ids) walk.words[id >> 5] |= 1u << (id & 31);
            Ints().swap(walk.ids);
        }
        walk.ids.shrink_to_fit();
        const int64_t size = walk.nbytes();
        // an empty walk (most crossings into a piece's rest die at their first byte) costs less to redo than to keep
        if ((num_ids == 0 && walk.exit_node.empty()) || walk_bytes + size > walk_budget) {
            scratch = std::move(walk);
            return scratch;
        }
        walk_bytes += size;
        walk_ids.insert(key, int32_t(walks.size()));
        walks.push_back(std::move(walk));
        return walks.back();
    }

    // The root walk of a state registered with pieces (see PieceTokens): the number of tokens marked.
    int64_t piece_walk(SubWalk& walk, int32_t state, const TrieView& trie) {
        const PieceSplit& split = splits.at(int64_t(state) << 1);  // node-based: the reference outlives inserts
        walk.words.assign(size_t(trie.num_words), 0);
        uint32_t* words = walk.words.data();
        std::vector<int64_t> keyed;
        for (const PieceRef& piece : split.pieces) {
            const PieceTokens& facts = piece_tokens[size_t(piece.tokens)];
            if (piece.high < 0 || piece.high >= facts.max_units) {
                for (int64_t w = 0; w < trie.num_words; ++w) words[w] |= facts.unbounded[w];
            } else {
                for (int64_t t = 0; t < trie.num_words * 32; ++t)
                    if (facts.never_exits[t] && facts.units[t] <= piece.high) words[t >> 5] |= 1u << (t & 31);
            }
            crossings(piece, 0, int32_t(trie.num_nodes), trie, words, keyed);
        }
        if (split.other >= 0) {
            SubWalk scratch;
            take(sub_walk(0, split.other, trie, scratch), words, trie, keyed);
        }
        walk.group(keyed);
        int64_t count = 0;
        for (int64_t w = 0; w < trie.num_words; ++w) count += __builtin_popcount(words[w]);
        return count;
    }

    // A part's tokens into `words` and its exits into `keyed` (as plain_walk keys them).
    static void take(const SubWalk& part, uint32_t* words, const TrieView& trie, std::vector<int64_t>& keyed) {
        part.mark(words, trie.num_words);
        for (size_t g = 0; g + 1 < part.group_start.size(); ++g)
            for (int32_t k = part.group_start[g]; k < part.group_start[g + 1]; ++k)
                keyed.push_back((int64_t(part.group_state[g]) << 41) | (int64_t(part.group_byte[g]) << 33) |
                                (int64_t(part.group_ends[g]) << 32) | part.exit_node[k]);
    }

    // The tokens that leave `piece` into its rest at a trie node in [first, end): each such node's walk from the
    // rest's state, where the units before it are within the piece's bounds.
    void crossings(const PieceRef& piece, int32_t first, int32_t end, const TrieView& trie, uint32_t* words,
                   std::vector<int64_t>& keyed) {
        const PieceTokens& facts = piece_tokens[size_t(piece.tokens)];
        const auto from = std::lower_bound(facts.cross_node.begin(), facts.cross_node.end(), first);
        for (size_t k = size_t(from - facts.cross_node.begin()); k < facts.cross_node.size(); ++k) {
            if (facts.cross_node[k] >= end) break;
            const int32_t units = facts.cross_units[k];
            if (units < piece.low || (piece.high >= 0 && units > piece.high)) continue;
            SubWalk scratch;
            take(sub_walk(facts.cross_node[k], piece.rest, trie, scratch), words, trie, keyed);
        }
    }

    // The walk below `node` from `state`, trie node by trie node: the number of tokens marked or listed.
    int64_t plain_walk(SubWalk& walk, int32_t node, int32_t state, const TrieView& trie) {
        const bool wide = node == 0;
        if (wide) walk.words.assign(size_t(trie.num_words), 0);
        uint32_t* words = walk.words.data();
        int64_t num_ids = 0;
        std::vector<int64_t> exits;
        int32_t stack[1024 + 1];  // the Trie checks depths below 1024
        const TrieNode* nodes = trie.nodes;
        const int32_t end = nodes[node].end, base = nodes[node].depth_byte >> 8;
        // Hot values in locals, read again after a move is derived (it may grow the tables).
        const int32_t* table = moves.data();
        const uint8_t* kinds = kind.data();
        stack[0] = state;
        int32_t i = node + 1;
        while (i < end) {
            const TrieNode n = nodes[i];
            const int32_t level = (n.depth_byte >> 8) - base, byte = n.depth_byte & 255;
            const int32_t parent = stack[level - 1];
            int32_t following = table[size_t(parent) * 256 + byte];
            if (__builtin_expect(following == UNBUILT, 0)) {
                following = move(parent, byte);
                table = moves.data();
                kinds = kind.data();
            }
            const uint8_t from = kinds[parent], to = following >= 0 ? kinds[following] : uint8_t(0);
            if ((to & LAZY_END) || ((from & ACCEPTING) && (following < 0 || (from & FORKS))))
                exits.push_back((int64_t(parent) << 41) | (int64_t(byte) << 33) | (int64_t(following < 0) << 32) | i);
            if (following < 0 || (to & LAZY_END)) {
                i = n.end;
                continue;
            }
            if (n.token >= 0) {
                if (wide) words[n.token >> 5] |= 1u << (n.token & 31); else walk.ids.push_back(n.token);
                ++num_ids;
            } else if (__builtin_expect(n.token == -2, 0)) {
                for (int64_t j = trie.own_start[i]; j < trie.own_end[i]; ++j) {
                    const int32_t id = trie.own_ids[j];
                    if (wide) words[id >> 5] |= 1u << (id & 31); else walk.ids.push_back(id);
                    ++num_ids;
                }
            }
            if (wide && level == 1 && piece_status[1][size_t(following)] == 2) {
                // one byte in, a state registered with pieces: the subtree's tokens from the pieces' facts, the
                // tokens that leave a piece from where they leave, and below the node the other members' walk
                const PieceSplit& split = splits.at((int64_t(following) << 1) | 1);
                for (const PieceRef& piece : split.pieces) {
                    const PieceTokens& facts = piece_tokens[size_t(piece.tokens)];
                    for (int64_t j = trie.own_start[i]; j < trie.subtree_end[i]; ++j) {
                        const int32_t id = trie.own_ids[j];
                        if (facts.never_exits[id] && (piece.high < 0 || facts.units[id] <= piece.high)) {
                            words[id >> 5] |= 1u << (id & 31);
                            ++num_ids;
                        }
                    }
                    crossings(piece, i, n.end, trie, words, exits);
                }
                table = moves.data();
                kinds = kind.data();
                if (split.other < 0) {
                    i = n.end;
                    continue;
                }
                stack[level] = split.other;
                ++i;
                continue;
            }
            stack[level] = following;
            ++i;
        }
        walk.group(exits);
        return num_ids;
    }

    static void mark(const TrieView& trie, int32_t node, uint32_t* words) {
        const int32_t id = trie.node_token[node];
        if (id >= 0) {
            words[id >> 5] |= 1u << (id & 31);
        } else if (id == -2) {
            for (int64_t j = trie.own_start[node]; j < trie.own_end[node]; ++j)
                words[trie.own_ids[j] >> 5] |= 1u << (trie.own_ids[j] & 31);
        }
    }

    int64_t nbytes() const { return state_bytes + walk_bytes; }

};

// ------------------------------------------------------------------------------------------ the productions

struct Productions {
    Ints lhs;                     // -1 for the augmented start
    std::vector<Ints> rhs;        // symbols: nonterminal k >= 0, terminal j as ~j
    std::vector<Ints> by_lhs;     // per nonterminal
    std::vector<uint8_t> nullable;
    int32_t start_production = 0;
};

struct Item {
    int32_t p, dot, origin;
    bool operator==(const Item& o) const { return p == o.p && dot == o.dot && origin == o.origin; }
    bool operator<(const Item& o) const {
        return p != o.p ? p < o.p : dot != o.dot ? dot < o.dot : origin < o.origin;
    }
};

struct ItemHash {
    size_t operator()(const Item& i) const {
        return size_t((uint64_t(uint32_t(i.p)) * 0x9E3779B97F4A7C15ull) ^ (uint64_t(uint32_t(i.dot)) << 40) ^
                      (uint64_t(uint32_t(i.origin)) * 0xC2B2AE3D27D4EB4Full));
    }
};

struct ItemsHash {
    size_t operator()(const std::vector<Item>& v) const {
        uint64_t h = 0xCBF29CE484222325ull ^ v.size();
        for (const Item& i : v) h = (h ^ ItemHash()(i)) * 0x100000001B3ull;
        return size_t(h);
    }
};

using Entries = std::vector<std::pair<int32_t, Item>>;

// The items of `entries` (sorted by symbol) filed under `symbol`.
std::pair<Entries::const_iterator, Entries::const_iterator> filed(const Entries& entries, int32_t symbol) {
    auto below = [](const std::pair<int32_t, Item>& e, int32_t s) { return e.first < s; };
    auto first = std::lower_bound(entries.begin(), entries.end(), symbol, below);
    auto last = first;
    while (last != entries.end() && last->first == symbol) ++last;
    return {first, last};
}

// The items of one closure, deduplicated: open addressing over a buffer reused from closure to closure (a slot
// belongs to this closure when its stamp is the current one).
struct ItemSet {
    std::vector<Item> slots;
    std::vector<uint32_t> stamps;
    uint32_t stamp = 0;
    size_t size = 0;

    void clear() {
        if (++stamp == 0) {  // wrapped: forget every old stamp
            std::fill(stamps.begin(), stamps.end(), 0u);
            stamp = 1;
        }
        size = 0;
        if (slots.empty()) grow(64);
    }
    bool insert(const Item& item) {
        if (2 * (size + 1) > slots.size()) rehash();
        const size_t mask = slots.size() - 1;
        for (size_t k = ItemHash()(item) & mask;; k = (k + 1) & mask) {
            if (stamps[k] != stamp) {
                stamps[k] = stamp;
                slots[k] = item;
                ++size;
                return true;
            }
            if (slots[k] == item) return false;
        }
    }

  private:
    void grow(size_t capacity) {
        slots.assign(capacity, Item{0, 0, 0});
        stamps.assign(capacity, 0u);
    }
    void rehash() {
        std::vector<Item> kept;
        for (size_t k = 0; k < slots.size(); ++k)
            if (stamps[k] == stamp) kept.push_back(slots[k]);
        grow(slots.size() * 2);
        stamp = 1;
        size = 0;
        for (const Item& item : kept) insert(item);
    }
};

struct EarleySet {
    // (symbol, item) sorted by symbol: the items with the dot before a nonterminal (waiting) or a terminal (scans)
    std::vector<std::pair<int32_t, Item>> waiting, scans;
    Ints expected;                                           // terminals some item can scan next
    bool is_accepting = false;
    int32_t lex_start = UNBUILT;  // the lexer state that starts a lexeme here (allowed: expected + ignore)
};

// ------------------------------------------------------------------------------------------------ the index

struct Index {
    nb::object trie_object;                // the trie and the terminals' automata, kept alive with the index
    std::vector<nb::object> dfa_objects;
    TrieView trie{};
    Lexer lexer;
    Productions grammar;
    Ints ignore;
    Ints specials;                           // special terminals
    std::vector<std::vector<uint32_t>> special_words;  // per special terminal (same order)
    std::vector<uint32_t> eos_words;

    std::deque<HeldBuffer> piece_arrays;  // the buffers behind lexer.piece_tokens
};

// corral._native.CfgIndex: one grammar's index, shared by its sessions.
struct IndexObject {
    std::unique_ptr<Index> index;
};

// ---------------------------------------------------------------------------------------------- the session

using Reading = std::pair<int32_t, int32_t>;  // (Earley set, lexer state)
using Readings = std::vector<Reading>;        // sorted, distinct

struct ReadingsHash {
    size_t operator()(const Readings& v) const {
        uint64_t h = 0xCBF29CE484222325ull ^ v.size();
        for (const Reading& r : v)
            h = (h ^ ((uint64_t(uint32_t(r.first)) << 32) | uint32_t(r.second))) * 0x100000001B3ull;
        return size_t(h);
    }
};

struct Row {
    int32_t node, set, lex;
};

struct Session {
    nb::object owner;  // the CfgIndex, kept alive with the session
    Index& index;
    Lexer& lexer;
    const Productions& grammar;
    // the Earley table
    std::vector<EarleySet> sets;
    std::unordered_map<std::vector<Item>, int32_t, ItemsHash> kernels;
    std::unordered_map<Ints, int32_t, IntsHash> scan_memo;  // set, terminals... -> set or -1
    FlatMap scan_one;                                       // set << 32 | terminal -> set or -1
    ItemSet seen_items;                                     // the closure's, reused
    Ints predicted;                                         // per nonterminal: the closure that predicted it
    int32_t closure_stamp = 0;
    int64_t num_items = 0, max_items = 4000000, work = 0, max_closure_work = int64_t(1) << 62;
    // configurations
    std::vector<Readings> configs;
    std::unordered_map<Readings, int32_t, ReadingsHash> config_ids;
    std::vector<int32_t> trans;                   // [config * 256 + byte]
    std::vector<std::vector<uint32_t>> masks;     // per config; empty: not computed
    FlatMap ended_ids;                // (set, lexer state, byte) -> index in ended_rows
    std::deque<Readings> ended_rows;  // (a deque: references stay valid as it grows)
    FlatMap seen_rows;                // one walk's rows, as node << 40 | set << 18 | lexer state
    int64_t max_configs = 32768, fuel = int64_t(1) << 62, fuel_start = 0, mask_bytes = 0;
    int32_t start = 0;

    bool replaying = false;  // reading a hidden stop's text again (see lazy_end)

    Session(nb::object owner_object, Index& of)
        : owner(std::move(owner_object)), index(of), lexer(of.lexer), grammar(of.grammar) {}

    // -- the Earley table (earley.py)
    int32_t scan(int32_t set_id, const Ints& terminals) {
        if (terminals.size() == 1) {  // the common case, without a vector key
            const int64_t one = (int64_t(set_id) << 32) | uint32_t(terminals[0]);
            if (const int32_t* found = scan_one.find(one)) return *found;
            const int32_t result = scan_uncached(set_id, terminals);
            scan_one.insert(one, result);
            return result;
        }
        Ints key;
        key.reserve(terminals.size() + 1);
        key.push_back(set_id);
        key.insert(key.end(), terminals.begin(), terminals.end());
        auto found = scan_memo.find(key);
        if (found != scan_memo.end()) return found->second;
        const int32_t result = scan_uncached(set_id, terminals);
        scan_memo.emplace(std::move(key), result);
        return result;
    }

    int32_t scan_uncached(int32_t set_id, const Ints& terminals) {
        std::vector<Item> kernel;
        for (int32_t t : terminals) {
            const auto range = filed(sets[set_id].scans, t);
            for (auto e = range.first; e != range.second; ++e)
                kernel.push_back(Item{e->second.p, e->second.dot + 1, e->second.origin});
        }
        std::sort(kernel.begin(), kernel.end());
        kernel.erase(std::unique(kernel.begin(), kernel.end()), kernel.end());
        return kernel.empty() ? -1 : intern_set(std::move(kernel));
    }

    int32_t intern_set(std::vector<Item> kernel) {
        auto found = kernels.find(kernel);
        if (found != kernels.end()) return found->second;
        const int32_t set_id = int32_t(sets.size());
        EarleySet built = closure(set_id, kernel);  // registered only once it is whole
        sets.push_back(std::move(built));
        kernels.emplace(std::move(kernel), set_id);
        return set_id;
    }

    EarleySet closure(int32_t set_id, const std::vector<Item>& kernel) {
        EarleySet out;
        std::vector<Item> items;
        items.reserve(kernel.size() * 4);
        for (const Item& i : kernel) items.push_back(Item{i.p, i.dot, i.origin < 0 ? set_id : i.origin});
        std::sort(items.begin(), items.end());
        ItemSet& seen = seen_items;
        seen.clear();
        for (const Item& i : items) seen.insert(i);
        if (predicted.size() != grammar.by_lhs.size()) predicted.assign(grammar.by_lhs.size(), 0);
        if (++closure_stamp == INT32_MAX) {
            std::fill(predicted.begin(), predicted.end(), 0);
            closure_stamp = 1;
        }
        int64_t completions = 0;
        const int64_t cap = max_closure_work;
        auto add = [&](const Item& item) {
            if (seen.insert(item)) items.push_back(item);
        };
        for (size_t k = 0; k < items.size(); ++k) {
            const Item item = items[k];
            const Ints& rhs = grammar.rhs[item.p];
            if (item.dot == int32_t(rhs.size())) {
                if (item.origin != set_id) {  // completions in this very set were made at prediction (nullable)
                    const auto advanced = filed(sets[item.origin].waiting, grammar.lhs[item.p]);
                    completions += int64_t(advanced.second - advanced.first);
                    if (completions > cap)
                        limit("one Earley set needed more than " + std::to_string(cap) +
                              " completions (the grammar is too ambiguous for this input)");
                    for (auto e = advanced.first; e != advanced.second; ++e)  // (sets[] does not move here)
                        add(Item{e->second.p, e->second.dot + 1, e->second.origin});
                }
                continue;
            }
            const int32_t symbol = rhs[item.dot];
            if (symbol < 0) {
                out.scans.emplace_back(~symbol, item);
                continue;
            }
            out.waiting.emplace_back(symbol, item);
            if (predicted[symbol] != closure_stamp) {
                predicted[symbol] = closure_stamp;
                for (int32_t q : grammar.by_lhs[symbol]) add(Item{q, 0, set_id});
            }
            if (grammar.nullable[symbol]) add(Item{item.p, item.dot + 1, item.origin});
        }
        auto by_symbol = [](const std::pair<int32_t, Item>& a, const std::pair<int32_t, Item>& b) {
            return a.first < b.first;
        };
        std::stable_sort(out.scans.begin(), out.scans.end(), by_symbol);
        std::stable_sort(out.waiting.begin(), out.waiting.end(), by_symbol);
        for (const auto& entry : out.scans)
            if (out.expected.empty() || out.expected.back() != entry.first) out.expected.push_back(entry.first);
        for (const Item& i : items)
            if (i.p == grammar.start_production && i.dot == 1) out.is_accepting = true;
        num_items += int64_t(items.size());
        work += int64_t(items.size()) + completions;
        if (num_items > max_items)
            limit("the parse reached its cap of " + std::to_string(max_items) + " Earley items");
        return out;
    }

    // -- lexemes (cfg_guide.py's ParseSession)
    int32_t lex_start(int32_t set_id) {
        int32_t state = sets[set_id].lex_start;
        if (state == UNBUILT) {
            Ints allowed;
            std::set_union(sets[set_id].expected.begin(), sets[set_id].expected.end(), index.ignore.begin(),
                           index.ignore.end(), std::back_inserter(allowed));
            state = lexer.start(allowed);
            sets[set_id].lex_start = state;
        }
        return state;
    }

    Reading after_lexeme(int32_t set_id) { return Reading(set_id, lex_start(set_id)); }

    // The Earley set after the lexeme read so far ends here as one of `matched` (null: every terminal it
    // matches); -1 when none.
    int32_t finish_lexeme(int32_t set_id, int32_t lex, const Ints* matched = nullptr) {
        const Ints& terminals = matched != nullptr ? *matched : lexer.accepts[lex];
        if (terminals.empty()) return -1;
        if (terminals.size() == 1) {
            const Ints& expected = sets[set_id].expected;
            if (!std::binary_search(expected.begin(), expected.end(), terminals[0])) return set_id;
            return scan(set_id, terminals);
        }
        const Ints scanned = intersection(terminals, sets[set_id].expected);
        if (scanned.empty()) return set_id;  // an %ignore lexeme: the parser does not move
        return scan(set_id, scanned);
    }

    void add(int32_t set_id, int32_t lex, Readings& out) {
        if (lexer.lazy_end(lex)) {  // a lazy lexeme ends as soon as it matches
            lazy_end(set_id, lex, out);
            return;
        }
        out.emplace_back(set_id, lex);
    }

    // The readings after a lazy lexeme that ends at `lex` (cfg_guide.py's _lazy_end and Lexer.replays): only its
    // lazy terminals match. A terminal with a hidden stop (Lexer::replay) ends before its stop's text, which is
    // then read again from the next lexeme.
    void lazy_end(int32_t set_id, int32_t lex, Readings& out) {
        std::map<std::string, Ints> by_text;  // accepts ascend, so each group does too
        for (int32_t j : lexer.accepts[lex])
            if (lexer.lazy[size_t(j)]) by_text[lexer.replay[size_t(j)]].push_back(j);
        for (const auto& [text, terminals] : by_text) {
            // a hidden stop inside the text read again would take that text as its own stop as well (with an
            // empty body, again and again: `line[stop="\n"]` in `line*`): bytes are read once as a stop
            if (!text.empty() && replaying) continue;
            const int32_t ended = finish_lexeme(set_id, lex, &terminals);
            if (ended < 0) continue;
            Readings readings{after_lexeme(ended)};
            replaying = true;
            struct Reset {
                bool& flag;
                ~Reset() { flag = false; }
            } reset{replaying};
            for (const char c : text) {
                Readings following;
                for (const Reading& r : readings) read(r.first, r.second, uint8_t(c), following);
                std::sort(following.begin(), following.end());
                following.erase(std::unique(following.begin(), following.end()), following.end());
                readings = std::move(following);
            }
            out.insert(out.end(), readings.begin(), readings.end());
        }
    }

    Ints exact_matches(int32_t lex) const {
        Ints out;
        for (int32_t j : lexer.accepts[lex])
            if (lexer.exact[j]) out.push_back(j);
        return out;
    }

    void read(int32_t set_id, int32_t lex, int byte, Readings& out) {
        const int32_t following = lexer.move(lex, byte);
        Ints matched;
        bool restricted = false;
        if (following >= 0) {
            add(set_id, following, out);
            if (lexer.greedy) {  // the lexeme goes on: it cannot end here, unless as an exact terminal
                matched = exact_matches(lex);
                if (matched.empty()) return;
                restricted = true;
            }
        }
        const int32_t ended = finish_lexeme(set_id, lex, restricted ? &matched : nullptr);
        if (ended >= 0) {
            const int32_t next = lexer.move(lex_start(ended), byte);
            if (next >= 0) add(ended, next, out);
        }
    }

    // The readings after `byte` where the lexeme read so far ends (before `byte`, which starts the next one, or
    // on it, a lazy one).
    const Readings& ended(int32_t set_id, int32_t lex, int byte) {
        const int64_t key = (int64_t(set_id) << 26) | (int64_t(lex) << 8) | byte;
        if (const int32_t* found = ended_ids.find(key)) return ended_rows[size_t(*found)];
        Readings out;
        const int32_t following = lexer.move(lex, byte);
        if (following >= 0 && lexer.lazy_end(following)) lazy_end(set_id, following, out);
        if (lexer.accepting(lex) && (following < 0 || lexer.forks(lex))) {
            Ints matched;
            const bool restricted = following >= 0 && lexer.greedy;
            if (restricted) matched = exact_matches(lex);
            const int32_t end = finish_lexeme(set_id, lex, restricted ? &matched : nullptr);
            if (end >= 0) {
                const int32_t after = lexer.move(lex_start(end), byte);
                if (after >= 0) add(end, after, out);
            }
        }
        std::sort(out.begin(), out.end());
        out.erase(std::unique(out.begin(), out.end()), out.end());
        check_fuel();
        ended_ids.insert(key, int32_t(ended_rows.size()));
        ended_rows.push_back(std::move(out));
        return ended_rows.back();
    }

    // -- configurations
    int32_t intern(Readings readings) {
        std::sort(readings.begin(), readings.end());
        readings.erase(std::unique(readings.begin(), readings.end()), readings.end());
        auto found = config_ids.find(readings);
        if (found != config_ids.end()) return found->second;
        const int32_t config = int32_t(configs.size());
        if (config >= max_configs)
            limit("the parse reached its cap of " + std::to_string(max_configs) + " states");
        configs.push_back(readings);
        config_ids.emplace(std::move(readings), config);
        trans.resize(trans.size() + 256, UNBUILT);
        masks.emplace_back();
        return config;
    }

    int32_t move(int32_t config, int byte) {
        const int32_t known = trans[size_t(config) * 256 + byte];
        if (known != UNBUILT) return known;
        Readings readings;
        const Readings from = configs[config];  // (configs may grow below)
        for (const Reading& r : from) read(r.first, r.second, byte, readings);
        const int32_t found = readings.empty() ? DEAD : intern(std::move(readings));
        trans[size_t(config) * 256 + byte] = found;
        check_fuel();
        return found;
    }

    void check_fuel() const {
        if (work - fuel_start > fuel)
            limit("one step of the parse built more than " + std::to_string(fuel) +
                  " Earley items (the grammar is too ambiguous for this input)");
    }

    Ints between_lexemes(int32_t config) {
        Ints out;
        const Readings readings = configs[config];
        for (const Reading& r : readings) {
            const int32_t between = lexer.is_start[r.second] ? r.first : finish_lexeme(r.first, r.second);
            if (between >= 0) out.push_back(between);
        }
        return out;
    }

    bool is_accepting(int32_t config) {
        for (int32_t s : between_lexemes(config))
            if (sets[s].is_accepting) return true;
        return false;
    }

    Ints specials_allowed(int32_t config) {
        Ints out;
        if (index.specials.empty()) return out;
        for (int32_t s : between_lexemes(config)) {
            const Ints both = intersection(sets[s].expected, index.specials);
            out.insert(out.end(), both.begin(), both.end());
        }
        std::sort(out.begin(), out.end());
        out.erase(std::unique(out.begin(), out.end()), out.end());
        return out;
    }

    // -- masks
    const std::vector<uint32_t>& mask(int32_t config) {
        if (!masks[config].empty()) return masks[config];
        std::vector<uint32_t> words(size_t(index.trie.num_words), 0);
        walk(config, words.data());
        if (is_accepting(config))
            for (size_t w = 0; w < words.size(); ++w) words[w] |= index.eos_words[w];
        for (int32_t j : specials_allowed(config)) {
            const size_t k = size_t(std::lower_bound(index.specials.begin(), index.specials.end(), j) -
                                    index.specials.begin());
            for (size_t w = 0; w < words.size(); ++w) words[w] |= index.special_words[k][w];
        }
        mask_bytes += int64_t(words.size()) * 4;
        masks[config] = std::move(words);
        return masks[config];
    }

    // Rows (node, Earley set, lexer state) from each reading at the trie's root: a row takes the tokens of its
    // sub-walk, and at each node where the lexeme ends the parser is asked (`ended`, memoized) which rows go on
    // below it. Each row is taken once.
    void walk(int32_t config, uint32_t* words) {
        const TrieView& trie = index.trie;
        std::vector<Row> stack;
        FlatMap& seen = seen_rows;
        seen.clear();
        for (const Reading& r : configs[config]) stack.push_back(Row{0, r.first, r.second});
        SubWalk scratch;
        while (!stack.empty()) {
            const Row row = stack.back();
            stack.pop_back();
            const SubWalk& sub = lexer.sub_walk(row.node, row.lex, trie, scratch);
            sub.mark(words, trie.num_words);
            const size_t num_groups = sub.group_state.size();
            int32_t state = -1, after = -1, start = -1;
            Readings one(1);
            for (size_t g = 0; g < num_groups; ++g) {
                const Readings* found = &one;
                if (sub.group_ends[g]) {
                    // The common case, as _resolve's: the lexeme ends before the byte, so its end is one parser
                    // step per exit state and the byte one lexer move.
                    if (sub.group_state[g] != state) {
                        state = sub.group_state[g];
                        after = finish_lexeme(row.set, state);
                        start = after >= 0 ? lex_start(after) : -1;
                        check_fuel();
                    }
                    if (after < 0) continue;
                    const int32_t next = lexer.move(start, sub.group_byte[g]);
                    if (next < 0) continue;
                    if (lexer.lazy_end(next))
                        found = &ended(row.set, state, sub.group_byte[g]);
                    else
                        one[0] = Reading(after, next);
                } else {
                    found = &ended(row.set, sub.group_state[g], sub.group_byte[g]);
                }
                const Readings& rows = *found;
                if (rows.empty()) continue;
                for (int32_t k = sub.group_start[g]; k < sub.group_start[g + 1]; ++k) {
                    const int32_t node = sub.exit_node[k];
                    Lexer::mark(trie, node, words);
                    if (trie.nodes[node].end == node + 1) continue;
                    for (const Reading& r : rows) {
                        const Row below{node, r.first, r.second};
                        const int64_t key = (int64_t(node) << 40) | (int64_t(r.first) << 18) | r.second;
                        if (seen.insert(key, 0)) stack.push_back(below);
                    }
                }
            }
        }
    }

    int32_t advance_bytes(int32_t config, const uint8_t* bytes, Py_ssize_t n) {
        for (Py_ssize_t k = 0; k < n && config >= 0; ++k) config = move(config, bytes[k]);
        return config < 0 ? DEAD : config;
    }

    int32_t advance_special(int32_t config, const Ints& terminals) {
        Readings readings;
        for (int32_t between : between_lexemes(config)) {
            const Ints scanned = intersection(terminals, sets[between].expected);
            if (scanned.empty()) continue;
            const int32_t set_id = scan(between, scanned);
            if (set_id >= 0) readings.push_back(after_lexeme(set_id));
        }
        return readings.empty() ? DEAD : intern(std::move(readings));
    }

    int64_t nbytes() const {
        return int64_t(trans.size()) * 4 + mask_bytes + num_items * 40 + int64_t(configs.size()) * 64 +
               int64_t(ended_rows.size()) * 48 + ended_ids.nbytes() + scan_one.nbytes();
    }
};

// corral._native.CfgSession: one sequence's parse, over its grammar's index.
struct SessionObject {
    std::unique_ptr<Session> session;
};

// ------------------------------------------------------------------------------------------- Python glue

template <typename T>
std::vector<T> vector_of(nb::handle array) {
    HeldBuffer held(array.ptr(), PyBUF_C_CONTIGUOUS, sizeof(T));
    return std::vector<T>(held.data<const T>(), held.data<const T>() + held.count());
}

nb::tuple tuple_of(const Ints& values) {
    PyObject* out = PyTuple_New(Py_ssize_t(values.size()));
    if (out == nullptr) throw PyFailure();
    nb::tuple owned = nb::steal<nb::tuple>(out);
    for (size_t k = 0; k < values.size(); ++k)
        PyTuple_SET_ITEM(out, Py_ssize_t(k), nb::int_(values[k]).release().ptr());
    return owned;
}

// CfgIndex(trie, dfas, priority, lazy, exact, greedy, ignore, lhs, rhs_offsets, rhs, num_nonterminals, nullable,
//          start_production, eos_words, special_terminals, special_words, max_lexer_states, walk_bytes, replays)
// replays: a list with the bytes of each terminal's hidden stop (b"" none; only a lazy terminal has one).
// dfas: a list with a corral._native.Dfa or None per terminal; int32 arrays but lazy/exact/nullable (uint8),
// rhs_offsets (int64, one more than productions), eos_words/special_words (int32 words, special_words
// [num_specials, num_words]). Every id is checked here.
void index_init(IndexObject* self, nb::handle trie, nb::list dfas, nb::handle priority, nb::handle lazy,
                nb::handle exact, bool greedy, nb::handle ignore, nb::handle lhs, nb::handle offsets, nb::handle rhs,
                int64_t num_nonterminals, nb::handle nullable, int64_t start_production, nb::handle eos,
                nb::handle specials, nb::handle special_words, int64_t max_states, int64_t root_bytes,
                nb::list replays) {
    auto index = std::make_unique<Index>();
    if (!trie_view(trie.ptr(), &index->trie)) throw PyFailure();
    if (index->trie.num_nodes >= (int64_t(1) << 23) || max_states > (int64_t(1) << 18))
        fail(PyExc_ValueError, "CfgIndex: at most 2^23 trie nodes and 2^18 lexer states (the walk's keys)");
    index->trie_object = nb::borrow(trie);
    const Py_ssize_t num_terminals = Py_ssize_t(nb::len(dfas));
    Lexer& lexer = index->lexer;
    for (nb::handle item : dfas) {
        void* dfa = nullptr;
        if (!item.is_none()) {
            dfa = dfa_of(item.ptr());
            if (dfa == nullptr) throw PyFailure();
            if (dfa_num_states(dfa) < 1) fail(PyExc_ValueError, "CfgIndex: a terminal's automaton has no start state");
            index->dfa_objects.push_back(nb::borrow(item));
        }
        lexer.dfas.push_back(dfa);
    }
    lexer.priority = vector_of<int32_t>(priority);
    lexer.lazy = vector_of<uint8_t>(lazy);
    lexer.exact = vector_of<uint8_t>(exact);
    lexer.greedy = greedy;
    lexer.max_states = max_states;
    lexer.walk_budget = root_bytes;
    if (int64_t(lexer.priority.size()) != num_terminals || int64_t(lexer.lazy.size()) != num_terminals ||
        int64_t(lexer.exact.size()) != num_terminals || Py_ssize_t(nb::len(replays)) != num_terminals)
        fail(PyExc_ValueError, "CfgIndex: the terminal arrays differ in length");
    for (Py_ssize_t j = 0; j < num_terminals; ++j) {
        PyObject* text = PyList_GET_ITEM(replays.ptr(), j);
        if (!PyBytes_Check(text)) fail(PyExc_TypeError, "CfgIndex: a replay text is not bytes");
        if (PyBytes_GET_SIZE(text) && !lexer.lazy[size_t(j)])
            fail(PyExc_ValueError, "CfgIndex: a terminal with a replay text must be lazy");
        lexer.replay.emplace_back(PyBytes_AS_STRING(text), size_t(PyBytes_GET_SIZE(text)));
    }
    auto check_terminals = [&](const Ints& ids) {
        for (size_t k = 0; k < ids.size(); ++k)
            if (ids[k] < 0 || ids[k] >= num_terminals || (k && ids[k] <= ids[k - 1]))
                fail(PyExc_ValueError, "CfgIndex: terminal ids must be sorted, distinct and in range");
    };
    index->ignore = vector_of<int32_t>(ignore);
    check_terminals(index->ignore);
    index->specials = vector_of<int32_t>(specials);
    check_terminals(index->specials);
    Productions& g = index->grammar;
    g.lhs = vector_of<int32_t>(lhs);
    const std::vector<int64_t> starts = vector_of<int64_t>(offsets);
    const Ints symbols = vector_of<int32_t>(rhs);
    const size_t num_productions = g.lhs.size();
    if (starts.size() != num_productions + 1 || starts.front() != 0 || starts.back() != int64_t(symbols.size()))
        fail(PyExc_ValueError, "CfgIndex: rhs_offsets do not cut rhs into the productions");
    g.nullable = vector_of<uint8_t>(nullable);
    if (num_nonterminals < 0 || int64_t(g.nullable.size()) != num_nonterminals)
        fail(PyExc_ValueError, "CfgIndex: nullable is not one flag per nonterminal");
    g.by_lhs.assign(size_t(num_nonterminals), Ints());
    for (size_t p = 0; p < num_productions; ++p) {
        if (starts[p] > starts[p + 1]) fail(PyExc_ValueError, "CfgIndex: rhs_offsets decrease");
        Ints one(symbols.begin() + starts[p], symbols.begin() + starts[p + 1]);
        for (int32_t s : one)
            if (s >= num_nonterminals || (s < 0 && ~s >= num_terminals))
                fail(PyExc_ValueError, "CfgIndex: a symbol outside the grammar");
        g.rhs.push_back(std::move(one));
        if (g.lhs[p] >= num_nonterminals || (g.lhs[p] < 0 && int64_t(p) != start_production))
            fail(PyExc_ValueError, "CfgIndex: a production's left side outside the grammar");
        if (g.lhs[p] >= 0) g.by_lhs[size_t(g.lhs[p])].push_back(int32_t(p));
    }
    if (start_production < 0 || size_t(start_production) >= num_productions ||
        g.rhs[size_t(start_production)].size() != 1)
        fail(PyExc_ValueError, "CfgIndex: the start production is not one symbol");
    g.start_production = int32_t(start_production);
    const int64_t num_words = index->trie.num_words;
    const std::vector<uint32_t> eos_words = vector_of<uint32_t>(eos);
    if (int64_t(eos_words.size()) != num_words) fail(PyExc_ValueError, "CfgIndex: eos_words is not one row");
    index->eos_words = eos_words;
    const std::vector<uint32_t> rows = vector_of<uint32_t>(special_words);
    if (int64_t(rows.size()) != num_words * int64_t(index->specials.size()))
        fail(PyExc_ValueError, "CfgIndex: special_words is not one row per special terminal");
    for (size_t k = 0; k < index->specials.size(); ++k)
        index->special_words.emplace_back(rows.begin() + int64_t(k) * num_words,
                                          rows.begin() + int64_t(k + 1) * num_words);
    new (self) IndexObject{std::move(index)};
}

int32_t lexer_state_arg(const Lexer& lexer, int64_t state) {
    if (state < 0 || state >= int64_t(lexer.members.size())) fail(PyExc_IndexError, "no such lexer state");
    return int32_t(state);
}

// lexer_members(state): (is_start, (terminal, automaton state, terminal, ...)).
nb::tuple index_lexer_members(IndexObject& self, int64_t state) {
    const Lexer& lexer = self.index->lexer;
    const size_t at = size_t(lexer_state_arg(lexer, state));
    return nb::make_tuple(bool(lexer.is_start[at]), tuple_of(lexer.members[at]));
}

// lexer_moves(state, fuel): (the number of tokens' first bytes that go on inside the lexeme, the distinct states
// they lead to that are not registered one byte into a token yet), deriving at most `fuel` new terms (-1: no cap)
// as a mask would.
nb::tuple index_lexer_moves(IndexObject& self, int64_t state, int64_t fuel) {
    Lexer& lexer = self.index->lexer;
    lexer.term_fuel = lexer.term_fuel_given = fuel < 0 ? -1 : fuel;
    const int32_t from = lexer_state_arg(lexer, state);
    Ints found;
    int live = 0;
    const TrieView& trie = self.index->trie;
    {
        NoGil nogil;  // the moves may derive: work like a mask's
        for (int64_t k = 0; k < trie.num_roots; ++k) {  // the first bytes of tokens only
            const int32_t following = lexer.move(from, trie.node_byte[trie.roots[k]]);
            if (following < 0) continue;
            ++live;
            if (lexer.piece_status[1][size_t(following)] == 0 &&
                std::find(found.begin(), found.end(), following) == found.end())
                found.push_back(following);
        }
    }
    return nb::make_tuple(live, tuple_of(found));
}

// add_piece_tokens(unbounded_words, units, never_exits, cross_nodes, cross_units, max_units): one piece's token
// facts at one offset (token_pieces.PieceTokens: int32 words; int32 and uint8 per token of whole words; int32
// trie nodes and their units), kept by the index; returns their id for set_pieces.
size_t index_add_piece_tokens(IndexObject& self, nb::handle unbounded_words, nb::handle units_per_token,
                              nb::handle never_exits, nb::handle cross_nodes, nb::handle cross_units,
                              int64_t max_units) {
    Index& index = *self.index;
    const int64_t num_words = index.trie.num_words;
    HeldBuffer unbounded(unbounded_words.ptr(), PyBUF_C_CONTIGUOUS, 4),
        units(units_per_token.ptr(), PyBUF_C_CONTIGUOUS, 4), never(never_exits.ptr(), PyBUF_C_CONTIGUOUS, 1);
    if (unbounded.count() != num_words || units.count() != num_words * 32 || never.count() != num_words * 32)
        fail(PyExc_ValueError, "add_piece_tokens: a row of words, and one unit count and flag per token");
    Lexer::PieceTokens facts;
    facts.cross_node = vector_of<int32_t>(cross_nodes);
    facts.cross_units = vector_of<int32_t>(cross_units);
    if (facts.cross_node.size() != facts.cross_units.size())
        fail(PyExc_ValueError, "add_piece_tokens: one unit count per crossing node");
    for (size_t k = 0; k < facts.cross_node.size(); ++k)
        if (facts.cross_node[k] < 0 || facts.cross_node[k] >= index.trie.num_nodes ||
            (k && facts.cross_node[k] <= facts.cross_node[k - 1]))
            fail(PyExc_ValueError, "add_piece_tokens: crossing nodes must be trie nodes, ascending");
    if (max_units < 0 || max_units > INT32_MAX) fail(PyExc_ValueError, "add_piece_tokens: max_units out of range");
    facts.max_units = int32_t(max_units);
    facts.unbounded = unbounded.data<const uint32_t>();
    facts.units = units.data<const int32_t>();
    facts.never_exits = never.data<const uint8_t>();
    index.piece_arrays.push_back(std::move(unbounded));
    index.piece_arrays.push_back(std::move(units));
    index.piece_arrays.push_back(std::move(never));
    Lexer& lexer = index.lexer;
    lexer.state_bytes += int64_t(facts.cross_node.size()) * 8 + 64;
    lexer.piece_tokens.push_back(std::move(facts));
    return lexer.piece_tokens.size() - 1;
}

// set_pieces(state, offset, other, pieces): register a lexer state met `offset` bytes into a token (0 or 1):
// `other` its members that are no piece (terminal,
// automaton state, ...: terminals ascending), `pieces` a list of (terminal, tokens id, low, high or -1, automaton
// state of the rest); an empty list says the state has none. Ignored where lexing is greedy, the terminals'
// priorities differ (walks taken apart would keep matches the top priority drops) or the state is known.
void index_set_pieces(IndexObject& self, int64_t state, int64_t offset, nb::handle other_members, nb::list pieces) {
    Lexer& lexer = self.index->lexer;
    lexer_state_arg(lexer, state);
    if (offset != 0 && offset != 1) fail(PyExc_ValueError, "set_pieces: offset 0 or 1");
    int8_t& status = lexer.piece_status[offset][size_t(state)];
    if (status != 0) return;
    const Ints members = lexer.members[size_t(state)];  // a copy: interning below may move the vector
    // one priority for the whole grammar: apart, two paths would each keep their own top-priority match of a
    // later lexeme, where together the lower one would be dropped
    bool one_priority = true;
    for (int32_t p : lexer.priority) one_priority &= p == lexer.priority.front();
    const size_t num_pieces = nb::len(pieces);
    if (num_pieces == 0 || lexer.greedy || !one_priority || lexer.is_start[size_t(state)]) {
        status = 1;
        return;
    }
    auto member_terminal = [&](int64_t terminal) {
        for (size_t k = 0; k < members.size(); k += 2)
            if (members[k] == terminal) return int32_t(terminal);
        fail(PyExc_ValueError, "set_pieces: a terminal that is no member of the state");
    };
    auto checked_state = [&](int32_t terminal, int64_t q) {
        if (q < 0 || q >= dfa_num_states(lexer.dfas[size_t(terminal)]))
            fail(PyExc_ValueError, "set_pieces: no such automaton state");
        return int32_t(q);
    };
    Lexer::PieceSplit split;
    for (nb::handle piece : pieces) {
        if (!nb::isinstance<nb::tuple>(piece) || nb::len(piece) != 5)
            fail(PyExc_TypeError, "set_pieces: a piece is a tuple of 5 ints");
        int64_t facts[5];
        for (int i = 0; i < 5; ++i) facts[i] = int_of(piece[i]);
        const int64_t terminal = facts[0], tokens = facts[1], low = facts[2], high = facts[3], rest = facts[4];
        if (tokens < 0 || tokens >= int64_t(lexer.piece_tokens.size()) || low < 0 || high < -1 ||
            low > INT32_MAX || high > INT32_MAX)
            fail(PyExc_ValueError, "set_pieces: a piece's facts or bounds are out of range");
        const int32_t t = member_terminal(terminal);
        const int32_t rest_state = lexer.intern(Ints{t, checked_state(t, rest)}, false);
        split.pieces.push_back(Lexer::PieceRef{int32_t(tokens), int32_t(low), int32_t(high), rest_state});
    }
    const Ints other = vector_of<int32_t>(other_members);
    if (other.size() % 2) fail(PyExc_ValueError, "set_pieces: other members come in pairs");
    for (size_t k = 0; k < other.size(); k += 2) {
        if (k && other[k] <= other[k - 2]) fail(PyExc_ValueError, "set_pieces: other terminals must ascend");
        checked_state(member_terminal(other[k]), other[k + 1]);
    }
    if (!other.empty()) split.other = lexer.intern(other, false);
    lexer.state_bytes += int64_t(num_pieces) * 16 + 64;
    lexer.splits.emplace((state << 1) | offset, std::move(split));
    lexer.piece_status[offset][size_t(state)] = 2;  // not `status`: interning may have moved the vector
}

// CfgSession(index, max_configs, max_items, max_closure_work): the start configuration is built here.
void session_init(SessionObject* self, nb::object owner, int64_t max_configs, int64_t max_items, int64_t closure) {
    if (!nb::isinstance<IndexObject>(owner) || !nb::inst_ready(owner))
        fail(PyExc_TypeError, "CfgSession: a corral._native.CfgIndex was expected");
    if (max_items < 1 || max_items > 4000000 || max_configs < 1 || max_configs > INT32_MAX)  // keys hold 2^22 sets
        fail(PyExc_ValueError, "CfgSession: max_items is 1..4,000,000 and max_configs positive");
    Index& index = *nb::inst_ptr<IndexObject>(owner)->index;
    auto session = std::make_unique<Session>(std::move(owner), index);
    Session& s = *session;
    s.max_configs = max_configs;
    s.max_items = max_items;
    s.max_closure_work = closure;
    s.lexer.term_fuel = s.lexer.term_fuel_given = -1;  // the start: bounded by the compile's clock
    {
        NoGil nogil;
        const int32_t first = s.intern_set({Item{s.grammar.start_production, 0, -1}});
        s.start = s.intern({s.after_lexeme(first)});
    }
    new (self) SessionObject{std::move(session)};
}

// Every call names a configuration of this session and the fuel of Earley work it may spend.
int32_t config_arg(const Session& s, int64_t config) {
    if (config < 0 || config >= int64_t(s.configs.size())) {
        PyErr_Format(PyExc_IndexError, "no configuration %lld in a session of %zd", static_cast<long long>(config),
                     s.configs.size());
        throw PyFailure();
    }
    return int32_t(config);
}

void begin(Session& s, int64_t fuel) {
    s.fuel = fuel;
    s.fuel_start = s.work;
    s.lexer.term_fuel = s.lexer.term_fuel_given = s.fuel < 0 ? -1 : s.fuel;  // and as many new terms
}

// fill_mask(config, row, fuel): the configuration's bitmask row (int32 words, one per 32 tokens) into `row`.
void session_fill_mask(SessionObject& self, int64_t config_number, nb::handle row_array, int64_t fuel) {
    Session& s = *self.session;
    const int32_t config = config_arg(s, config_number);
    HeldBuffer row(row_array.ptr(), PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE, 4);
    if (row.count() != s.index.trie.num_words) fail(PyExc_ValueError, "fill_mask: the row is not one mask long");
    begin(s, fuel);
    NoGil nogil;
    maybe_wait();
    const std::vector<uint32_t>& words = s.mask(config);
    std::memcpy(row.data<uint32_t>(), words.data(), words.size() * 4);
}

// advance(config, token_bytes, fuel): the configuration after a token's bytes, or -1 where one is refused.
int32_t session_advance(SessionObject& self, int64_t config_number, nb::handle token_bytes, int64_t fuel) {
    Session& s = *self.session;
    const int32_t config = config_arg(s, config_number);
    HeldBuffer bytes(token_bytes.ptr(), PyBUF_C_CONTIGUOUS, 1);
    begin(s, fuel);
    NoGil nogil;
    return s.advance_bytes(config, bytes.data<const uint8_t>(), bytes.count());
}

// advance_special(config, terminals, fuel): after a special token that is each of `terminals` (sorted int32).
int32_t session_advance_special(SessionObject& self, int64_t config_number, nb::handle terminal_ids, int64_t fuel) {
    Session& s = *self.session;
    const int32_t config = config_arg(s, config_number);
    const Ints terminals = vector_of<int32_t>(terminal_ids);
    for (size_t k = 0; k < terminals.size(); ++k)
        if (terminals[k] < 0 || size_t(terminals[k]) >= s.lexer.dfas.size() || (k && terminals[k] <= terminals[k - 1]))
            fail(PyExc_ValueError, "advance_special: terminals must be sorted, distinct and in range");
    begin(s, fuel);
    NoGil nogil;
    return s.advance_special(config, terminals);
}

// move(config, byte, fuel)
int32_t session_move(SessionObject& self, int64_t config_number, int64_t byte, int64_t fuel) {
    Session& s = *self.session;
    const int32_t config = config_arg(s, config_number);
    if (byte < 0 || byte > 255) fail(PyExc_ValueError, "move: a byte is 0..255");
    begin(s, fuel);
    NoGil nogil;
    return s.move(config, int(byte));
}

// is_accepting(config, fuel)
bool session_is_accepting(SessionObject& self, int64_t config_number, int64_t fuel) {
    Session& s = *self.session;
    const int32_t config = config_arg(s, config_number);
    begin(s, fuel);
    NoGil nogil;
    return s.is_accepting(config);
}

// Checks a configuration, spends at most `fuel` on it, and returns what `work(session, config)` finds there,
// found with the GIL released, as a tuple of ints.
template <typename Work>
nb::tuple ints_found(SessionObject& self, int64_t config_number, int64_t fuel, Work work) {
    Session& s = *self.session;
    const int32_t config = config_arg(s, config_number);
    begin(s, fuel);
    Ints found;
    {
        NoGil nogil;
        found = work(s, config);
    }
    return tuple_of(found);
}

// specials_allowed(config, fuel): the special terminals some reading expects here.
nb::tuple session_specials_allowed(SessionObject& self, int64_t config_number, int64_t fuel) {
    return ints_found(self, config_number, fuel, [](Session& s, int32_t config) { return s.specials_allowed(config); });
}

// live_bytes(config, fuel): the bytes that can follow.
nb::tuple session_live_bytes(SessionObject& self, int64_t config_number, int64_t fuel) {
    return ints_found(self, config_number, fuel, [](Session& s, int32_t config) {
        Ints live;
        for (int byte = 0; byte < 256; ++byte)
            if (s.move(config, byte) >= 0) live.push_back(byte);
        return live;
    });
}

// forced(config, limit, fuel): the bytes every continuation starts with (cfg_guide.py's
// ParseSession.forced_bytes): while the text is not a complete parse, exactly one byte can follow and no special
// token may come instead, that byte, at most `limit` of them. Each question asked on the way has its own fuel, as
// the separate calls had. A limit met on the way ends the span there, its error cleared: the bytes found are
// forced all the same, and the guide meets the limit itself where its own moves need that work.
nb::bytes session_forced(SessionObject& self, int64_t config_number, int64_t limit, int64_t fuel) {
    Session& s = *self.session;
    int32_t config = config_arg(s, config_number);
    std::string out;
    {
        NoGil nogil;
        try {
            while (config >= 0 && int64_t(out.size()) < limit) {
                begin(s, fuel);
                if (s.is_accepting(config)) break;
                begin(s, fuel);
                int live = -1, num_live = 0;
                for (int byte = 0; byte < 256; ++byte)  // every move, as live_bytes makes them
                    if (s.move(config, byte) >= 0) live = byte, ++num_live;
                if (num_live != 1) break;
                begin(s, fuel);
                if (!s.specials_allowed(config).empty()) break;
                begin(s, fuel);
                out.push_back(char(live));
                config = s.move(config, live);
            }
        } catch (const PyFailure&) {
            WithGil gil;
            if (!PyErr_ExceptionMatches(LimitError)) throw;
            PyErr_Clear();
        }
    }
    return nb::bytes(out.data(), out.size());
}

// readings(config): the (Earley set, lexer state) pairs.
nb::tuple session_readings(SessionObject& self, int64_t config_number) {
    Session& s = *self.session;
    const Readings& readings = s.configs[size_t(config_arg(s, config_number))];
    PyObject* out = PyTuple_New(Py_ssize_t(readings.size()));
    if (out == nullptr) throw PyFailure();
    nb::tuple owned = nb::steal<nb::tuple>(out);
    for (size_t k = 0; k < readings.size(); ++k)
        PyTuple_SET_ITEM(out, Py_ssize_t(k), nb::make_tuple(readings[k].first, readings[k].second).release().ptr());
    return owned;
}

// unregistered_roots(config): where its mask is not known yet, the lexer states of its readings (inside a
// lexeme) that have not been through set_pieces.
nb::tuple session_unregistered_roots(SessionObject& self, int64_t config_number) {
    Session& s = *self.session;
    const int32_t config = config_arg(s, config_number);
    Ints found;
    const Lexer& lexer = s.lexer;
    if (s.masks[size_t(config)].empty() && !lexer.greedy)
        for (const Reading& r : s.configs[size_t(config)]) {
            const size_t lex = size_t(r.second);
            if (lexer.piece_status[0][lex] == 0 && !lexer.is_start[lex] &&
                std::find(found.begin(), found.end(), r.second) == found.end())
                found.push_back(r.second);
        }
    return tuple_of(found);
}

// sets_between_lexemes(config, fuel)
nb::tuple session_between(SessionObject& self, int64_t config_number, int64_t fuel) {
    return ints_found(self, config_number, fuel, [](Session& s, int32_t config) { return s.between_lexemes(config); });
}

}  // namespace

void add_cfg(nb::module_& m) {
    nb::class_<IndexObject>(m, "CfgIndex")
        .def("__init__", &index_init)
        .def("lexer_members", &index_lexer_members)
        .def("lexer_moves", &index_lexer_moves)
        .def("add_piece_tokens", &index_add_piece_tokens)
        .def("set_pieces", &index_set_pieces)
        .def("nbytes", [](const IndexObject& self) { return self.index->lexer.nbytes(); })
        .def_prop_ro("num_lexer_states", [](const IndexObject& self) { return self.index->lexer.num_states.load(); })
        .def_prop_ro("num_piece_splits", [](const IndexObject& self) { return self.index->lexer.splits.size(); });

    nb::class_<SessionObject>(m, "CfgSession")
        .def("__init__", &session_init)
        .def("fill_mask", &session_fill_mask)
        .def("advance", &session_advance)
        .def("advance_special", &session_advance_special)
        .def("move", &session_move)
        .def("is_accepting", &session_is_accepting)
        .def("specials_allowed", &session_specials_allowed)
        .def("live_bytes", &session_live_bytes)
        .def("forced", &session_forced)
        .def("readings", &session_readings)
        .def("sets_between_lexemes", &session_between)
        .def("unregistered_roots", &session_unregistered_roots)
        .def("nbytes", [](const SessionObject& self) { return self.session->nbytes(); })
        .def_prop_ro("start", [](const SessionObject& self) { return self.session->start; })
        .def_prop_ro("num_configs", [](const SessionObject& self) { return self.session->configs.size(); })
        .def_prop_ro("work", [](const SessionObject& self) { return self.session->work; });
}

}  // namespace corral_native

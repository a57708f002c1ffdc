// The derivative term table of derivatives.py in C++: the same terms, normalization, derivatives, first-byte
// sets, byte classes and liveness, kept in native memory. A CPython extension (not ctypes): the lazy DFA calls
// it once per derived move and a ctypes call costs microseconds, about what a derivative costs here.
//
// Terms are ids into parallel arrays. kind: BYTES (a = index into masks), CAT (a head, b tail; right-nested),
// ALT and AND (a = offset into pool, b = member count; members sorted by id, deduplicated), REP (a inner, b low,
// c high or -1 for none), CONST (0 the empty set, 1 epsilon). Python sees them through the table's methods and
// through the views kind/args/nullable/has_and, indexed like the pure table's lists.
//
// Errors: a Python exception raised inside (the budget's check_time), a limit reached (LimitError) or a bad
// argument unwinds as PyFailure and the entry point returns NULL with the exception set. Every memo is written
// after its value is complete, so an unwind leaves the table consistent.
//
// Limits, which hold while decoding as well as while compiling: max_terms caps a table's terms (its memory),
// an automaton's max_states its states, and fuel caps the new terms one walk (one mask) may make. They count work,
// never time, so a mask passes or fails alike on a busy machine. Fuel belongs to the thread that computes the mask
// (thread_fuel), not to the table: the mask's registrations between native calls spend what its walk left, and a
// move derived on another thread meanwhile spends none of it.
//
// Threads: the walks run with the GIL released (they take it back only to call Python), so every entry point
// holds the table's mutex; a thread that must wait for it waits without the GIL.

#include "automata.h"
#include "common.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <nanobind/stl/optional.h>
#include <optional>
#include <string>
#include <sys/mman.h>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace corral_native {
namespace {

constexpr int32_t EMPTYSET = 0, EPSILON = 1;
enum : uint8_t { K_BYTES, K_CAT, K_ALT, K_REP, K_AND, K_CONST };
constexpr size_t INDEXED_ALT_MEMBERS = 8;
constexpr int INDEXED_MEMBER_BYTES = 16;

struct Mask {
    uint64_t w[4] = {0, 0, 0, 0};
    bool operator==(const Mask& o) const { return w[0] == o.w[0] && w[1] == o.w[1] && w[2] == o.w[2] && w[3] == o.w[3]; }
    bool operator<(const Mask& o) const {
        for (int k = 3; k >= 0; --k)
            if (w[k] != o.w[k]) return w[k] < o.w[k];
        return false;
    }
    bool test(int byte) const { return (w[byte >> 6] >> (byte & 63)) & 1; }
    bool empty() const { return (w[0] | w[1] | w[2] | w[3]) == 0; }
    int count() const {
        return __builtin_popcountll(w[0]) + __builtin_popcountll(w[1]) + __builtin_popcountll(w[2]) +
               __builtin_popcountll(w[3]);
    }
    int lowest() const {
        for (int k = 0; k < 4; ++k)
            if (w[k]) return k * 64 + __builtin_ctzll(w[k]);
        return -1;
    }
    Mask operator&(const Mask& o) const { Mask r; for (int k = 0; k < 4; ++k) r.w[k] = w[k] & o.w[k]; return r; }
    Mask operator|(const Mask& o) const { Mask r; for (int k = 0; k < 4; ++k) r.w[k] = w[k] | o.w[k]; return r; }
    Mask without(const Mask& o) const { Mask r; for (int k = 0; k < 4; ++k) r.w[k] = w[k] & ~o.w[k]; return r; }
};

struct MaskHash {
    size_t operator()(const Mask& m) const {
        uint64_t h = m.w[0] * 0x9E3779B97F4A7C15ull;
        h ^= m.w[1] + 0x632BE59BD9B4E019ull + (h << 6) + (h >> 2);
        h ^= m.w[2] * 0xC2B2AE3D27D4EB4Full + (h << 6) + (h >> 2);
        h ^= m.w[3] + 0x165667B19E3779F9ull + (h << 6) + (h >> 2);
        return size_t(h);
    }
};

template <typename T>
struct VectorHash {
    size_t operator()(const std::vector<T>& v) const {
        uint64_t h = 0xCBF29CE484222325ull ^ v.size();
        for (const T& x : v) {
            uint64_t y;
            if constexpr (std::is_same_v<T, Mask>) y = MaskHash()(x); else y = uint64_t(uint32_t(x));
            h = (h ^ y) * 0x100000001B3ull;
            h ^= h >> 29;
        }
        return size_t(h);
    }
};

struct RepKey {
    int32_t inner, low, high;
    bool operator==(const RepKey& o) const { return inner == o.inner && low == o.low && high == o.high; }
};
struct RepHash {
    size_t operator()(const RepKey& k) const {
        return size_t((uint64_t(uint32_t(k.inner)) * 0x9E3779B97F4A7C15ull) ^ (uint64_t(uint32_t(k.low)) << 32) ^
                      uint64_t(uint32_t(k.high)) * 0xC2B2AE3D27D4EB4Full);
    }
};

// An alternation's members by first byte (see derivatives.py, _starts_of): members starting with at most
// INDEXED_MEMBER_BYTES bytes listed under each byte, the others tested by their first-byte mask.
struct Starts {
    int32_t offsets[257];
    std::vector<int32_t> members;
    std::vector<std::pair<int32_t, Mask>> wide;
};

// The new terms the mask being computed on this thread may still make (-1: no mask: no cap), and the fuel it was
// given (named in the error). Set for a scope by FuelScope, which puts back what was there before.
thread_local int64_t thread_fuel = -1;
thread_local int64_t thread_fuel_given = 0;

struct FuelScope {
    int64_t saved, saved_given;
    FuelScope(int64_t fuel, int64_t given) : saved(thread_fuel), saved_given(thread_fuel_given) {
        thread_fuel = fuel < 0 ? -1 : fuel;
        thread_fuel_given = given;
    }
    ~FuelScope() {
        thread_fuel = saved;
        thread_fuel_given = saved_given;
    }
};

struct Table {
    std::vector<uint8_t> kind, nullable, has_and;
    std::vector<int32_t> a, b, c;
    std::vector<int8_t> live;         // -1 unknown, 0 empty, 1 live (kept for intersections only)
    std::vector<int32_t> first_set;   // id of the term's first-byte mask set, -1 not computed
    std::vector<int32_t> pool;        // members of alternations and intersections
    std::vector<Mask> masks;          // byte sets
    std::unordered_map<Mask, int32_t, MaskHash> bytes_ids;
    std::unordered_map<uint64_t, int32_t> cat_ids;
    std::unordered_map<RepKey, int32_t, RepHash> rep_ids;
    std::unordered_map<std::vector<int32_t>, int32_t, VectorHash<int32_t>> alt_ids, and_ids;
    std::unordered_map<int64_t, int32_t> derivatives;  // term << 8 | byte
    std::unordered_map<int64_t, int32_t> relinked;     // chain << 32 | tail
    std::vector<std::vector<Mask>> sets;               // interned first-byte mask sets (sorted, unique)
    std::unordered_map<std::vector<Mask>, int32_t, VectorHash<Mask>> set_ids;
    std::vector<Mask> set_union;                       // per set: the union of its masks
    std::unordered_map<int32_t, std::vector<Mask>> partitions;  // set id -> byte classes
    std::unordered_map<int32_t, Starts> starts;
    std::unordered_map<std::vector<int32_t>, std::vector<std::pair<int32_t, int32_t>>, VectorHash<int32_t>> live_boxes;
    int64_t num_undecided = 0;
    int64_t step_limit = 5000;  // liveness search steps before an intersection is treated as empty
    PyObject* budget = nullptr;  // owned; check_time() every 4096 new terms
    int64_t max_terms = -1;      // -1: no cap
    std::recursive_mutex mutex;

    Table() {
        for (int k = 0; k < 2; ++k) push(K_CONST, 0, 0, 0, k == 1, false);
        intern_set({});  // set 0: no first bytes
    }

    int32_t size() const { return int32_t(kind.size()); }

    int32_t push(uint8_t k, int32_t x, int32_t y, int32_t z, bool null, bool with_and) {
        const int32_t term = size();
        if (max_terms >= 0 && term >= max_terms) {
            WithGil gil;
            PyErr_Format(LimitError, "the grammar's automaton reached its memory cap of %lld terms",
                         static_cast<long long>(max_terms));
            throw PyFailure();
        }
        if (thread_fuel == 0) {
            WithGil gil;
            PyErr_Format(LimitError, "a token mask ran out of its fuel of %lld new terms",
                         static_cast<long long>(thread_fuel_given));
            throw PyFailure();
        }
        if (thread_fuel > 0) --thread_fuel;
        kind.push_back(k);
        a.push_back(x);
        b.push_back(y);
        c.push_back(z);
        nullable.push_back(null);
        has_and.push_back(with_and);
        live.push_back(-1);
        first_set.push_back(-1);
        if (term % 4096 == 0 && budget != nullptr) {
            WithGil gil;
            PyObject* result = PyObject_CallMethod(budget, "check_time", nullptr);
            if (result == nullptr) throw PyFailure();
            Py_DECREF(result);
        }
        return term;
    }

    // ---- constructors (normalizing), as derivatives.py's ----------------------------------------------------
    int32_t byte_set(const Mask& mask) {
        if (mask.empty()) return EMPTYSET;
        auto known = bytes_ids.find(mask);
        if (known != bytes_ids.end()) return known->second;
        masks.push_back(mask);
        const int32_t term = push(K_BYTES, int32_t(masks.size() - 1), 0, 0, false, false);
        bytes_ids.emplace(mask, term);
        return term;
    }

    int32_t cat(int32_t head, int32_t tail) {
        if (head == EMPTYSET || tail == EMPTYSET) return EMPTYSET;
        if (head == EPSILON) return tail;
        if (tail == EPSILON) return head;
        if (kind[head] == K_CAT) return relink(head, tail);
        return cat_node(head, tail);
    }

    int32_t cat_node(int32_t head, int32_t tail) {  // head is not a concatenation, EPSILON or EMPTYSET
        const uint64_t key = (uint64_t(uint32_t(head)) << 32) | uint32_t(tail);
        auto known = cat_ids.find(key);
        if (known != cat_ids.end()) return known->second;
        const int32_t term = push(K_CAT, head, tail, 0, nullable[head] && nullable[tail], has_and[head] || has_and[tail]);
        cat_ids.emplace(key, term);
        return term;
    }

    int32_t relink(int32_t chain, int32_t tail) {
        const int64_t key = (int64_t(chain) << 32) | uint32_t(tail);
        auto known = relinked.find(key);
        if (known != relinked.end()) return known->second;
        std::vector<int32_t> heads;
        int32_t current = chain;
        while (kind[current] == K_CAT) {
            heads.push_back(a[current]);
            current = b[current];
        }
        int32_t result = cat(current, tail);
        for (auto head = heads.rbegin(); head != heads.rend(); ++head) result = cat_node(*head, result);
        relinked.emplace(key, result);
        return result;
    }

    int32_t alt(const std::vector<int32_t>& terms) {
        std::vector<int32_t> members;
        members.reserve(terms.size() + 4);
        Mask mask;
        bool any_mask = false;
        auto add = [&](int32_t member) {
            if (kind[member] == K_BYTES) {
                mask = mask | masks[a[member]];
                any_mask = true;
            } else if (member != EMPTYSET) {
                members.push_back(member);
            }
        };
        for (int32_t term : terms) {
            if (kind[term] == K_ALT) {
                for (int32_t k = 0; k < b[term]; ++k) add(pool[a[term] + k]);
            } else {
                add(term);
            }
        }
        if (any_mask) members.push_back(byte_set(mask));
        std::sort(members.begin(), members.end());
        members.erase(std::unique(members.begin(), members.end()), members.end());
        if (members.empty()) return EMPTYSET;
        if (members.size() == 1) return members[0];
        auto known = alt_ids.find(members);
        if (known != alt_ids.end()) return known->second;
        bool null = false, with_and = false;
        for (int32_t m : members) {
            null = null || nullable[m];
            with_and = with_and || has_and[m];
        }
        const int32_t offset = int32_t(pool.size());
        pool.insert(pool.end(), members.begin(), members.end());
        const int32_t term = push(K_ALT, offset, int32_t(members.size()), 0, null, with_and);
        alt_ids.emplace(std::move(members), term);
        return term;
    }

    int32_t repeat(int32_t term, int32_t low, int32_t high) {  // high -1: unbounded
        if (high == 0 || term == EPSILON) return EPSILON;
        if (term == EMPTYSET) return low == 0 ? EPSILON : EMPTYSET;
        if (nullable[term]) low = 0;
        if (low == 1 && high == 1) return term;
        const RepKey key{term, low, high};
        auto known = rep_ids.find(key);
        if (known != rep_ids.end()) return known->second;
        const int32_t id = push(K_REP, term, low, high, low == 0, has_and[term]);
        rep_ids.emplace(key, id);
        return id;
    }

    int32_t intersect(const std::vector<int32_t>& terms) {
        std::vector<int32_t> members;
        for (int32_t term : terms) {
            if (term == EMPTYSET) return EMPTYSET;
            if (kind[term] == K_AND) {
                for (int32_t k = 0; k < b[term]; ++k) members.push_back(pool[a[term] + k]);
            } else {
                members.push_back(term);
            }
        }
        std::sort(members.begin(), members.end());
        members.erase(std::unique(members.begin(), members.end()), members.end());
        if (members.size() == 1) return members[0];
        auto known = and_ids.find(members);
        if (known != and_ids.end()) return known->second;
        bool null = true;
        for (int32_t m : members) null = null && nullable[m];
        const int32_t offset = int32_t(pool.size());
        pool.insert(pool.end(), members.begin(), members.end());
        const int32_t term = push(K_AND, offset, int32_t(members.size()), 0, null, true);
        and_ids.emplace(std::move(members), term);
        return term;
    }

    // ---- first bytes and byte classes -------------------------------------------------------------------------
    int32_t intern_set(std::vector<Mask> set) {
        std::sort(set.begin(), set.end());
        set.erase(std::unique(set.begin(), set.end()), set.end());
        auto known = set_ids.find(set);
        if (known != set_ids.end()) return known->second;
        Mask all;
        for (const Mask& m : set) all = all | m;
        const int32_t id = int32_t(sets.size());
        sets.push_back(set);
        set_union.push_back(all);
        set_ids.emplace(std::move(set), id);
        return id;
    }

    int32_t first_bytes(int32_t term) {
        if (first_set[term] >= 0) return first_set[term];
        int32_t result;
        const uint8_t k = kind[term];
        if (k == K_BYTES) {
            result = intern_set({masks[a[term]]});
        } else if (k == K_CAT && !nullable[a[term]]) {
            result = first_bytes(a[term]);
        } else if (k == K_CAT) {
            std::vector<Mask> found;
            int32_t current = term;
            bool ended = false;
            while (kind[current] == K_CAT) {
                const int32_t head = a[current], tail = b[current];
                const std::vector<Mask>& part = sets[first_bytes(head)];
                found.insert(found.end(), part.begin(), part.end());
                if (!nullable[head]) { ended = true; break; }
                current = tail;
            }
            if (!ended) {
                const std::vector<Mask>& part = sets[first_bytes(current)];
                found.insert(found.end(), part.begin(), part.end());
            }
            result = intern_set(std::move(found));
        } else if (k == K_ALT || k == K_AND) {
            std::vector<Mask> found;
            const int32_t offset = a[term], count = b[term];
            for (int32_t j = 0; j < count; ++j) {
                const int32_t set = first_bytes(pool[offset + j]);
                found.insert(found.end(), sets[set].begin(), sets[set].end());
            }
            result = intern_set(std::move(found));
        } else if (k == K_REP) {
            result = first_bytes(a[term]);
        } else {
            result = 0;
        }
        first_set[term] = result;
        return result;
    }

    const Mask& first_mask(int32_t term) { return set_union[first_bytes(term)]; }

    const std::vector<Mask>& byte_classes(int32_t term) {
        const int32_t set = first_bytes(term);
        auto known = partitions.find(set);
        if (known != partitions.end()) return known->second;
        std::vector<Mask> classes;
        for (const Mask& mask : sets[set]) {  // the coarsest partition each mask is a union of
            Mask remaining = mask;
            std::vector<Mask> refined;
            for (const Mask& cls : classes) {
                const Mask inside = cls & mask, outside = cls.without(mask);
                if (!inside.empty()) refined.push_back(inside);
                if (!outside.empty()) refined.push_back(outside);
                remaining = remaining.without(cls);
            }
            if (!remaining.empty()) refined.push_back(remaining);
            classes.swap(refined);
        }
        return partitions.emplace(set, std::move(classes)).first->second;
    }

    // ---- derivatives ------------------------------------------------------------------------------------------
    int32_t derivative(int32_t term, int byte) {
        const int64_t key = (int64_t(term) << 8) | byte;
        auto known = derivatives.find(key);
        if (known != derivatives.end()) return known->second;
        int32_t result = EMPTYSET;
        const uint8_t k = kind[term];
        if (k == K_BYTES) {
            result = masks[a[term]].test(byte) ? EPSILON : EMPTYSET;
        } else if (k == K_CAT && kind[a[term]] == K_BYTES) {  // a literal, a spelled character
            result = masks[a[a[term]]].test(byte) ? b[term] : EMPTYSET;
        } else if (k == K_CAT) {  // d(a b) = d(a) b | (a nullable) d(b), along the right-nested chain
            std::vector<int32_t> options;
            int32_t current = term;
            bool ended = false;
            while (kind[current] == K_CAT) {
                const int32_t head = a[current], tail = b[current];
                options.push_back(cat(derivative(head, byte), tail));
                if (!nullable[head]) { ended = true; break; }
                current = tail;
            }
            if (!ended) options.push_back(derivative(current, byte));
            result = options.size() == 1 ? options[0] : alt(options);
        } else if (k == K_ALT) {  // members that cannot start with the byte derive to the empty set: skipped
            std::vector<int32_t> options;
            const int32_t offset = a[term], count = b[term];
            if (size_t(count) < INDEXED_ALT_MEMBERS) {
                for (int32_t j = 0; j < count; ++j) {
                    const int32_t member = pool[offset + j];
                    if (first_mask(member).test(byte)) options.push_back(derivative(member, byte));
                }
            } else {
                const Starts& index = starts_of(term);
                std::vector<int32_t> listed(index.members.begin() + index.offsets[byte],
                                            index.members.begin() + index.offsets[byte + 1]);
                std::vector<int32_t> wide;
                for (const auto& [member, mask] : index.wide)
                    if (mask.test(byte)) wide.push_back(member);
                for (int32_t member : listed) options.push_back(derivative(member, byte));
                for (int32_t member : wide) options.push_back(derivative(member, byte));
            }
            result = alt(options);
        } else if (k == K_REP) {
            const int32_t inner = a[term], low = b[term], high = c[term];
            const int32_t rest = repeat(inner, std::max(low - 1, 0), high < 0 ? -1 : high - 1);
            result = cat(derivative(inner, byte), rest);
        } else if (k == K_AND) {
            std::vector<int32_t> options;
            const int32_t offset = a[term], count = b[term];
            for (int32_t j = 0; j < count; ++j) options.push_back(derivative(pool[offset + j], byte));
            result = intersect(options);
        }
        derivatives.emplace(key, result);
        return result;
    }

    const Starts& starts_of(int32_t term) {
        auto known = starts.find(term);
        if (known != starts.end()) return known->second;
        Starts index;
        std::vector<std::pair<int, int32_t>> listed;  // (byte, member)
        const int32_t offset = a[term], count = b[term];
        for (int32_t j = 0; j < count; ++j) {
            const int32_t member = pool[offset + j];
            const Mask mask = first_mask(member);
            if (mask.count() > INDEXED_MEMBER_BYTES) {
                index.wide.emplace_back(member, mask);
                continue;
            }
            for (int byte = 0; byte < 256; ++byte)
                if (mask.test(byte)) listed.emplace_back(byte, member);
        }
        std::stable_sort(listed.begin(), listed.end(),
                         [](const auto& x, const auto& y) { return x.first < y.first; });
        size_t at = 0;
        for (int byte = 0; byte <= 256; ++byte) {
            index.offsets[byte] = int32_t(at);
            while (at < listed.size() && listed[at].first == byte) index.members.push_back(listed[at++].second);
        }
        return starts.emplace(term, std::move(index)).first->second;
    }

    // ---- liveness ---------------------------------------------------------------------------------------------
    bool is_live(int32_t term) {
        if (term == EMPTYSET) return false;
        if (!has_and[term]) return true;
        if (live[term] >= 0) return live[term] == 1;
        bool known;
        const uint8_t k = kind[term];
        if (k == K_CAT) {
            known = true;
            int32_t current = term;
            while (known && kind[current] == K_CAT && has_and[current]) {
                const int32_t head = a[current];
                current = b[current];
                known = is_live(head);
            }
            known = known && is_live(current);
        } else if (k == K_ALT) {
            known = false;
            const int32_t offset = a[term], count = b[term];
            for (int32_t j = 0; j < count && !known; ++j) known = is_live(pool[offset + j]);
        } else if (k == K_REP) {
            known = b[term] == 0 || is_live(a[term]);
        } else {
            known = intersection_is_live(term);
        }
        live[term] = known;
        return known;
    }

    bool intersection_is_live(int32_t term) {
        std::vector<int32_t> key;
        int32_t low = 0, high = -1;
        const int32_t offset = a[term], count = b[term];
        for (int32_t j = 0; j < count; ++j) {  // the first counted member X{lo,hi}, X not nullable
            const int32_t member = pool[offset + j];
            if (kind[member] == K_REP && !nullable[a[member]]) {
                key.push_back(a[member]);
                for (int32_t i = 0; i < count; ++i)
                    if (i != j) key.push_back(pool[offset + i]);
                low = b[member];
                high = c[member];
                break;
            }
        }
        if (!key.empty()) {
            auto boxes = live_boxes.find(key);
            if (boxes != live_boxes.end())
                for (const auto& [known_low, depth] : boxes->second)
                    if (low <= known_low && (high < 0 || high >= depth)) return true;
        }
        const auto [found, depth] = explore_for_acceptance(term);
        if (found && !key.empty() && depth >= 0) live_boxes[key].emplace_back(low, depth);
        return found;
    }

    // Breadth-first over the derivatives of an intersection until a nullable one: (live, the witness's length,
    // or -1 when liveness came from a term already known live). Past the step limit: treated as empty.
    std::pair<bool, int32_t> explore_for_acceptance(int32_t term) {
        std::unordered_set<int32_t> seen{term};
        std::deque<std::pair<int32_t, int32_t>> frontier{{term, 0}};
        while (!frontier.empty() && int64_t(seen.size()) < step_limit) {
            const auto [current, depth] = frontier.front();
            frontier.pop_front();
            if (nullable[current]) return {true, depth};
            if (live[current] == 1) return {true, -1};
            const std::vector<Mask> classes = byte_classes(current);
            for (const Mask& cls : classes) {
                const int32_t following = derivative(current, cls.lowest());
                if (following != EMPTYSET && !seen.count(following) && live[following] != 0) {
                    seen.insert(following);
                    frontier.emplace_back(following, depth + 1);
                }
            }
        }
        if (frontier.empty()) {
            for (int32_t dead : seen) live[dead] = 0;
            return {false, -1};
        }
        ++num_undecided;
        return {false, -1};
    }

    // The shape X{lo,hi} R of a member of a state's term, as token_pieces.py's _as_piece reads it (single units
    // before a repeat count into it): status 0 not a piece (by its terms alone), 1 a piece, 2 R is empty.
    struct Shape {
        int status;
        int32_t unit, low, high, rest;
    };

    Shape piece_shape(int32_t member, int narrow_bytes) {
        Shape none{0, 0, 0, 0, 0};
        int32_t unit, low, high, rest;
        if (kind[member] == K_REP) {
            unit = a[member], low = b[member], high = c[member], rest = EPSILON;
        } else if (kind[member] == K_CAT) {
            unit = a[member];
            if (kind[unit] == K_REP) unit = a[unit];
            int32_t count = 0;
            rest = member;
            while (kind[rest] == K_CAT && a[rest] == unit) {
                ++count;
                rest = b[rest];
            }
            low = high = count;
            if (kind[rest] == K_CAT && kind[a[rest]] == K_REP) {
                const int32_t repeat = a[rest], tail = b[rest];
                if (a[repeat] == unit) {
                    low += b[repeat];
                    high = c[repeat] < 0 ? -1 : high + c[repeat];
                    rest = tail;
                }
            } else if (rest == unit) {  // the last unit is the whole tail
                low += 1, high += 1, rest = EPSILON;
            }
            if (high == low && low <= 1) return none;  // one unit, no repeat: its facts would serve once
        } else {
            return none;
        }
        if (has_and[unit] || nullable[unit]) return none;
        const Mask unit_first = first_mask(unit);
        if (unit_first.count() <= narrow_bytes) return none;
        const Mask rest_first = first_mask(rest);
        if (!(unit_first & rest_first).empty()) return none;
        if (!is_live(rest)) return Shape{2, unit, low, high, rest};
        return Shape{1, unit, low, high, rest};
    }

    size_t nbytes() const {  // an estimate of the native memory held
        const size_t terms = kind.size() * (3 + 4 * 3 + 1 + 4);
        const size_t maps = (bytes_ids.size() + cat_ids.size() + rep_ids.size() + alt_ids.size() + and_ids.size() +
                             derivatives.size() + relinked.size()) * 40;
        size_t sets_bytes = 0;
        for (const auto& set : sets) sets_bytes += 2 * 32 * set.size() + 96;
        return terms + maps + pool.size() * 8 + masks.size() * 72 + sets_bytes + partitions.size() * 96 +
               starts.size() * 1200;
    }
};

// ---- Python glue (nanobind) -----------------------------------------------------------------------------------
//
// Every entry point takes its table's lock first (see TableLock) and checks its arguments against the table:
// a term or state out of range is an IndexError that names it, never a read out of bounds.

// A new reference from a C API call, or the Python error that call set.
nb::object owned(PyObject* object) {
    if (object == nullptr) throw PyFailure();
    return nb::steal(object);
}

nb::object mask_to_int(const Mask& mask) {
    return owned(_PyLong_FromByteArray(reinterpret_cast<const unsigned char*>(mask.w), 32, 1, 0));
}

Mask int_to_mask(nb::handle value) {
    if (!PyLong_Check(value.ptr())) {
        PyErr_SetString(PyExc_TypeError, "a byte set is a non-negative int below 2**256");
        throw PyFailure();
    }
    Mask mask;
#if PY_VERSION_HEX >= 0x030D0000
    const int failed = _PyLong_AsByteArray(reinterpret_cast<PyLongObject*>(value.ptr()),
                                           reinterpret_cast<unsigned char*>(mask.w), 32, 1, 0, 1);
#else
    const int failed = _PyLong_AsByteArray(reinterpret_cast<PyLongObject*>(value.ptr()),
                                           reinterpret_cast<unsigned char*>(mask.w), 32, 1, 0);
#endif
    if (failed) throw PyFailure();
    return mask;
}

// corral._native.Table: one term table. Python subclasses it (derivatives.py's NativeTermTable).
struct TableObject {
    Table* table = new Table();
    TableObject() = default;
    ~TableObject() {
        Py_XDECREF(table->budget);
        delete table;
    }
    TableObject(const TableObject&) = delete;
    TableObject& operator=(const TableObject&) = delete;
};

// The table's mutex, for one entry point; a thread that must wait for it waits without the GIL (the holder may
// need the GIL to finish: the budget's check_time is Python).
struct TableLock {
    std::recursive_mutex& mutex;
    explicit TableLock(Table* table) : mutex(table->mutex) {
        if (!mutex.try_lock()) {
            NoGil nogil;
            mutex.lock();
        }
    }
    ~TableLock() { mutex.unlock(); }
    TableLock(const TableLock&) = delete;
    TableLock& operator=(const TableLock&) = delete;
};

int32_t term_arg(const TableObject& self, int64_t term) {
    if (term < 0 || term >= self.table->size()) {
        PyErr_Format(PyExc_IndexError, "no term %lld in a table of %d", static_cast<long long>(term),
                     self.table->size());
        throw PyFailure();
    }
    return int32_t(term);
}

int32_t int_arg(int64_t number) {
    if (number < -1 || number > INT32_MAX) fail(PyExc_OverflowError, "a count out of range");
    return int32_t(number);
}

int32_t byte_arg(int64_t byte) {
    if (byte < 0 || byte > 255) fail(PyExc_ValueError, "a byte is 0..255");
    return int32_t(byte);
}

std::vector<int32_t> terms_arg(const TableObject& self, nb::handle iterable) {
    std::vector<int32_t> terms;
    for (nb::handle item : iterable) terms.push_back(term_arg(self, int_of(item)));
    return terms;
}

nb::list mask_list(const std::vector<Mask>& found) {
    nb::list list;
    for (const Mask& mask : found) list.append(mask_to_int(mask));
    return list;
}

nb::object args_of(Table* table, int32_t term) {
    switch (table->kind[term]) {
        case K_BYTES:
            return mask_to_int(table->masks[table->a[term]]);
        case K_CAT:
            return nb::make_tuple(table->a[term], table->b[term]);
        case K_REP:
            if (table->c[term] < 0) return nb::make_tuple(table->a[term], table->b[term], nb::none());
            return nb::make_tuple(table->a[term], table->b[term], table->c[term]);
        case K_ALT:
        case K_AND: {
            const int32_t offset = table->a[term], count = table->b[term];
            nb::object members = owned(PyTuple_New(count));
            for (int32_t j = 0; j < count; ++j)
                PyTuple_SET_ITEM(members.ptr(), j, owned(PyLong_FromLong(table->pool[offset + j])).release().ptr());
            return members;
        }
        default:
            return nb::none();
    }
}

// A read-only view of one per-term field, indexed like the pure table's lists (table.kind[t], table.args[t]).
struct TableView {
    nb::object owner;  // the table, kept alive by the view
    Table* table;
    int field;  // 0 kind, 1 args, 2 nullable, 3 has_and
};

nb::object view_item(const TableView& view, Py_ssize_t index) {
    TableLock lock(view.table);
    Table* table = view.table;
    if (index < 0) index += table->size();
    if (index < 0 || index >= table->size()) throw nb::index_error("term index out of range");
    const int32_t term = int32_t(index);
    switch (view.field) {
        case 0: return nb::int_(table->kind[term]);
        case 1: return args_of(table, term);
        case 2: return nb::bool_(table->nullable[term] != 0);
        default: return nb::bool_(table->has_and[term] != 0);
    }
}

TableView make_view(nb::handle self, int field) {
    return TableView{nb::borrow(self), nb::cast<TableObject*>(self)->table, field};
}

// piece_shape(member, narrow_bytes): None, False (the rest is empty), or (unit, low, high or None, rest)
nb::object piece_shape(TableObject& self, int64_t member, int64_t narrow_bytes) {
    TableLock lock(self.table);
    const Table::Shape shape = self.table->piece_shape(term_arg(self, member), int_arg(narrow_bytes));
    if (shape.status == 0) return nb::none();
    if (shape.status == 2) return nb::bool_(false);
    if (shape.high < 0) return nb::make_tuple(shape.unit, shape.low, nb::none(), shape.rest);
    return nb::make_tuple(shape.unit, shape.low, shape.high, shape.rest);
}

void bind_table(nb::module_& m) {
    nb::class_<TableView>(m, "View")
        .def("__len__", [](const TableView& view) { return view.table->size(); })
        .def("__getitem__", &view_item);

    nb::class_<TableObject>(m, "Table")
        .def(nb::init<>())
        .def("__len__", [](const TableObject& self) { return self.table->size(); })
        .def("byte_set", [](TableObject& self, nb::handle set) {
            TableLock lock(self.table);
            return self.table->byte_set(int_to_mask(set));
        })
        .def("cat", [](TableObject& self, int64_t first, int64_t second) {
            TableLock lock(self.table);
            return self.table->cat(term_arg(self, first), term_arg(self, second));
        })
        .def("alt", [](TableObject& self, nb::handle terms) {
            TableLock lock(self.table);
            return self.table->alt(terms_arg(self, terms));
        })
        .def("intersect", [](TableObject& self, nb::handle terms) {
            TableLock lock(self.table);
            return self.table->intersect(terms_arg(self, terms));
        })
        .def("repeat", [](TableObject& self, int64_t term, int64_t low, std::optional<int64_t> high) {
            TableLock lock(self.table);
            const int32_t body = term_arg(self, term);
            if (low < 0 || (high && *high < 0)) fail(PyExc_ValueError, "repeat bounds must be non-negative");
            return self.table->repeat(body, int_arg(low), high ? int_arg(*high) : -1);
        })
        .def("derivative", [](TableObject& self, int64_t term, int64_t byte) {
            TableLock lock(self.table);
            const int32_t of = term_arg(self, term);
            return self.table->derivative(of, byte_arg(byte));
        })
        .def("first_mask", [](TableObject& self, int64_t term) {
            TableLock lock(self.table);
            return mask_to_int(self.table->first_mask(term_arg(self, term)));
        })
        .def("first_bytes", [](TableObject& self, int64_t term) {
            TableLock lock(self.table);
            const nb::list sets = mask_list(self.table->sets[self.table->first_bytes(term_arg(self, term))]);
            return owned(PyFrozenSet_New(sets.ptr()));
        })
        .def("byte_classes", [](TableObject& self, int64_t term) {
            TableLock lock(self.table);
            return mask_list(self.table->byte_classes(term_arg(self, term)));
        })
        .def("is_live", [](TableObject& self, int64_t term) {
            TableLock lock(self.table);
            return self.table->is_live(term_arg(self, term));
        })
        .def("_explore_for_acceptance", [](TableObject& self, int64_t term) {
            TableLock lock(self.table);
            const auto [found, depth] = self.table->explore_for_acceptance(term_arg(self, term));
            return nb::make_tuple(found, depth < 0 ? nb::object(nb::none()) : nb::object(nb::int_(depth)));
        })
        .def("piece_shape", &piece_shape)
        .def("nbytes", [](TableObject& self) {
            TableLock lock(self.table);
            return self.table->nbytes();
        })
        .def_prop_ro("kind", [](nb::handle self) { return make_view(self, 0); })
        .def_prop_ro("args", [](nb::handle self) { return make_view(self, 1); })
        .def_prop_ro("nullable", [](nb::handle self) { return make_view(self, 2); })
        .def_prop_ro("has_and", [](nb::handle self) { return make_view(self, 3); })
        .def_prop_ro("num_undecided", [](const TableObject& self) { return self.table->num_undecided; })
        .def_prop_rw(
            "liveness_step_limit", [](const TableObject& self) { return self.table->step_limit; },
            [](TableObject& self, int64_t limit) {
                if (limit < 0) fail(PyExc_ValueError, "the step limit is a non-negative int");
                self.table->step_limit = limit;
            })
        .def_prop_rw(
            "budget",
            [](const TableObject& self) {
                return self.table->budget ? nb::borrow(self.table->budget) : nb::none();
            },
            [](TableObject& self, nb::object budget) { Py_XSETREF(self.table->budget, budget.release().ptr()); })
        .def_prop_rw(
            "max_terms", [](const TableObject& self) { return self.table->max_terms; },
            [](TableObject& self, int64_t cap) {
                TableLock lock(self.table);
                self.table->max_terms = cap < 0 ? -1 : cap;
            });
}

// ---- the lazy DFA over a table's terms (lazy_dfa.py's storage and moves, in native code) ---------------------
//
// A state is a live term; its row holds, per byte, the state of the derivative (DEAD -1 when empty, UNBUILT -3
// not derived yet). Rows, accepting and built flags live in native blocks that Python views with numpy (read
// only): growing makes new blocks, and a view holds its block, so old views stay valid (the generation counts the
// grows). Blocks are made and freed without the GIL.
// The token walks (a state's mask over the vocabulary trie, tokens one by one) run here too: a move they meet
// unbuilt is derived in place, and they never call Python. What needs the vocabulary's piece facts (whether a wide
// state holds repeat pieces, and their mask at a depth) is registered by Python between walks: a walk that meets
// a wide state or a depth not registered yet walks that subtree plainly (the same tokens, found the slow way) and
// reports it, and Python registers it for the walks after.

constexpr int32_t DEAD = -1, UNBUILT = -3;

constexpr uint8_t FLAG_UNKNOWN = 0, FLAG_PLAIN = 1, FLAG_PIECES = 2;

// The vocabulary's token trie in the layout the walk reads, copied in and checked once per vocabulary: nodes in
// preorder, so the subtree of node n is n .. end[n] - 1; a node's depth is at most one more than the node before
// it (the walk's per-depth stack always holds the parent), below MAX_DEPTH; every id is a token of the mask.
constexpr int32_t MAX_DEPTH = 1024;

struct Trie {
    std::vector<TrieNode> nodes;  // the same nodes packed, for the context-free walk
    std::vector<int32_t> node_byte, node_depth, node_end, node_token, own_ids, roots;
    std::vector<int64_t> own_start, own_end, subtree_end;
    int64_t num_words = 0;
};

// Native memory shared with Python's views of it: each view holds a reference. Small blocks are heap memory; a
// large automaton's blocks are address space reserved once for its state cap (map): pages become memory as rows are
// first written, and growing within the reservation moves nothing.
struct Block {
    std::atomic<int64_t> refs{1};
    int64_t size = 0;
    char* data = nullptr;
    bool mapped = false;

    static Block* make(int64_t size) {
        auto block = std::make_unique<Block>();
        block->data = static_cast<char*>(std::calloc(size_t(std::max<int64_t>(size, 1)), 1));
        if (block->data == nullptr) throw std::bad_alloc();
        block->size = size;
        return block.release();
    }
    // Zero pages on first touch; nullptr when the address space is not there (the caller copies instead).
    static Block* map(int64_t size) {
        void* data = mmap(nullptr, size_t(size), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                          -1, 0);
        if (data == MAP_FAILED) return nullptr;
        auto block = std::make_unique<Block>();
        block->data = static_cast<char*>(data);
        block->size = size;
        block->mapped = true;
        return block.release();
    }
    void hold() { refs.fetch_add(1, std::memory_order_relaxed); }
    void drop() {
        if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) {
            if (mapped)
                munmap(data, size_t(size));
            else
                std::free(data);
            delete this;
        }
    }
};

// Growing by copying doubles the rows; past MAP_AFTER states (4 MiB of rows) an automaton reserves address space
// for its state cap (MAP_UNCAPPED states without one) and grows in steps of MAP_STEP states without copying: a
// copy of 16,384 states' rows took 22 ms, of 32,768 41 ms, inside whichever mask met the new state.
constexpr int64_t MAP_AFTER = 4096, MAP_STEP = 1024, MAP_UNCAPPED = int64_t(1) << 20;

// What Python registered for a state holding pieces, at one depth: the pieces' mask words (empty when the
// pieces' facts are not exact there: the subtree is walked plainly) and the state of the other members.
struct PieceAnswer {
    std::vector<uint32_t> allowed;
    int32_t other = DEAD;
};

// Per token index (its vocabulary's piece facts): the flags of the states it has settled and the piece answers
// registered, by (state << 16 | depth).
struct FlagSet {
    int64_t num_words = 0;  // a mask row's words: every answer's, and the trie's of every walk
    std::vector<uint8_t> flags;
    std::unordered_map<int64_t, PieceAnswer> answers;
    size_t exact_answers = 0;
};

// Past this many exact answers a flag set keeps registering answers as "walk plainly" (about 24 MB of masks at
// 49k tokens): correct, slower, bounded.
constexpr size_t MAX_EXACT_ANSWERS = 4096;

inline int64_t answer_key(int32_t state, int32_t depth) { return (int64_t(state) << 16) | depth; }

struct Dfa {
    Table* table;
    std::vector<int32_t> state_terms;
    std::unordered_map<int32_t, int32_t> state_ids;
    std::vector<const std::vector<Mask>*> classes;  // per state, into the table's partitions; null: not yet
    Block* blocks[3] = {nullptr, nullptr, nullptr};  // trans, accepting, built
    int32_t* trans = nullptr;
    uint8_t* accepting = nullptr;
    uint8_t* built = nullptr;
    int64_t capacity = 0, generation = 0;
    int64_t reserved = 0;  // the states the mapped blocks hold room for (0: heap blocks)
    std::deque<FlagSet> flag_sets;  // per token index
    std::atomic<int64_t> answer_bytes{0};  // the piece answers' masks, for the grammar's memory count
    int64_t max_states = -1;                // -1: no cap
    int narrow_bytes = 32;  // a state whose first bytes are at most this many holds no repeat piece

    explicit Dfa(Table* t) : table(t) { grow(16); }
    ~Dfa() {
        for (Block* block : blocks)
            if (block != nullptr) block->drop();
    }

    void grow(int64_t size) {
        if (size <= capacity) return;
        if (reserved >= size) {  // within the reservation: the next step's rows, nothing moves
            const int64_t grown = std::min(reserved, std::max(size, capacity + MAP_STEP));
            std::fill(trans + capacity * 256, trans + grown * 256, UNBUILT);
            capacity = grown;
            ++generation;
            return;
        }
        int64_t grown = std::max<int64_t>(size, 2 * capacity);
        // the reservation: the cap's states, never past MAP_UNCAPPED (a larger cap grows by copying past it)
        const int64_t limit = std::max<int64_t>(max_states >= 0 ? std::min(max_states, MAP_UNCAPPED) : MAP_UNCAPPED, size);
        const bool mapping = reserved == 0 && grown > MAP_AFTER && limit > capacity + MAP_STEP;
        if (mapping) grown = std::min(limit, std::max(size, capacity + MAP_STEP));
        const int64_t widths[3] = {256 * 4, 1, 1};
        Block* fresh[3] = {nullptr, nullptr, nullptr};
        bool mapped = mapping;
        for (int k = 0; k < 3 && mapped; ++k) mapped = (fresh[k] = Block::map(limit * widths[k])) != nullptr;
        if (!mapped) {
            for (Block*& block : fresh)
                if (block != nullptr) block->drop(), block = nullptr;
            grown = std::max<int64_t>(size, 2 * capacity);
            try {
                for (int k = 0; k < 3; ++k) fresh[k] = Block::make(grown * widths[k]);
            } catch (std::bad_alloc&) {
                for (Block* block : fresh)
                    if (block != nullptr) block->drop();
                throw;
            }
        }
        for (int k = 0; k < 3; ++k) {
            const int64_t kept = capacity * widths[k];
            if (kept) std::memcpy(fresh[k]->data, blocks[k]->data, size_t(kept));
            if (k == 0) {
                int32_t* rows = reinterpret_cast<int32_t*>(fresh[k]->data);
                std::fill(rows + capacity * 256, rows + grown * 256, UNBUILT);
            }
            if (blocks[k] != nullptr) blocks[k]->drop();  // a Python view may still hold it
            blocks[k] = fresh[k];
        }
        trans = reinterpret_cast<int32_t*>(blocks[0]->data);
        accepting = reinterpret_cast<uint8_t*>(blocks[1]->data);
        built = reinterpret_cast<uint8_t*>(blocks[2]->data);
        capacity = grown;
        reserved = mapped ? limit : 0;
        ++generation;
    }

    int32_t num_states() const { return int32_t(state_terms.size()); }

    int32_t state_of(int32_t term) {
        auto known = state_ids.find(term);
        if (known != state_ids.end()) return known->second;
        if (!table->is_live(term)) return DEAD;
        const int32_t state = num_states();
        if (max_states >= 0 && state >= max_states) {
            WithGil gil;
            PyErr_Format(LimitError, "the grammar's automaton reached its cap of %lld states",
                         static_cast<long long>(max_states));
            throw PyFailure();
        }
        grow(int64_t(state) + 1);
        state_terms.push_back(term);
        classes.push_back(nullptr);
        state_ids.emplace(term, state);
        accepting[state] = table->nullable[term];
        return state;
    }

    // The byte classes of a state (cached); the first call marks the bytes outside them all dead.
    const std::vector<Mask>& classes_of(int32_t state) {
        if (classes[state] != nullptr) return *classes[state];
        const std::vector<Mask>& found = table->byte_classes(state_terms[state]);
        classes[state] = &found;  // partitions are map nodes: the address is stable
        Mask covered;
        for (const Mask& cls : found) covered = covered | cls;
        if (covered.count() != 256) {
            int32_t* row = trans + int64_t(state) * 256;
            for (int byte = 0; byte < 256; ++byte) row[byte] = covered.test(byte) ? UNBUILT : DEAD;
        }
        return found;
    }

    void build_class(int32_t state, const Mask& cls) {
        const int32_t following = state_of(table->derivative(state_terms[state], cls.lowest()));
        int32_t* row = trans + int64_t(state) * 256;  // after state_of: it may have grown the rows
        for (int k = 0; k < 4; ++k)
            for (uint64_t bits = cls.w[k]; bits; bits &= bits - 1) row[k * 64 + __builtin_ctzll(bits)] = following;
    }

    int32_t next_state(int32_t state, int byte) {
        const int32_t known = trans[int64_t(state) * 256 + byte];
        if (known != UNBUILT) return known;
        for (const Mask& cls : classes_of(state)) {
            if (cls.test(byte)) {
                build_class(state, cls);
                break;
            }
        }
        return trans[int64_t(state) * 256 + byte];
    }

    void build_row(int32_t state) {
        for (const Mask& cls : classes_of(state))
            if (trans[int64_t(state) * 256 + cls.lowest()] == UNBUILT) build_class(state, cls);
        built[state] = 1;
    }

    // A state's flag in a flag set, settled here when its first bytes are few (plain); FLAG_UNKNOWN for a wide
    // state nobody has registered yet.
    __attribute__((noinline)) uint8_t flag_of(FlagSet& set, int32_t state) {
        if (size_t(state) >= set.flags.size())
            set.flags.resize(std::max<size_t>(size_t(capacity), size_t(state) + 1), FLAG_UNKNOWN);
        if (set.flags[state] != FLAG_UNKNOWN) return set.flags[state];
        if (table->first_mask(state_terms[state]).count() > narrow_bytes) return FLAG_UNKNOWN;
        if (size_t(state) >= set.flags.size()) set.flags.resize(size_t(state) + 1, FLAG_UNKNOWN);
        set.flags[state] = FLAG_PLAIN;
        return FLAG_PLAIN;
    }

    // Nodes are numbered in preorder, so the subtree of node n is the run n .. end[n] - 1 and a walk is one pass
    // over it: a node's parent state sits in a per-depth stack, a dead move skips the whole subtree.
    // node_token: the id ending at the node, -1 none, -2 several (then own_ids[own_start[n]:own_end[n]]);
    // own_ids[own_start[n]:subtree_end[n]] are all the ids at or below n.
    // A node with children reached in a state flagged FLAG_PIECES takes the answer registered for (state, depth):
    // its subtree's tokens from the pieces' mask, and the pass goes on below it in the other members' state. A
    // wide state not flagged yet, or a depth with no answer, is walked plainly and its (state, depth) added to
    // `pending` for Python to register. The tokens found are or-ed into words (trie.num_words of them).
    void walk_trie(const Trie& trie, int32_t state, FlagSet& set, uint32_t* words, std::vector<int64_t>& pending) {
        const int32_t* node_byte = trie.node_byte.data();
        const int32_t* node_depth = trie.node_depth.data();
        const int32_t* node_end = trie.node_end.data();
        const int32_t* node_token = trie.node_token.data();
        const int64_t* own_start = trie.own_start.data();
        const int64_t* own_end = trie.own_end.data();
        const int64_t* subtree_end = trie.subtree_end.data();
        const int32_t* own_ids = trie.own_ids.data();
        const int32_t* roots = trie.roots.data();
        const int64_t n_roots = int64_t(trie.roots.size());
        thread_local std::vector<int32_t> found_ids;
        found_ids.resize(trie.own_ids.size() + 1);
        int32_t* found = found_ids.data();
        int32_t stack[MAX_DEPTH];
        int64_t n_found = 0;
        // Hot values in locals (the compiler cannot keep members in registers across calls): the rows and the
        // flags are read again after anything that may derive or settle a flag.
        const int32_t* rows = trans;
        const uint8_t* known_flags = set.flags.data();
        size_t n_flags = set.flags.size();
        for (int64_t p = 0; p < n_roots; ++p) {
            const int32_t top = roots[p], end = node_end[top], base = node_depth[top] - 1;
            stack[0] = state;
            int32_t i = top;
            while (i < end) {
                const int32_t level = node_depth[i] - base;  // 1 at top
                const int32_t parent = stack[level - 1];
                const int32_t byte = node_byte[i];
                int32_t t = rows[int64_t(parent) * 256 + byte];
                if (__builtin_expect(t == UNBUILT, 0)) {
                    t = next_state(parent, byte);
                    rows = trans;
                }
                if (t < 0) {
                    i = node_end[i];
                    continue;
                }
                uint8_t flag = FLAG_PLAIN;
                if (node_end[i] != i + 1) {  // only a node with children needs its state's flag
                    flag = size_t(t) < n_flags ? known_flags[t] : FLAG_UNKNOWN;
                    if (__builtin_expect(flag == FLAG_UNKNOWN, 0)) {
                        flag = flag_of(set, t);
                        rows = trans;
                        known_flags = set.flags.data();
                        n_flags = set.flags.size();
                        if (flag == FLAG_UNKNOWN) {
                            pending.push_back(answer_key(t, node_depth[i]));
                            flag = FLAG_PLAIN;
                        }
                    }
                }
                const int32_t id = node_token[i];
                found[n_found] = id;  // listed now, set below: bits or-ed in here, in trie order, stalled the walk
                n_found += id >= 0;
                if (__builtin_expect(id == -2, 0)) {
                    for (int64_t j = own_start[i]; j < own_end[i]; ++j) found[n_found++] = own_ids[j];
                }
                stack[level] = t;
                if (__builtin_expect(flag == FLAG_PIECES, 0)) {
                    const auto answer = set.answers.find(answer_key(t, node_depth[i]));
                    if (answer == set.answers.end()) {
                        pending.push_back(answer_key(t, node_depth[i]));
                    } else if (!answer->second.allowed.empty()) {
                        // exact: the subtree from the pieces' mask, below it the others
                        const uint32_t* allowed = answer->second.allowed.data();
                        for (int64_t j = own_start[i]; j < subtree_end[i]; ++j) {
                            const int32_t below = own_ids[j];
                            words[below >> 5] |= allowed[below >> 5] & (1u << (below & 31));
                        }
                        if (answer->second.other < 0) {
                            i = node_end[i];
                            continue;
                        }
                        stack[level] = answer->second.other;
                    }
                }
                ++i;
            }
        }
        for (int64_t j = 0; j < n_found; ++j) words[found[j] >> 5] |= 1u << (found[j] & 31);
        std::sort(pending.begin(), pending.end());
        pending.erase(std::unique(pending.begin(), pending.end()), pending.end());
    }

    // The state after a token's bytes from `state`, or DEAD.
    int32_t advance(int32_t state, const uint8_t* bytes, int64_t length) {
        for (int64_t k = 0; k < length && state >= 0; ++k) {
            int32_t next = trans[int64_t(state) * 256 + bytes[k]];
            if (next == UNBUILT) next = next_state(state, bytes[k]);
            state = next;
        }
        return state < 0 ? DEAD : state;
    }

    // The bytes every continuation from `state` starts with: while the state is not accepting and exactly one
    // byte keeps it alive, that byte (at most `limit` of them). The rows it meets are built. A limit met while
    // building one ends the span there, its error cleared: the bytes found are forced all the same, and the
    // cursor meets the limit itself where its own moves need that row. Other errors unwind as usual.
    std::string forced(int32_t state, int64_t limit) {
        std::string out;
        try {
            while (state >= 0 && int64_t(out.size()) < limit && !accepting[state]) {
                if (!built[state]) build_row(state);
                const int32_t* row = trans + int64_t(state) * 256;
                int live = -1;
                for (int byte = 0; byte < 256; ++byte) {
                    if (row[byte] < 0) continue;
                    if (live >= 0) return out;
                    live = byte;
                }
                if (live < 0) break;
                out.push_back(char(live));
                state = row[live];
            }
        } catch (const PyFailure&) {
            WithGil gil;
            if (!PyErr_ExceptionMatches(LimitError)) throw;
            PyErr_Clear();
        }
        return out;
    }

    // Each token's bytes from offsets[k] on, walked from state `start` until a dead move: units[k] counts the
    // bytes taken at `start`, exits[k] is where it died (-1 never), at_start[k] (0/1) whether it died at `start`.
    // tokens is the [*, width] byte matrix; ids_offsets is ids[n] then offsets[n] (int64); out is units[n],
    // exits[n], at_start[n] (int32).
    void walk_tokens(const uint8_t* tokens, int64_t width, const int32_t* lengths, const int64_t* ids_offsets,
                     int64_t n, int32_t start, int32_t* out) {
        const int64_t* ids = ids_offsets;
        const int64_t* offsets = ids_offsets + n;
        int32_t* units = out;
        int32_t* exits = out + n;
        int32_t* at_start = out + 2 * n;
        for (int64_t k = 0; k < n; ++k) {
            const int64_t id = ids[k];
            const uint8_t* bytes = tokens + id * width;
            int32_t state = start, count = 0;
            exits[k] = -1;
            at_start[k] = 0;
            for (int32_t depth = int32_t(offsets[k]); depth < lengths[id]; ++depth) {
                int32_t next = trans[int64_t(state) * 256 + bytes[depth]];
                if (next == UNBUILT) next = next_state(state, bytes[depth]);
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
};

// The instance behind a handle, or null where it is not a ready instance of T.
template <typename T>
T* instance_of(PyObject* object) {
    const nb::handle handle(object);
    if (!nb::isinstance<T>(handle) || !nb::inst_ready(handle)) return nullptr;
    return nb::inst_ptr<T>(handle);
}

// corral._native.Trie: the vocabulary's trie, copied in and checked once.
struct TrieObject {
    std::unique_ptr<Trie> trie;
};

template <typename T>
std::vector<T> copied(nb::handle array) {
    const HeldBuffer held(array.ptr(), PyBUF_C_CONTIGUOUS, sizeof(T));
    return std::vector<T>(held.data<const T>(), held.data<const T>() + held.count());
}

// Trie(node_byte, node_depth, node_end, node_token, own_start, own_end, subtree_end, own_ids, roots, num_words):
// int32 arrays but own_start, own_end, subtree_end (int64); checked here, so that no walk reads out of bounds.
void trie_init(TrieObject* self, nb::handle node_byte, nb::handle node_depth, nb::handle node_end,
               nb::handle node_token, nb::handle own_start, nb::handle own_end, nb::handle subtree_end,
               nb::handle own_ids, nb::handle roots, int64_t num_words) {
    auto trie = std::make_unique<Trie>();
    trie->node_byte = copied<int32_t>(node_byte);
    trie->node_depth = copied<int32_t>(node_depth);
    trie->node_end = copied<int32_t>(node_end);
    trie->node_token = copied<int32_t>(node_token);
    trie->own_start = copied<int64_t>(own_start);
    trie->own_end = copied<int64_t>(own_end);
    trie->subtree_end = copied<int64_t>(subtree_end);
    trie->own_ids = copied<int32_t>(own_ids);
    trie->roots = copied<int32_t>(roots);
    trie->num_words = num_words;
    const size_t n = trie->node_byte.size();
    const int64_t ids = int64_t(trie->own_ids.size()), limit = num_words * 32;
    if (trie->node_depth.size() != n || trie->node_end.size() != n || trie->node_token.size() != n ||
        trie->own_start.size() != n || trie->own_end.size() != n || trie->subtree_end.size() != n ||
        num_words < 0)
        fail(PyExc_ValueError, "Trie: the node arrays differ in length");
    int64_t listed = 0;
    for (size_t i = 0; i < n; ++i) {
        const int32_t depth = trie->node_depth[i];
        if (trie->node_byte[i] < 0 || trie->node_byte[i] > 255 || depth < 0 || depth >= MAX_DEPTH ||
            (i > 0 && depth < 1) || (i + 1 < n && trie->node_depth[i + 1] > depth + 1) ||
            trie->node_end[i] <= int32_t(i) || size_t(trie->node_end[i]) > n ||
            trie->node_token[i] < -2 || trie->node_token[i] >= limit ||
            trie->own_start[i] < 0 || trie->own_start[i] > trie->own_end[i] ||
            trie->own_end[i] > trie->subtree_end[i] || trie->subtree_end[i] > ids)
            fail(PyExc_ValueError, "Trie: a node out of shape (preorder, depths, ranges, ids)");
        const int32_t token = trie->node_token[i];
        listed += token >= 0 ? 1 : token == -2 ? trie->own_end[i] - trie->own_start[i] : 0;
    }
    if (listed > ids) fail(PyExc_ValueError, "Trie: more tokens at nodes than ids");
    trie->nodes.resize(n);
    for (size_t i = 0; i < n; ++i)
        trie->nodes[i] = TrieNode{trie->node_end[i], trie->node_token[i],
                                  (trie->node_depth[i] << 8) | trie->node_byte[i]};
    for (int32_t id : trie->own_ids)
        if (id < 0 || id >= limit) fail(PyExc_ValueError, "Trie: a token id outside the mask");
    for (int32_t root : trie->roots)
        if (root < 1 || size_t(root) >= n || trie->node_depth[root] != 1)
            fail(PyExc_ValueError, "Trie: a root that is not a first-level node");
    new (self) TrieObject{std::move(trie)};
}

// corral._native.Dfa: the lazy automaton over one table's terms.
struct DfaObject {
    nb::object owner;  // the table, which outlives the automaton
    TableObject* table;
    Dfa* dfa;
    DfaObject(nb::object owner_, TableObject* table_)
        : owner(std::move(owner_)), table(table_), dfa(new Dfa(table->table)) {}
    ~DfaObject() { delete dfa; }  // before the table goes
    DfaObject(const DfaObject&) = delete;
    DfaObject& operator=(const DfaObject&) = delete;
};

int32_t state_arg(const DfaObject& self, int64_t state) {
    if (state < 0 || state >= self.dfa->num_states()) {
        PyErr_Format(PyExc_IndexError, "no state %lld in an automaton of %d", static_cast<long long>(state),
                     self.dfa->num_states());
        throw PyFailure();
    }
    return int32_t(state);
}

FlagSet& flag_set_arg(DfaObject& self, int64_t value) {
    if (value < 0 || uint64_t(value) >= self.dfa->flag_sets.size()) fail(PyExc_IndexError, "no such flag set");
    return self.dfa->flag_sets[size_t(value)];
}

// walk_trie(trie, state, flag_set, words, fuel) -> ([(state, depth), ...], fuel left): or the tokens allowed in
// state into words (uint32, the trie's num_words, the flag set's), with the GIL released for the whole walk; fuel
// caps the new terms it may make (-1: none; -2: whatever this thread's fuel holds, see set_thread_fuel). Returns
// the wide states, with the depths they were met at, that the flag set has no flag or no piece answer for (walked
// plainly this time), which Python registers with set_flag and set_piece_answer under the fuel the walk left. A
// walk that fails registers nothing: the states it built stay built, and the next walk that meets them returns
// them.
nb::tuple walk_trie(DfaObject& self, const TrieObject& trie_object, int64_t state_number, int64_t flag_set,
                    nb::handle words_array, int64_t fuel) {
    const Trie& trie = *trie_object.trie;
    std::vector<int64_t> pending;
    int64_t left = -1;
    {
        TableLock lock(self.dfa->table);
        const int32_t state = state_arg(self, state_number);
        FlagSet& set = flag_set_arg(self, flag_set);
        const HeldBuffer words(words_array.ptr(), PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE, 4);
        if (words.count() != trie.num_words) fail(PyExc_ValueError, "walk_trie: words is not one mask row");
        if (set.num_words != trie.num_words)
            fail(PyExc_ValueError, "walk_trie: the flag set's rows are not the trie's");
        if (fuel < -2) fail(PyExc_ValueError, "walk_trie: fuel must be >= -2");
        std::optional<FuelScope> scope;  // -2: the thread's fuel, which the rest of the mask goes on spending
        if (fuel != -2) scope.emplace(fuel, fuel);
        {
            NoGil nogil;
            maybe_wait();
            self.dfa->walk_trie(trie, state, set, words.data<uint32_t>(), pending);
        }
        left = thread_fuel;
    }
    nb::list out;
    for (int64_t entry : pending) out.append(nb::make_tuple(int(entry >> 16), int(entry & 0xffff)));
    return nb::make_tuple(out, left);
}

// set_piece_answer(flag_set, state, depth, other, allowed): for a state holding pieces met after depth bytes, the
// state of its other members (DEAD -1 when none) and the pieces' mask words (uint32, one mask row; None when their
// facts are not exact there). Past MAX_EXACT_ANSWERS exact answers, a new one is kept as "walk plainly".
void set_piece_answer(DfaObject& self, int64_t flag_set, int64_t state_number, int64_t depth, int64_t other,
                      nb::handle allowed_array) {
    TableLock lock(self.dfa->table);
    FlagSet& set = flag_set_arg(self, flag_set);
    const int32_t state = state_arg(self, state_number);
    if (depth < 0 || depth >= MAX_DEPTH) fail(PyExc_ValueError, "set_piece_answer: a depth outside the trie's");
    if (other != DEAD) state_arg(self, other);
    PieceAnswer answer;
    answer.other = int32_t(other);
    if (!allowed_array.is_none() && set.exact_answers < MAX_EXACT_ANSWERS) {
        const HeldBuffer allowed(allowed_array.ptr(), PyBUF_C_CONTIGUOUS, 4);
        if (allowed.count() != set.num_words) fail(PyExc_ValueError, "set_piece_answer: allowed is not one mask row");
        answer.allowed.assign(allowed.data<const uint32_t>(), allowed.data<const uint32_t>() + allowed.count());
    }
    const int64_t key = answer_key(state, int32_t(depth));
    auto known = set.answers.find(key);
    if (known != set.answers.end()) {
        self.dfa->answer_bytes -= int64_t(known->second.allowed.size() * 4);
        set.exact_answers -= !known->second.allowed.empty();
    }
    self.dfa->answer_bytes += int64_t(answer.allowed.size() * 4);
    set.exact_answers += !answer.allowed.empty();
    set.answers[key] = std::move(answer);
}

// walk_tokens(tokens, lengths, ids_offsets, start, out): tokens uint8 [*, width], lengths int32, ids_offsets
// int64 [2, n], out int32 [3, n]; all C-contiguous
void walk_tokens(DfaObject& self, nb::handle tokens_array, nb::handle lengths_array, nb::handle ids_offsets_array,
                 int64_t start_state, nb::handle out_array) {
    TableLock lock(self.dfa->table);
    const HeldBuffer tokens(tokens_array.ptr(), PyBUF_C_CONTIGUOUS | PyBUF_ND, 1);
    const HeldBuffer lengths(lengths_array.ptr(), PyBUF_C_CONTIGUOUS, 4);
    const HeldBuffer ids_offsets(ids_offsets_array.ptr(), PyBUF_C_CONTIGUOUS, 8);
    const int32_t start = state_arg(self, start_state);
    const HeldBuffer out(out_array.ptr(), PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE, 4);
    if (tokens.view.ndim != 2 || ids_offsets.count() % 2 || out.count() != ids_offsets.count() / 2 * 3 ||
        lengths.count() != tokens.view.shape[0])
        fail(PyExc_ValueError, "walk_tokens: arrays of mismatched shapes");
    const int64_t n = ids_offsets.count() / 2, rows = tokens.view.shape[0], width = tokens.view.shape[1];
    const int64_t* ids = ids_offsets.data<const int64_t>();
    const int32_t* length = lengths.data<const int32_t>();
    for (int64_t k = 0; k < n; ++k)
        if (ids[k] < 0 || ids[k] >= rows || ids[n + k] < 0 || length[ids[k]] < 0 || length[ids[k]] > width)
            fail(PyExc_IndexError, "walk_tokens: a token id, offset or length outside the byte matrix");
    NoGil nogil;
    self.dfa->walk_tokens(tokens.data<const uint8_t>(), width, length, ids, n, start, out.data<int32_t>());
}

// A read-only Python buffer over one native Block (the automaton's rows, accepting or built flags).
struct BlockView {
    Block* block;  // held
    int64_t size;  // the bytes in use when the view was made (a mapped block is larger)
    BlockView(Block* block_, int64_t size_) : block(block_), size(size_) { block->hold(); }
    ~BlockView() { block->drop(); }
    BlockView(const BlockView&) = delete;
    BlockView& operator=(const BlockView&) = delete;
};

int block_view_getbuffer(PyObject* self, Py_buffer* view, int flags) {
    if (!nb::inst_ready(self)) {  // BlockView.__new__ makes one with no block behind it
        PyErr_SetString(PyExc_BufferError, "a BlockView that no automaton made");
        view->obj = nullptr;
        return -1;
    }
    const BlockView* block_view = nb::inst_ptr<BlockView>(self);
    return PyBuffer_FillInfo(view, self, block_view->block->data, block_view->size, 1, flags);
}

PyType_Slot block_view_slots[] = {
    {Py_bf_getbuffer, reinterpret_cast<void*>(block_view_getbuffer)},
    {0, nullptr},
};

// buffers() -> (trans, accepting, built, capacity): read-only buffers over the current blocks
nb::tuple buffers(DfaObject& self) {
    TableLock lock(self.dfa->table);
    nb::object views[3];
    for (int k = 0; k < 3; ++k) {
        // owned here until the cast has made its Python object, so a failed cast still drops the block's hold
        auto view = std::make_unique<BlockView>(self.dfa->blocks[k], self.dfa->capacity * (k == 0 ? 256 * 4 : 1));
        views[k] = nb::cast(view.get(), nb::rv_policy::take_ownership);
        view.release();
    }
    return nb::make_tuple(views[0], views[1], views[2], self.dfa->capacity);
}

// or_bits(words, ids): set the bit of every token id (int32 or int64) in the bitmask words (int32 or uint32)
void or_bits(nb::handle words_array, nb::handle ids_array) {
    const HeldBuffer words(words_array.ptr(), PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE, 4);
    HeldBuffer ids;
    if (PyObject_GetBuffer(ids_array.ptr(), &ids.view, PyBUF_C_CONTIGUOUS) < 0) throw PyFailure();
    ids.held = true;
    if (ids.view.itemsize != 4 && ids.view.itemsize != 8) fail(PyExc_TypeError, "or_bits: ids must be int32 or int64");
    uint32_t* out = words.data<uint32_t>();
    const int64_t limit = int64_t(words.count()) * 32;
    const Py_ssize_t n = ids.count();
    for (Py_ssize_t k = 0; k < n; ++k) {
        const int64_t id = ids.view.itemsize == 8 ? ids.data<const int64_t>()[k] : ids.data<const int32_t>()[k];
        if (id < 0 || id >= limit) {
            PyErr_Format(PyExc_IndexError, "token id %lld outside the mask", static_cast<long long>(id));
            throw PyFailure();
        }
        out[id >> 5] |= 1u << (id & 31);
    }
}

// set_thread_fuel(fuel, given) -> (fuel, given) this thread had before: the new terms what this thread derives next
// may make (-1: no cap), named in the error as a fuel of `given`. Python sets it around a whole mask (its rows,
// nested masks, walk and registrations: corral/fsm/native_walk.py mask_fuel) and restores it after.
nb::tuple set_thread_fuel(int64_t fuel, int64_t given) {
    const int64_t before = thread_fuel, before_given = thread_fuel_given;
    thread_fuel = fuel < 0 ? -1 : fuel;
    thread_fuel_given = given;
    return nb::make_tuple(before, before_given);
}

void bind_dfa(nb::module_& m) {
    nb::class_<TrieObject>(m, "Trie").def("__init__", &trie_init);

    nb::class_<BlockView>(m, "BlockView", nb::type_slots(block_view_slots));

    nb::class_<DfaObject>(m, "Dfa")
        .def("__init__", [](DfaObject* self, nb::object owner) {
            TableObject* table = instance_of<TableObject>(owner.ptr());
            if (table == nullptr) throw nb::type_error("Dfa: a corral._native.Table was expected");
            new (self) DfaObject(std::move(owner), table);
        })
        .def("state_of", [](DfaObject& self, int64_t term) {
            TableLock lock(self.dfa->table);
            return self.dfa->state_of(term_arg(*self.table, term));
        })
        .def("term_of", [](DfaObject& self, int64_t state) {
            TableLock lock(self.dfa->table);
            return self.dfa->state_terms[state_arg(self, state)];
        })
        .def("next_state", [](DfaObject& self, int64_t state, int64_t byte) {
            TableLock lock(self.dfa->table);
            const int32_t from = state_arg(self, state);
            return self.dfa->next_state(from, byte_arg(byte));
        })
        .def("build_row", [](DfaObject& self, int64_t state) {
            TableLock lock(self.dfa->table);
            self.dfa->build_row(state_arg(self, state));
        })
        .def("classes_of", [](DfaObject& self, int64_t state) {
            TableLock lock(self.dfa->table);
            return mask_list(self.dfa->classes_of(state_arg(self, state)));
        })
        .def("walk_trie", &walk_trie)
        .def("walk_tokens", &walk_tokens)
        .def("set_flag", [](DfaObject& self, int64_t flag_set, int64_t state_number, int64_t flag) {
            // whether state holds repeat pieces (2) or not (1), for the walks of that set
            TableLock lock(self.dfa->table);
            FlagSet& set = flag_set_arg(self, flag_set);
            const int32_t state = state_arg(self, state_number);
            if (flag != FLAG_PLAIN && flag != FLAG_PIECES) fail(PyExc_ValueError, "set_flag: a flag is 1 or 2");
            if (size_t(state) >= set.flags.size()) set.flags.resize(size_t(state) + 1, FLAG_UNKNOWN);
            set.flags[size_t(state)] = uint8_t(flag);
        })
        .def("set_piece_answer", &set_piece_answer, nb::arg("flag_set"), nb::arg("state"), nb::arg("depth"),
             nb::arg("other"), nb::arg("allowed").none())
        .def("new_flag_set", [](DfaObject& self, int64_t num_words) {
            // a new flag set's number, for walks whose mask rows are num_words uint32 words
            TableLock lock(self.dfa->table);
            if (num_words < 1 || num_words > (int64_t(1) << 26))
                fail(PyExc_ValueError, "new_flag_set: no mask is that long");
            self.dfa->flag_sets.emplace_back();
            self.dfa->flag_sets.back().num_words = num_words;
            return self.dfa->flag_sets.size() - 1;
        })
        .def("advance", [](DfaObject& self, int64_t state_number, nb::handle token_bytes) {
            // the state after the token's bytes, or DEAD (-1)
            TableLock lock(self.dfa->table);
            const int32_t state = state_arg(self, state_number);
            const HeldBuffer bytes(token_bytes.ptr(), PyBUF_SIMPLE, 1);
            NoGil nogil;
            return self.dfa->advance(state, bytes.data<const uint8_t>(), bytes.count());
        })
        .def("forced", [](DfaObject& self, int64_t state_number, int64_t limit) {
            // the bytes forced from the state, at most limit of them (see Dfa::forced)
            TableLock lock(self.dfa->table);
            const std::string out = self.dfa->forced(state_arg(self, state_number), limit);
            return nb::bytes(out.data(), out.size());
        })
        .def("flags_of", [](DfaObject& self, int64_t flag_set) {
            TableLock lock(self.dfa->table);
            std::vector<uint8_t> flags = flag_set_arg(self, flag_set).flags;
            flags.resize(size_t(self.dfa->num_states()), FLAG_UNKNOWN);
            return nb::bytes(flags.data(), flags.size());
        })
        .def("states_left", [](DfaObject& self) {
            TableLock lock(self.dfa->table);
            nb::list left;
            for (int32_t state = 0; state < self.dfa->num_states(); ++state)
                if (self.dfa->classes[state] != nullptr) left.append(state);
            return left;
        })
        .def("buffers", &buffers)
        .def_prop_ro("num_states", [](DfaObject& self) {
            TableLock lock(self.dfa->table);
            return self.dfa->num_states();
        })
        .def_prop_ro("generation", [](const DfaObject& self) { return int64_t(self.dfa->generation); })
        .def_prop_ro("piece_bytes", [](const DfaObject& self) { return self.dfa->answer_bytes.load(); })
        .def_prop_rw(
            "max_states", [](const DfaObject& self) { return self.dfa->max_states; },
            [](DfaObject& self, int64_t cap) {
                TableLock lock(self.dfa->table);
                self.dfa->max_states = cap < 0 ? -1 : cap;
            });

    m.def("or_bits", &or_bits);
    m.def("set_thread_fuel", &set_thread_fuel);
}

}  // namespace

bool trie_view(PyObject* object, TrieView* out) {
    const TrieObject* found = instance_of<TrieObject>(object);
    if (found == nullptr) {
        PyErr_SetString(PyExc_TypeError, "a corral._native.Trie was expected");
        return false;
    }
    const Trie& trie = *found->trie;
    *out = TrieView{trie.nodes.data(), trie.node_byte.data(), trie.node_depth.data(), trie.node_end.data(),
                    trie.node_token.data(), trie.own_ids.data(), trie.roots.data(), trie.own_start.data(),
                    trie.own_end.data(), int64_t(trie.node_byte.size()), int64_t(trie.roots.size()), trie.num_words,
                    trie.subtree_end.data()};
    return true;
}

void* dfa_of(PyObject* object) {
    DfaObject* found = instance_of<DfaObject>(object);
    if (found == nullptr) {
        PyErr_SetString(PyExc_TypeError, "a corral._native.Dfa was expected");
        return nullptr;
    }
    return found->dfa;
}

int32_t dfa_next(void* handle, int32_t state, int byte, int64_t* fuel, int64_t fuel_given) {
    Dfa* dfa = static_cast<Dfa*>(handle);
    TableLock lock(dfa->table);
    FuelScope scope(*fuel, fuel_given);  // the caller's for this move
    const int32_t following = dfa->next_state(state, byte);
    if (*fuel >= 0) *fuel = thread_fuel;
    return following;
}

bool dfa_accepting(void* handle, int32_t state) {
    Dfa* dfa = static_cast<Dfa*>(handle);
    TableLock lock(dfa->table);
    return dfa->accepting[state] != 0;
}

int32_t dfa_num_states(void* handle) { return static_cast<Dfa*>(handle)->num_states(); }

void add_terms(nb::module_& m) {
    bind_table(m);
    bind_dfa(m);
}

}  // namespace corral_native

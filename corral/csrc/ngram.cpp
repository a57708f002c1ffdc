// NgramIndex: prompt lookup's index of one sequence's tokens (corral/engine/speculation.py). For each n up to its
// order, every n-gram of the tokens maps to the position right after its latest occurrence; a draft is what
// followed the longest suffix of the text that occurred before. The index grows with the sequence, one call per
// step reading only the tokens added since the call before, so a step's lookup costs a few hash probes, with no
// Python object made per n-gram: 60-75 bytes a token, where a dict of tuples took 260-300, and most of the
// drafter's time after a forward, its data cold.
#include "common.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace corral_native {
namespace {

constexpr int64_t MAX_ORDER = 8;

// One order's n-grams: open addressing, linear probing, at most 7/10 full. A slot is its n token ids and the
// position after the n-gram (-1: empty).
struct Table {
    int64_t n = 0, used = 0;
    std::vector<uint32_t> keys;  // [capacity, n]
    std::vector<int32_t> ends;   // [capacity]

    static uint64_t hash(const uint32_t* key, int64_t n) {
        uint64_t h = 0x9E3779B97F4A7C15ull * uint64_t(n);
        for (int64_t i = 0; i < n; ++i) {
            h ^= key[i];
            h *= 0xBF58476D1CE4E5B9ull;
            h ^= h >> 31;
        }
        return h;
    }

    // The slot of `key`, or of the empty slot where it would go.
    size_t slot(const uint32_t* key) const {
        const size_t mask = ends.size() - 1;
        for (size_t at = size_t(hash(key, n)) & mask;; at = (at + 1) & mask)
            if (ends[at] < 0 || std::memcmp(&keys[at * n], key, sizeof(uint32_t) * n) == 0) return at;
    }

    void grow() {
        Table bigger;
        bigger.n = n;
        const size_t capacity = ends.empty() ? 64 : 2 * ends.size();
        bigger.keys.assign(capacity * n, 0);
        bigger.ends.assign(capacity, -1);
        for (size_t at = 0; at < ends.size(); ++at)
            if (ends[at] >= 0) {
                const size_t to = bigger.slot(&keys[at * n]);
                std::memcpy(&bigger.keys[to * n], &keys[at * n], sizeof(uint32_t) * n);
                bigger.ends[to] = ends[at];
            }
        bigger.used = used;
        *this = std::move(bigger);
    }

    void put(const uint32_t* key, int32_t end) {
        if (10 * (used + 1) > 7 * int64_t(ends.size())) grow();
        const size_t at = slot(key);
        if (ends[at] < 0) {
            std::memcpy(&keys[at * n], key, sizeof(uint32_t) * n);
            ++used;
        }
        ends[at] = end;
    }

    int32_t get(const uint32_t* key) const { return ends.empty() ? -1 : ends[slot(key)]; }

    size_t nbytes() const { return keys.capacity() * sizeof(uint32_t) + ends.capacity() * sizeof(int32_t); }
};

struct NgramIndex {
    int64_t order = 0, indexed = 0;
    std::vector<uint32_t> window;  // a call's new tokens (kept for its capacity, up to a few thousand)
    Table tables[MAX_ORDER];
};

// A token id of a list argument: an exact int in [0, 2**32).
uint32_t token_of(PyObject* item) {
    const int64_t value = exact_int_of(item);
    if (value < 0 || value > int64_t(UINT32_MAX)) fail(PyExc_ValueError, "NgramIndex: token ids are 0..2**32-1");
    return uint32_t(value);
}

void index_init(NgramIndex* self, int64_t order) {
    if (order < 1 || order > MAX_ORDER) fail(PyExc_ValueError, "NgramIndex: order is 1..8");
    new (self) NgramIndex();
    self->order = order;
    for (int64_t n = 1; n <= order; ++n) self->tables[n - 1].n = n;
}

// find(tokens, tail): registers every n-gram of `tokens` (a list of ints that only ever grows between calls: a
// sequence's token ids) that ends before its last token and was not registered by an earlier call, then returns
// (n, end) for the longest n <= order whose last n items of tokens + tail (tail: a list of ints, or None) were
// registered: end is the position in `tokens` right after their latest occurrence. (0, -1): no suffix occurred.
nb::tuple index_find(NgramIndex& self, nb::handle tokens_in, nb::handle tail_in) {
    if (!PyList_CheckExact(tokens_in.ptr())) fail(PyExc_TypeError, "NgramIndex.find: tokens must be a list");
    const bool has_tail = !tail_in.is_none();
    if (has_tail && !PyList_CheckExact(tail_in.ptr())) fail(PyExc_TypeError, "NgramIndex.find: tail must be a list");
    PyObject* list = tokens_in.ptr();
    const Py_ssize_t length = PyList_GET_SIZE(list);
    if (length >= INT32_MAX) fail(PyExc_ValueError, "NgramIndex.find: too many tokens");
    // the new n-grams' tokens, read from the list as it is now: from `order` before the first new end on
    const int64_t first_end = std::max<int64_t>(self.indexed, 1);
    const int64_t from = std::max<int64_t>(first_end - self.order, 0);
    std::vector<uint32_t>& window = self.window;
    window.clear();
    for (Py_ssize_t i = from; i < length; ++i) window.push_back(token_of(PyList_GET_ITEM(list, i)));
    for (int64_t end = first_end; end < length; ++end)
        for (int64_t n = 1; n <= self.order && n <= end; ++n)
            self.tables[n - 1].put(&window[size_t(end - n - from)], int32_t(end));
    self.indexed = std::max<int64_t>(self.indexed, length);
    if (window.capacity() > 4096) std::vector<uint32_t>().swap(window);  // a long prompt's first call: not kept
    uint32_t context[MAX_ORDER];
    const Py_ssize_t extra = has_tail ? PyList_GET_SIZE(tail_in.ptr()) : 0;
    for (int64_t n = std::min<int64_t>(self.order, length + extra); n >= 1; --n) {
        for (int64_t i = 0; i < n; ++i) {  // the last n items of tokens + tail
            const Py_ssize_t at = length + extra - n + i;
            PyObject* item = at < length ? PyList_GET_ITEM(list, at) : PyList_GET_ITEM(tail_in.ptr(), at - length);
            context[i] = token_of(item);
        }
        const int32_t end = self.tables[n - 1].get(context);
        if (end >= 0) return nb::make_tuple(n, int64_t(end));
    }
    return nb::make_tuple(0, -1);
}

size_t index_nbytes(const NgramIndex& self) {
    size_t total = self.window.capacity() * sizeof(uint32_t);
    for (int64_t n = 0; n < self.order; ++n) total += self.tables[n].nbytes();
    return total;
}

}  // namespace

void add_ngram(nb::module_& m) {
    nb::class_<NgramIndex>(m, "NgramIndex")
        .def("__init__", &index_init)
        .def("find", &index_find, nb::arg("tokens"), nb::arg("tail").none())
        .def("nbytes", &index_nbytes)
        .def_prop_ro("order", [](const NgramIndex& self) { return self.order; })
        .def_prop_ro("indexed", [](const NgramIndex& self) { return self.indexed; });
}

}  // namespace corral_native

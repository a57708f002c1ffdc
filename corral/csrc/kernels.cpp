// The CPU kernels' Python entry points: every buffer is checked (item size, shape, strides, writability, index
// ranges) before a kernel reads it, the GIL is released while it runs, and the kernel table is the one chosen
// for this CPU when the module loads. 2-byte items are bfloat16 (torch hands them in as int16 views).

#include "arrays.h"
#include "common.h"
#include "draws.h"
#include "kernels.h"

#include <memory>

#include <omp.h>

#include <cfloat>
#include <cstdlib>
#include <string>
#include <type_traits>

namespace corral_native {
namespace {

using corral_kernels::Isa;
using corral_kernels::KernelTable;

const KernelTable* chosen = nullptr;

// The variant for this CPU; CORRAL_NATIVE_BUILD=baseline takes the baseline one anywhere (for its tests), and
// CORRAL_NATIVE_BUILD=avx2 the AVX2 one on an AVX-512 CPU.
const KernelTable* choose() {
    const char* forced = std::getenv("CORRAL_NATIVE_BUILD");
    if (forced != nullptr && std::string(forced) == "baseline") return corral_kernels::variant<Isa::baseline>();
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (avx512 && !(forced != nullptr && std::string(forced) == "avx2"))
        return corral_kernels::variant<Isa::avx512>();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
        __builtin_cpu_supports("bmi2"))
        return corral_kernels::variant<Isa::avx2>();
#endif
    return corral_kernels::variant<Isa::baseline>();
}


// add_rms_norm(h, delta or None, weight, out, eps, threads): h += delta, out = RMSNorm(h) * weight; h, delta,
// out [rows, n], weight [n], all of one dtype.
void kernel_add_rms_norm(nb::handle h_in, nb::handle delta_in, nb::handle weight_in, nb::handle out_in, double eps_in,
                         int threads_in) {
    const Array h(h_in, "h", true);
    h.expect_ndim(2);
    const Py_ssize_t rows = h.dim(0), n = h.dim(1);
    const int kind = h.float_kind();
    const bool with_delta = !delta_in.is_none();
    const Array delta(with_delta ? delta_in : h_in, "delta", false);
    if (with_delta) {
        delta.expect_shape({rows, n});
        delta.expect_like(h);
    }
    const Array weight(weight_in, "weight", false);
    weight.expect_shape({n});
    weight.expect_like(h);
    const Array out(out_in, "out", true);
    out.expect_shape({rows, n});
    out.expect_like(h);
    const float eps = float(eps_in);
    const int threads = checked_threads(threads_in);
    {
        NoGil nogil;
        if (kind == 4)
            chosen->add_rms_norm_f32(h.data<float>(), with_delta ? delta.data<const float>() : nullptr,
                                     weight.data<const float>(), out.data<float>(), rows, n, eps, threads);
        else
            chosen->add_rms_norm_bf16(h.data<uint16_t>(), with_delta ? delta.data<const uint16_t>() : nullptr,
                                      weight.data<const uint16_t>(), out.data<uint16_t>(), rows, n, eps, threads);
    }
}

// rope(x, positions, cos, sin, threads): x [rows, heads, dim] rotated in place (rows may be strided; heads and dims
// contiguous), cos/sin [max_position, dim] of x's dtype, positions int64 [rows], each below max_position.
void kernel_rope(nb::handle x_in, nb::handle positions_in, nb::handle cos_in, nb::handle sin_in, int threads_in) {
    const Array x(x_in, "x", true, true);
    x.expect_ndim(3);
    const int kind = x.float_kind();
    const Py_ssize_t rows = x.dim(0), heads = x.dim(1), dim = x.dim(2), item = x.itemsize();
    const Py_ssize_t* strides = x.buffer.view.strides;
    if (dim % 2 || strides[2] != item || strides[1] != dim * item || strides[0] % item ||
        (rows > 1 && strides[0] < heads * dim * item))
        fail(PyExc_ValueError, "x: heads and dims must be contiguous, rows apart");
    const Array positions(positions_in, "positions", false);
    positions.expect_shape({rows});
    positions.expect_int64();
    const Array cos(cos_in, "cos", false), sin(sin_in, "sin", false);
    cos.expect_ndim(2);
    cos.expect_like(x);
    if (cos.dim(1) != dim) fail(PyExc_ValueError, "cos: one row of dim entries per position");
    sin.expect_shape({cos.dim(0), dim});
    sin.expect_like(x);
    const int64_t* at = positions.data<const int64_t>();
    for (Py_ssize_t r = 0; r < rows; ++r)
        if (at[r] < 0 || at[r] >= cos.dim(0)) fail(PyExc_IndexError, "rope: a position past the cos/sin tables");
    const int threads = checked_threads(threads_in);
    {
        NoGil nogil;
        if (kind == 4)
            chosen->rope_f32(x.data<float>(), strides[0] / item, at, cos.data<const float>(),
                             sin.data<const float>(), rows, heads, dim, threads);
        else
            chosen->rope_bf16(x.data<uint16_t>(), strides[0] / item, at, cos.data<const uint16_t>(),
                              sin.data<const uint16_t>(), rows, heads, dim, threads);
    }
}

// silu_mul(gate_up, out, threads): out [rows, n] = silu(gate) * up for gate_up [rows, 2n] = [gate | up].
void kernel_silu_mul(nb::handle gate_up_in, nb::handle out_in, int threads_in) {
    const Array gate_up(gate_up_in, "gate_up", false);
    gate_up.expect_ndim(2);
    const int kind = gate_up.float_kind();
    const Py_ssize_t rows = gate_up.dim(0), n = gate_up.dim(1) / 2;
    if (gate_up.dim(1) % 2) fail(PyExc_ValueError, "gate_up: an even row length");
    const Array out(out_in, "out", true);
    out.expect_shape({rows, n});
    out.expect_like(gate_up);
    const int threads = checked_threads(threads_in);
    {
        NoGil nogil;
        if (kind == 4)
            chosen->silu_mul_f32(gate_up.data<const float>(), out.data<float>(), rows, n, threads);
        else
            chosen->silu_mul_bf16(gate_up.data<const uint16_t>(), out.data<uint16_t>(), rows, n, threads);
    }
}

// log_normalizers(logits [rows, width] float32, n, out [rows] float32, threads): out = logsumexp of each row's
// first n columns.
void kernel_log_normalizers(nb::handle logits_in, int64_t n, nb::handle out_in, int threads_in) {
    const Array logits(logits_in, "logits", false), out(out_in, "out", true);
    logits.expect_ndim(2);
    logits.expect_float32();
    if (n < 1 || n > logits.dim(1)) fail(PyExc_ValueError, "log_normalizers: n must be 1..width");
    out.expect_shape({logits.dim(0)});
    out.expect_float32();
    const int threads = checked_threads(threads_in);
    {
        NoGil nogil;
        chosen->log_normalizers(logits.data<const float>(), logits.dim(0), logits.dim(1), n, out.data<float>(),
                                threads);
    }
}

// The bitmask of greedy_pick and sample_pick: [rows, words] int32 or None, and the list of the rows it applies to.
struct RowMasks {
    std::unique_ptr<Array> bitmask;
    std::vector<uint8_t> masked;

    RowMasks(nb::handle bitmask_in, nb::handle masked_in, int64_t rows, int64_t n, const char* name) {
        if (bitmask_in.is_none()) return;
        bitmask = std::make_unique<Array>(bitmask_in, "bitmask", false);
        bitmask->expect_format('i', 4, "int32");
        bitmask->expect_shape({rows, (Py_ssize_t(n) + 31) / 32});
        if (!PyList_Check(masked_in.ptr()))
            fail(PyExc_TypeError, (std::string(name) + ": a bitmask needs its masked rows").c_str());
        masked.assign(rows, 0);
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(masked_in.ptr()); ++i) {
            const int64_t row = exact_int_of(PyList_GET_ITEM(masked_in.ptr(), i));
            if (row < 0 || row >= rows)
                fail(PyExc_IndexError, (std::string(name) + ": a masked row outside the logits").c_str());
            masked[row] = 1;
        }
    }
    const int32_t* words() const { return bitmask ? bitmask->data<const int32_t>() : nullptr; }
    int64_t words_stride() const { return bitmask ? bitmask->dim(1) : 0; }
    const uint8_t* rows() const { return bitmask ? masked.data() : nullptr; }
};

// The logits of greedy_pick and sample_pick: [rows, width] float32, of which the first n columns are tokens.
static Array pick_logits(nb::handle logits_in, int64_t n, const char* name) {
    Array logits(logits_in, "logits", false);
    logits.expect_ndim(2);
    logits.expect_float32();
    if (n < 1 || n > logits.dim(1)) fail(PyExc_ValueError, (std::string(name) + ": n must be 1..width").c_str());
    return logits;
}

static nb::tuple id_and_logprob_lists(const std::vector<int64_t>& ids, const std::vector<float>& logprobs) {
    nb::list id_list, logprob_list;
    for (size_t r = 0; r < ids.size(); ++r) {
        id_list.append(nb::int_(ids[r]));
        logprob_list.append(nb::float_(double(logprobs[r])));
    }
    return nb::make_tuple(id_list, logprob_list);
}

// greedy_pick(logits [rows, width] float32, n, bitmask [rows, words] int32 or None, masked: a list of the rows
// the bitmask applies to, or None, threads) -> (ids, logprobs), two lists: per row the first largest of the first
// n columns its mask allows (no bitmask: every column), or -1 (none allowed above -inf, or a NaN or +inf in the
// row), and its raw logit less the row's log-normalizer. Lists in and out: a numpy or torch call per array costs
// tens of microseconds in a step that finds the caches cold.
nb::tuple kernel_greedy_pick(nb::handle logits_in, int64_t n, nb::handle bitmask_in, nb::handle masked_in,
                             int threads_in) {
    const Array logits = pick_logits(logits_in, n, "greedy_pick");
    const int64_t rows = logits.dim(0);
    const RowMasks masks(bitmask_in, masked_in, rows, n, "greedy_pick");
    const int threads = checked_threads(threads_in);
    std::vector<int64_t> ids(rows);
    std::vector<float> logprobs(rows);
    {
        NoGil nogil;
        chosen->greedy_pick(logits.data<const float>(), rows, logits.dim(1), n, masks.words(), masks.words_stride(),
                            masks.rows(), ids.data(), logprobs.data(), threads);
    }
    return id_and_logprob_lists(ids, logprobs);
}

// A list of one number per row (ints or floats), checked.
template <typename T>
static std::vector<T> numbers_of(nb::handle list, int64_t rows, const char* name) {
    if (!PyList_Check(list.ptr()) || PyList_GET_SIZE(list.ptr()) != rows)
        fail(PyExc_ValueError, (std::string(name) + " must be a list of one number per row").c_str());
    std::vector<T> out(rows);
    for (int64_t r = 0; r < rows; ++r) {
        PyObject* item = PyList_GET_ITEM(list.ptr(), r);
        if constexpr (std::is_integral_v<T>) {
            out[r] = T(exact_int_of(item));
        } else {
            const double value = PyFloat_AsDouble(item);
            if (value == -1.0 && PyErr_Occurred()) throw PyFailure();
            out[r] = T(value);
        }
    }
    return out;
}

// The items of a list or tuple (borrowed), and how many.
static PyObject* const* items_of(PyObject* seq, Py_ssize_t& size, const char* what) {
    if (!PyList_Check(seq) && !PyTuple_Check(seq))
        fail(PyExc_TypeError, (std::string("sample_pick: ") + what + " must be a list or a tuple").c_str());
    size = PySequence_Fast_GET_SIZE(seq);
    return PySequence_Fast_ITEMS(seq);
}

// An int (a subclass too, not a bool), read from its own value: no Python code runs.
static int64_t id_of(PyObject* value, const char* what) {
    if (!PyLong_Check(value) || PyBool_Check(value))
        fail(PyExc_TypeError, (std::string("sample_pick: ") + what + " must be an int").c_str());
    const long long id = PyLong_AsLongLong(value);
    if (id == -1 && PyErr_Occurred()) throw PyFailure();
    return id;
}

// A float or an int (subclasses too, numpy's float64 among them; not a bool), read from its own value: no Python
// code runs.
static double number_of(PyObject* value, const char* what) {
    if (PyFloat_Check(value)) return PyFloat_AS_DOUBLE(value);
    if (PyLong_Check(value) && !PyBool_Check(value)) {
        const double number = PyLong_AsDouble(value);
        if (number == -1.0 && PyErr_Occurred()) throw PyFailure();
        return number;
    }
    fail(PyExc_TypeError, (std::string("sample_pick: ") + what + " must be a float or an int").c_str());
}

// Token runs: a list of (tokens, start, stop), tokens a list or tuple of ints of which items start .. stop count;
// f(id) for each of those ids in 0 .. n (others name no column). Reading them runs no Python code.
template <typename F>
static void for_each_token(PyObject* runs, int64_t n, const char* what, F f) {
    Py_ssize_t num_runs;
    PyObject* const* run = items_of(runs, num_runs, what);
    for (Py_ssize_t j = 0; j < num_runs; ++j) {
        Py_ssize_t three;
        PyObject* const* parts = items_of(run[j], three, what);
        if (three != 3) fail(PyExc_ValueError, (std::string("sample_pick: ") + what + ": (tokens, start, stop)").c_str());
        Py_ssize_t size;
        PyObject* const* tokens = items_of(parts[0], size, what);
        const int64_t start = exact_int_of(parts[1]), stop = exact_int_of(parts[2]);
        if (start < 0 || start > stop || stop > size)
            fail(PyExc_IndexError, (std::string("sample_pick: ") + what + ": a run outside its tokens").c_str());
        for (int64_t i = start; i < stop; ++i) {
            const int64_t id = exact_int_of(tokens[i]);
            if (id >= 0 && id < n) f(id);
        }
    }
}

// The distinct tokens of one sequence's prompt and output, kept from step to step so that its penalties read what
// its distinct tokens number, not its length: each id once, with how often the output has it (0: the prompt alone).
// catch_up counts what the sequence's token list gained since the last call; it counts again from the start where the
// list is another one, is shorter than what was counted, or splits prompt from output elsewhere. A list that changes
// in place is not seen: the engine's lists only grow. Ids outside 0 .. 2^31 name no column and are not kept.
class TokenTally {
  public:
    void catch_up(nb::handle tokens, int64_t split, int64_t stop) {
        if (!PyList_Check(tokens.ptr())) fail(PyExc_TypeError, "token tally: its tokens must be a list");
        const Py_ssize_t size = PyList_GET_SIZE(tokens.ptr());
        if (split < 0 || split > size || stop < 0 || stop > size)
            fail(PyExc_IndexError, "token tally: split or stop outside its tokens");
        if (!list_.is(tokens) || split != split_ || stop < counted_) clear(tokens, split);
        PyObject* const* items = PySequence_Fast_ITEMS(tokens.ptr());
        try {
            for (; counted_ < stop; ++counted_) {
                const int64_t id = exact_int_of(items[counted_]);
                if (id < 0 || id > INT32_MAX) continue;
                const int32_t entry = entry_of(int32_t(id));
                if (counted_ >= split && counts_[entry]++ == 0) output_.push_back(entry);
            }
        } catch (...) {
            list_ = nb::object();  // counted again from the start next time
            throw;
        }
    }
    // f(id) for each id of the prompt and output below n
    template <typename F>
    void for_each_seen(int64_t n, F f) const {
        for (const int32_t id : ids_)
            if (id < n) f(int64_t(id));
    }
    // f(id, count) for each id of the output below n
    template <typename F>
    void for_each_counted(int64_t n, F f) const {
        for (const int32_t entry : output_)
            if (ids_[entry] < n) f(int64_t(ids_[entry]), counts_[entry]);
    }
    // {id: its output count} for every id kept (tests read it)
    nb::dict counts() const {
        nb::dict out;
        for (size_t e = 0; e < ids_.size(); ++e) out[nb::int_(ids_[e])] = nb::int_(counts_[e]);
        return out;
    }
    int64_t num_seen() const { return int64_t(ids_.size()); }
    int64_t num_counted() const { return int64_t(output_.size()); }
    int64_t num_tokens() const { return counted_; }

  private:
    nb::object list_;  // held, so that no other list takes its address while the tally counts it
    int64_t split_ = 0, counted_ = 0;
    std::vector<int32_t> ids_, counts_, output_;  // per entry its id and output count; the entries counted > 0
    std::vector<int32_t> table_;  // open addressing on the id: entry + 1, 0 empty; a power of two, at most half full

    void clear(nb::handle tokens, int64_t split) {
        list_ = nb::borrow(tokens), split_ = split, counted_ = 0;
        ids_.clear(), counts_.clear(), output_.clear(), table_.assign(64, 0);
    }
    size_t slot_of(int32_t id) const { return (uint32_t(id) * 2654435761u) & (table_.size() - 1); }
    int32_t entry_of(int32_t id) {
        size_t i = slot_of(id);
        for (; table_[i] != 0; i = (i + 1) & (table_.size() - 1))
            if (ids_[table_[i] - 1] == id) return table_[i] - 1;
        ids_.push_back(id), counts_.push_back(0);
        table_[i] = int32_t(ids_.size());
        if (ids_.size() * 2 > table_.size()) {  // grow: every entry placed again
            table_.assign(table_.size() * 2, 0);
            for (size_t e = 0; e < ids_.size(); ++e) {
                size_t j = slot_of(ids_[e]);
                while (table_[j] != 0) j = (j + 1) & (table_.size() - 1);
                table_[j] = int32_t(e + 1);
            }
        }
        return int32_t(ids_.size() - 1);
    }
};

// The sampler's steps 2-4 for the rows that have them (see RowShaping), read from shaping: None, or one entry per row,
// None (unshaped) or (hold, bias, repetition, frequency, presence, seen, output[, tallied]): hold the stop ids
// min_tokens holds back (ints), bias (id, value) pairs, the three penalties (numbers; 1, 0, 0 are off), seen the token
// runs the repetition penalty reads (prompt and output) and output those the frequency and presence penalties count.
// tallied: None, or (a TokenTally, the sequence's token list, where its output starts, how many of it count): the
// tally is caught up on that list and stands for its prompt and output, seen and output then name only the tokens
// past them (a draft's). Ids past n name no column (as the torch path's); a negative one is an error.
struct Shapings {
    std::vector<corral_kernels::RowShaping> rows;
    std::vector<corral_kernels::ColumnEdit> edits;
    std::vector<int64_t> holds;

    Shapings(nb::handle shaping_in, int64_t num_rows, int64_t n) {
        if (shaping_in.is_none()) return;
        if (!PyList_Check(shaping_in.ptr()) || PyList_GET_SIZE(shaping_in.ptr()) != num_rows)
            fail(PyExc_ValueError, "sample_pick: shaping must be None or a list of one entry per row");
        static thread_local std::vector<int32_t> slot;  // column -> its edit in this row, -1: none yet
        if (int64_t(slot.size()) < n) slot.assign(n, -1);
        std::vector<int64_t> edit_at(num_rows + 1, 0), hold_at(num_rows + 1, 0);
        rows.assign(num_rows, corral_kernels::RowShaping{false, false, nullptr, 0, nullptr, 0, 1.0f, 0.0f, 0.0f});
        for (int64_t r = 0; r < num_rows; ++r) {
            edit_at[r] = int64_t(edits.size()), hold_at[r] = int64_t(holds.size());
            PyObject* entry = PyList_GET_ITEM(shaping_in.ptr(), r);
            if (entry != Py_None) read_row(entry, n, rows[r], slot);
        }
        edit_at[num_rows] = int64_t(edits.size()), hold_at[num_rows] = int64_t(holds.size());
        for (int64_t r = 0; r < num_rows; ++r) {  // the arrays are whole now: point into them
            rows[r].edits = edits.data() + edit_at[r], rows[r].num_edits = edit_at[r + 1] - edit_at[r];
            rows[r].hold = holds.data() + hold_at[r], rows[r].num_hold = hold_at[r + 1] - hold_at[r];
        }
    }
    const corral_kernels::RowShaping* data() const { return rows.empty() ? nullptr : rows.data(); }

  private:
    void read_row(PyObject* entry, int64_t n, corral_kernels::RowShaping& row, std::vector<int32_t>& slot) {
        Py_ssize_t num_parts;
        PyObject* const* part = items_of(entry, num_parts, "a shaping entry");
        if (num_parts != 7 && num_parts != 8)
            fail(PyExc_ValueError, "sample_pick: a shaping entry is (hold, bias, repetition, frequency, presence, "
                                   "seen, output[, tallied])");
        TokenTally* tally = nullptr;
        if (num_parts == 8 && part[7] != Py_None) {
            Py_ssize_t four;
            PyObject* const* tallied = items_of(part[7], four, "tallied");
            if (four != 4 || !nb::isinstance<TokenTally>(tallied[0]))
                fail(PyExc_TypeError, "sample_pick: tallied is (TokenTally, tokens, split, stop)");
            tally = nb::inst_ptr<TokenTally>(tallied[0]);
            tally->catch_up(tallied[1], exact_int_of(tallied[2]), exact_int_of(tallied[3]));
        }
        const double repetition = number_of(part[2], "repetition"),
                     frequency = number_of(part[3], "frequency"), presence = number_of(part[4], "presence");
        if (!(repetition > 0.0) || repetition != repetition || frequency != frequency || presence != presence)
            fail(PyExc_ValueError, "sample_pick: a penalty is out of range");
        row.shaped = true;
        // past float32's range the torch path decides what such a penalty means (the row's id is -1)
        row.undecided = !(repetition <= FLT_MAX && float(repetition) > 0.0f) || !(std::fabs(frequency) <= FLT_MAX) ||
                        !(std::fabs(presence) <= FLT_MAX);
        row.repetition = float(repetition), row.frequency = float(frequency), row.presence = float(presence);
        const size_t first = edits.size(), hold_first = holds.size();
        const auto edit = [&](int64_t id) -> corral_kernels::ColumnEdit& {
            if (slot[id] < 0) {  // pushed first: a failed push leaves no slot pointing past the edits
                edits.push_back(corral_kernels::ColumnEdit{id, 0.0f, 0, 0, 0});
                slot[id] = int32_t(edits.size() - 1 - first);
            }
            return edits[first + size_t(slot[id])];
        };
        try {
            Py_ssize_t size;
            PyObject* const* hold = items_of(part[0], size, "hold");
            for (Py_ssize_t i = 0; i < size; ++i) {
                const int64_t id = id_of(hold[i], "a stop id");
                if (id < 0) fail(PyExc_ValueError, "sample_pick: a negative stop id");
                if (id < n && std::find(holds.begin() + hold_first, holds.end(), id) == holds.end())
                    holds.push_back(id);
            }
            PyObject* const* bias = items_of(part[1], size, "bias");
            for (Py_ssize_t i = 0; i < size; ++i) {
                Py_ssize_t two;
                PyObject* const* pair = items_of(bias[i], two, "a bias pair");
                if (two != 2) fail(PyExc_ValueError, "sample_pick: a bias entry is an (id, value) pair");
                const int64_t id = id_of(pair[0], "a bias id");
                const double value = number_of(pair[1], "a bias value");
                if (id < 0) fail(PyExc_ValueError, "sample_pick: a negative bias id");
                if (!(std::fabs(value) <= FLT_MAX)) fail(PyExc_ValueError, "sample_pick: a bias value out of range");
                if (id >= n) continue;
                corral_kernels::ColumnEdit& e = edit(id);
                if (e.biased) fail(PyExc_ValueError, "sample_pick: a bias names one id twice");
                e.biased = 1, e.bias = float(value);
            }
            if (row.repetition != 1.0f) {
                const auto see = [&](int64_t id) { edit(id).seen = 1; };
                if (tally != nullptr) tally->for_each_seen(n, see);
                for_each_token(part[5], n, "seen", see);
            }
            if (row.frequency != 0.0f || row.presence != 0.0f) {
                if (tally != nullptr)
                    tally->for_each_counted(n, [&](int64_t id, int32_t count) { edit(id).count += count; });
                for_each_token(part[6], n, "output", [&](int64_t id) { ++edit(id).count; });
            }
        } catch (...) {
            for (size_t i = first; i < edits.size(); ++i) slot[edits[i].column] = -1;
            throw;
        }
        for (size_t i = first; i < edits.size(); ++i) slot[edits[i].column] = -1;
    }
};

// sample_pick(logits, n, bitmask or None, masked or None, temperature, top_k, top_p, min_p, uniform, top_n, shaping,
// threads) -> (ids, logprobs, tops): greedy_pick's arguments and lists, and six lists of one number per row
// (temperature 0: greedy; negative: the row is skipped, id -2; top_k 0, top_p 1, min_p 0: off; uniform in [0, 1);
// top_n 0-20 top logprobs), and the shaping of the rows that have a min_tokens hold-back, a bias or penalties (see
// Shapings); per row the token the sampler's steps 2-7 draw with that uniform, or -1 as greedy_pick says it (or
// where the row's bias or penalties take a column to +inf), and its top_n most likely raw columns above -inf as (id,
// logprob) pairs (torch's topk would also list -inf columns, where a row has fewer finite ones).
nb::tuple kernel_sample_pick(nb::handle logits_in, int64_t n, nb::handle bitmask_in, nb::handle masked_in,
                             nb::handle temperature_in, nb::handle top_k_in, nb::handle top_p_in, nb::handle min_p_in,
                             nb::handle uniform_in, nb::handle top_n_in, nb::handle shaping_in, int threads_in) {
    const Array logits = pick_logits(logits_in, n, "sample_pick");
    const int64_t rows = logits.dim(0);
    const RowMasks masks(bitmask_in, masked_in, rows, n, "sample_pick");
    const Shapings shapings(shaping_in, rows, n);
    const DrawLists draws(temperature_in, top_k_in, top_p_in, min_p_in, uniform_in, rows, 1, "sample_pick");
    const auto top_n = numbers_of<int64_t>(top_n_in, rows, "sample_pick: top_n");
    for (int64_t r = 0; r < rows; ++r)
        if (top_n[r] < 0 || top_n[r] > corral_kernels::TOP_LOGPROBS)
            fail(PyExc_ValueError, "sample_pick: a row's parameters are out of range");
    const int threads = checked_threads(threads_in);
    std::vector<int64_t> ids(rows), top_ids(rows * corral_kernels::TOP_LOGPROBS);
    std::vector<float> logprobs(rows), top_logprobs(rows * corral_kernels::TOP_LOGPROBS);
    {
        NoGil nogil;
        const corral_kernels::DrawParams params = draws.params(0, shapings.data());
        const corral_kernels::TopLogprobs top{top_n.data(), top_ids.data(), top_logprobs.data()};
        chosen->sample_pick(logits.data<const float>(), rows, logits.dim(1), n, masks.words(), masks.words_stride(),
                            masks.rows(), params, top, ids.data(), logprobs.data(), threads);
    }
    nb::list tops;  // per row a list of (id, logprob): as many as asked for, fewer where the row has fewer finite
    for (int64_t r = 0; r < rows; ++r) {
        nb::list row;
        const float* x = logits.data<const float>() + r * logits.dim(1);
        int64_t finite = 0;
        for (int64_t i = 0; i < n && finite < top_n[r]; ++i) finite += x[i] > -INFINITY;
        for (int64_t j = 0; ids[r] >= 0 && j < std::min(top_n[r], finite); ++j)
            row.append(nb::make_tuple(nb::int_(top_ids[r * corral_kernels::TOP_LOGPROBS + j]),
                                      nb::float_(double(top_logprobs[r * corral_kernels::TOP_LOGPROBS + j]))));
        tops.append(row);
    }
    nb::tuple picked = id_and_logprob_lists(ids, logprobs);
    return nb::make_tuple(picked[0], picked[1], tops);
}

// A paged KV cache handed in, checked: k_cache and v_cache [blocks, block_size, KVH, head_dim] of one element type
// (kind: 4 float32, 2 bfloat16, 1 int8), KVH dividing the query heads, and float32 scales [blocks, block_size, KVH]
// given exactly when the cache is int8 (absent, they stand as views of k_cache, never read).
struct CacheArgs {
    Array k, v, k_scale, v_scale;
    bool has_scales;
    int kind;
    Py_ssize_t blocks, block_size, kv_heads;

    CacheArgs(nb::handle k_in, nb::handle v_in, nb::handle k_scale_in, nb::handle v_scale_in, Py_ssize_t heads,
              Py_ssize_t head_dim)
        : k(k_in, "k_cache", false), v(v_in, "v_cache", false),
          k_scale(k_scale_in.is_none() && v_scale_in.is_none() ? k_in : k_scale_in, "k_scale", false),
          v_scale(k_scale_in.is_none() && v_scale_in.is_none() ? k_in : v_scale_in, "v_scale", false),
          has_scales(!k_scale_in.is_none() || !v_scale_in.is_none()) {
        k.expect_ndim(4);
        kind = k.cache_kind();
        blocks = k.dim(0), block_size = k.dim(1), kv_heads = k.dim(2);
        if (k.dim(3) != head_dim) fail(PyExc_ValueError, "k_cache: the head size differs from q's");
        if (kv_heads < 1 || heads % kv_heads)
            fail(PyExc_ValueError, "the query heads are not a multiple of the KV heads");
        v.expect_shape({blocks, block_size, kv_heads, head_dim});
        v.expect_like(k);
        if (v.cache_kind() != kind) fail(PyExc_TypeError, "k_cache and v_cache differ in dtype");
        if (has_scales != (kind == 1)) fail(PyExc_TypeError, "k_scale and v_scale go with an int8 cache, only");
        if (has_scales) {
            for (const Array* scales : {&k_scale, &v_scale}) {
                scales->expect_shape({blocks, block_size, kv_heads});
                if (scales->float_kind() != 4) fail(PyExc_TypeError, "KV scales: float32 expected");
            }
        }
    }
    const float* k_scales() const { return has_scales ? k_scale.data<const float>() : nullptr; }
    const float* v_scales() const { return has_scales ? v_scale.data<const float>() : nullptr; }
};

// paged_decode(q, k_cache, v_cache, block_tables, context_lens, out, scale, threads, k_scale, v_scale): q [S, H, D]
// float32 or bfloat16; caches [blocks, block_size, KVH, D] of q's dtype, bfloat16 under float32 queries, or int8
// with float32 scales [blocks, block_size, KVH] (None otherwise); block_tables int64 [S, width], every entry a
// sequence reads below blocks; context_lens int64 [S], each in 1 .. width * block_size; out [S, H * D] like q.
void kernel_paged_decode(nb::handle q_in, nb::handle k_cache_in, nb::handle v_cache_in, nb::handle block_tables_in,
                         nb::handle context_lens_in, nb::handle out_in, double scale_in, int threads_in,
                         nb::handle k_scale_in, nb::handle v_scale_in) {
    const Array q(q_in, "q", false);
    q.expect_ndim(3);
    const int kind = q.float_kind();
    const Py_ssize_t seqs = q.dim(0), heads = q.dim(1), head_dim = q.dim(2);
    const CacheArgs cache(k_cache_in, v_cache_in, k_scale_in, v_scale_in, heads, head_dim);
    const int kv_kind = cache.kind;
    if (!(kv_kind == kind || kv_kind == 1 || (kind == 4 && kv_kind == 2)))
        fail(PyExc_TypeError, "k_cache: q's dtype, bfloat16 under float32 queries, or int8 expected");
    const Py_ssize_t blocks = cache.blocks, block_size = cache.block_size, kv_heads = cache.kv_heads;
    const Array &k = cache.k, &v = cache.v;
    const Array tables(block_tables_in, "block_tables", false);
    tables.expect_ndim(2);
    tables.expect_int64();
    if (tables.dim(0) != seqs) fail(PyExc_ValueError, "block_tables: one row per sequence");
    const Py_ssize_t width = tables.dim(1);
    const Array lens(context_lens_in, "context_lens", false);
    lens.expect_shape({seqs});
    lens.expect_int64();
    const Array out(out_in, "out", true);
    out.expect_shape({seqs, heads * head_dim});
    out.expect_like(q);
    const float scale = float(scale_in);
    const int threads = checked_threads(threads_in);
    const int64_t* table = tables.data<const int64_t>();
    const int64_t* len = lens.data<const int64_t>();
    for (Py_ssize_t s = 0; s < seqs; ++s) {
        if (len[s] < 1 || len[s] > width * block_size)
            fail(PyExc_IndexError, "paged_decode: a context length outside its block table");
        for (int64_t b = 0; b < (len[s] + block_size - 1) / block_size; ++b) {
            const int64_t block = table[s * width + b];
            if (block < 0 || block >= blocks) fail(PyExc_IndexError, "paged_decode: a block id outside the cache");
        }
    }
    const float* ks = cache.k_scales();
    const float* vs = cache.v_scales();
    {
        NoGil nogil;
        if (kind == 4 && kv_kind == 4)
            chosen->paged_decode_f32(q.data<const float>(), k.data<const float>(), v.data<const float>(), ks, vs,
                                     table, width, len, out.data<float>(), seqs, heads, kv_heads, head_dim,
                                     block_size, scale, threads);
        else if (kind == 4 && kv_kind == 2)
            chosen->paged_decode_f32_bf16(q.data<const float>(), k.data<const uint16_t>(),
                                          v.data<const uint16_t>(), ks, vs, table, width, len, out.data<float>(),
                                          seqs, heads, kv_heads, head_dim, block_size, scale, threads);
        else if (kind == 4)
            chosen->paged_decode_f32_i8(q.data<const float>(), k.data<const int8_t>(), v.data<const int8_t>(),
                                        ks, vs, table, width, len, out.data<float>(), seqs, heads, kv_heads,
                                        head_dim, block_size, scale, threads);
        else if (kv_kind == 2)
            chosen->paged_decode_bf16(q.data<const uint16_t>(), k.data<const uint16_t>(),
                                      v.data<const uint16_t>(), ks, vs, table, width, len, out.data<uint16_t>(),
                                      seqs, heads, kv_heads, head_dim, block_size, scale, threads);
        else
            chosen->paged_decode_bf16_i8(q.data<const uint16_t>(), k.data<const int8_t>(), v.data<const int8_t>(),
                                         ks, vs, table, width, len, out.data<uint16_t>(), seqs, heads, kv_heads,
                                         head_dim, block_size, scale, threads);
    }
}

// The row stride, in floats, of a float32 [rows, heads, dims] view whose heads and dims are contiguous and whose
// rows lie apart (views into the fused QKV output).
static int64_t row_stride(const Array& a, const char* what) {
    const Py_ssize_t* strides = a.buffer.view.strides;
    if (strides[2] != 4 || strides[1] != a.dim(2) * 4 || strides[0] % 4 ||
        (a.dim(0) > 1 && strides[0] < a.dim(1) * a.dim(2) * 4))
        fail(PyExc_ValueError, (std::string(what) + ": heads and dims must be contiguous, rows apart").c_str());
    return int64_t(strides[0] / 4);
}

// causal_prefill(q, k, v, out, scale, threads): q [T, H, D], k and v [T, KVH, D] float32 (rows may be strided,
// heads and dims contiguous), D 64 or 128, H a multiple of KVH; out [T, H * D]
// float32. Query t attends to keys 0 .. t of its KV head.
void kernel_causal_prefill(nb::handle q_in, nb::handle k_in, nb::handle v_in, nb::handle out_in, double scale_in,
                           int threads_in) {
    const Array q(q_in, "q", false, true), k(k_in, "k", false, true), v(v_in, "v", false, true);
    q.expect_ndim(3);
    q.expect_float32();
    const Py_ssize_t tokens = q.dim(0), heads = q.dim(1), head_dim = q.dim(2);
    if (head_dim != 64 && head_dim != 128) fail(PyExc_ValueError, "q: head size 64 or 128 expected");
    k.expect_ndim(3);
    k.expect_float32();
    const Py_ssize_t kv_heads = k.dim(1);
    if (kv_heads < 1 || heads % kv_heads) fail(PyExc_ValueError, "the query heads are not a multiple of the KV heads");
    k.expect_shape({tokens, kv_heads, head_dim});
    v.expect_shape({tokens, kv_heads, head_dim});
    v.expect_float32();
    const int64_t q_stride = row_stride(q, "q"), k_stride = row_stride(k, "k"), v_stride = row_stride(v, "v");
    const Array out(out_in, "out", true);
    out.expect_shape({tokens, heads * head_dim});
    out.expect_float32();
    const float scale = float(scale_in);
    const int threads = checked_threads(threads_in);
    if (tokens == 0) return;
    NoGil nogil;
    chosen->causal_prefill(q.data<const float>(), q_stride, k.data<const float>(), k_stride, v.data<const float>(),
                           v_stride, out.data<float>(), tokens, heads, kv_heads, head_dim, scale, threads);
}

// prefill_paged(q, k_cache, v_cache, block_table, num_context, out, scale, threads, k_scale, v_scale): q [T, H, D]
// float32 (rows may be strided, heads and dims contiguous), D 64 or 128; caches [blocks, block_size, KVH, D]
// float32, bfloat16, or int8 with float32 scales [blocks, block_size, KVH]; block_table int64 [width], its first
// ceil(num_context / block_size) entries below blocks; T <= num_context <= width * block_size; out [T, H * D]
// float32. Query t sits at position num_context - T + t and attends to keys 0 .. that position.
void kernel_prefill_paged(nb::handle q_in, nb::handle k_cache_in, nb::handle v_cache_in, nb::handle table_in,
                          int64_t num_context, nb::handle out_in, double scale_in, int threads_in,
                          nb::handle k_scale_in, nb::handle v_scale_in) {
    const Array q(q_in, "q", false, true);
    q.expect_ndim(3);
    q.expect_float32();
    const Py_ssize_t tokens = q.dim(0), heads = q.dim(1), head_dim = q.dim(2);
    if (head_dim != 64 && head_dim != 128) fail(PyExc_ValueError, "q: head size 64 or 128 expected");
    const int64_t q_stride = row_stride(q, "q");
    const CacheArgs cache(k_cache_in, v_cache_in, k_scale_in, v_scale_in, heads, head_dim);
    const int kv_kind = cache.kind;
    const Py_ssize_t blocks = cache.blocks, block_size = cache.block_size, kv_heads = cache.kv_heads;
    const Array &k = cache.k, &v = cache.v;
    const Array table(table_in, "block_table", false);
    table.expect_ndim(1);
    table.expect_int64();
    if (num_context < tokens || num_context < 1 || num_context > table.dim(0) * block_size)
        fail(PyExc_IndexError, "prefill_paged: num_context outside T .. the block table's keys");
    const int64_t* ids = table.data<const int64_t>();
    for (int64_t b = 0; b < (num_context + block_size - 1) / block_size; ++b)
        if (ids[b] < 0 || ids[b] >= blocks) fail(PyExc_IndexError, "prefill_paged: a block id outside the cache");
    const Array out(out_in, "out", true);
    out.expect_shape({tokens, heads * head_dim});
    out.expect_float32();
    const float scale = float(scale_in);
    const int threads = checked_threads(threads_in);
    if (tokens == 0) return;
    const float* ks = cache.k_scales();
    const float* vs = cache.v_scales();
    NoGil nogil;
    corral_kernels::prefill_paged_of_kind(chosen, kv_kind, q.data<const float>(), q_stride, k.data<const void>(),
                                          v.data<const void>(), ks, vs, ids, num_context, out.data<float>(), tokens,
                                          heads, kv_heads, head_dim, block_size, scale, threads);
}

// Ends the calling thread's OpenMP worker threads (they come back if it runs a parallel region again). OpenMP
// keeps one pool of workers per thread that has started a parallel region, and once the process holds more
// workers than the machine has cores, every pool's workers stop spinning between regions and sleep instead:
// waking them costs tens of microseconds per operation (a decode step runs hundreds), and the engine thread's
// linears ran 2.4x slower for it. The thread that loaded the model hands the compute to the engine thread and
// gives its pool back with this.
int release_thread_pool() { return omp_pause_resource_all(omp_pause_soft); }

}  // namespace

DrawLists::DrawLists(nb::handle temperature_in, nb::handle top_k_in, nb::handle top_p_in, nb::handle min_p_in,
                     nb::handle uniform_in, int64_t rows, int64_t steps, const char* who) {
    const std::string name = who;
    const auto temperature_64 = numbers_of<double>(temperature_in, rows, (name + ": temperature").c_str());
    top_k = numbers_of<int64_t>(top_k_in, rows, (name + ": top_k").c_str());
    const auto top_p_64 = numbers_of<double>(top_p_in, rows, (name + ": top_p").c_str());
    const auto min_p_64 = numbers_of<double>(min_p_in, rows, (name + ": min_p").c_str());
    uniform = numbers_of<double>(uniform_in, rows * steps, (name + ": uniform").c_str());
    temperature.resize(rows), top_p.resize(rows), min_p.resize(rows);
    for (int64_t r = 0; r < rows; ++r) {
        const bool ok = temperature_64[r] == temperature_64[r] && temperature_64[r] < INFINITY && top_k[r] >= 0 &&
                        top_p_64[r] > 0.0 && top_p_64[r] <= 1.0 && min_p_64[r] >= 0.0 && min_p_64[r] <= 1.0;
        if (!ok) fail(PyExc_ValueError, (name + ": a row's parameters are out of range").c_str());
        // in float32 as the torch path has them, where a temperature past its range divides every logit to
        // about 0 (all tokens alike) and a top_p below it keeps the first token alone
        temperature[r] = float(std::min<double>(temperature_64[r], FLT_MAX));
        if (temperature_64[r] > 0.0 && temperature[r] == 0.0f) temperature[r] = FLT_MIN;
        top_p[r] = std::max(float(top_p_64[r]), FLT_MIN);
        min_p[r] = float(min_p_64[r]);
    }
    for (const double u : uniform)
        if (!(u >= 0.0 && u < 1.0)) fail(PyExc_ValueError, (name + ": a row's parameters are out of range").c_str());
}

const corral_kernels::KernelTable* kernel_table() { return chosen; }

void add_kernels(nb::module_& m) {
    chosen = choose();
    m.attr("kernel_isa") = chosen->isa;
    m.def("release_thread_pool", &release_thread_pool);
    nb::class_<TokenTally>(m, "TokenTally")
        .def(nb::init<>())
        .def("catch_up", &TokenTally::catch_up, nb::arg("tokens"), nb::arg("split"), nb::arg("stop"))
        .def("counts", &TokenTally::counts)
        .def_prop_ro("num_seen", &TokenTally::num_seen)
        .def_prop_ro("num_counted", &TokenTally::num_counted)
        .def_prop_ro("num_tokens", &TokenTally::num_tokens);
    // None is an argument only where one is named with .none()
    m.def("add_rms_norm", &kernel_add_rms_norm, nb::arg("h"), nb::arg("delta").none(), nb::arg("weight"),
          nb::arg("out"), nb::arg("eps"), nb::arg("threads"));
    m.def("rope", &kernel_rope);
    m.def("silu_mul", &kernel_silu_mul);
    m.def("log_normalizers", &kernel_log_normalizers);
    m.def("greedy_pick", &kernel_greedy_pick, nb::arg("logits"), nb::arg("n"), nb::arg("bitmask").none(),
          nb::arg("masked").none(), nb::arg("threads"));
    m.def("sample_pick", &kernel_sample_pick, nb::arg("logits"), nb::arg("n"), nb::arg("bitmask").none(),
          nb::arg("masked").none(), nb::arg("temperature"), nb::arg("top_k"), nb::arg("top_p"), nb::arg("min_p"),
          nb::arg("uniform"), nb::arg("top_n"), nb::arg("shaping").none(), nb::arg("threads"));
    m.def("paged_decode", &kernel_paged_decode, nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"),
          nb::arg("block_tables"), nb::arg("context_lens"), nb::arg("out"), nb::arg("scale"), nb::arg("threads"),
          nb::arg("k_scale").none(), nb::arg("v_scale").none());
    m.def("causal_prefill", &kernel_causal_prefill, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"),
          nb::arg("scale"), nb::arg("threads"));
    m.def("prefill_paged", &kernel_prefill_paged, nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"),
          nb::arg("block_table"), nb::arg("num_context"), nb::arg("out"), nb::arg("scale"), nb::arg("threads"),
          nb::arg("k_scale").none(), nb::arg("v_scale").none());
}

}  // namespace corral_native

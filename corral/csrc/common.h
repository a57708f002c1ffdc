// What every part of the native module shares: errors that unwind to Python, argument checks, held buffers, and
// the GIL released around native work and taken back only where Python must be touched.
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <nanobind/nanobind.h>

#include <atomic>
#include <cstdint>
#include <new>

namespace nb = nanobind;

namespace corral_native {

// A Python exception is set. Thrown through native code with the GIL held or not (it is set with the GIL); the
// module's exception translator lets it reach Python as it is.
struct PyFailure {};

// A limit of the native side was reached (a state cap, a memory cap, a mask's fuel): LimitError, a subclass of
// corral.errors.GrammarTooComplexError, whose message names the limit.
extern PyObject* LimitError;

[[noreturn]] inline void fail(PyObject* type, const char* message) {
    PyErr_SetString(type, message);
    throw PyFailure();
}

// An int from a Python object (an item of a list argument): the TypeError or OverflowError Python raises
// where it is none.
inline int64_t int_of(nb::handle value) {
    const long long number = PyLong_AsLongLong(value.ptr());
    if (number == -1 && PyErr_Occurred()) throw PyFailure();
    return number;
}

// An item of a list argument that must be an int itself (not a subclass, not an object with __index__): reading
// it runs no Python code, so the list cannot change while it is read.
inline int64_t exact_int_of(PyObject* value) {
    if (!PyLong_CheckExact(value)) {
        PyErr_SetString(PyExc_TypeError, "a list of ints expected");
        throw PyFailure();
    }
    return int_of(nb::handle(value));
}

// The GIL, released for a stretch of native work (NoGil) and taken back inside it wherever Python must be
// touched (WithGil: a callback, an allocation of a Python object, an exception). Both are no-ops outside such a
// stretch, so the same code runs with the GIL held or not. One stretch per thread at a time.
extern thread_local PyThreadState* released;

// How many times native work took the GIL back inside a released stretch (tests read it through
// _gil_taken_back(): a mask that calls Python, or touches a Python object, shows here).
extern std::atomic<int64_t> gil_taken_back;

struct NoGil {
    bool active = false;
    NoGil() {
        if (released == nullptr) {
            released = PyEval_SaveThread();
            active = true;
        }
    }
    ~NoGil() {
        if (active) {
            PyThreadState* state = released;
            released = nullptr;
            PyEval_RestoreThread(state);
        }
    }
    NoGil(const NoGil&) = delete;
    NoGil& operator=(const NoGil&) = delete;
};

struct WithGil {
    PyThreadState* state;
    WithGil() : state(released) {
        if (state != nullptr) {
            gil_taken_back.fetch_add(1, std::memory_order_relaxed);
            released = nullptr;
            PyEval_RestoreThread(state);
        }
    }
    ~WithGil() {
        if (state != nullptr) released = PyEval_SaveThread();
    }
    WithGil(const WithGil&) = delete;
    WithGil& operator=(const WithGil&) = delete;
};

// A held buffer of a Python object, released when this goes (with the GIL: see WithGil).
struct HeldBuffer {
    Py_buffer view{};
    bool held = false;
    HeldBuffer() = default;
    HeldBuffer(PyObject* object, int flags, Py_ssize_t item_size) {
        if (PyObject_GetBuffer(object, &view, flags) < 0) throw PyFailure();
        held = true;
        if (view.itemsize != item_size) {
            PyErr_Format(PyExc_TypeError, "an array of %zd-byte items where %zd-byte items were expected",
                         view.itemsize, item_size);
            throw PyFailure();
        }
    }
    HeldBuffer(HeldBuffer&& other) noexcept : view(other.view), held(other.held) { other.held = false; }
    HeldBuffer(const HeldBuffer&) = delete;
    HeldBuffer& operator=(const HeldBuffer&) = delete;
    ~HeldBuffer() {
        if (held) {
            WithGil gil;
            PyBuffer_Release(&view);
        }
    }
    template <typename T>
    T* data() const { return static_cast<T*>(view.buf); }
    Py_ssize_t count() const { return view.len / view.itemsize; }
};

// Test hook: a native call that passes through maybe_wait() while the hook is armed waits there (GIL released)
// until a Python thread calls release, or until the hook's timeout; the result says which. Arming it from the
// test and releasing it from another Python thread proves the GIL is not held at that point.
void maybe_wait();

void add_hook(nb::module_& m);
void add_terms(nb::module_& m);
void add_kernels(nb::module_& m);
void add_qmatmul(nb::module_& m);
void add_decode_step(nb::module_& m);
void add_ngram(nb::module_& m);

}  // namespace corral_native

// A checked view of a Python buffer argument (shape, item type, writability), shared by the native entry points.
#pragma once

#include "common.h"

#include <initializer_list>

namespace corral_native {

// A checked view of one argument.
struct Array {
    HeldBuffer buffer;
    const char* name;

    Array(PyObject* object, const char* what, bool writable, bool strided = false)
        : name(what) {
        int flags = (strided ? PyBUF_STRIDES : PyBUF_C_CONTIGUOUS) | PyBUF_FORMAT;
        if (writable) flags |= PyBUF_WRITABLE;
        if (PyObject_GetBuffer(object, &buffer.view, flags) < 0) throw PyFailure();
        buffer.held = true;
    }
    Array(nb::handle object, const char* what, bool writable, bool strided = false)
        : Array(object.ptr(), what, writable, strided) {}
    Py_ssize_t itemsize() const { return buffer.view.itemsize; }
    int ndim() const { return buffer.view.ndim; }
    Py_ssize_t dim(int k) const { return buffer.view.shape[k]; }
    template <typename T>
    T* data() const { return static_cast<T*>(buffer.view.buf); }

    void expect_ndim(int n) const {
        if (ndim() != n) {
            PyErr_Format(PyExc_ValueError, "%s: %d dimensions where %d were expected", name, ndim(), n);
            throw PyFailure();
        }
    }
    void expect_shape(std::initializer_list<Py_ssize_t> shape) const {
        expect_ndim(int(shape.size()));
        int k = 0;
        for (Py_ssize_t size : shape) {
            if (dim(k) != size) {
                PyErr_Format(PyExc_ValueError, "%s: size %zd in dimension %d where %zd was expected", name, dim(k), k,
                             size);
                throw PyFailure();
            }
            ++k;
        }
    }
    void expect_like(const Array& other) const {
        if (itemsize() != other.itemsize()) {
            PyErr_Format(PyExc_TypeError, "%s and %s differ in dtype", name, other.name);
            throw PyFailure();
        }
    }
    void expect_int64() const {
        const char* format = buffer.view.format;
        if (itemsize() != 8 || format == nullptr || (format[0] != 'q' && format[0] != 'l')) {
            PyErr_Format(PyExc_TypeError, "%s: int64 expected", name);
            throw PyFailure();
        }
    }
    // 4: float32, 2: bfloat16
    int float_kind() const {
        const char* format = buffer.view.format;
        const char code = format == nullptr ? 'B' : format[0] == '<' || format[0] == '=' ? format[1] : format[0];
        if (itemsize() == 4 && code == 'f') return 4;
        if (itemsize() == 2 && (code == 'h' || code == 'H' || code == 'e')) return 2;
        PyErr_Format(PyExc_TypeError, "%s: float32 or bfloat16 (as 16-bit items) expected", name);
        throw PyFailure();
    }
    void expect_format(char code, Py_ssize_t size, const char* what) const {
        const char* format = buffer.view.format;
        const char got = format == nullptr ? 'B' : (format[0] == '<' || format[0] == '=' || format[0] == '@')
                                                       ? format[1] : format[0];
        if (itemsize() != size || (got != code && !(code == 'q' && got == 'l'))) {
            PyErr_Format(PyExc_TypeError, "%s: %s expected", name, what);
            throw PyFailure();
        }
    }
    void expect_float32() const { expect_format('f', 4, "float32"); }
    void expect_uint8() const { expect_format('B', 1, "uint8"); }
    // a KV cache's element: 4 float32, 2 bfloat16, 1 int8
    int cache_kind() const {
        const char* format = buffer.view.format;
        if (itemsize() == 1 && format != nullptr && format[0] == 'b') return 1;
        return float_kind();
    }
};

inline int checked_threads(int threads) {
    if (threads < 1 || threads > 1024) fail(PyExc_ValueError, "threads must be 1..1024");
    return threads;
}


}  // namespace corral_native

// corral._native: the one extension module, built by the build backend when the package is installed (setup.py;
// on x86 twice, as corral._native for x86-64-v3 and corral._native_baseline for x86-64-v2).
// It holds the mask core (terms.cpp: derivative terms, the lazy DFA, the token-trie walk) and the CPU kernels
// (kernels.cpp, one variant per instruction set chosen at load). corral/native.py loads it and says which paths run.

#include "automata.h"
#include "common.h"

#include <atomic>
#include <chrono>
#include <thread>

namespace corral_native {

PyObject* LimitError = nullptr;
thread_local PyThreadState* released = nullptr;
std::atomic<int64_t> gil_taken_back{0};

namespace {

// The test hook (see maybe_wait in common.h): 0 idle, 1 armed, 2 waiting inside a native call, 3 released.
std::atomic<int> hook_stage{0};
std::atomic<int64_t> hook_timeout_ms{0};
std::atomic<int> hook_result{-1};  // -1 not reached, 0 timed out, 1 released by another thread

PyObject* hook_arm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (!check_args(nargs, 1, "_hook_arm")) return nullptr;
    const double timeout = PyFloat_AsDouble(args[0]);
    if (timeout == -1.0 && PyErr_Occurred()) return nullptr;
    hook_timeout_ms = int64_t(timeout * 1000);
    hook_result = -1;
    hook_stage = 1;
    Py_RETURN_NONE;
}

PyObject* hook_waiting(PyObject*, PyObject*) { return PyBool_FromLong(hook_stage.load() == 2); }

PyObject* hook_release(PyObject*, PyObject*) {
    int waiting = 2;
    hook_stage.compare_exchange_strong(waiting, 3);
    Py_RETURN_NONE;
}

// -1: the hook was never reached; 0: it timed out (the GIL was held, or nobody released it); 1: released.
PyObject* hook_outcome(PyObject*, PyObject*) { return PyLong_FromLong(hook_result.load()); }

PyObject* gil_count(PyObject*, PyObject*) { return PyLong_FromLongLong(gil_taken_back.load()); }

PyMethodDef hook_methods[] = {
    {"_gil_taken_back", reinterpret_cast<PyCFunction>(gil_count), METH_NOARGS, nullptr},
    FAST("_hook_arm", hook_arm),
    {"_hook_waiting", reinterpret_cast<PyCFunction>(hook_waiting), METH_NOARGS, nullptr},
    {"_hook_release", reinterpret_cast<PyCFunction>(hook_release), METH_NOARGS, nullptr},
    {"_hook_outcome", reinterpret_cast<PyCFunction>(hook_outcome), METH_NOARGS, nullptr},
    {nullptr, nullptr, 0, nullptr},
};

#ifndef CORRAL_MODULE
#define CORRAL_MODULE _native
#endif
#define CORRAL_STR2(x) #x
#define CORRAL_STR(x) CORRAL_STR2(x)
#define CORRAL_CAT2(a, b) a##b
#define CORRAL_CAT(a, b) CORRAL_CAT2(a, b)

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "corral." CORRAL_STR(CORRAL_MODULE), nullptr, -1, nullptr};

}  // namespace

void maybe_wait() {
    int armed = 1;
    if (hook_stage.load(std::memory_order_relaxed) != 1 || !hook_stage.compare_exchange_strong(armed, 2)) return;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(hook_timeout_ms.load());
    while (hook_stage.load() == 2 && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    int stage = 2;
    const bool timed_out = hook_stage.compare_exchange_strong(stage, 0);
    hook_result = timed_out ? 0 : 1;
    hook_stage = 0;
}

bool add_hook(PyObject* module) { return PyModule_AddFunctions(module, hook_methods) == 0; }

}  // namespace corral_native

#ifndef CORRAL_BUILD_INFO
#define CORRAL_BUILD_INFO "unknown"
#endif

PyMODINIT_FUNC CORRAL_CAT(PyInit_, CORRAL_MODULE)() {
    using namespace corral_native;
    PyObject* module = PyModule_Create(&module_def);
    if (module == nullptr) return nullptr;
    // A limit is a GrammarTooComplexError (a typed 400 while compiling; a sequence's typed error while decoding).
    PyObject* errors = PyImport_ImportModule("corral.errors");
    PyObject* base = errors == nullptr ? nullptr : PyObject_GetAttrString(errors, "GrammarTooComplexError");
    Py_XDECREF(errors);
    LimitError = base == nullptr ? nullptr : PyErr_NewException("corral._native.LimitError", base, nullptr);
    Py_XDECREF(base);
    if (LimitError == nullptr || PyModule_AddObjectRef(module, "LimitError", LimitError) < 0 ||
        PyModule_AddStringConstant(module, "build_info", CORRAL_BUILD_INFO " (" __VERSION__ ")") < 0 ||
        !add_hook(module) || !add_terms(module) || !add_kernels(module) || !add_qmatmul(module) ||
        !add_decode_step(module) || !add_cfg(module)) {
        Py_DECREF(module);
        return nullptr;
    }
    return module;
}

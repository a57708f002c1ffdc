// corral._native: the one extension module, built by the build backend when the package is installed (setup.py;
// on x86 twice, as corral._native for x86-64-v3 and corral._native_baseline for x86-64-v2).
// It holds the mask core (terms.cpp: derivative terms, the lazy DFA, the token-trie walk) and the CPU kernels
// (kernels.cpp, one variant per instruction set chosen at load). corral/native.py loads it and says which paths run.

#include "automata.h"
#include "common.h"

#include <atomic>
#include <chrono>
#include <typeinfo>
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

void hook_arm(double timeout) {
    hook_timeout_ms = int64_t(timeout * 1000);
    hook_result = -1;
    hook_stage = 1;
}

void hook_release() {
    int waiting = 2;
    hook_stage.compare_exchange_strong(waiting, 3);
}

#ifndef CORRAL_MODULE
#define CORRAL_MODULE _native
#endif

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

void add_hook(nb::module_& m) {
    m.def("_hook_arm", &hook_arm, nb::arg("timeout"));
    m.def("_hook_waiting", [] { return hook_stage.load() == 2; });
    m.def("_hook_release", &hook_release);
    // -1: the hook was never reached; 0: it timed out (the GIL was held, or nobody released it); 1: released.
    m.def("_hook_outcome", [] { return hook_result.load(); });
    m.def("_gil_taken_back", [] { return gil_taken_back.load(); });
}

}  // namespace corral_native

#ifndef CORRAL_BUILD_INFO
#define CORRAL_BUILD_INFO "unknown"
#endif

NB_MODULE(CORRAL_MODULE, m) {
    using namespace corral_native;
    // Objects that caches hold until the interpreter ends are not leaks worth a report at exit.
    nb::set_leak_warnings(false);
    // PyFailure carries a Python exception already set: it goes to Python as it is.
    nb::register_exception_translator([](const std::exception_ptr& thrown, void*) {
        try {
            std::rethrow_exception(thrown);
        } catch (const PyFailure&) {
        } catch (const std::bad_cast&) {  // a nanobind cast of an argument that is not of its type
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "an argument of the wrong type");
        }
    });
    // A limit is a GrammarTooComplexError (a typed 400 while compiling; a sequence's typed error while decoding).
    nb::object base = nb::module_::import_("corral.errors").attr("GrammarTooComplexError");
    LimitError = PyErr_NewException("corral._native.LimitError", base.ptr(), nullptr);
    if (LimitError == nullptr) throw nb::python_error();
    m.attr("LimitError") = nb::handle(LimitError);
    m.attr("build_info") = CORRAL_BUILD_INFO " (" __VERSION__ ")";
    add_hook(m);
    add_terms(m);
    add_kernels(m);
    add_qmatmul(m);
    add_decode_step(m);
    add_cfg(m);
    add_ngram(m);
}

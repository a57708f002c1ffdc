"""Small C++ kernel libraries compiled on first use with the host compiler, cached on disk, loaded with ctypes.

A library is its source plus the ctypes signatures of its entry points. It is built with ``$CXX`` (default
``g++``) for the host CPU, with OpenMP, and cached under ``$CORRAL_CACHE_DIR/kernels`` by a hash of the source,
compiler, flags and CPU flags, so a changed kernel or a different machine builds afresh. Without a compiler, or
with ``CORRAL_CPU_KERNELS=0``, :meth:`CompiledLibrary.load` returns None and callers keep their torch path.
"""

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import subprocess
import sysconfig
import threading

from corral.cache import cache_dir

log = logging.getLogger(__name__)

# Not -ffast-math: linking with it pulls in crtfastmath, whose constructor turns on flush-to-zero and
# denormals-are-zero for the whole process when the library loads (numpy, torch and every test after it would
# lose subnormal floats). -fassociative-math, asked for on its own, lets reductions end in a tree of vector adds
# (under ``omp simd`` alone the lanes were summed one by one).
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
         "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


# Helpers every kernel source starts with (prepend ``PRELUDE``): bfloat16 is the high half of a float32, rounded
# to nearest even as torch rounds; ``exp_approx`` is an exp the compiler vectorizes (std::exp stays a scalar call
# without -ffast-math): Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, a degree-6 minimax polynomial for
# exp(r), and 2^n built in the exponent bits; relative error about 2 ulp (-fassociative-math may fold the
# two-constant reduction into one: a few ulp more for large |x|); x is clamped to [-87, 88].
PRELUDE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

static inline float load(float x) { return x; }
static inline float load(uint16_t x) { uint32_t u = uint32_t(x) << 16; float f; std::memcpy(&f, &u, 4); return f; }
static inline void store(float x, float* dst) { *dst = x; }
static inline void store(float x, uint16_t* dst) {
    uint32_t u; std::memcpy(&u, &x, 4);
    *dst = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline float round_to(float x, float) { return x; }
static inline float round_to(float x, uint16_t) {  // through bfloat16 and back
    uint32_t u; std::memcpy(&u, &x, 4);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    float f; std::memcpy(&f, &u, 4); return f;
}
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = std::floor(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    const int32_t bits = (int32_t(n) + 127) << 23;
    float scale; std::memcpy(&scale, &bits, 4);
    return y * scale;
}
"""


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


class CompiledLibrary:
    """``name``: the cache file's stem; ``signatures``: entry point -> ctypes argument types (each returns void);
    ``extra_flags``: compiler flags after :data:`FLAGS`."""

    def __init__(self, name: str, source: str, signatures: dict[str, list], extra_flags: tuple[str, ...] = ()):
        self.name, self.source, self.signatures = name, source, signatures
        self.flags = [*FLAGS, *extra_flags]
        self._lock = threading.Lock()
        self._library: ctypes.CDLL | None = None
        self._tried = False

    def load(self) -> ctypes.CDLL | None:
        """The library, built on the first call; None when it cannot be built."""
        with self._lock:
            if self._tried:
                return self._library
            self._tried = True
            if os.environ.get("CORRAL_CPU_KERNELS", "1") == "0":
                return None
            try:
                self._library = self._open(self._build(os.environ.get("CXX", "g++")))
            except (OSError, ImportError, subprocess.SubprocessError) as exc:
                log.warning("CPU kernel library %s unavailable, using the fallback path: %s", self.name, exc)
            return self._library

    def _open(self, path: str):
        library = ctypes.CDLL(path)
        for entry, argtypes in self.signatures.items():
            getattr(library, entry).argtypes = argtypes
            getattr(library, entry).restype = None
        return library

    def _build(self, compiler: str) -> str:
        key = hashlib.sha256("|".join([self.source, compiler, *self.flags, _cpu_key(), platform.machine()]).encode())
        path = os.path.join(cache_dir(), "kernels", f"{self.name}-{key.hexdigest()[:16]}.so")
        if not os.path.isfile(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            src, tmp = f"{path}.{os.getpid()}.cpp", f"{path}.{os.getpid()}.tmp"
            with open(src, "w") as f:
                f.write(self.source)
            try:
                subprocess.run([compiler, *self.flags, src, "-o", tmp], check=True, capture_output=True, timeout=300)
                os.replace(tmp, path)  # atomic: a concurrent loader sees the whole library or none
            finally:
                for leftover in (src, tmp):
                    if os.path.exists(leftover):
                        os.remove(leftover)
        return path


class CompiledExtension(CompiledLibrary):
    """A CPython extension module built the same way (``source`` defines ``PyInit_<module_name>``): for code that
    Python calls often with small arguments, where a ctypes call's own cost (microseconds) would dominate."""

    def __init__(self, module_name: str, source: str):
        super().__init__(module_name, source, {}, extra_flags=(f"-I{sysconfig.get_paths()['include']}",))
        self.module_name = module_name

    def _open(self, path: str):
        loader = importlib.machinery.ExtensionFileLoader(self.module_name, path)
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(self.module_name, path,
                                                                                        loader=loader))
        loader.exec_module(module)
        return module

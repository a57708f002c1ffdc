"""Paged decode attention on the CPU: one query token per sequence against K/V read straight from the block
pool, with no gather and no padding.

The operation is :mod:`corral.kernels.paged_attention`'s with ``q_len = 1`` for every sequence (its pseudo-code
is the contract; :func:`~corral.kernels.paged_attention.paged_attention_torch` is the oracle). Per (sequence, KV
head) the kernel reads each visible key once to score the query heads of that group, takes a float32 softmax,
then reads each value once to accumulate the output. The torch path it replaces gathered every context into a
padded copy, layer after layer, and that copy was most of a CPU decode step.

The C++ source below is compiled on first use with the system C++ compiler (``$CXX``, default ``g++``) for the
host CPU, OpenMP over (sequence, KV head), and cached under ``$CORRAL_CACHE_DIR/kernels``. Without a compiler,
or with ``CORRAL_CPU_KERNELS=0``, :func:`load` returns None and callers keep the torch path. What this leaves
out: prefill (many queries per sequence is compute-bound, and torch's flash attention does it well), float16.
"""

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import threading

import torch

log = logging.getLogger(__name__)

SOURCE = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

static inline float load(float x) { return x; }
static inline float load(uint16_t x) {  // bfloat16 is the high half of a float32
    uint32_t u = uint32_t(x) << 16; float f; std::memcpy(&f, &u, 4); return f;
}
static inline void store(float x, float* dst) { *dst = x; }
static inline void store(float x, uint16_t* dst) {  // round to nearest even, as torch does
    uint32_t u; std::memcpy(&u, &x, 4);
    *dst = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// DIM > 0 fixes the head size at compile time (so the inner loops vectorize fully); 0 reads it at run time.
template <int DIM>
static inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
    const int64_t D = DIM > 0 ? DIM : n;
    float sum = 0.0f;
    for (int64_t d = 0; d < D; ++d) sum += a[d] * b[d];
    return sum;
}

template <int DIM>
static inline void axpy(float p, const float* __restrict x, float* __restrict y, int64_t n) {
    const int64_t D = DIM > 0 ? DIM : n;
    for (int64_t d = 0; d < D; ++d) y[d] += p * x[d];
}

template <typename T, int DIM>
static inline void widen(const T* __restrict src, float* __restrict dst, int64_t n) {
    const int64_t D = DIM > 0 ? DIM : n;
    for (int64_t d = 0; d < D; ++d) dst[d] = load(src[d]);
}

template <typename T, int DIM>
static void decode(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables, int64_t table_stride,
                   const int64_t* context_lens, T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, int64_t block_size, float scale, int num_threads) {
    const int64_t D = DIM > 0 ? DIM : head_dim;
    const int64_t group = num_heads / num_kv_heads, slot = num_kv_heads * D;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t job = 0; job < num_seqs * num_kv_heads; ++job) {
        const int64_t s = job / num_kv_heads, g = job % num_kv_heads, n = context_lens[s];
        const int64_t* table = tables + s * table_stride;
        std::vector<float> query(group * D), acc(group * D, 0.0f), scores(group * n), row(D), inv_sum(group);
        for (int64_t i = 0; i < group; ++i) {
            widen<T, DIM>(q + (s * num_heads + g * group + i) * D, query.data() + i * D, D);
            for (int64_t d = 0; d < D; ++d) query[i * D + d] *= scale;
        }
        for (int64_t t = 0; t < n; ++t) {
            widen<T, DIM>(k_cache + (table[t / block_size] * block_size + t % block_size) * slot + g * D, row.data(), D);
            for (int64_t i = 0; i < group; ++i) scores[i * n + t] = dot<DIM>(query.data() + i * D, row.data(), D);
        }
        for (int64_t i = 0; i < group; ++i) {
            float* sc = scores.data() + i * n;
            float top = sc[0];
            for (int64_t t = 1; t < n; ++t) top = sc[t] > top ? sc[t] : top;
            float sum = 0.0f;
            for (int64_t t = 0; t < n; ++t) { sc[t] = std::exp(sc[t] - top); sum += sc[t]; }
            inv_sum[i] = 1.0f / sum;
        }
        for (int64_t t = 0; t < n; ++t) {
            widen<T, DIM>(v_cache + (table[t / block_size] * block_size + t % block_size) * slot + g * D, row.data(), D);
            for (int64_t i = 0; i < group; ++i) axpy<DIM>(scores[i * n + t], row.data(), acc.data() + i * D, D);
        }
        for (int64_t i = 0; i < group; ++i)
            for (int64_t d = 0; d < D; ++d)
                store(acc[i * D + d] * inv_sum[i], out + (s * num_heads + g * group + i) * D + d);
    }
}

#define ENTRY(NAME, T)                                                                                         \
extern "C" void NAME(const T* q, const T* k, const T* v, const int64_t* tables, int64_t table_stride,         \
                     const int64_t* lens, T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,  \
                     int64_t head_dim, int64_t block_size, float scale, int num_threads) {                    \
    auto f = head_dim == 64 ? decode<T, 64> : head_dim == 128 ? decode<T, 128> : decode<T, 0>;               \
    f(q, k, v, tables, table_stride, lens, out, num_seqs, num_heads, num_kv_heads, head_dim, block_size,     \
      scale, num_threads);                                                                                     \
}
ENTRY(corral_paged_decode_f32, float)
ENTRY(corral_paged_decode_bf16, uint16_t)
"""

# Not -ffast-math: linking with it pulls in crtfastmath, whose constructor turns on flush-to-zero and
# denormals-are-zero for the whole process when the library loads (numpy, torch and every test after it would
# lose subnormal floats). The reassociation that lets the dot products vectorize is asked for on its own.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
         "-fopenmp", "-shared", "-fPIC", "-std=c++17"]

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _build(compiler: str) -> str:
    from corral.engine.weights import cache_dir

    key = hashlib.sha256("|".join([SOURCE, compiler, *FLAGS, _cpu_key(), platform.machine()]).encode()).hexdigest()
    path = os.path.join(cache_dir(), "kernels", f"paged_decode-{key[:16]}.so")
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        src, tmp = f"{path}.{os.getpid()}.cpp", f"{path}.{os.getpid()}.tmp"
        with open(src, "w") as f:
            f.write(SOURCE)
        try:
            subprocess.run([compiler, *FLAGS, src, "-o", tmp], check=True, capture_output=True, timeout=300)
            os.replace(tmp, path)  # atomic: a concurrent loader sees the whole library or none
        finally:
            for leftover in (src, tmp):
                if os.path.exists(leftover):
                    os.remove(leftover)
    return path


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, built on first call; None when it cannot be built (callers use torch)."""
    global _library, _tried
    with _lock:
        if _tried:
            return _library
        _tried = True
        if os.environ.get("CORRAL_CPU_KERNELS", "1") == "0":
            return None
        try:
            library = ctypes.CDLL(_build(os.environ.get("CXX", "g++")))
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("CPU paged-attention kernel unavailable, using the torch path: %s", exc)
            return None
        args = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int]
        for name in ("corral_paged_decode_f32", "corral_paged_decode_bf16"):
            getattr(library, name).argtypes = args
            getattr(library, name).restype = None
        _library = library
        return library


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``out[s]`` [heads * D] for the single query ``q[s]`` [heads, D] of each sequence, over its first
    ``context_lens[s]`` keys through ``block_tables[s]`` (int64 ``[S, width]``). float32 or bfloat16."""
    library = load()
    assert library is not None, "the CPU kernel is not available"
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    name = {torch.float32: "corral_paged_decode_f32", torch.bfloat16: "corral_paged_decode_bf16"}[q.dtype]
    assert k_cache.dtype == v_cache.dtype == q.dtype and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_tables.dtype == context_lens.dtype == torch.int64 and num_heads % num_kv_heads == 0
    q, block_tables, context_lens = q.contiguous(), block_tables.contiguous(), context_lens.contiguous()
    assert num_seqs == 0 or 0 < int(context_lens.min()) and int(context_lens.max()) <= block_tables.shape[1] * block_size
    out = q.new_empty(num_seqs, num_heads * head_dim)
    getattr(library, name)(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                           block_tables.shape[1], context_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads,
                           num_kv_heads, head_dim, block_size, scale, torch.get_num_threads())
    return out

"""Paged decode attention on the CPU: one query token per sequence against K/V read straight from the block
pool, with no gather and no padding.

The operation is :mod:`corral.kernels.paged_attention`'s with ``q_len = 1`` for every sequence (its pseudo-code
is the contract; :func:`~corral.kernels.paged_attention.paged_attention_torch` is the oracle). Per (sequence, KV
head) the kernel reads each visible key once to score the query heads of that group, takes a float32 softmax,
then reads each value once to accumulate the output. The torch path it replaces gathered every context into a
padded copy, layer after layer, and that copy was most of a CPU decode step.

The C++ source below is compiled on first use (:mod:`corral.kernels.cpu_build`), OpenMP over (sequence, KV
head). Without a compiler, or with ``CORRAL_CPU_KERNELS=0``, :func:`load` returns None and callers keep the
torch path. What this leaves out: prefill (many queries per sequence is compute-bound, and torch's flash attention does it well), float16.
"""

import ctypes

import torch

from corral.kernels.cpu_build import PRELUDE, CompiledLibrary

SOURCE = PRELUDE + r"""
// The next block sits anywhere in the pool, where no hardware prefetcher looks: while row j of this block is
// read, row j of the next one is asked for (the loads of K and V rows were most of the kernel's time; asking for
// a whole block at once stalled on the line-fill buffers instead).
template <typename T>
static inline void prefetch_row(const T* row, int64_t D) {
    for (int64_t byte = 0; byte < D * int64_t(sizeof(T)); byte += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(row) + byte);
}

// Widens row t = 0 .. n-1 of one KV head (at `offset` within each token's slot) into `row`, then calls visit(t):
// one table lookup per block, none per key, and the next block's row asked for while this one is read.
template <typename T, int DIM, typename Visit>
static inline void for_each_row(const T* cache, const int64_t* table, int64_t n, int64_t block_size, int64_t slot,
                                int64_t offset, int64_t head_dim, float* __restrict row, Visit visit) {
    const int64_t D = DIM > 0 ? DIM : head_dim;
    const int64_t num_blocks = (n + block_size - 1) / block_size;
    for (int64_t b = 0; b < num_blocks; ++b) {
        const T* block = cache + table[b] * block_size * slot + offset;
        const int64_t first = b * block_size, count = std::min(block_size, n - first);
        const T* next = b + 1 < num_blocks ? cache + table[b + 1] * block_size * slot + offset : nullptr;
        for (int64_t j = 0; j < count; ++j) {
            if (next) prefetch_row(next + j * slot, D);
            const T* src = block + j * slot;
            #pragma omp simd
            for (int64_t d = 0; d < D; ++d) row[d] = load(src[d]);
            visit(first + j);
        }
    }
}

// DIM > 0 fixes the head size at compile time (so the inner loops vectorize fully); 0 reads it at run time.
template <typename T, int DIM>
static void decode(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables, int64_t table_stride,
                   const int64_t* context_lens, T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, int64_t block_size, float scale, int num_threads) {
    const int64_t D = DIM > 0 ? DIM : head_dim;
    const int64_t group = num_heads / num_kv_heads, slot = num_kv_heads * D;
    #pragma omp parallel num_threads(num_threads)
    {
        // per thread, reused by every job it takes: scores [group][keys], scaled queries, accumulators, one row
        std::vector<float> scores, query(group * D), acc(group * D), row(D);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < num_seqs * num_kv_heads; ++job) {
            const int64_t s = job / num_kv_heads, g = job % num_kv_heads, n = context_lens[s];
            const int64_t* table = tables + s * table_stride;
            if (int64_t(scores.size()) < group * n) scores.resize(group * n);
            float* __restrict qv = query.data();
            float* __restrict av = acc.data();
            float* __restrict rv = row.data();
            float* __restrict sv = scores.data();
            for (int64_t i = 0; i < group; ++i) {
                const T* src = q + (s * num_heads + g * group + i) * D;
                #pragma omp simd
                for (int64_t d = 0; d < D; ++d) qv[i * D + d] = load(src[d]) * scale;
            }
            // scores: one pass over the keys
            for_each_row<T, DIM>(k_cache, table, n, block_size, slot, g * D, head_dim, rv, [&](int64_t t) {
                for (int64_t i = 0; i < group; ++i) {
                    float sum = 0.0f;
                    #pragma omp simd reduction(+ : sum)
                    for (int64_t d = 0; d < D; ++d) sum += qv[i * D + d] * rv[d];
                    sv[i * n + t] = sum;
                }
            });
            for (int64_t i = 0; i < group; ++i) {
                float* sc = sv + i * n;
                float top = sc[0];
                #pragma omp simd reduction(max : top)
                for (int64_t t = 1; t < n; ++t) top = sc[t] > top ? sc[t] : top;
                float sum = 0.0f;
                #pragma omp simd reduction(+ : sum)
                for (int64_t t = 0; t < n; ++t) { sc[t] = exp_approx(sc[t] - top); sum += sc[t]; }
                const float inv = 1.0f / sum;
                #pragma omp simd
                for (int64_t t = 0; t < n; ++t) sc[t] *= inv;
            }
            std::fill(av, av + group * D, 0.0f);
            for_each_row<T, DIM>(v_cache, table, n, block_size, slot, g * D, head_dim, rv, [&](int64_t t) {
                for (int64_t i = 0; i < group; ++i) {
                    const float p = sv[i * n + t];
                    #pragma omp simd
                    for (int64_t d = 0; d < D; ++d) av[i * D + d] += p * rv[d];
                }
            });
            for (int64_t i = 0; i < group; ++i) {
                T* dst = out + (s * num_heads + g * group + i) * D;
                for (int64_t d = 0; d < D; ++d) store(av[i * D + d], dst + d);
            }
        }
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

_LIBRARY = CompiledLibrary("paged_decode", SOURCE, {
    name: [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int]
    for name in ("corral_paged_decode_f32", "corral_paged_decode_bf16")})


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, built on first call; None when it cannot be built (callers use torch)."""
    return _LIBRARY.load()


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

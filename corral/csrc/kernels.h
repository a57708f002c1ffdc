// The CPU kernels of the forward pass (fused RMSNorm, RoPE, SiLU * up; paged decode attention), one table of entry
// points per instruction set. kernels_impl.h holds the bodies; each kernels_<isa>.cpp compiles them for its
// target; kernels.cpp checks the buffers Python hands in and calls the table chosen for this CPU.
#pragma once

#include <algorithm>
#include <numeric>
#include <type_traits>
#include <functional>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>  // _mm_getcsr / _mm_setcsr: the SiLU's flush to zero
#endif

namespace corral_kernels {

enum class Isa { baseline, avx2, avx512 };

template <typename T>
using AddRmsNorm = void (*)(T* h, const T* delta, const T* w, T* out, int64_t rows, int64_t n, float eps,
                            int threads);
template <typename T>
using Rope = void (*)(T* x, int64_t stride, const int64_t* positions, const T* cos, const T* sin, int64_t rows,
                      int64_t heads, int64_t dim, int threads);
template <typename T>
using SiluMul = void (*)(const T* gate_up, T* out, int64_t rows, int64_t n, int threads);
using LogNormalizers = void (*)(const float* logits, int64_t rows, int64_t stride, int64_t n, float* out,
                               int threads);
using GreedyPick = void (*)(const float* logits, int64_t rows, int64_t stride, int64_t n, const int32_t* words,
                            int64_t words_stride, const uint8_t* masked, int64_t* ids, float* logprobs, int threads);
// One column a row's bias or penalties touch (sampler.py's steps 3 and 4, in that order on it): bias added when
// biased, the repetition penalty when seen (in the prompt or output), and count (its occurrences in the output)
// times the frequency penalty, then the presence penalty, taken off when count > 0.
struct ColumnEdit {
    int64_t column;
    float bias;
    int32_t count;
    uint8_t biased, seen;
};
// A row's steps 2-4 beyond its mask: the stop ids that min_tokens holds back (while some other token is allowed),
// and the columns its bias and penalties change. A row with neither has shaped = false; one whose penalty is past
// float32's range is undecided (its id is -1: the torch path decides).
struct RowShaping {
    bool shaped, undecided;
    const int64_t* hold;
    int64_t num_hold;
    const ColumnEdit* edits;
    int64_t num_edits;
    float repetition, frequency, presence;
};
// Per row: temperature (0: greedy; < 0: the row is skipped), top_k (0: off), top_p (1: off), min_p (0: off), the
// row's uniform in [0, 1) and its shaping (null: no row is shaped).
struct DrawParams {
    const float* temperature;
    const int64_t* top_k;
    const float* top_p;
    const float* min_p;
    const double* uniform;
    const RowShaping* shaping;
};
// Per row, how many of the most likely columns to report (at most TOP_LOGPROBS), and where: row r's at
// [r * TOP_LOGPROBS, r * TOP_LOGPROBS + count).
constexpr int64_t TOP_LOGPROBS = 20;
struct TopLogprobs {
    const int64_t* count;
    int64_t* ids;
    float* logprobs;
};
using SamplePick = void (*)(const float* logits, int64_t rows, int64_t stride, int64_t n, const int32_t* words,
                            int64_t words_stride, const uint8_t* masked, DrawParams params, TopLogprobs top, int64_t* ids,
                            float* logprobs, int threads);
template <typename T, typename KV>
using PagedDecode = void (*)(const T* q, const KV* k, const KV* v, const float* k_scale, const float* v_scale,
                             const int64_t* tables, int64_t table_stride, const int64_t* lens, T* out,
                             int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             int64_t block_size, float scale, int num_threads);
using CausalPrefill = void (*)(const float* q, int64_t q_stride, const float* k, int64_t k_stride, const float* v,
                              int64_t v_stride, float* out, int64_t tokens, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_dim, float scale, int num_threads);
template <typename KV>
using PrefillPaged = void (*)(const float* q, int64_t q_stride, const KV* k_cache, const KV* v_cache,
                              const float* k_scale, const float* v_scale, const int64_t* table, int64_t num_context,
                              float* out, int64_t tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              int64_t block_size, float scale, int num_threads);

// uint16_t is bfloat16 throughout. paged_decode_<queries>_<cache>: an int8 cache has per-(token, head) scales.
struct KernelTable {
    const char* isa;
    AddRmsNorm<float> add_rms_norm_f32;
    AddRmsNorm<uint16_t> add_rms_norm_bf16;
    Rope<float> rope_f32;
    Rope<uint16_t> rope_bf16;
    SiluMul<float> silu_mul_f32;
    SiluMul<uint16_t> silu_mul_bf16;
    PagedDecode<float, float> paged_decode_f32;
    PagedDecode<uint16_t, uint16_t> paged_decode_bf16;
    PagedDecode<float, uint16_t> paged_decode_f32_bf16;
    PagedDecode<float, int8_t> paged_decode_f32_i8;
    PagedDecode<uint16_t, int8_t> paged_decode_bf16_i8;
    LogNormalizers log_normalizers;
    GreedyPick greedy_pick;
    SamplePick sample_pick;
    CausalPrefill causal_prefill;  // float32, head_dim 64 or 128
    PrefillPaged<float> prefill_paged_f32;  // float32 queries over a float32, bfloat16 or int8 cache
    PrefillPaged<uint16_t> prefill_paged_bf16;
    PrefillPaged<int8_t> prefill_paged_i8;
};

template <Isa isa>
const KernelTable* variant();

// prefill_paged over a cache of `kind` (a KV cache's element, as Array::cache_kind gives it: 4 float32, 2 bfloat16,
// 1 int8 with its scales), through `table`'s kernels.
inline void prefill_paged_of_kind(const KernelTable* table, int kind, const float* q, int64_t q_stride,
                                  const void* k_cache, const void* v_cache, const float* k_scale,
                                  const float* v_scale, const int64_t* blocks, int64_t num_context, float* out,
                                  int64_t tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  int64_t block_size, float scale, int num_threads) {
    if (kind == 4)
        table->prefill_paged_f32(q, q_stride, static_cast<const float*>(k_cache), static_cast<const float*>(v_cache),
                                 k_scale, v_scale, blocks, num_context, out, tokens, num_heads, num_kv_heads,
                                 head_dim, block_size, scale, num_threads);
    else if (kind == 2)
        table->prefill_paged_bf16(q, q_stride, static_cast<const uint16_t*>(k_cache),
                                  static_cast<const uint16_t*>(v_cache), k_scale, v_scale, blocks, num_context, out,
                                  tokens, num_heads, num_kv_heads, head_dim, block_size, scale, num_threads);
    else
        table->prefill_paged_i8(q, q_stride, static_cast<const int8_t*>(k_cache), static_cast<const int8_t*>(v_cache),
                                k_scale, v_scale, blocks, num_context, out, tokens, num_heads, num_kv_heads, head_dim,
                                block_size, scale, num_threads);
}

}  // namespace corral_kernels

namespace corral_native {
const corral_kernels::KernelTable* kernel_table();  // the variant chosen for this CPU when the module loaded
}  // namespace corral_native

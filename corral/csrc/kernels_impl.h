// The CPU kernels' bodies, compiled once per instruction set: a variant file sets the target (#pragma GCC target),
// defines CORRAL_VARIANT (the namespace) and includes this header; kernels.cpp picks the variant at run time
// from the CPU's features. Standard headers come in through kernels.h, before any target pragma.
//
// Numerics: the elementwise ops (RMSNorm, RoPE, SiLU) round exactly where the torch expressions they replace
// round (bf16 after every op HF's modeling code does in bf16) and use no fused multiply-add, since torch rounds
// each product before the sum that follows it. Attention accumulates in float32 and may contract into FMAs.

#ifndef CORRAL_VARIANT
#error "a variant file defines CORRAL_VARIANT before including kernels_impl.h"
#endif

namespace corral_kernels {
namespace CORRAL_VARIANT {

// The helpers are always inlined: a function under another optimize pragma (the ops below) would otherwise not
// inline them, and neither would attention inline helpers defined under the ops' pragma (it then ran 4-5x slower).
#define CORRAL_INLINE static inline __attribute__((always_inline))

// bfloat16 is the high half of a float32, rounded to nearest even as torch rounds.
CORRAL_INLINE float load(float x) { return x; }
CORRAL_INLINE float load(uint16_t x) { uint32_t u = uint32_t(x) << 16; float f; std::memcpy(&f, &u, 4); return f; }
CORRAL_INLINE float load(int8_t x) { return float(x); }  // an int8 KV code; its row's scale applies after
CORRAL_INLINE void store(float x, float* dst) { *dst = x; }
CORRAL_INLINE void store(float x, uint16_t* dst) {
    uint32_t u; std::memcpy(&u, &x, 4);
    *dst = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
CORRAL_INLINE float round_to(float x, float) { return x; }
CORRAL_INLINE float round_to(float x, uint16_t) {  // through bfloat16 and back
    uint32_t u; std::memcpy(&u, &x, 4);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    float f; std::memcpy(&f, &u, 4); return f;
}
// An exp the compiler vectorizes (std::exp stays a scalar call without -ffast-math): Cody-Waite reduction
// x = n ln2 + r, |r| <= ln2/2, a degree-6 minimax polynomial for exp(r), and 2^n built in the exponent bits;
// relative error about 2 ulp (-fassociative-math may fold the two-constant reduction into one: a few ulp more
// for large |x|); x is clamped to [-87, 88].
CORRAL_INLINE float exp_approx(float x) {
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

// The ops: no fused multiply-add (torch rounds each product before the sum that follows it).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

static const int64_t PARALLEL_MIN = 1 << 16;  // elements; below this a thread hand-off costs more than it saves

// h[r] += delta[r] (when delta), then out[r] = w * T(h[r] * rsqrt(mean(h[r]^2) + eps)), as HF's LlamaRMSNorm.
template <typename T>
static void add_rms_norm(T* h, const T* delta, const T* w, T* out, int64_t rows, int64_t n, float eps, int threads) {
    #pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r) {
        T* x = h + r * n;
        float ss = 0.0f;
        if (delta) {
            const T* d = delta + r * n;
            #pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; ++i) {
                const float v = round_to(load(x[i]) + load(d[i]), T());
                store(v, x + i);
                ss += v * v;
            }
        } else {
            #pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; ++i) { const float v = load(x[i]); ss += v * v; }
        }
        const float inv = 1.0f / std::sqrt(ss / float(n) + eps);
        T* y = out + r * n;
        #pragma omp simd
        for (int64_t i = 0; i < n; ++i) store(load(w[i]) * round_to(load(x[i]) * inv, T()), y + i);
    }
}

// In place on rows of x (row stride `stride` elements, `heads` heads of `dim` each, contiguous within the row):
// x = x * cos + rotate_half(x) * sin, with cos/sin rows [dim] picked by each row's position.
template <typename T>
static void rope(T* x, int64_t stride, const int64_t* positions, const T* cos, const T* sin, int64_t rows,
                 int64_t heads, int64_t dim, int threads) {
    const int64_t half = dim / 2;
    #pragma omp parallel for num_threads(threads) if (rows * heads * dim >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r) {
        const T* c = cos + positions[r] * dim;
        const T* s = sin + positions[r] * dim;
        for (int64_t h = 0; h < heads; ++h) {
            T* v = x + r * stride + h * dim;
            #pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float a = load(v[i]), b = load(v[i + half]);
                const float lo = round_to(a * load(c[i]), T()) + round_to(-b * load(s[i]), T());
                const float hi = round_to(b * load(c[i + half]), T()) + round_to(a * load(s[i + half]), T());
                store(lo, v + i);
                store(hi, v + i + half);
            }
        }
    }
}

#pragma GCC pop_options

// out[r] = T(silu(gate[r])) * up[r], where row r of gate_up is [gate (n) | up (n)]. Outside the no-FMA block:
// nothing here is a product followed by a sum that torch rounds in between, and exp_approx (no torch op in any
// case) ran at half speed without its FMAs.
template <typename T>
static void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t n, int threads) {
    #pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r) {
        const T* g = gate_up + r * 2 * n;
        const T* u = g + n;
        T* y = out + r * n;
        #pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
            const float a = load(g[i]);
            store(round_to(a / (1.0f + exp_approx(-a)), T()) * load(u[i]), y + i);
        }
    }
}

// log(sum_i exp(x[i])) over the first n columns (the sampler's log-normalizer): the row's max, then one pass of
// exp(x - max) summed in float32 vectors (8 or 16 partial sums, then their sum): relative error a few float32 ulp.
// -inf columns add 0; an all -inf row gives -inf.
static inline float log_normalizer(const float* x, int64_t n) {
    float top = -INFINITY;
    #pragma omp simd reduction(max : top)
    for (int64_t i = 0; i < n; ++i) top = x[i] > top ? x[i] : top;
    if (top == -INFINITY || top != top) return top;
    float sum = 0.0f;
    #pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += x[i] == -INFINITY ? 0.0f : exp_approx(x[i] - top);
    return top + std::log(sum);
}

// out[r] = the log-normalizer of logits row r's first n columns.
static void log_normalizers(const float* logits, int64_t rows, int64_t stride, int64_t n, float* out, int threads) {
    #pragma omp parallel for num_threads(threads) if (rows * n >= 4 * PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r) out[r] = log_normalizer(logits + r * stride, n);
}

// The greedy sampler's row, where a row needs nothing but its mask: among the first n columns of logits row r
// (those whose bit is set in bitmask row r, when masked[r]; bit i of int32 word i / 32), the first largest. ids[r]
// is it, or -1 when no column is allowed, none is above -inf, or a NaN or +inf is met (the caller's general path then
// decides, as torch's argmax would); logprobs[r] its raw logit less the row's log-normalizer over all n columns.
static void greedy_pick(const float* logits, int64_t rows, int64_t stride, int64_t n, const int32_t* words,
                        int64_t words_stride, const uint8_t* masked, int64_t* ids, float* logprobs, int threads) {
    #pragma omp parallel for num_threads(threads) if (rows * n >= 4 * PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r) {
        const float* x = logits + r * stride;
        ids[r] = -1;
        logprobs[r] = 0.0f;
        int odd = 0;  // a NaN or +inf anywhere: the general path says what that means
        #pragma omp simd reduction(| : odd)
        for (int64_t i = 0; i < n; ++i) odd |= !(x[i] < INFINITY);
        if (odd) continue;
        float top = -INFINITY;
        int64_t at = -1;
        if (masked != nullptr && masked[r]) {
            const uint32_t* bits = reinterpret_cast<const uint32_t*>(words + r * words_stride);
            for (int64_t w = 0; w * 32 < n; ++w) {
                uint32_t word = bits[w];
                if (word == 0) continue;
                const int64_t base = w * 32, span = std::min<int64_t>(32, n - base);
                if (span < 32) word &= (uint32_t(1) << span) - 1;
                if (word == 0xffffffffu) {  // a whole block allowed: its max, then the first at it
                    float block = -INFINITY;
                    #pragma omp simd reduction(max : block)
                    for (int64_t i = 0; i < 32; ++i) block = x[base + i] > block ? x[base + i] : block;
                    if (block > top) {
                        top = block;
                        for (int64_t i = 0; i < 32; ++i)
                            if (x[base + i] == block) {
                                at = base + i;
                                break;
                            }
                    }
                    continue;
                }
                for (; word; word &= word - 1) {
                    const int64_t i = base + __builtin_ctz(word);
                    if (x[i] > top) {
                        top = x[i];
                        at = i;
                    }
                }
            }
        } else {
            #pragma omp simd reduction(max : top)
            for (int64_t i = 0; i < n; ++i) top = x[i] > top ? x[i] : top;
            for (int64_t i = 0; i < n; ++i)
                if (x[i] == top) {
                    at = i;
                    break;
                }
        }
        if (at < 0 || top == -INFINITY) continue;
        ids[r] = at;
        logprobs[r] = x[at] - log_normalizer(x, n);
    }
}

// The next block sits anywhere in the pool, where no hardware prefetcher looks: while row j of this block is
// read, row j of the next one is asked for (the loads of K and V rows were most of the kernel's time; asking for
// a whole block at once stalled on the line-fill buffers instead).
template <typename T>
static inline void prefetch_row(const T* row, int64_t D) {
    for (int64_t byte = 0; byte < D * int64_t(sizeof(T)); byte += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(row) + byte);
}

// Widens row t = 0 .. n-1 of one KV head (at `offset` within each token's slot) into `row`, then calls
// visit(t, scale), scale being the row's int8 scale (scales[slot index * scale_stride]) or 1 without scales: one
// table lookup per block, none per key, and the next block's row asked for while this one is read.
template <typename KV, int DIM, typename Visit>
static inline void for_each_row(const KV* cache, const float* scales, int64_t scale_stride, const int64_t* table,
                                int64_t n, int64_t block_size, int64_t slot, int64_t offset, int64_t head_dim,
                                float* __restrict row, Visit visit) {
    const int64_t D = DIM > 0 ? DIM : head_dim;
    const int64_t num_blocks = (n + block_size - 1) / block_size;
    for (int64_t b = 0; b < num_blocks; ++b) {
        const KV* block = cache + table[b] * block_size * slot + offset;
        const int64_t first = b * block_size, count = std::min(block_size, n - first);
        const KV* next = b + 1 < num_blocks ? cache + table[b + 1] * block_size * slot + offset : nullptr;
        const float* block_scales = scales ? scales + table[b] * block_size * scale_stride : nullptr;
        for (int64_t j = 0; j < count; ++j) {
            if (next) prefetch_row(next + j * slot, D);
            const KV* src = block + j * slot;
            #pragma omp simd
            for (int64_t d = 0; d < D; ++d) row[d] = load(src[d]);
            visit(first + j, block_scales ? block_scales[j * scale_stride] : 1.0f);
        }
    }
}

// Consecutive query rows with the same block table (a decode and its draft: one sequence, one query per position)
// form a run: [run_start[r], run_start[r + 1]). A job is (run, KV head) and reads each K/V row once for all of the
// run's queries, each query seeing its own context length.
static std::vector<int64_t> query_runs(const int64_t* tables, int64_t table_stride, int64_t num_seqs) {
    std::vector<int64_t> starts;
    for (int64_t s = 0; s < num_seqs; ++s)
        if (s == 0 || !std::equal(tables + s * table_stride, tables + (s + 1) * table_stride,
                                  tables + (s - 1) * table_stride))
            starts.push_back(s);
    starts.push_back(num_seqs);
    return starts;
}

// DIM > 0 fixes the head size at compile time (so the inner loops vectorize fully); 0 reads it at run time.
// KV is the cache's element: T itself, bfloat16 under float32 queries, or int8 codes with k_scale/v_scale
// [blocks, block_size, kv_heads] (nullptr otherwise). Each query's arithmetic is the same whatever run it is in
// (its scores, softmax and weighted sum over its own keys, in key order): a row's result does not depend on the
// rows beside it.
template <typename T, typename KV, int DIM>
static void decode(const T* q, const KV* k_cache, const KV* v_cache, const float* k_scale, const float* v_scale,
                   const int64_t* tables, int64_t table_stride, const int64_t* context_lens, T* out,
                   int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                   float scale, int num_threads) {
    const int64_t D = DIM > 0 ? DIM : head_dim;
    const int64_t group = num_heads / num_kv_heads, slot = num_kv_heads * D;
    const std::vector<int64_t> runs = query_runs(tables, table_stride, num_seqs);
    const int64_t num_runs = int64_t(runs.size()) - 1;
    #pragma omp parallel num_threads(num_threads)
    {
        // per thread, reused by every job it takes: scores [query][keys], scaled queries, accumulators, one row
        std::vector<float> scores, query, acc, row(D);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < num_runs * num_kv_heads; ++job) {
            const int64_t r = job / num_kv_heads, g = job % num_kv_heads;
            const int64_t first = runs[r], m = runs[r + 1] - first, queries = m * group;
            const int64_t* lens = context_lens + first;
            const int64_t n = *std::max_element(lens, lens + m);
            const int64_t* table = tables + first * table_stride;
            if (int64_t(scores.size()) < queries * n) scores.resize(queries * n);
            if (int64_t(query.size()) < queries * D) query.resize(queries * D), acc.resize(queries * D);
            float* __restrict qv = query.data();
            float* __restrict av = acc.data();
            float* __restrict rv = row.data();
            float* __restrict sv = scores.data();
            for (int64_t j = 0; j < m; ++j)
                for (int64_t i = 0; i < group; ++i) {
                    const T* src = q + ((first + j) * num_heads + g * group + i) * D;
                    #pragma omp simd
                    for (int64_t d = 0; d < D; ++d) qv[(j * group + i) * D + d] = load(src[d]) * scale;
                }
            const float* ks = k_scale ? k_scale + g : nullptr;
            const float* vs = v_scale ? v_scale + g : nullptr;
            // scores: one pass over the keys, each key row for every query that sees it
            for_each_row<KV, DIM>(k_cache, ks, num_kv_heads, table, n, block_size, slot, g * D, head_dim, rv,
                                  [&](int64_t t, float row_scale) {
                for (int64_t j = 0; j < m; ++j) {
                    if (t >= lens[j]) continue;
                    for (int64_t i = 0; i < group; ++i) {
                        const float* qi = qv + (j * group + i) * D;
                        float sum = 0.0f;
                        #pragma omp simd reduction(+ : sum)
                        for (int64_t d = 0; d < D; ++d) sum += qi[d] * rv[d];
                        sv[(j * group + i) * n + t] = sum * row_scale;
                    }
                }
            });
            for (int64_t j = 0; j < m; ++j)
                for (int64_t i = 0; i < group; ++i) {
                    float* sc = sv + (j * group + i) * n;
                    const int64_t keys = lens[j];
                    float top = sc[0];
                    #pragma omp simd reduction(max : top)
                    for (int64_t t = 1; t < keys; ++t) top = sc[t] > top ? sc[t] : top;
                    float sum = 0.0f;
                    #pragma omp simd reduction(+ : sum)
                    for (int64_t t = 0; t < keys; ++t) { sc[t] = exp_approx(sc[t] - top); sum += sc[t]; }
                    const float inv = 1.0f / sum;
                    #pragma omp simd
                    for (int64_t t = 0; t < keys; ++t) sc[t] *= inv;
                }
            std::fill(av, av + queries * D, 0.0f);
            for_each_row<KV, DIM>(v_cache, vs, num_kv_heads, table, n, block_size, slot, g * D, head_dim, rv,
                                  [&](int64_t t, float row_scale) {
                for (int64_t j = 0; j < m; ++j) {
                    if (t >= lens[j]) continue;
                    for (int64_t i = 0; i < group; ++i) {
                        const float p = sv[(j * group + i) * n + t] * row_scale;
                        float* a = av + (j * group + i) * D;
                        #pragma omp simd
                        for (int64_t d = 0; d < D; ++d) a[d] += p * rv[d];
                    }
                }
            });
            for (int64_t j = 0; j < m; ++j)
                for (int64_t i = 0; i < group; ++i) {
                    T* dst = out + ((first + j) * num_heads + g * group + i) * D;
                    for (int64_t d = 0; d < D; ++d) store(av[(j * group + i) * D + d], dst + d);
                }
        }
    }
}

template <typename T, typename KV>
static void paged_decode(const T* q, const KV* k, const KV* v, const float* k_scale, const float* v_scale,
                         const int64_t* tables, int64_t table_stride, const int64_t* lens, T* out, int64_t num_seqs,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                         int num_threads) {
    auto f = head_dim == 64 ? decode<T, KV, 64> : head_dim == 128 ? decode<T, KV, 128> : decode<T, KV, 0>;
    f(q, k, v, k_scale, v_scale, tables, table_stride, lens, out, num_seqs, num_heads, num_kv_heads, head_dim,
      block_size, scale, num_threads);
}

// Causal attention of T new tokens over their own keys: a prefill with nothing cached before it. q [T, heads, DIM],
// k and v [T, kv_heads, DIM] (rows q_stride, k_stride and v_stride floats apart: views into the fused QKV output), out
// [T, heads * DIM], all float32; query t sees keys 0 .. t of its head's KV head. Flash-style: keys in blocks of
// PREFILL_KEYS, the scores of PREFILL_ROWS query rows against a block as vector FMAs over K transposed (so no
// horizontal sums), a running max and sum per row (each block's exps taken against the row's largest score so
// far, earlier sums and outputs rescaled when it grows), the weights times V accumulated in registers. A job is
// (block of rows, KV head) and serves every query head of the group with the same K and V; the last rows, which see
// the most keys, go first. float32 throughout, FMAs allowed, exp_approx's few ulp: within about 1e-5 relative of
// torch's attention in float32 (tests/kernels/test_prefill_attention.py states the bound it checks).
//
// The vector is the one the variant's registers hold: 16 floats with AVX-512, 8 with AVX2, 4 otherwise (a wider
// vector type than the target has is split by GCC into pieces that went through memory: 20x slower). The helpers
// are always inlined, so the ABI that GCC warns about for wide vector arguments never applies.
#pragma GCC diagnostic ignored "-Wpsabi"
#if defined(__AVX512F__)
typedef float vfn __attribute__((vector_size(64), aligned(4), may_alias));
static const int PREFILL_ROWS = 4;  // 2 score vectors and 4 output vectors per row at DIM 64: 24 of 32 registers
#elif defined(__AVX__)
typedef float vfn __attribute__((vector_size(32), aligned(4), may_alias));
static const int PREFILL_ROWS = 2;  // 4 score vectors per row; the outputs spill to L1
#else
typedef float vfn __attribute__((vector_size(16), aligned(4), may_alias));
static const int PREFILL_ROWS = 2;
#endif
static const int64_t LANES = int64_t(sizeof(vfn) / sizeof(float));

CORRAL_INLINE vfn vload(const float* p) { return *reinterpret_cast<const vfn*>(p); }
CORRAL_INLINE void vstore(float* p, vfn x) { *reinterpret_cast<vfn*>(p) = x; }

static const int64_t PREFILL_KEYS = 32;  // keys per block

template <int DIM>
static void causal_prefill_impl(const float* q, int64_t q_stride, const float* k, int64_t k_stride, const float* v,
                                int64_t v_stride, float* out, int64_t T, int64_t num_heads, int64_t num_kv_heads,
                                float scale, int num_threads) {
    constexpr int64_t KEYS = PREFILL_KEYS, SCORE_VECS = KEYS / LANES, VECS = DIM / LANES;
    constexpr int ROWS = PREFILL_ROWS;
    const int64_t group = num_heads / num_kv_heads, padded = (T + KEYS - 1) / KEYS * KEYS;
    // K transposed per KV head, [g][d][t], zero past T: one key block's d-th coordinates are 32 adjacent floats
    std::vector<float> kt(size_t(num_kv_heads * DIM * padded), 0.0f);
    for (int64_t g = 0; g < num_kv_heads; ++g)
        for (int64_t t = 0; t < T; ++t)
            for (int64_t d = 0; d < DIM; ++d) kt[size_t((g * DIM + d) * padded + t)] = k[t * k_stride + g * DIM + d];
    const int64_t row_blocks = (T + ROWS - 1) / ROWS;
    #pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (T > ROWS)
    for (int64_t job = 0; job < row_blocks * num_kv_heads; ++job) {
        const int64_t r0 = (row_blocks - 1 - job / num_kv_heads) * ROWS, g = job % num_kv_heads;
        const int64_t rows = std::min<int64_t>(ROWS, T - r0), last = r0 + rows - 1;
        const float* ktg = kt.data() + g * DIM * padded;
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
            alignas(64) float qv[ROWS][DIM];
            for (int r = 0; r < ROWS; ++r) {  // a short last block repeats its last row: computed, never stored
                const float* src = q + (r0 + std::min<int64_t>(r, rows - 1)) * q_stride + h * DIM;
                #pragma omp simd
                for (int64_t d = 0; d < DIM; ++d) qv[r][d] = src[d] * scale;
            }
            float top[ROWS], sum[ROWS];
            vfn acc[ROWS][VECS];
            for (int r = 0; r < ROWS; ++r) {
                top[r] = -INFINITY, sum[r] = 0.0f;
                for (int64_t c = 0; c < VECS; ++c) acc[r][c] = vfn{};
            }
            for (int64_t j0 = 0; j0 <= last; j0 += KEYS) {
                vfn s[ROWS][SCORE_VECS];
                for (int r = 0; r < ROWS; ++r)
                    for (int64_t c = 0; c < SCORE_VECS; ++c) s[r][c] = vfn{};
                const float* kp = ktg + j0;
                for (int64_t d = 0; d < DIM; ++d) {
                    vfn key[SCORE_VECS];
                    for (int64_t c = 0; c < SCORE_VECS; ++c) key[c] = vload(kp + d * padded + c * LANES);
                    for (int r = 0; r < ROWS; ++r)
                        for (int64_t c = 0; c < SCORE_VECS; ++c) s[r][c] += qv[r][d] * key[c];
                }
                alignas(64) float p[ROWS][KEYS];
                const int64_t keys = std::min<int64_t>(KEYS, T - j0);
                for (int r = 0; r < ROWS; ++r) {
                    for (int64_t c = 0; c < SCORE_VECS; ++c) vstore(p[r] + c * LANES, s[r][c]);
                    // row r0 + r sees keys j0 .. r0 + r of this block (none when it ends before j0)
                    const int64_t visible = r < rows ? std::min<int64_t>(keys, r0 + r - j0 + 1) : 0;
                    if (visible <= 0) {
                        for (int64_t j = 0; j < KEYS; ++j) p[r][j] = 0.0f;
                        continue;
                    }
                    float high = top[r];
                    for (int64_t j = 0; j < visible; ++j) high = std::max(high, p[r][j]);
                    float total = 0.0f;
                    #pragma omp simd reduction(+ : total)
                    for (int64_t j = 0; j < KEYS; ++j) {
                        const float e = j < visible ? exp_approx(p[r][j] - high) : 0.0f;
                        p[r][j] = e;
                        total += e;
                    }
                    if (high != top[r]) {  // the row's largest score grew: earlier weights shrink by exp(old - new)
                        const float shrink = top[r] == -INFINITY ? 0.0f : exp_approx(top[r] - high);
                        sum[r] *= shrink;
                        for (int64_t c = 0; c < VECS; ++c) acc[r][c] *= shrink;
                        top[r] = high;
                    }
                    sum[r] += total;
                }
                for (int64_t j = 0; j < keys; ++j) {
                    const float* vr = v + (j0 + j) * v_stride + g * DIM;
                    vfn row[VECS];
                    for (int64_t c = 0; c < VECS; ++c) row[c] = vload(vr + LANES * c);
                    for (int r = 0; r < ROWS; ++r)
                        for (int64_t c = 0; c < VECS; ++c) acc[r][c] += p[r][j] * row[c];
                }
            }
            for (int r = 0; r < rows; ++r) {
                const float inverse = 1.0f / sum[r];  // key 0 is always visible: sum >= 1
                float* dst = out + (r0 + r) * num_heads * DIM + h * DIM;
                for (int64_t c = 0; c < VECS; ++c) vstore(dst + LANES * c, acc[r][c] * inverse);
            }
        }
    }
}

static void causal_prefill(const float* q, int64_t q_stride, const float* k, int64_t k_stride, const float* v,
                           int64_t v_stride, float* out, int64_t T, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, float scale, int num_threads) {
    auto f = head_dim == 64 ? causal_prefill_impl<64> : causal_prefill_impl<128>;
    f(q, q_stride, k, k_stride, v, v_stride, out, T, num_heads, num_kv_heads, scale, num_threads);
}

}  // namespace CORRAL_VARIANT

#undef CORRAL_INLINE

template <>
const KernelTable* variant<Isa::CORRAL_VARIANT>() {
    static const KernelTable table = {
        CORRAL_VARIANT_NAME,
        CORRAL_VARIANT::add_rms_norm<float>, CORRAL_VARIANT::add_rms_norm<uint16_t>,
        CORRAL_VARIANT::rope<float>, CORRAL_VARIANT::rope<uint16_t>,
        CORRAL_VARIANT::silu_mul<float>, CORRAL_VARIANT::silu_mul<uint16_t>,
        CORRAL_VARIANT::paged_decode<float, float>, CORRAL_VARIANT::paged_decode<uint16_t, uint16_t>,
        CORRAL_VARIANT::paged_decode<float, uint16_t>, CORRAL_VARIANT::paged_decode<float, int8_t>,
        CORRAL_VARIANT::paged_decode<uint16_t, int8_t>, CORRAL_VARIANT::log_normalizers,
        CORRAL_VARIANT::greedy_pick, CORRAL_VARIANT::causal_prefill,
    };
    return &table;
}

}  // namespace corral_kernels

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

// While one lives, on this thread, a float result too small for a normal float is zero (x86: MXCSR's flush to
// zero; the mode before is put back after). GCC vectorizes the SiLU below as both sides of exp_approx's clamp for
// every lane, one side being a / (1 + e^88), a subnormal for any |a| under 1.9, which the blend then drops:
// Intel cores take a microcode assist for every subnormal result, and the SiLU ran at 3.5-4 ns per element on a
// Xeon (Ice Lake) against 0.4-0.6 with the flush. Only results that would be subnormal change: a SiLU output
// under 1.2e-38 in size becomes 0. Other CPUs keep subnormal results: ARM's flush mode (FPCR.FZ) would zero
// subnormal inputs as well, which x86's leaves alone, and no ARM core has been timed on this.
struct FlushToZero {
#if defined(__x86_64__) || defined(__i386__)
    const unsigned saved = _mm_getcsr();
    FlushToZero() { _mm_setcsr(saved | 0x8000u); }
    ~FlushToZero() { _mm_setcsr(saved); }
#endif
};

// out[r] = T(silu(gate[r])) * up[r], where row r of gate_up is [gate (n) | up (n)]. Outside the no-FMA block:
// nothing here is a product followed by a sum that torch rounds in between, and exp_approx (no torch op in any
// case) ran at half speed without its FMAs. Results flush to zero (FlushToZero, above), on every thread.
template <typename T>
static void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t n, int threads) {
    #pragma omp parallel num_threads(threads) if (rows * n >= PARALLEL_MIN)
    {
        const FlushToZero flush;
        #pragma omp for schedule(static)
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
}

// log(sum_i exp(x[i])) over the first n columns (the sampler's log-normalizer): the row's max, then one pass of
// exp(x - max) summed in float32 vectors (8 or 16 partial sums, then their sum): relative error a few float32 ulp.
// -inf columns add 0; an all -inf row gives -inf.
static inline float row_max(const float* x, int64_t n) {
    float top = -INFINITY;
    #pragma omp simd reduction(max : top)
    for (int64_t i = 0; i < n; ++i) top = x[i] > top ? x[i] : top;
    return top;
}
// The second half, given the row's max (the max is exact, whatever order finds it).
static inline float log_normalizer_at(const float* x, int64_t n, float top) {
    if (top == -INFINITY || top != top) return top;
    float sum = 0.0f;
    #pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += x[i] == -INFINITY ? 0.0f : exp_approx(x[i] - top);
    return top + std::log(sum);
}
static inline float log_normalizer(const float* x, int64_t n) { return log_normalizer_at(x, n, row_max(x, n)); }

// out[r] = the log-normalizer of logits row r's first n columns.
static void log_normalizers(const float* logits, int64_t rows, int64_t stride, int64_t n, float* out, int threads) {
    #pragma omp parallel for num_threads(threads) if (rows * n >= 4 * PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r) out[r] = log_normalizer(logits + r * stride, n);
}

// The greedy sampler's row, where a row needs nothing but its mask: among the first n columns of logits row r
// (those whose bit is set in bitmask row r, when masked[r]; bit i of int32 word i / 32), the first largest. ids[r]
// is it, or -1 when no column is allowed, none is above -inf, or a NaN or +inf is met (the caller's general path then
// decides, as torch's argmax would); logprobs[r] its raw logit less the row's log-normalizer over all n columns
// (logprobs null: not computed).
static void greedy_pick(const float* logits, int64_t rows, int64_t stride, int64_t n, const int32_t* words,
                        int64_t words_stride, const uint8_t* masked, int64_t* ids, float* logprobs, int threads) {
    #pragma omp parallel for num_threads(threads) if (rows * n >= 4 * PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r) {
        const float* x = logits + r * stride;
        ids[r] = -1;
        if (logprobs != nullptr) logprobs[r] = 0.0f;
        // one pass for the whole row's max (the log-normalizer's) and whether it holds a NaN or +inf (then the
        // general path says what that means)
        float full = -INFINITY;
        int odd = 0;
        #pragma omp simd reduction(max : full) reduction(| : odd)
        for (int64_t i = 0; i < n; ++i) {
            odd |= !(x[i] < INFINITY);
            full = x[i] > full ? x[i] : full;
        }
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
        } else if (full > -INFINITY) {  // the first column at the row's max: 64 columns tested at a time
            top = full;
            for (int64_t base = 0; at < 0 && base < n; base += 64) {
                const int64_t span = std::min<int64_t>(64, n - base);
                int hit = 0;
                #pragma omp simd reduction(| : hit)
                for (int64_t i = 0; i < span; ++i) hit |= x[base + i] == top;
                if (hit)
                    for (int64_t i = 0; i < span; ++i)
                        if (x[base + i] == top) {
                            at = base + i;
                            break;
                        }
            }
        }
        if (at < 0 || top == -INFINITY) continue;
        ids[r] = at;
        if (logprobs != nullptr) logprobs[r] = x[at] - log_normalizer_at(x, n, full);
    }
}

// The k best of v[0, n) above `floor`, best first, into out: item(i) makes column i's entry, better orders entries
// (largest value first) and value_of reads an entry's value. A min-heap of k, and 16 values at a time tested against
// the heap's least at once (a row's distribution has few large values: once the heap is full, almost every group
// of 16 is passed over with one vector comparison). Columns come in order, so a later column whose value equals
// the heap's least never beats it.
template <typename Item, typename Make, typename Better, typename Value>
static void best_of(const float* v, int64_t n, int64_t k, float floor, std::vector<Item>& out, Make item,
                    Better better, Value value_of) {
    out.clear();
    float bar = floor;  // a value must exceed it to enter: the floor, then the full heap's least
    for (int64_t base = 0; base < n; base += 16) {
        const int64_t span = std::min<int64_t>(16, n - base);
        int any = 0;
        #pragma omp simd reduction(| : any)
        for (int64_t i = 0; i < span; ++i) any |= v[base + i] > bar;
        if (!any) continue;
        for (int64_t i = base; i < base + span; ++i) {
            if (!(v[i] > bar)) continue;
            if (int64_t(out.size()) < k) {
                out.push_back(item(i));
                std::push_heap(out.begin(), out.end(), better);
            } else {
                std::pop_heap(out.begin(), out.end(), better);
                out.back() = item(i);
                std::push_heap(out.begin(), out.end(), better);
            }
            if (int64_t(out.size()) == k) bar = std::max(floor, value_of(out.front()));
        }
    }
    std::sort_heap(out.begin(), out.end(), better);
}

// The k largest values of v[0, n) above `floor`, largest first.
static void largest(const float* v, int64_t n, int64_t k, float floor, std::vector<float>& out) {
    best_of(v, n, k, floor, out, [v](int64_t i) { return v[i]; }, std::greater<float>(), [](float a) { return a; });
}

// The k largest of x[0, n) above -inf with their columns, largest first and the lower column first among equals
// (torch's topk leaves that order open).
static void largest_at(const float* x, int64_t n, int64_t k, std::vector<std::pair<float, int64_t>>& out) {
    using Entry = std::pair<float, int64_t>;
    const auto better = [](const Entry& a, const Entry& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
    };
    best_of(x, n, k, -INFINITY, out, [x](int64_t i) { return Entry{x[i], i}; }, better,
            [](const Entry& e) { return e.first; });
}

// The probability of the last token top_p keeps in p[0, n) (float32, not all zero, summing to about 1): sorted
// largest first, a token is kept while the mass before it (float32 running sums, as torch's cumsum rounds them) is
// below top_p. The largest 64 are looked at first, 4x more while they hold less than top_p, and past 1,024 (a flat
// distribution) every positive one is sorted at once.
static float top_p_smallest_kept(const float* p, int64_t n, float top_p, std::vector<float>& sorted) {
    for (int64_t k = 64;; k *= 4) {
        if (k <= 1024) {
            largest(p, n, k, 0.0f, sorted);
        } else {
            sorted.clear();
            for (int64_t i = 0; i < n; ++i)
                if (p[i] > 0.0f) sorted.push_back(p[i]);
            std::sort(sorted.begin(), sorted.end(), std::greater<float>());
        }
        double running = 0.0;
        float smallest = 0.0f;
        bool reached = false;
        for (const float q : sorted) {
            running += q;
            if (!(float(running) - q < top_p)) {  // as torch: (cumulative - largest) < top_p, in float32
                reached = true;
                break;
            }
            smallest = q;
        }
        if (reached || k > 1024 || int64_t(sorted.size()) < k) return smallest;  // past 1,024: all were sorted
    }
}

// v as float32 holds it, where the compiler may neither fuse it into the next operation nor reassociate around it:
// each of the torch path's tensor operations rounds on its own.
static inline float rounded(float v) {
    volatile float held = v;
    return held;
}

// The sampler's steps 2-4 past the mask on a row's masked logits w[0, n) (free of NaN and +inf), each rounded as the
// torch path rounds it: the stop ids held back while any other column is allowed, then per edited column its bias,
// its repetition penalty (l / p above 0, else l * p) and its frequency and presence penalties. False where that
// takes a column to +inf or NaN (the torch path then decides).
static bool shape(float* w, int64_t n, const RowShaping& s) {
    if (s.num_hold > 0) {
        int64_t allowed = 0, stops = 0;
        #pragma omp simd reduction(+ : allowed)
        for (int64_t i = 0; i < n; ++i) allowed += w[i] > -INFINITY;
        for (int64_t j = 0; j < s.num_hold; ++j) stops += w[s.hold[j]] > -INFINITY;
        if (allowed > stops)  // a grammar that allows only stops here outranks min_tokens
            for (int64_t j = 0; j < s.num_hold; ++j) w[s.hold[j]] = -INFINITY;
    }
    for (int64_t j = 0; j < s.num_edits; ++j) {
        const ColumnEdit& e = s.edits[j];
        float value = w[e.column];
        if (e.biased) value = rounded(value + e.bias);
        if (e.seen && s.repetition != 1.0f)
            value = value > 0.0f ? rounded(value / s.repetition) : rounded(value * s.repetition);
        if (e.count > 0) {
            value = rounded(value - rounded(float(e.count) * s.frequency));
            value = rounded(value - s.presence);
        }
        if (!(value < INFINITY)) return false;  // +inf or NaN
        w[e.column] = value;
    }
    return true;
}

// The sampler's row for a row that needs its mask, temperature, min_p, top_k, top_p and one uniform (sampler.py's
// steps 5-7, in its order, on the masked logits, shaped first where the row has a hold-back, bias or penalties, see
// shape): among the first n columns that the mask allows (and are above
// -inf), logits / temperature; min_p keeps those >= max + log(min_p); top_k those >= the k-th largest; then the
// softmax, and top_p keeps those >= the last probability the nucleus takes (ties stay); the token is the first
// whose running sum of probabilities (float64, in column order) exceeds u times their total. Temperature 0 takes
// the first largest allowed column, as greedy_pick; a negative temperature skips the row (ids[r] = -2). ids[r] = -1
// where no column is allowed or the row holds a NaN or +inf (the caller's general path then decides). logprobs[r]:
// the raw logit less the row's log-normalizer over all n columns; and the row's top_out.count[r] most likely raw
// columns (above -inf) with theirs, largest first. The arithmetic is float32 with an exp of a few
// ulp, where torch's softmax differs in its last bits: a draw can differ from the torch path's only where u lands
// within that rounding of a boundary between two tokens' cumulative mass.
static void sample_pick(const float* logits, int64_t rows, int64_t stride, int64_t n, const int32_t* words,
                        int64_t words_stride, const uint8_t* masked, DrawParams params, TopLogprobs top_out,
                        int64_t* ids, float* logprobs, int threads) {
    #pragma omp parallel for num_threads(threads) if (rows * n >= 4 * PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r) {
        static thread_local std::vector<float> v, sorted;
        static thread_local std::vector<std::pair<float, int64_t>> best;
        const float* x = logits + r * stride;
        const float t = params.temperature[r];
        ids[r] = t < 0.0f ? -2 : -1;
        logprobs[r] = 0.0f;
        if (t < 0.0f) continue;
        float full = -INFINITY;
        int odd = 0;
        #pragma omp simd reduction(max : full) reduction(| : odd)
        for (int64_t i = 0; i < n; ++i) {
            odd |= !(x[i] < INFINITY);
            full = x[i] > full ? x[i] : full;
        }
        if (odd || full == -INFINITY) continue;
        v.resize(n);
        float* w = v.data();
        const float scale = t > 0.0f ? t : 1.0f;
        const RowShaping* shaping = params.shaping != nullptr && params.shaping[r].shaped ? params.shaping + r : nullptr;
        // an unshaped row is tempered as it is copied (a masked -inf stays -inf), a shaped one once it is shaped
        const float first = shaping == nullptr ? scale : 1.0f;
        #pragma omp simd
        for (int64_t i = 0; i < n; ++i) w[i] = x[i] / first;
        if (masked != nullptr && masked[r]) {
            const uint32_t* bits = reinterpret_cast<const uint32_t*>(words + r * words_stride);
            for (int64_t word = 0; word * 32 < n; ++word) {
                const uint32_t allowed = bits[word];
                if (allowed == 0xffffffffu) continue;
                const int64_t base = word * 32, span = std::min<int64_t>(32, n - base);
                for (int64_t i = 0; i < span; ++i)
                    if (!((allowed >> i) & 1u)) w[base + i] = -INFINITY;
            }
        }
        if (shaping != nullptr) {
            if (shaping->undecided || !shape(w, n, *shaping)) continue;
            if (scale != 1.0f) {
                #pragma omp simd
                for (int64_t i = 0; i < n; ++i) w[i] /= scale;
            }
        }
        float top = -INFINITY;
        #pragma omp simd reduction(max : top)
        for (int64_t i = 0; i < n; ++i) top = w[i] > top ? w[i] : top;
        if (top == -INFINITY) continue;
        int64_t at = -1;
        if (t == 0.0f) {  // greedy: the first column at the max
            for (int64_t i = 0; i < n; ++i)
                if (w[i] == top) {
                    at = i;
                    break;
                }
        } else {
            float cut = -INFINITY;  // every rule below keeps the values >= its cut: ties stay
            if (params.min_p[r] > 0.0f) cut = top + std::log(params.min_p[r]);
            const int64_t k = params.top_k[r];
            if (k > 0 && k < n) {
                largest(w, n, k, cut == -INFINITY ? -INFINITY : std::nextafter(cut, -INFINITY), sorted);
                if (int64_t(sorted.size()) == k) cut = std::max(cut, sorted.back());
            }
            float sum = 0.0f;  // softmax over what is kept, w becomes the probabilities
            #pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < n; ++i) {
                // below -87, where exp_approx stops, float32 holds at most a denormal: 0, as good as torch's
                w[i] = w[i] >= cut && w[i] - top >= -87.0f ? exp_approx(w[i] - top) : 0.0f;
                sum += w[i];
            }
            #pragma omp simd
            for (int64_t i = 0; i < n; ++i) w[i] /= sum;
            if (params.top_p[r] < 1.0f) {
                const float smallest = top_p_smallest_kept(w, n, params.top_p[r], sorted);
                #pragma omp simd
                for (int64_t i = 0; i < n; ++i) w[i] = w[i] < smallest ? 0.0f : w[i];
            }
            // float64 sums: the total in vector lanes, the running sum by blocks of 64 (each block's sum in
            // lanes) and one column at a time inside the block where it passes the target. Summed in another
            // order than torch's cumsum, they differ from it by float64 rounding (1e-16 of the total).
            double total = 0.0;
            #pragma omp simd reduction(+ : total)
            for (int64_t i = 0; i < n; ++i) total += w[i];
            // as torch: u * total can round up to total itself, which no running sum exceeds; one ulp below it
            const double target = std::min(params.uniform[r] * total, std::nextafter(total, 0.0));
            double running = 0.0;
            for (int64_t base = 0; at < 0 && base < n; base += 64) {
                const int64_t end = std::min<int64_t>(base + 64, n);
                double block = 0.0;
                #pragma omp simd reduction(+ : block)
                for (int64_t i = base; i < end; ++i) block += w[i];
                if (running + block <= target) {
                    running += block;
                    continue;
                }
                for (int64_t i = base; i < end; ++i) {
                    running += w[i];
                    if (running > target && w[i] > 0.0f) {
                        at = i;
                        break;
                    }
                }
            }
        }
        if (at < 0) continue;
        const float normalizer = log_normalizer_at(x, n, full);
        ids[r] = at;
        logprobs[r] = x[at] - normalizer;
        if (top_out.count[r] > 0) {  // the raw distribution's most likely columns, as the torch path reports them
            largest_at(x, n, std::min(top_out.count[r], TOP_LOGPROBS), best);
            for (size_t j = 0; j < best.size(); ++j) {
                top_out.ids[r * TOP_LOGPROBS + int64_t(j)] = best[j].second;
                top_out.logprobs[r * TOP_LOGPROBS + int64_t(j)] = best[j].first - normalizer;
            }
        }
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
// form a run: [run_start[r], run_start[r + 1]). A job reads each K/V row of its run once for all of the run's
// queries, each query seeing its own context length.
static std::vector<int64_t> query_runs(const int64_t* tables, int64_t table_stride, int64_t num_seqs) {
    std::vector<int64_t> starts;
    for (int64_t s = 0; s < num_seqs; ++s)
        if (s == 0 || !std::equal(tables + s * table_stride, tables + (s + 1) * table_stride,
                                  tables + (s - 1) * table_stride))
            starts.push_back(s);
    starts.push_back(num_seqs);
    return starts;
}

// Decode attention for head sizes other than 64 and 128 (decode_blocked below serves those): per (run, KV head),
// every key's score for each query as one dot product, an exact softmax, then the weighted sum. DIM > 0 fixes the
// head size at compile time; 0 reads it at run time. KV is the cache's element: T itself, bfloat16 under float32
// queries, or int8 codes with k_scale/v_scale [blocks, block_size, kv_heads] (nullptr otherwise). Each query's
// arithmetic is the same whatever run it is in (its scores, softmax and weighted sum over its own keys, in key
// order): a row's result does not depend on the rows beside it.
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
// vector type than the target has is split by GCC into pieces that went through memory: 20x slower). The variant
// file says its width (CORRAL_VECTOR_BYTES): g++ does not define __AVX512F__ and the like for a #pragma GCC target,
// so the build's own -march is all the macros show. The helpers are always inlined, so the ABI that GCC warns
// about for wide vector arguments never applies.
#pragma GCC diagnostic ignored "-Wpsabi"
#ifndef CORRAL_VECTOR_BYTES
#if defined(__AVX512F__)
#define CORRAL_VECTOR_BYTES 64
#elif defined(__AVX__)
#define CORRAL_VECTOR_BYTES 32
#else
#define CORRAL_VECTOR_BYTES 16
#endif
#endif
typedef float vfn __attribute__((vector_size(CORRAL_VECTOR_BYTES), aligned(4), may_alias));
#if CORRAL_VECTOR_BYTES == 64
static const int PREFILL_ROWS = 4;  // 2 score vectors and 4 output vectors per row at DIM 64: 24 of 32 registers
#else
static const int PREFILL_ROWS = 2;  // 4 score vectors per row at 8 floats; the outputs spill to L1
#endif
static const int64_t LANES = int64_t(sizeof(vfn) / sizeof(float));

CORRAL_INLINE vfn vload(const float* p) { return *reinterpret_cast<const vfn*>(p); }
CORRAL_INLINE void vstore(float* p, vfn x) { *reinterpret_cast<vfn*>(p) = x; }

typedef int32_t vin __attribute__((vector_size(sizeof(vfn))));
#if CORRAL_VECTOR_BYTES == 64
static const vin EVEN = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
static const vin ODD = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
static const vfn LANE = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};  // each lane's index
#elif CORRAL_VECTOR_BYTES == 32
static const vin EVEN = {0, 2, 4, 6, 8, 10, 12, 14}, ODD = {1, 3, 5, 7, 9, 11, 13, 15};
static const vfn LANE = {0, 1, 2, 3, 4, 5, 6, 7};
#else
static const vin EVEN = {0, 2, 4, 6}, ODD = {1, 3, 5, 7};
static const vfn LANE = {0, 1, 2, 3};
#endif

// part[0 .. LANES) each hold partial sums of one dot product; returns the vector whose lane i is part[i]'s total.
// Adjacent lanes are summed pairwise, two vectors into one, so LANES dot products take LANES - 1 such steps (two
// shuffles and an add each) where reducing each vector on its own takes log2(LANES) shuffles and adds apiece and
// leaves a scalar. part is overwritten.
CORRAL_INLINE vfn lane_totals(vfn* part) {
    for (int64_t n = LANES; n > 1; n /= 2)
        for (int64_t i = 0; i < n / 2; ++i)
            part[i] = __builtin_shuffle(part[2 * i], part[2 * i + 1], EVEN) +
                      __builtin_shuffle(part[2 * i], part[2 * i + 1], ODD);
    return part[0];
}

// ROTATE[i]: lane j takes lane (j + LANES / 2**(i + 1)) % LANES. Constants: an index vector filled in a loop was
// rebuilt lane by lane at every call.
#if CORRAL_VECTOR_BYTES == 64
static const vin ROTATE[] = {{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                             {4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3},
                             {2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1},
                             {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0}};
#elif CORRAL_VECTOR_BYTES == 32
static const vin ROTATE[] = {{4, 5, 6, 7, 0, 1, 2, 3}, {2, 3, 4, 5, 6, 7, 0, 1}, {1, 2, 3, 4, 5, 6, 7, 0}};
#else
static const vin ROTATE[] = {{2, 3, 0, 1}, {1, 2, 3, 0}};
#endif

CORRAL_INLINE float lane_max(vfn x) {  // the largest lane, by halving: the upper half against the lower
    for (const vin& upper : ROTATE) {
        const vfn y = __builtin_shuffle(x, upper);
        x = x > y ? x : y;
    }
    return x[0];
}

static const int64_t DECODE_KEYS = 16;  // keys per block: a query's scores are one to four vectors
// Keys per job. A long context is cut into chunks of this many keys, each (run, chunk) with one KV head or all of
// them a job (decode_blocked), their partial softmax sums merged after, so that one sequence's few KV heads still
// keep every thread busy. The size is fixed, not taken from the thread count or the batch, so a row's arithmetic
// never depends on either.
static const int64_t DECODE_CHUNK = 256;

// A query's weights for one key block, on a cache line of its own: the loop that writes them is vectorized with a
// reduction, and a compiler may peel iterations to reach an alignment, which would make the sum's order depend on
// where the buffer happens to lie.
struct alignas(64) KeyWeights {
    float w[DECODE_KEYS];
};
static_assert(sizeof(KeyWeights) == DECODE_KEYS * sizeof(float), "consecutive queries' weights are contiguous");

// The weighted sum of one key block's V rows (vb, DECODE_KEYS x DIM floats) into NQ queries' accumulators (acc,
// DIM floats apart), each first scaled by its shrink unless that is 1: query q adds w[q * DECODE_KEYS + k] times
// row k for k < n in that order, the operations it would do alone.
template <int DIM, int NQ>
CORRAL_INLINE void weigh_values(float* acc, const float* w, const float* shrink, const float* vb, int64_t n) {
    constexpr int64_t VECS = DIM / LANES;
    vfn ar[NQ][VECS];
    for (int q = 0; q < NQ; ++q) {
        for (int64_t v = 0; v < VECS; ++v) ar[q][v] = vload(acc + q * DIM + v * LANES);
        if (shrink[q] != 1.0f)
            for (int64_t v = 0; v < VECS; ++v) ar[q][v] *= shrink[q];
    }
    for (int64_t k = 0; k < n; ++k)
        for (int64_t v = 0; v < VECS; ++v) {
            const vfn x = vload(vb + k * DIM + v * LANES);
            for (int q = 0; q < NQ; ++q) ar[q][v] += w[q * DECODE_KEYS + k] * x;
        }
    for (int q = 0; q < NQ; ++q)
        for (int64_t v = 0; v < VECS; ++v) vstore(acc + q * DIM + v * LANES, ar[q][v]);
}

// Flash-decoding over the paged cache, for head sizes 64 and 128. Keys are read in blocks of DECODE_KEYS,
// each key's row widened to float32 (times its scale, for int8) once into an L1 buffer for every query of the run;
// a query's scores for the block are DECODE_KEYS dot products taken as vector FMAs and reduced together
// (lane_totals), then a running max and sum per query (each block's weights taken against the largest score so far,
// earlier sums and outputs rescaled when it grows), the weighted V rows accumulated in registers. Chunks are merged
// per query in chunk order. float32 throughout, FMAs allowed, exp_approx's few ulp. As in decode, a row's result
// does not depend on its run: key blocks and chunks start at fixed positions, and a key past a row's own context
// is masked out of its max as well as its weights. On a 2-core AVX-512 EPYC, SmolLM2's 9 heads over 560 keys of
// bfloat16 cache: 18-19 us per layer for one row (38 with the two-pass kernel above), 56 us for a run of 9 rows
// (147); one query's work at a time, not a pass at a time, took 22 and 100. On the 2-core Ice Lake Xeon
// (bench/native_ab.py --attention, each layer's cache read from memory), taking a chunk's KV heads in one job and a
// group of 3 queries' V rows together: 2,048 keys 136 -> 124 us per layer for one sequence, 2.00 -> 1.73 ms for 16;
// 128 keys 12.4 -> 12.1 us for one, 135 -> 120 for 16.
template <typename T, typename KV, int DIM>
static void decode_blocked(const T* q, const KV* k_cache, const KV* v_cache, const float* k_scale,
                           const float* v_scale, const int64_t* tables, int64_t table_stride,
                           const int64_t* context_lens, T* out, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t block_size, float scale, int num_threads) {
    constexpr int64_t KEYS = DECODE_KEYS, VECS = DIM / LANES, PART = DIM + 2;  // a partial: acc, max, sum
    // queries in lockstep in the weighted sum: AVX-512's 32 registers hold NQ x VECS = 16 accumulators; narrower
    // vectors take one query at a time
    constexpr int NQ = LANES == 16 ? (VECS <= 4 ? 4 : 2) : 1;
    const int64_t group = num_heads / num_kv_heads, slot = num_kv_heads * DIM;
    const std::vector<int64_t> runs = query_runs(tables, table_stride, num_seqs);
    const int64_t num_runs = int64_t(runs.size()) - 1;
    // per run: its chunk count, its first job and the offset of its rows' partials (in rows x chunks)
    std::vector<int64_t> chunks(num_runs), first_job(num_runs + 1, 0), first_part(num_runs + 1, 0);
    for (int64_t r = 0; r < num_runs; ++r) {
        const int64_t n = *std::max_element(context_lens + runs[r], context_lens + runs[r + 1]);
        chunks[r] = (n + DECODE_CHUNK - 1) / DECODE_CHUNK;
        first_part[r + 1] = first_part[r] + (runs[r + 1] - runs[r]) * chunks[r];
    }
    // A job is (run, chunk, group of KV heads). Its heads' rows lie side by side in each token's slot, and it reads
    // them block by block, head after head: a slot's adjacent lines together, in the order they lie, where a job
    // per head read one head's lines of each slot (a third of them for SmolLM2's 3 KV heads) and left the rest to
    // other jobs, often on the other core. Every head to a job where that leaves each thread four jobs or more, else
    // a head to a job; a head's arithmetic is the same either way.
    const int64_t total_chunks = std::accumulate(chunks.begin(), chunks.end(), int64_t(0));
    const int64_t per_job = total_chunks >= 4 * int64_t(num_threads) ? num_kv_heads : 1;
    const int64_t head_groups = num_kv_heads / per_job;
    for (int64_t r = 0; r < num_runs; ++r) first_job[r + 1] = first_job[r] + chunks[r] * head_groups;
    // partials [row x chunk][heads][PART]: kept by the calling thread between calls (grown, never shrunk) so a
    // step's 30 layers do not map and fault in fresh pages each. 66 floats per query head and 256 keys: about 1% of
    // the bfloat16 K and V those keys hold at a GQA group of 3 and head size 64.
    static thread_local std::vector<float> partials;
    if (int64_t(partials.size()) < first_part[num_runs] * num_heads * PART)
        partials.resize(size_t(first_part[num_runs] * num_heads * PART));
    float* const parts = partials.data();
    const int64_t num_jobs = first_job[num_runs];
    #pragma omp parallel num_threads(num_threads) if (num_jobs > 1)
    {
        alignas(64) float kb[KEYS][DIM], vb[KEYS][DIM];
        std::vector<float> query, acc, top, sum, shrinks, highs;
        std::vector<KeyWeights> weights;
        std::vector<int64_t> seen;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < num_jobs; ++job) {
            const int64_t r = std::upper_bound(first_job.begin(), first_job.end(), job) - first_job.begin() - 1;
            const int64_t c = (job - first_job[r]) / head_groups, g0 = (job - first_job[r]) % head_groups * per_job;
            const int64_t g1 = g0 + per_job;
            const int64_t row0 = runs[r], m = runs[r + 1] - row0, queries = m * group, all = per_job * queries;
            const int64_t* lens = context_lens + row0;
            const int64_t* table = tables + row0 * table_stride;
            const int64_t n = *std::max_element(lens, lens + m);
            const int64_t begin = c * DECODE_CHUNK, end = std::min(n, begin + DECODE_CHUNK);
            if (int64_t(query.size()) < all * DIM) query.resize(all * DIM), acc.resize(all * DIM);
            if (int64_t(top.size()) < all) {
                for (auto* buffer : {&top, &sum, &shrinks, &highs}) buffer->resize(all);
                seen.resize(all);
                weights.resize(all);
            }
            // head g's queries at (g - g0) * queries in each of the buffers above: qi below is within a head
            for (int64_t g = g0; g < g1; ++g)
                for (int64_t j = 0; j < m; ++j)
                    for (int64_t i = 0; i < group; ++i) {
                        const T* src = q + ((row0 + j) * num_heads + g * group + i) * DIM;
                        float* dst = query.data() + ((g - g0) * queries + j * group + i) * DIM;
                        #pragma omp simd
                        for (int64_t d = 0; d < DIM; ++d) dst[d] = load(src[d]) * scale;
                    }
            std::fill(acc.begin(), acc.begin() + all * DIM, 0.0f);
            std::fill(top.begin(), top.begin() + all, -INFINITY);
            std::fill(sum.begin(), sum.begin() + all, 0.0f);
            // a block of keys lies in one cache block when the block size is a multiple of KEYS (t0 is one): one
            // table lookup for it, and one for the next block's keys, asked for while these are read
            const bool whole = block_size % KEYS == 0;
            for (int64_t t0 = begin; t0 < end; t0 += KEYS) {
                const int64_t count = std::min(KEYS, end - t0);
                const int64_t base = whole ? table[t0 / block_size] * block_size + t0 % block_size : 0;
                const int64_t ahead = t0 + KEYS;
                const int64_t next =
                    whole && ahead < end ? table[ahead / block_size] * block_size + ahead % block_size : -1;
                for (int64_t g = g0; g < g1; ++g) {  // the heads one after the other, each its own work
                    const int64_t h0 = (g - g0) * queries;  // head g's first query in the buffers
                    const float* ks = k_scale ? k_scale + g : nullptr;
                    const float* vs = v_scale ? v_scale + g : nullptr;
                    for (int64_t i = 0; i < KEYS; ++i) {
                        if (i >= count) {  // past the context: never read, zero so a zero weight stays zero
                            std::fill(kb[i], kb[i] + DIM, 0.0f);
                            std::fill(vb[i], vb[i] + DIM, 0.0f);
                            continue;
                        }
                        const int64_t t = t0 + i;
                        const int64_t at = whole ? base + i : table[t / block_size] * block_size + t % block_size;
                        if (next >= 0 && ahead + i < end) {
                            prefetch_row(k_cache + (next + i) * slot + g * DIM, DIM);
                            prefetch_row(v_cache + (next + i) * slot + g * DIM, DIM);
                        }
                        const KV* kr = k_cache + at * slot + g * DIM;
                        const KV* vr = v_cache + at * slot + g * DIM;
                        if constexpr (std::is_same_v<KV, int8_t>) {  // codes times their row's scale
                            const float kscale = ks ? ks[at * num_kv_heads] : 1.0f;
                            const float vscale = vs ? vs[at * num_kv_heads] : 1.0f;
                            #pragma omp simd
                            for (int64_t d = 0; d < DIM; ++d)
                                kb[i][d] = load(kr[d]) * kscale, vb[i][d] = load(vr[d]) * vscale;
                        } else {  // float32 or bfloat16: the values themselves (a scale of 1 changed no bit)
                            #pragma omp simd
                            for (int64_t d = 0; d < DIM; ++d) kb[i][d] = load(kr[d]), vb[i][d] = load(vr[d]);
                        }
                    }
                    // Three passes over the queries, each query's work in each independent of the others': the
                    // scores and their max; the weights, their sum and the running max; the weighted sum of V. A
                    // query's scores, max, exponentials and sum form one long chain of dependent operations, and
                    // passes give the core the next queries' work to run beside it.
                    for (int64_t j = 0; j < m; ++j) {
                        const int64_t visible = std::max<int64_t>(0, std::min(count, lens[j] - t0));  // keys j sees
                        for (int64_t i = 0; i < group; ++i) {
                            const int64_t qi = j * group + i;
                            seen[h0 + qi] = visible;
                            if (visible == 0) continue;
                            const float* qv = query.data() + (h0 + qi) * DIM;
                            float* const sc = weights[h0 + qi].w;
                            vfn qr[VECS];
                            for (int64_t v = 0; v < VECS; ++v) qr[v] = vload(qv + v * LANES);
                            vfn most = vfn{} - INFINITY;  // lanewise max of the visible scores
                            for (int64_t k0 = 0; k0 < KEYS; k0 += LANES) {
                                vfn part[LANES];
                                for (int64_t k = 0; k < LANES; ++k) {
                                    vfn p = qr[0] * vload(kb[k0 + k]);
                                    for (int64_t v = 1; v < VECS; ++v) p += qr[v] * vload(kb[k0 + k] + v * LANES);
                                    part[k] = p;
                                }
                                const vfn scores = lane_totals(part);
                                const vfn in = LANE + float(k0) < float(visible) ? scores : vfn{} - INFINITY;
                                vstore(sc + k0, in);
                                most = most > in ? most : in;
                            }
                            highs[h0 + qi] = std::max(top[h0 + qi], lane_max(most));
                        }
                    }
                    for (int64_t qi = 0; qi < queries; ++qi) {
                        const int64_t visible = seen[h0 + qi];
                        if (visible == 0) continue;
                        float* const sc = weights[h0 + qi].w;
                        const float high = highs[h0 + qi];
                        float total = 0.0f;
                        #pragma omp simd reduction(+ : total)
                        for (int64_t k = 0; k < KEYS; ++k) {
                            const float e = k < visible ? exp_approx(sc[k] - high) : 0.0f;
                            sc[k] = e;
                            total += e;
                        }
                        shrinks[h0 + qi] = 1.0f;
                        if (high != top[h0 + qi]) {  // the largest score grew: earlier weights shrink by exp(old - new)
                            shrinks[h0 + qi] = top[h0 + qi] == -INFINITY ? 0.0f : exp_approx(top[h0 + qi] - high);
                            sum[h0 + qi] *= shrinks[h0 + qi];
                            top[h0 + qi] = high;
                        }
                        sum[h0 + qi] += total;
                    }
                    // Up to NQ consecutive queries that all see the block's KEYS keys take the V rows in lockstep,
                    // the rest one at a time. Each query's sums are the same operations in the same order as alone;
                    // in lockstep several chains of FMAs are in flight, not one, and each V row is read once for
                    // them all (a single row's GQA group of 3 went one query at a time when only 4 went together).
                    for (int64_t qi = 0; qi < queries;) {
                        const int64_t visible = seen[h0 + qi];
                        int64_t width = 1;
                        while (width < NQ && qi + width < queries && seen[h0 + qi + width] == visible) ++width;
                        float* const a = acc.data() + (h0 + qi) * DIM;
                        if (visible == 0) {
                            qi += width;
                        } else if (width > 1 && visible == KEYS) {  // width <= NQ: 3 go as 3 where NQ is 4
                            const float* w = weights[h0 + qi].w;
                            const float* shrink = shrinks.data() + h0 + qi;
                            if constexpr (NQ >= 4) {
                                if (width == 4) weigh_values<DIM, 4>(a, w, shrink, &vb[0][0], KEYS);
                                else if (width == 3) weigh_values<DIM, 3>(a, w, shrink, &vb[0][0], KEYS);
                                else weigh_values<DIM, 2>(a, w, shrink, &vb[0][0], KEYS);
                            } else if constexpr (NQ >= 2) {
                                weigh_values<DIM, 2>(a, w, shrink, &vb[0][0], KEYS);
                            }
                            qi += width;
                        } else {
                            weigh_values<DIM, 1>(a, weights[h0 + qi].w, shrinks.data() + h0 + qi, &vb[0][0],
                                                 visible);
                            qi += 1;
                        }
                    }
                }
            }
            for (int64_t g = g0; g < g1; ++g)
                for (int64_t j = 0; j < m; ++j)
                    for (int64_t i = 0; i < group; ++i) {
                        const int64_t qi = (g - g0) * queries + j * group + i;
                        float* dst = parts + (((first_part[r] + j * chunks[r] + c) * num_heads) + g * group + i) * PART;
                        std::copy(acc.data() + qi * DIM, acc.data() + (qi + 1) * DIM, dst);
                        dst[DIM] = top[qi], dst[DIM + 1] = sum[qi];
                    }
        }
        // merge each (row, head)'s chunks in chunk order; a chunk the row sees none of has sum 0 and is skipped
        #pragma omp for schedule(static)
        for (int64_t rh = 0; rh < num_seqs * num_heads; ++rh) {
            const int64_t s = rh / num_heads, h = rh % num_heads;
            const int64_t r = std::upper_bound(runs.begin(), runs.end(), s) - runs.begin() - 1;
            const float* part = parts + ((first_part[r] + (s - runs[r]) * chunks[r]) * num_heads + h) * PART;
            const int64_t stride = num_heads * PART;
            float high = -INFINITY;
            for (int64_t c = 0; c < chunks[r]; ++c)
                if (part[c * stride + DIM + 1] > 0.0f) high = std::max(high, part[c * stride + DIM]);
            vfn total[VECS] = {};
            float weight_sum = 0.0f;
            for (int64_t c = 0; c < chunks[r]; ++c) {
                const float* p = part + c * stride;
                if (!(p[DIM + 1] > 0.0f)) continue;
                const float w = exp_approx(p[DIM] - high);  // exactly 1 for the chunk that holds the max
                weight_sum += w * p[DIM + 1];
                for (int64_t v = 0; v < VECS; ++v) total[v] += w * vload(p + v * LANES);
            }
            const float inverse = 1.0f / weight_sum;  // every row sees key 0: weight_sum >= 1
            T* dst = out + (s * num_heads + h) * DIM;
            for (int64_t v = 0; v < VECS; ++v) {
                alignas(64) float lane[LANES];
                vstore(lane, total[v] * inverse);
                for (int64_t d = 0; d < LANES; ++d) store(lane[d], dst + v * LANES + d);
            }
        }
    }
}

template <typename T, typename KV>
static void paged_decode(const T* q, const KV* k, const KV* v, const float* k_scale, const float* v_scale,
                         const int64_t* tables, int64_t table_stride, const int64_t* lens, T* out, int64_t num_seqs,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                         int num_threads) {
    if (head_dim == 64 || head_dim == 128) {
        auto f = head_dim == 64 ? decode_blocked<T, KV, 64> : decode_blocked<T, KV, 128>;
        return f(q, k, v, k_scale, v_scale, tables, table_stride, lens, out, num_seqs, num_heads, num_kv_heads,
                 block_size, scale, num_threads);
    }
    decode<T, KV, 0>(q, k, v, k_scale, v_scale, tables, table_stride, lens, out, num_seqs, num_heads, num_kv_heads,
                     head_dim, block_size, scale, num_threads);
}

static const int64_t PREFILL_KEYS = 32;  // keys per block

// Scratch for the prefill kernels' widened keys (which 0) and values (which 1), owned by the calling thread and
// kept between calls (grown, never shrunk) up to KEEP_FLOATS floats each, so a prefill's layers do not map and
// fault in fresh pages for every layer: 2 x 4 MiB at most per thread, shared by every head size and cache type,
// against 2 x 1.5 MiB that SmolLM2's 3 KV heads of 64 take at a 2,048-key context. A larger request gets a buffer
// of its own (`own`) for the call.
static const size_t KEEP_FLOATS = size_t(1) << 20;
static float* scratch(int which, std::vector<float>& own, size_t n) {
    static thread_local std::vector<float> kept[2];
    if (n > KEEP_FLOATS) {
        own.resize(n);
        return own.data();
    }
    if (kept[which].size() < n) kept[which].resize(n);
    return kept[which].data();
}

// Where key t's coordinate d of KV head g lies in a prefill's transposed keys: per head, `padded` keys (a multiple
// of PREFILL_KEYS, zero past the real ones) in blocks of PREFILL_KEYS, each block DIM rows of PREFILL_KEYS floats, so
// one block's keys are one contiguous run (8 KiB at DIM 64). Laid out as one row of every key per coordinate, a
// block's keys were 64 lines `padded` floats apart (past 1,024 keys, each in a page of its own), and the kernel's
// speed fell with the prompt's length. With the blocks and a whole block's max taken in vectors, SmolLM2's heads on
// the 2-core Ice Lake Xeon (bench/native_ab.py --prefill, three runs): 455 tokens -12 to -18%, 1,000 -32 to -34%,
// 1,800 -14 to -34% per call; over a cached context -12% to -41%. The last bits of rows move (the compiler orders the sums differently);
// the error against float64 attention did not.
CORRAL_INLINE int64_t kt_index(int64_t g, int64_t d, int64_t t, int64_t padded, int64_t dim) {
    return g * dim * padded + (t / PREFILL_KEYS) * (dim * PREFILL_KEYS) + d * PREFILL_KEYS + t % PREFILL_KEYS;
}

// The rows of a prefill: T queries q [T, heads, DIM] (rows q_stride floats apart) at positions offset .. offset +
// T - 1, query t seeing keys 0 .. offset + t of its KV head. K comes transposed per KV head in blocks (kt_index),
// V as rows v_stride floats apart (KV head g at g * DIM). out [T, heads * DIM].
template <int DIM>
static void prefill_rows(const float* q, int64_t q_stride, const float* kt, int64_t padded, const float* v,
                         int64_t v_stride, float* out, int64_t T, int64_t offset, int64_t num_heads,
                         int64_t num_kv_heads, float scale, int num_threads) {
    constexpr int64_t KEYS = PREFILL_KEYS, SCORE_VECS = KEYS / LANES, VECS = DIM / LANES;
    constexpr int ROWS = PREFILL_ROWS;
    const int64_t group = num_heads / num_kv_heads, num_keys = offset + T;
    const int64_t row_blocks = (T + ROWS - 1) / ROWS;
    #pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (row_blocks * num_kv_heads > 1)
    for (int64_t job = 0; job < row_blocks * num_kv_heads; ++job) {
        const int64_t r0 = (row_blocks - 1 - job / num_kv_heads) * ROWS, g = job % num_kv_heads;
        const int64_t rows = std::min<int64_t>(ROWS, T - r0), last = offset + r0 + rows - 1;  // its last key
        const float* ktg = kt + g * DIM * padded;
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
                const float* kp = ktg + j0 * DIM;  // the block's run: DIM rows of KEYS
                for (int64_t d = 0; d < DIM; ++d) {
                    vfn key[SCORE_VECS];
                    for (int64_t c = 0; c < SCORE_VECS; ++c) key[c] = vload(kp + d * KEYS + c * LANES);
                    for (int r = 0; r < ROWS; ++r)
                        for (int64_t c = 0; c < SCORE_VECS; ++c) s[r][c] += qv[r][d] * key[c];
                }
                alignas(64) float p[ROWS][KEYS];
                const int64_t keys = std::min<int64_t>(KEYS, num_keys - j0);
                for (int r = 0; r < ROWS; ++r) {
                    for (int64_t c = 0; c < SCORE_VECS; ++c) vstore(p[r] + c * LANES, s[r][c]);
                    // row r0 + r sees keys j0 .. offset + r0 + r of this block (none when it ends before j0)
                    const int64_t visible = r < rows ? std::min<int64_t>(keys, offset + r0 + r - j0 + 1) : 0;
                    if (visible <= 0) {
                        for (int64_t j = 0; j < KEYS; ++j) p[r][j] = 0.0f;
                        continue;
                    }
                    float high = top[r];
                    if (visible == KEYS) {  // a whole block: its max lane by lane, then across (the same max)
                        vfn most = s[r][0];
                        for (int64_t c = 1; c < SCORE_VECS; ++c) most = s[r][c] > most ? s[r][c] : most;
                        high = std::max(high, lane_max(most));
                    } else {
                        for (int64_t j = 0; j < visible; ++j) high = std::max(high, p[r][j]);
                    }
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

template <int DIM>
static void causal_prefill_impl(const float* q, int64_t q_stride, const float* k, int64_t k_stride, const float* v,
                                int64_t v_stride, float* out, int64_t T, int64_t num_heads, int64_t num_kv_heads,
                                float scale, int num_threads) {
    const int64_t padded = (T + PREFILL_KEYS - 1) / PREFILL_KEYS * PREFILL_KEYS;
    std::vector<float> own;
    float* kt = scratch(0, own, size_t(num_kv_heads * DIM * padded));
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (T * num_kv_heads * DIM >= PARALLEL_MIN)
    for (int64_t t0 = 0; t0 < padded; t0 += PREFILL_KEYS)  // blocks of keys: each thread writes runs of its own
        for (int64_t g = 0; g < num_kv_heads; ++g)
            for (int64_t d = 0; d < DIM; ++d) {
                float* dst = kt + kt_index(g, d, t0, padded, DIM);
                for (int64_t i = 0; i < PREFILL_KEYS; ++i)
                    dst[i] = t0 + i < T ? k[(t0 + i) * k_stride + g * DIM + d] : 0.0f;
            }
    prefill_rows<DIM>(q, q_stride, kt, padded, v, v_stride, out, T, 0, num_heads, num_kv_heads, scale, num_threads);
}

static void causal_prefill(const float* q, int64_t q_stride, const float* k, int64_t k_stride, const float* v,
                           int64_t v_stride, float* out, int64_t T, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, float scale, int num_threads) {
    auto f = head_dim == 64 ? causal_prefill_impl<64> : causal_prefill_impl<128>;
    f(q, q_stride, k, k_stride, v, v_stride, out, T, num_heads, num_kv_heads, scale, num_threads);
}

// A prefill over cached context: T new queries at positions num_context - T .. num_context - 1 over every key
// 0 .. num_context - 1 of the paged cache (the new tokens' K/V written there already), read through one block
// table. The keys and values are widened to float32 (times their scales, for int8) into the calling thread's
// scratch, K transposed, then attended as the causal prefill attends its own: prefix-cache hits and a long
// prompt's later chunks take the same kernel as a fresh prompt. The attention over the cache is that of torch's
// masked SDPA on the widened cache, to float32 rounding and exp_approx's few ulp.
template <typename KV, int DIM>
static void prefill_paged_impl(const float* q, int64_t q_stride, const KV* k_cache, const KV* v_cache,
                               const float* k_scale, const float* v_scale, const int64_t* table, int64_t num_context,
                               float* out, int64_t T, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                               float scale, int num_threads) {
    const int64_t padded = (num_context + PREFILL_KEYS - 1) / PREFILL_KEYS * PREFILL_KEYS, slot = num_kv_heads * DIM;
    std::vector<float> own_k, own_v;
    float* kt = scratch(0, own_k, size_t(num_kv_heads * DIM * padded));
    float* vb = scratch(1, own_v, size_t(num_context * slot));
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (num_context * slot >= PARALLEL_MIN)
    for (int64_t t0 = 0; t0 < padded; t0 += PREFILL_KEYS)
        for (int64_t t = t0; t < t0 + PREFILL_KEYS; ++t) {
            if (t >= num_context) {
                for (int64_t gd = 0; gd < slot; ++gd) kt[kt_index(gd / DIM, gd % DIM, t, padded, DIM)] = 0.0f;
                continue;
            }
            const int64_t at = table[t / block_size] * block_size + t % block_size;
            for (int64_t g = 0; g < num_kv_heads; ++g) {
                const KV* kr = k_cache + at * slot + g * DIM;
                const KV* vr = v_cache + at * slot + g * DIM;
                const float ks = k_scale ? k_scale[at * num_kv_heads + g] : 1.0f;
                const float vs = v_scale ? v_scale[at * num_kv_heads + g] : 1.0f;
                float* vd = vb + t * slot + g * DIM;
                for (int64_t d = 0; d < DIM; ++d) {
                    kt[kt_index(g, d, t, padded, DIM)] = load(kr[d]) * ks;
                    vd[d] = load(vr[d]) * vs;
                }
            }
        }
    prefill_rows<DIM>(q, q_stride, kt, padded, vb, slot, out, T, num_context - T, num_heads, num_kv_heads, scale,
                      num_threads);
}

template <typename KV>
static void prefill_paged(const float* q, int64_t q_stride, const KV* k_cache, const KV* v_cache,
                          const float* k_scale, const float* v_scale, const int64_t* table, int64_t num_context,
                          float* out, int64_t T, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, float scale, int num_threads) {
    auto f = head_dim == 64 ? prefill_paged_impl<KV, 64> : prefill_paged_impl<KV, 128>;
    f(q, q_stride, k_cache, v_cache, k_scale, v_scale, table, num_context, out, T, num_heads, num_kv_heads,
      block_size, scale, num_threads);
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
        CORRAL_VARIANT::greedy_pick, CORRAL_VARIANT::sample_pick, CORRAL_VARIANT::causal_prefill,
        CORRAL_VARIANT::prefill_paged<float>, CORRAL_VARIANT::prefill_paged<uint16_t>,
        CORRAL_VARIANT::prefill_paged<int8_t>,
    };
    return &table;
}

}  // namespace corral_kernels

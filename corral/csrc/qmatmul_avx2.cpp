// The quantized products with AVX2: each 64-byte tile chunk is two 32-byte halves of 8 rows x 4 codes;
// vpmaddubsw multiplies unsigned codes by signed activation bytes into 16-bit pair sums and vpmaddwd adds those
// into one 32-bit sum per row. Q4 codes (at most 15) let a whole block's pair sums stay in 16 bits (at most
// 4 x 2 x 2 x 15 x 127 = 30,480); Q8 codes go through vpsignb (|q| times x with q's sign: at most 2 x 127 x 127).
#include "qmatmul.h"

#include <cstring>

#if defined(__x86_64__) || defined(__i386__)  // (other CPUs have no <immintrin.h>)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// Everything compiled for the target above, in a namespace named for it (tests/test_native_isa.py)
namespace corral_qmatmul {
namespace avx2 {
namespace {

#define CORRAL_INLINE static inline __attribute__((always_inline))

CORRAL_INLINE __m256i broadcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

CORRAL_INLINE __m256 halves(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// v as it is: the build's -fassociative-math could otherwise fold a product into the next one (d sc times s as d
// times sc s), rounding it differently in kernels of different row counts (a row's bits would depend on its pass).
CORRAL_INLINE __m256 opaque(__m256 v) {
    __asm__("" : "+x"(v));
    return v;
}

CORRAL_INLINE void store(float* y, const __m256 v, int64_t valid) {
    if (valid >= 8) {
        _mm256_storeu_ps(y, v);
        return;
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    for (int64_t i = 0; i < valid; ++i) y[i] = lanes[i];
}

// A decode step's products of at most SMALL_MAX rows read each weight byte once and wait on memory: their kernels ask
// for the tile bytes `Ahead` bytes past the block they are at (28 Q2, 25 Q3, 20 Q4, 16 Q5, 14 Q6 or 12 Q8 blocks),
// every line, as each block of a tile's first half starts in the first pass (the second half and later passes find the
// tile in the cache), as the AVX-512 kernels do (corral/csrc/qmatmul_avx512.cpp). With these kernels forced
// (CORRAL_QMATMUL_ISA=avx2) on the 2-core Ice Lake Xeon, the two builds' calls interleaved in one process: the 30
// layers' Q4 products of SmolLM2 6-12% faster at 1-4 rows, the Q8 LM head 14-23%; 3-4% at 8 rows; at 16 rows (four
// passes, whose arithmetic hides the memory) 1-5% slower, so those go without. It changes no arithmetic.
// (Q3 and Q2 tiles in super-blocks since: about the bytes ahead they read before)
constexpr int64_t Q2_AHEAD = 28 * 224, Q3_AHEAD = 25 * 256, Q4_AHEAD = 20 * Q4_TILE_BYTES,
                  Q5_AHEAD = 16 * Q5_TILE_BYTES, Q6_AHEAD = 14 * Q6_TILE_BYTES, Q8_AHEAD = 12 * Q8_TILE_BYTES,
                  SMALL_MAX = 8;

template <int64_t Ahead, int64_t Bytes>
CORRAL_INLINE void read_ahead(const uint8_t* block, int64_t m, int half) {
    if (Ahead == 0 || m != 0 || half != 0) return;
    for (int64_t line = 0; line < Bytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(block + Ahead + line), _MM_HINT_T0);
}

// `value` where bit j of the 32 bits at p is set, else 0, in byte j: a Q5 or Q6 code's fifth bit (16), a Q6
// code's sixth (32) or a Q3 code's third (4) (qmatmul.h).
CORRAL_INLINE __m256i bit_values(const uint8_t* p, char value) {
    int32_t bits;
    std::memcpy(&bits, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(  // byte j gets byte j / 8 of the 32 bits (both lanes hold all 4)
        _mm256_set1_epi32(bits), _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                  2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i select = _mm256_set1_epi64x(int64_t(0x8040201008040201));  // bit j % 8 in byte j
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select), _mm256_set1_epi8(value));
}

// Rows m..m+R of one half (8 output rows) of a tile; Bits 5: Q5 tiles, each code's fifth bit added first; Bits 6: Q6
// tiles, its sixth too; once a half block's two chunks are in, its dot less 32 times the half's activation sum, times
// the half's scale, goes into the block's integer sum, which then takes d s. Bits 3: Q3 tiles, each code's low 2 bits
// and third bit, then as Q6 with 4 times the half's sum. Bits 2: Q2 tiles, the 2-bit codes alone, each half's dot times
// its 4-bit scale; then each half's 4-bit min times its activation sum, times dmin s, taken off. A Q4 block's 16
// products a lane sum in 16 bits (at most 16 x 15 x 127); a Q5 or Q6 block's may not (16 x 63 x 127), so those go to 32
// bits a chunk at a time (a chunk's 16-bit lane, two pair sums, is at most 4 x 63 x 127 = 32,004); an IQ4 tile's (Bits
// IQ4: grid values to 127 in magnitude) each pair sum alone. Integer sums every way: the same values. Bits Q4K, Q5K:
// Q4K and Q5K tiles, as Q4 and Q5 tiles with d = d sc and m = -dmin mn from the super-block's d and dmin and the
// block's sc and mn; Bits IQ4XS, as IQ4 with d = d (sc - 32). Q3, Q2, Q4K, Q5K and IQ4XS tiles read d (and dmin) in
// each super-block's header (qmatmul.h).
template <int Bits, int R, int64_t Ahead = 0>
CORRAL_INLINE void nibble_rows(const Activations& x, int64_t m, const uint8_t* w, int64_t blocks, int half, float* y,
                               int64_t ldy, int64_t valid) {
    constexpr int64_t Bytes = in_super_blocks(Bits) ? super_block_body(Bits) : tile_block_bytes(Bits),
                      Scales = Bits == 5 || Bits == Q5K ? 320 : 256;  // Q4K, Q5K: the 6-bit scales (mins: + 16)
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    // IQ4: the grid's values and their magnitudes, looked up in each 128-bit lane
    constexpr bool on_grid = Bits == IQ4 || Bits == IQ4XS;  // indices into IQ4_VALUES
    const __m256i grid = on_grid ? _mm256_broadcastsi128_si256(_mm_loadu_si128(
                                       reinterpret_cast<const __m128i*>(IQ4_VALUES)))
                                 : _mm256_setzero_si256();
    const __m256i magnitudes = _mm256_abs_epi8(grid);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const uint8_t* head = w;  // tiles in super-blocks: the super-block's header (d, dmin)
    for (int64_t b = 0; b < blocks; ++b, w += Bytes) {
        if constexpr (in_super_blocks(Bits))
            if (b % SUPER_BLOCKS == 0) head = w, w += SUPER_HEAD_BYTES;
        read_ahead<Ahead, Bytes>(w, m, half);
        __m256i pairs[R], wide[R], scaled[R];
        for (int r = 0; r < R; ++r) pairs[r] = wide[r] = scaled[r] = _mm256_setzero_si256();
        constexpr bool by_halves = Bits == 6 || Bits == 3 || Bits == 2;
        constexpr bool wide_sums = Bits == 5 || Bits == Q5K || by_halves;
        constexpr bool pairs_of_bits = Bits == 3 || Bits == 2;
        for (int c = 0; c < 4; ++c) {
            const __m256i v = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(w + (pairs_of_bits ? 64 * (c / 2) : 64 * c) + 32 * half));
            __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            if constexpr (pairs_of_bits) {  // chunk c's codes 4 (c % 2) bits up in its 2-bit chunk
                const __m256i two = _mm256_set1_epi8(3), shifted = _mm256_srli_epi16(v, 4 * (c % 2));
                lo = _mm256_and_si256(shifted, two), hi = _mm256_and_si256(_mm256_srli_epi16(shifted, 2), two);
            }
            if constexpr (Bits == 3) {  // and the third bits
                lo = _mm256_or_si256(lo, bit_values(w + 128 + 16 * c + 4 * half, 4));
                hi = _mm256_or_si256(hi, bit_values(w + 128 + 16 * c + 8 + 4 * half, 4));
            }
            if constexpr (on_grid) {  // |grid value| times the activation with the value's sign: vpmaddubsw
                // takes unsigned by signed bytes, and a pair of such products (at most 2 x 127 x 127) fits 16 bits
                const __m256i lo_abs = _mm256_shuffle_epi8(magnitudes, lo), lo_sign = _mm256_shuffle_epi8(grid, lo);
                const __m256i hi_abs = _mm256_shuffle_epi8(magnitudes, hi), hi_sign = _mm256_shuffle_epi8(grid, hi);
                for (int r = 0; r < R; ++r) {
                    const int8_t* xq = x.xq + (m + r) * x.cols + b * BLOCK + 8 * c;
                    const __m256i first = _mm256_maddubs_epi16(lo_abs, _mm256_sign_epi8(broadcast4(xq), lo_sign));
                    const __m256i second = _mm256_maddubs_epi16(hi_abs, _mm256_sign_epi8(broadcast4(xq + 4), hi_sign));
                    wide[r] = _mm256_add_epi32(wide[r], _mm256_add_epi32(_mm256_madd_epi16(first, ones),
                                                                         _mm256_madd_epi16(second, ones)));
                }
                continue;
            }
            if constexpr (Bits == 5 || Bits == 6 || Bits == Q5K) {
                lo = _mm256_or_si256(lo, bit_values(w + 256 + 16 * c + 4 * half, 16));
                hi = _mm256_or_si256(hi, bit_values(w + 256 + 16 * c + 8 + 4 * half, 16));
            }
            if constexpr (Bits == 6) {
                lo = _mm256_or_si256(lo, bit_values(w + 320 + 16 * c + 4 * half, 32));
                hi = _mm256_or_si256(hi, bit_values(w + 320 + 16 * c + 8 + 4 * half, 32));
            }
            for (int r = 0; r < R; ++r) {
                const int8_t* xq = x.xq + (m + r) * x.cols + b * BLOCK + 8 * c;
                const __m256i both = _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(xq)),
                                                      _mm256_maddubs_epi16(hi, broadcast4(xq + 4)));
                if constexpr (wide_sums)
                    wide[r] = _mm256_add_epi32(wide[r], _mm256_madd_epi16(both, ones));
                else pairs[r] = _mm256_add_epi16(pairs[r], both);
            }
            if constexpr (by_halves) {
                if (c % 2 == 0) continue;
                const int h = c / 2;  // the half block whose two chunks are in
                const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(
                    w + (Bits == 2 ? 128 : Bits == 3 ? 192 : 416) + 16 * h + 8 * half));
                const __m256i sc = Bits == 2 ? _mm256_and_si256(_mm256_cvtepu8_epi32(bytes), _mm256_set1_epi32(15))
                                             : _mm256_cvtepi8_epi32(bytes);
                for (int r = 0; r < R; ++r) {
                    const int64_t at = (m + r) * blocks + b;
                    const int32_t offset = Bits == 2 ? 0 : Bits == 3 ? x.halves32[2 * at + h] / 8
                                                                     : x.halves32[2 * at + h];
                    const __m256i part = _mm256_mullo_epi32(_mm256_sub_epi32(wide[r], _mm256_set1_epi32(offset)), sc);
                    scaled[r] = _mm256_add_epi32(scaled[r], part);
                    wide[r] = _mm256_setzero_si256();
                }
            }
        }
        if constexpr (by_halves) {
            const __m256 d = halves((Bits == 6 ? w + 384 : head) + 16 * half);
            for (int r = 0; r < R; ++r) {
                const float s = x.scale[(m + r) * blocks + b];
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(scaled[r]), _mm256_mul_ps(d, _mm256_set1_ps(s)), acc[r]);
            }
            if constexpr (Bits == 2) {  // less dmin s (mn_0 isum_0 + mn_1 isum_1)
                const __m256 dmin = halves(head + 32 + 16 * half);
                const uint8_t* mins = w + 128 + 8 * half;
                const __m256i first = _mm256_srli_epi32(
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mins))), 4);
                const __m256i second = _mm256_srli_epi32(
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mins + 16))), 4);
                for (int r = 0; r < R; ++r) {
                    const int64_t at = (m + r) * blocks + b;
                    const __m256i total = _mm256_add_epi32(
                        _mm256_mullo_epi32(first, _mm256_set1_epi32(x.halves32[2 * at] / 32)),
                        _mm256_mullo_epi32(second, _mm256_set1_epi32(x.halves32[2 * at + 1] / 32)));
                    acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(total),
                                              _mm256_mul_ps(dmin, _mm256_set1_ps(x.scale[at])), acc[r]);
                }
            }
            continue;
        }
        if constexpr (on_grid) {  // IQ4XS: d (sc - 32), exact in float32
            const __m256 d = Bits == IQ4 ? _mm256_loadu_ps(reinterpret_cast<const float*>(w + 256 + 32 * half))
                : opaque(_mm256_mul_ps(halves(head + 16 * half), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 256 + 8 * half))))));
            for (int r = 0; r < R; ++r) {
                const float s = x.scale[(m + r) * blocks + b];
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(wide[r]), _mm256_mul_ps(d, _mm256_set1_ps(s)), acc[r]);
            }
            continue;
        }
        __m256 d, mins;
        if constexpr (!in_super_blocks(Bits)) {
            d = halves(w + Scales + 16 * half), mins = halves(w + Scales + 32 + 16 * half);
        } else {  // d sc and dmin mn (taken off below), exact in float32
            const __m256 sc = _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + Scales + 8 * half))));
            const __m256 mn = _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + Scales + 16 + 8 * half))));
            d = opaque(_mm256_mul_ps(halves(head + 16 * half), sc));
            mins = opaque(_mm256_mul_ps(halves(head + 32 + 16 * half), mn));
        }
        for (int r = 0; r < R; ++r) {
            const int64_t at = (m + r) * blocks + b;
            const __m256 dot = _mm256_cvtepi32_ps(wide_sums ? wide[r] : _mm256_madd_epi16(pairs[r], ones));
            acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(x.scale[at])), acc[r]);
            acc[r] = in_super_blocks(Bits) ? _mm256_fnmadd_ps(mins, _mm256_set1_ps(x.sum[at]), acc[r])
                                           : _mm256_fmadd_ps(mins, _mm256_set1_ps(x.sum[at]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) store(y + (m + r) * ldy, acc[r], valid);
}

template <int R, int64_t Ahead = 0>
CORRAL_INLINE void q8_rows(const Activations& x, int64_t m, const uint8_t* w, int64_t blocks, int half, float* y,
                           int64_t ldy, int64_t valid) {
    const __m256i flip = _mm256_set1_epi8(char(0x80)), ones = _mm256_set1_epi16(1);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b, w += Q8_TILE_BYTES) {
        read_ahead<Ahead, Q8_TILE_BYTES>(w, m, half);
        __m256i dot[R];
        for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) {
            const __m256i q = _mm256_xor_si256(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * c + 32 * half)), flip);  // signed codes
            const __m256i magnitude = _mm256_abs_epi8(q);
            for (int r = 0; r < R; ++r) {
                const __m256i signed_x = _mm256_sign_epi8(broadcast4(x.xq + (m + r) * x.cols + b * BLOCK + 4 * c), q);
                dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones));
            }
        }
        const __m256 d = halves(w + 512 + 16 * half);
        for (int r = 0; r < R; ++r) {
            const float s = x.scale[(m + r) * blocks + b];
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(d, _mm256_set1_ps(s)), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) store(y + (m + r) * ldy, acc[r], valid);
}

using Rows = void (*)(const Activations&, int64_t, const uint8_t*, int64_t, int, float*, int64_t, int64_t);

// Rows go in passes of at most 4 (the accumulators and pair sums of 4 rows and the tile's registers fill the 16
// vector registers), as few passes as that allows and as even as they fall: 3 rows in one pass, 7 in 4 and 3, 9
// in three 3s. Each pass reads the tile's half again; the first waits on memory. A row's products are the same
// whatever pass computes them.
// `plain[r]` and `ahead[r]` are the kernels of r rows (r = 1 .. 4), the second reading ahead (up to SMALL_MAX rows).
template <int64_t TileBytes>
void matmul(const Activations& x, const uint8_t* tiles, int64_t n, float* y, int64_t ldy, int threads,
            const Rows* plain, const Rows* ahead) {
    const Rows* by_count = x.rows <= SMALL_MAX ? ahead : plain;
    const int64_t passes = (x.rows + 3) / 4;
    const int64_t blocks = x.cols / BLOCK, halves_total = 2 * ((n + TILE - 1) / TILE);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < halves_total; ++h) {
        const int64_t first = h * 8;  // the half's first output row
        if (first >= n) continue;
        const uint8_t* w = tiles + (h / 2) * blocks * TileBytes;
        const int half = int(h % 2);
        const int64_t valid = n - first < 8 ? n - first : 8;
        float* out = y + first;
        for (int64_t p = 0, m = 0; p < passes; ++p) {
            const int64_t rows = (x.rows - m) / (passes - p) + ((x.rows - m) % (passes - p) != 0);
            by_count[rows](x, m, w, blocks, half, out, ldy, valid);
            m += rows;
        }
    }
}

template <int Bits>
void nibbles(const Activations& x, const uint8_t* tiles, int64_t n, float* y, int64_t ldy, int threads) {
    constexpr int64_t A = Bits == 6 ? Q6_AHEAD : Bits == 5 || Bits == Q5K ? Q5_AHEAD : Bits == 3 ? Q3_AHEAD
                        : Bits == 2 ? Q2_AHEAD : Q4_AHEAD;
    static const Rows plain[5] = {nullptr, nibble_rows<Bits, 1>, nibble_rows<Bits, 2>, nibble_rows<Bits, 3>,
                                  nibble_rows<Bits, 4>};
    static const Rows ahead[5] = {nullptr, nibble_rows<Bits, 1, A>, nibble_rows<Bits, 2, A>, nibble_rows<Bits, 3, A>,
                                  nibble_rows<Bits, 4, A>};
    matmul<tile_block_bytes(Bits)>(x, tiles, n, y, ldy, threads, plain, ahead);
}

void q8(const Activations& x, const uint8_t* tiles, int64_t n, float* y, int64_t ldy, int threads) {
    constexpr int64_t A = Q8_AHEAD;
    static const Rows plain[5] = {nullptr, q8_rows<1>, q8_rows<2>, q8_rows<3>, q8_rows<4>};
    static const Rows ahead[5] = {nullptr, q8_rows<1, A>, q8_rows<2, A>, q8_rows<3, A>, q8_rows<4, A>};
    matmul<Q8_TILE_BYTES>(x, tiles, n, y, ldy, threads, plain, ahead);
}

// The scalar variant's quantization, 8 lanes at a time: the same products, rounded by the same mode (MXCSR's
// round to nearest even, as std::nearbyint's), so the same bytes for finite x. The saturating packs leave every
// code as it is (all are within [-127, 127]); their lane interleaving is undone by one permute.
void quantize(const float* x, int64_t rows, int64_t cols, const QuantizedOut& out, int threads) {
    const int64_t blocks = cols / BLOCK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    #pragma omp parallel for num_threads(threads) schedule(static) if (quantize_in_parallel(rows, cols))
    for (int64_t m = 0; m < rows; ++m)
        for (int64_t b = 0; b < blocks; ++b) {
            const float* in = x + m * cols + b * BLOCK;
            __m256 v[4];
            __m256 high = _mm256_setzero_ps();
            for (int i = 0; i < 4; ++i) {
                v[i] = _mm256_loadu_ps(in + 8 * i);
                // vmaxps returns its second operand when either is NaN: a NaN |x| is skipped, as std::fmax skips it
                high = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), high);
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(high), _mm256_extractf128_ps(high, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
            const float amax = _mm_cvtss_f32(h);
            const __m256 inverse = _mm256_set1_ps(block_inverse(amax));
            __m256i q[4];
            for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.xq + m * cols + b * BLOCK),
                                _mm256_permutevar8x32_epi32(bytes, order));
            const __m256i both = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
            const int32_t total = _mm_cvtsi128_si32(t);
            finish_block(out, m * blocks + b, amax, total);
        }
}

const QTable table = {"avx2",     nibbles<4>,   q8,         quantize,  nibbles<5>,
                      nibbles<6>, nibbles<IQ4>, nibbles<3>, nibbles<2>, nibbles<Q4K>, nibbles<Q5K>, nibbles<IQ4XS>};

}  // namespace
}  // namespace avx2
}  // namespace corral_qmatmul

#pragma GCC pop_options

namespace corral_qmatmul {
const QTable* avx2_table() { return &avx2::table; }
}  // namespace corral_qmatmul

#else

namespace corral_qmatmul {
const QTable* avx2_table() { return nullptr; }
}  // namespace corral_qmatmul

#endif

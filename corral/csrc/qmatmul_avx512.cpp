// The quantized products with AVX-512 VNNI: one 64-byte load of a tile chunk is 16 rows x 4 codes, and one
// vpdpbusd adds those 16 rows' 4-term dot products with a broadcast group of 4 activation bytes. Up to 8
// activation rows share each unpacked chunk (R below); in a prefill's products each activation broadcast serves two
// Q4 tiles; tiles are split between the threads.
#include "qmatmul.h"

#include <cstring>

#if defined(__x86_64__) || defined(__i386__)  // (other CPUs have no <immintrin.h>)
// GCC 12's own AVX-512 headers trip this warning (their _mm512_undefined_* values)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

// Everything compiled for the target above, in a namespace named for it (tests/test_native_isa.py)
namespace corral_qmatmul {
namespace avx512 {
namespace {

#define CORRAL_INLINE static inline __attribute__((always_inline))

CORRAL_INLINE __m512i broadcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// v as it is: the build's -fassociative-math could otherwise fold a product into the next one (d sc times s as d
// times sc s), rounding it differently in kernels of different row counts (a row's bits would depend on its pass).
CORRAL_INLINE __m512 opaque(__m512 v) {
    __asm__("" : "+v"(v));
    return v;
}

CORRAL_INLINE __m512 halves(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// A decode step's products (at most SMALL_MAX rows, below) read each weight byte once and wait on memory: the
// hardware's prefetchers alone left one core reading about 10 GB/s of tiles here, where a dense fp32 product of the
// same step reads 20+. Those kernels ask for the tile bytes `Ahead` bytes past the block they are at, every line of it,
// as each block starts (28 Q2, 25 Q3, 20 Q4, 16 Q5, 14 Q6 or 12 Q8 blocks). On the 2-core Ice Lake Xeon, the two
// builds' calls interleaved in one process: the 30 layers' Q4 products of SmolLM2 21-25% faster at 1-4 rows (with tile
// pairs, below, as that Intel CPU runs them), 14% at 8, 6% at 16; the Q8 LM head 17-23% at 1-8 rows, 12% at 16. On the
// 2-core Zen 4 EPYC, both builds with pairs: level at 1 row, 6-19% faster at 2-16 rows. A prefill's products, whose
// arithmetic hides the memory, ran 1-3% slower with it: they go without. Reading ahead changes no arithmetic, so no
// product.
// (Q3 and Q2 tiles in super-blocks since: about the bytes ahead they read before)
constexpr int64_t Q2_AHEAD = 28 * 224, Q3_AHEAD = 25 * 256, Q4_AHEAD = 20 * Q4_TILE_BYTES,
                  Q5_AHEAD = 16 * Q5_TILE_BYTES, Q6_AHEAD = 14 * Q6_TILE_BYTES, Q8_AHEAD = 12 * Q8_TILE_BYTES;
// Q4K and Q5K tiles read Q4 and Q5 tiles' distance ahead

template <int64_t Ahead, int64_t Bytes>
CORRAL_INLINE void read_ahead(const uint8_t* block) {
    if (Ahead == 0) return;
    for (int64_t line = 0; line < Bytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(block + Ahead + line), _MM_HINT_T0);
}

// Rows m..m+R of T adjacent tiles (T * 16 outputs), the tiles `stride` bytes apart: each activation broadcast feeds
// T vpdpbusd, one per tile. Two tiles at a time made the 521-row products 5-16% faster than one (paired runs), and
// on the Ice Lake Xeon a decode step's products of 1-4 rows 5-8% faster (two streams of tiles and two chains of
// vpdpbusd in flight); on the Zen 4 EPYC 27-28% slower, so only Intel CPUs run them there (q4_pairs, below).
// Bits 5: Q5 tiles, each code's fifth bit added from its chunk's masks (qmatmul.h) before the same products. Bits
// 6: Q6 tiles, a sixth bit too; once a half block's two chunks are in, its dot less 32 times the half's activation
// sum, times the half's scale, goes into the block's integer sum (`scaled`), which then takes d s as Q8's does. Bits
// 3: Q3 tiles, each code's low 2 bits from its 2-bit chunk and its third bit from its chunk's masks, then as Q6 with
// 4 times the half's activation sum. Bits 2: Q2 tiles, the 2-bit codes alone, each half's dot times its 4-bit scale
// into the block's integer sum, which takes d s; then each half's 4-bit min times its activation sum, summed in
// integers, times dmin s, taken off. Bits Q4K and Q5K: Q4K and Q5K tiles, as Q4 and Q5 tiles with d = d sc and
// m = -dmin mn, each from the super-block's d and dmin and the block's 6-bit sc and mn; Bits IQ4XS, as IQ4 with
// d = d (sc - 32). Q3, Q2, Q4K, Q5K and IQ4XS tiles read d (and dmin) in each super-block's header (qmatmul.h).
CORRAL_INLINE __m512i add_where(__m512i v, const uint8_t* mask, __m512i value) {
    uint64_t bits;
    std::memcpy(&bits, mask, 8);
    return _mm512_mask_add_epi8(v, _cvtu64_mask64(bits), v, value);
}

CORRAL_INLINE __m512i iq4_grid() {
    alignas(16) uint8_t grid[16];
    for (int i = 0; i < 16; ++i) grid[i] = uint8_t(IQ4_VALUES[i] + 128);
    return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(grid)));
}

template <int Bits, int R, int T, int64_t Ahead = 0>
CORRAL_INLINE void nibble_rows(const Activations& x, int64_t m, const uint8_t* w, int64_t stride, int64_t blocks,
                               float* y, int64_t ldy, __mmask16 keep) {
    constexpr int64_t Bytes = in_super_blocks(Bits) ? super_block_body(Bits) : tile_block_bytes(Bits),
                      Scales = Bits == 5 || Bits == Q5K ? 320 : 256;  // Q4K, Q5K: the 6-bit scales (mins: + 16)
    const __m512i low = _mm512_set1_epi8(0x0F);
    // IQ4: each index's grid value plus 128 (an unsigned byte for vpdpbusd), looked up in every 128-bit lane
    constexpr bool on_grid = Bits == IQ4 || Bits == IQ4XS;  // indices into IQ4_VALUES
    const __m512i grid = on_grid ? iq4_grid() : _mm512_setzero_si512();
    __m512 acc[T][R];
    for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
    const uint8_t* head = w;  // tiles in super-blocks: the super-block's header (d, dmin) in the first tile
    for (int64_t b = 0; b < blocks; ++b, w += Bytes) {
        if constexpr (in_super_blocks(Bits))
            if (b % SUPER_BLOCKS == 0) head = w, w += SUPER_HEAD_BYTES;
        for (int t = 0; t < T; ++t) read_ahead<Ahead, Bytes>(w + t * stride);
        constexpr bool by_halves = Bits == 6 || Bits == 3 || Bits == 2, pairs_of_bits = Bits == 3 || Bits == 2;
        __m512i dot[T][R], scaled[by_halves ? T : 1][by_halves ? R : 1];
        for (int t = 0; t < T; ++t)
            for (int r = 0; r < R; ++r) dot[t][r] = _mm512_setzero_si512();
        if constexpr (by_halves)
            for (int t = 0; t < T; ++t)
                for (int r = 0; r < R; ++r) scaled[t][r] = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {
            __m512i lo[T], hi[T];
            for (int t = 0; t < T; ++t) {
                const __m512i v = _mm512_loadu_si512(w + t * stride + (pairs_of_bits ? 64 * (c / 2) : 64 * c));
                lo[t] = _mm512_and_si512(v, low), hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                if constexpr (pairs_of_bits) {  // chunk c's codes 4 (c % 2) bits up in its 2-bit chunk
                    const __m512i two = _mm512_set1_epi8(3), shifted = _mm512_srli_epi16(v, 4 * (c % 2));
                    lo[t] = _mm512_and_si512(shifted, two);
                    hi[t] = _mm512_and_si512(_mm512_srli_epi16(shifted, 2), two);
                }
                if constexpr (Bits == 3) {  // and the third bits
                    const uint8_t* third = w + t * stride + 128 + 16 * c;
                    const __m512i four = _mm512_set1_epi8(4);
                    lo[t] = add_where(lo[t], third, four), hi[t] = add_where(hi[t], third + 8, four);
                }
                if constexpr (on_grid)
                    lo[t] = _mm512_shuffle_epi8(grid, lo[t]), hi[t] = _mm512_shuffle_epi8(grid, hi[t]);
                if constexpr (Bits == 5 || Bits == 6 || Bits == Q5K) {
                    const uint8_t* fifth = w + t * stride + 256 + 16 * c;
                    const __m512i sixteen = _mm512_set1_epi8(16);
                    lo[t] = add_where(lo[t], fifth, sixteen), hi[t] = add_where(hi[t], fifth + 8, sixteen);
                }
                if constexpr (Bits == 6) {
                    const uint8_t* sixth = w + t * stride + 320 + 16 * c;
                    const __m512i thirty_two = _mm512_set1_epi8(32);
                    lo[t] = add_where(lo[t], sixth, thirty_two), hi[t] = add_where(hi[t], sixth + 8, thirty_two);
                }
            }
            for (int r = 0; r < R; ++r) {
                const int8_t* xq = x.xq + (m + r) * x.cols + b * BLOCK + 8 * c;
                const __m512i first = broadcast4(xq), second = broadcast4(xq + 4);
                for (int t = 0; t < T; ++t) {
                    dot[t][r] = _mm512_dpbusd_epi32(dot[t][r], lo[t], first);
                    dot[t][r] = _mm512_dpbusd_epi32(dot[t][r], hi[t], second);
                }
            }
            if constexpr (by_halves) {
                if (c % 2 == 0) continue;
                const int h = c / 2;  // the half block whose two chunks are in
                for (int t = 0; t < T; ++t) {
                    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
                        w + t * stride + (Bits == 2 ? 128 : Bits == 3 ? 192 : 416) + 16 * h));
                    const __m512i sc = Bits == 2 ? _mm512_and_si512(_mm512_cvtepu8_epi32(bytes), _mm512_set1_epi32(15))
                                                 : _mm512_cvtepi8_epi32(bytes);
                    for (int r = 0; r < R; ++r) {
                        const int64_t at = (m + r) * blocks + b;
                        const int32_t offset = Bits == 2 ? 0 : Bits == 3 ? x.halves32[2 * at + h] / 8
                                                                         : x.halves32[2 * at + h];
                        const __m512i part =
                            _mm512_mullo_epi32(_mm512_sub_epi32(dot[t][r], _mm512_set1_epi32(offset)), sc);
                        scaled[t][r] = _mm512_add_epi32(scaled[t][r], part);
                        dot[t][r] = _mm512_setzero_si512();
                    }
                }
            }
        }
        if constexpr (by_halves) {
            for (int t = 0; t < T; ++t) {
                const __m512 d = halves(Bits == 6 ? w + t * stride + 384 : head + t * stride);
                for (int r = 0; r < R; ++r) {
                    const int64_t at = (m + r) * blocks + b;
                    acc[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(scaled[t][r]),
                                                _mm512_mul_ps(d, _mm512_set1_ps(x.scale[at])), acc[t][r]);
                }
                if constexpr (Bits == 2) {  // less dmin s (mn_0 isum_0 + mn_1 isum_1)
                    const __m512 dmin = halves(head + t * stride + 32);
                    const uint8_t* mins = w + t * stride + 128;
                    const __m512i first = _mm512_srli_epi32(
                        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins))), 4);
                    const __m512i second = _mm512_srli_epi32(
                        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + 16))), 4);
                    for (int r = 0; r < R; ++r) {
                        const int64_t at = (m + r) * blocks + b;
                        const __m512i total = _mm512_add_epi32(
                            _mm512_mullo_epi32(first, _mm512_set1_epi32(x.halves32[2 * at] / 32)),
                            _mm512_mullo_epi32(second, _mm512_set1_epi32(x.halves32[2 * at + 1] / 32)));
                        acc[t][r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(total),
                                                     _mm512_mul_ps(dmin, _mm512_set1_ps(x.scale[at])), acc[t][r]);
                    }
                }
            }
            continue;
        }
        if constexpr (on_grid) {  // the grid values carry +128: take 128 times the activations' sum back off
            for (int t = 0; t < T; ++t) {
                // IQ4XS: d (sc - 32), exact in float32
                const __m512 d = Bits == IQ4 ? _mm512_loadu_ps(w + t * stride + 256)
                    : opaque(_mm512_mul_ps(halves(head + t * stride), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + t * stride + 256))))));
                for (int r = 0; r < R; ++r) {
                    const int64_t at = (m + r) * blocks + b;
                    const __m512i exact = _mm512_sub_epi32(dot[t][r], _mm512_set1_epi32(128 * x.isum[at]));
                    const __m512 step = _mm512_mul_ps(d, _mm512_set1_ps(x.scale[at]));
                    acc[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), step, acc[t][r]);
                }
            }
            continue;
        }
        for (int t = 0; t < T; ++t) {
            __m512 d, mins;
            if constexpr (!in_super_blocks(Bits)) {
                d = halves(w + t * stride + Scales), mins = halves(w + t * stride + Scales + 32);
            } else {  // d sc and dmin mn (taken off below), exact in float32
                const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + t * stride + Scales))));
                const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + t * stride + Scales + 16))));
                d = opaque(_mm512_mul_ps(halves(head + t * stride), sc));
                mins = opaque(_mm512_mul_ps(halves(head + t * stride + 32), mn));
            }
            for (int r = 0; r < R; ++r) {
                const int64_t at = (m + r) * blocks + b;
                const __m512 step = _mm512_mul_ps(d, _mm512_set1_ps(x.scale[at]));
                acc[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t][r]), step, acc[t][r]);
                acc[t][r] = in_super_blocks(Bits) ? _mm512_fnmadd_ps(mins, _mm512_set1_ps(x.sum[at]), acc[t][r])
                                                  : _mm512_fmadd_ps(mins, _mm512_set1_ps(x.sum[at]), acc[t][r]);
            }
        }
    }
    for (int t = 0; t < T; ++t)  // only the last tile may be short
        for (int r = 0; r < R; ++r)
            _mm512_mask_storeu_ps(y + (m + r) * ldy + 16 * t, t + 1 == T ? keep : __mmask16(0xFFFF), acc[t][r]);
}

template <int R, int T, int64_t Ahead = 0>
CORRAL_INLINE void q8_rows(const Activations& x, int64_t m, const uint8_t* w, int64_t, int64_t blocks, float* y,
                           int64_t ldy, __mmask16 keep) {
    static_assert(T == 1, "Q8 tiles go one at a time (two at a time measured no faster for the LM head)");
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b, w += Q8_TILE_BYTES) {
        read_ahead<Ahead, Q8_TILE_BYTES>(w);
        __m512i dot[R];
        for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
        for (int c = 0; c < 8; ++c) {
            const __m512i v = _mm512_loadu_si512(w + 64 * c);
            for (int r = 0; r < R; ++r)
                dot[r] = _mm512_dpbusd_epi32(dot[r], v, broadcast4(x.xq + (m + r) * x.cols + b * BLOCK + 4 * c));
        }
        const __m512 d = halves(w + 512);
        for (int r = 0; r < R; ++r) {
            const int64_t at = (m + r) * blocks + b;
            // the codes carry +128: take 128 times the activations' sum back off
            const __m512i exact = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(128 * x.isum[at]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(d, _mm512_set1_ps(x.scale[at])), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (m + r) * ldy, keep, acc[r]);
}

using Rows = void (*)(const Activations&, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t, __mmask16);

// Up to SMALL_MAX rows (a decode step's: its sequences and their drafts) go in at most two passes over a tile, as
// even as they fall (9 rows: 5 and 4), each pass all of its rows against one tile: the tile's weights, read from
// memory once per step, feed every row while they are at hand. Fours over tile pairs left a 9-row step three
// passes, the first waiting on memory and the others' arithmetic not overlapping it. The 30 layers' products of
// SmolLM2 in the native step (2-core AVX-512 EPYC, decode at a 550-token context, alternating runs): 1 row
// 1.8-2.6 ms -> 1.4-1.5, 5 rows 3.0-3.3 -> 1.8, 9 rows 3.8-4.1 -> 3.2. One pass of 9-12 rows measured no faster
// than two. Larger row counts (a prefill) go in sixes (then fours, a two, a one), over Q4 tile pairs, each
// broadcast feeding two tiles (Q8 tiles one at a time): 31 of the 32 vector registers, and the 30 layers' products
// of a 503-token prompt 3-7% faster than in fours (three alternating runs). A row's products are the same whatever
// pass computes them.
static const int64_t SMALL_MAX = 16;
static_assert(SMALL_MAX <= 16, "two passes of at most 8 rows: the one-tile kernels go up to 8");

// Tiles go to the threads in groups of Group (a last short group takes the one-tile kernels). `single[r]` is the
// one-tile kernel of r rows (r = 1 .. 8), `pair[r]` (r = 1 .. 4; none: nullptr) the kernel of a whole group of two
// tiles, both for a decode step's rows, reading ahead.
template <Rows Rows1, Rows Rows2, Rows Rows4, Rows Group1, Rows Group2, Rows Group4, Rows Group6, int64_t TileBytes,
          int64_t Group>
void matmul(const Activations& x, const uint8_t* tiles, int64_t n, float* y, int64_t ldy, int threads,
            const Rows* single, const Rows* pair) {
    if (x.rows == 0) return;  // single[0] is no kernel
    const int64_t blocks = x.cols / BLOCK, num_tiles = (n + TILE - 1) / TILE, stride = blocks * TileBytes;
    const int64_t groups = (num_tiles + Group - 1) / Group;
    const bool small = x.rows <= SMALL_MAX;
    const int64_t first_pass = x.rows > 8 ? (x.rows + 1) / 2 : x.rows;  // rows of the first of at most two passes
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t t = g * Group, count = num_tiles - t < Group ? num_tiles - t : Group, last = t + count - 1;
        const uint8_t* w = tiles + t * stride;
        const int64_t valid = n - last * TILE < TILE ? n - last * TILE : TILE;
        const __mmask16 keep = __mmask16((1u << valid) - 1u);  // of the group's last tile
        float* out = y + t * TILE;
        if (small && pair != nullptr && count == 2 && x.rows <= 4) {
            pair[x.rows](x, 0, w, stride, blocks, out, ldy, keep);
            continue;
        }
        if (small) {
            for (int64_t i = 0; i < count; ++i) {
                const __mmask16 mask = i == count - 1 ? keep : __mmask16(0xFFFF);
                single[first_pass](x, 0, w + i * stride, stride, blocks, out + i * TILE, ldy, mask);
                if (x.rows > first_pass)
                    single[x.rows - first_pass](x, first_pass, w + i * stride, stride, blocks, out + i * TILE, ldy,
                                                mask);
            }
            continue;
        }
        const bool whole = count == Group;
        int64_t m = 0;
        if (whole)
            for (; m + 6 <= x.rows; m += 6) Group6(x, m, w, stride, blocks, out, ldy, keep);
        for (; m + 4 <= x.rows; m += 4) (whole ? Group4 : Rows4)(x, m, w, stride, blocks, out, ldy, keep);
        if (m + 2 <= x.rows) (whole ? Group2 : Rows2)(x, m, w, stride, blocks, out, ldy, keep), m += 2;
        if (m < x.rows) (whole ? Group1 : Rows1)(x, m, w, stride, blocks, out, ldy, keep);
    }
}

// A decode step's products of 1-4 rows on Q4 tiles go over one tile at a time or over a group's two at once (two
// streams of tiles, two chains of vpdpbusd), by CPU (tile_pairs(), qmatmul_scalar.cpp); the same bits either way.
// Pairs on the 2-core Ice Lake Xeon: the 30 layers' products 5-8% faster at 1-4 rows (paired runs, with reading
// ahead). On the 2-core AMD EPYC (Zen 4, family 25), in one process taking turns with a build that has them, 12
// rounds: 2.83 -> 2.22 ms at 1 row, 2.97 -> 2.33 at 2, 3.55 -> 2.77 at 4 without them (the same build otherwise,
// reading ahead; at 8 and 16 rows, where no pairs run, within 4%).
template <int Bits>
void nibbles_over(const Activations& x, const uint8_t* tiles, int64_t n, float* y, int64_t ldy, int threads,
                  const Rows* pair) {
    constexpr int64_t A = Bits == 6 ? Q6_AHEAD : Bits == 5 || Bits == Q5K ? Q5_AHEAD : Bits == 3 ? Q3_AHEAD
                        : Bits == 2 ? Q2_AHEAD : Q4_AHEAD,
                      Bytes = tile_block_bytes(Bits);  // a tile row's bytes over its blocks (matmul's stride)
    static const Rows single[9] = {nullptr, nibble_rows<Bits, 1, 1, A>, nibble_rows<Bits, 2, 1, A>,
                                   nibble_rows<Bits, 3, 1, A>, nibble_rows<Bits, 4, 1, A>, nibble_rows<Bits, 5, 1, A>,
                                   nibble_rows<Bits, 6, 1, A>, nibble_rows<Bits, 7, 1, A>, nibble_rows<Bits, 8, 1, A>};
    if constexpr (Bits == 6 || Bits == 3 || Bits == 2)  // a block's integer sums take a third set of registers:
        // one tile at a time, always
        matmul<nibble_rows<Bits, 1, 1>, nibble_rows<Bits, 2, 1>, nibble_rows<Bits, 4, 1>, nibble_rows<Bits, 1, 1>,
               nibble_rows<Bits, 2, 1>, nibble_rows<Bits, 4, 1>, nibble_rows<Bits, 6, 1>, Bytes, 1>(
            x, tiles, n, y, ldy, threads, single, nullptr);
    else
        matmul<nibble_rows<Bits, 1, 1>, nibble_rows<Bits, 2, 1>, nibble_rows<Bits, 4, 1>, nibble_rows<Bits, 1, 2>,
               nibble_rows<Bits, 2, 2>, nibble_rows<Bits, 4, 2>, nibble_rows<Bits, 6, 2>, Bytes, 2>(
            x, tiles, n, y, ldy, threads, single, pair);
}

template <int Bits>
const Rows* pairs() {
    static_assert(Bits != 6 && Bits != 3 && Bits != 2, "Q6, Q3 and Q2 tiles go one at a time");
    constexpr int64_t A = Bits == 5 || Bits == Q5K ? Q5_AHEAD : Q4_AHEAD;
    static const Rows pair[5] = {nullptr, nibble_rows<Bits, 1, 2, A>, nibble_rows<Bits, 2, 2, A>,
                                 nibble_rows<Bits, 3, 2, A>, nibble_rows<Bits, 4, 2, A>};
    return pair;
}

// A kind's product one tile at a time, and with a decode step's 1-4 rows over a group's two tiles at once.
template <int Bits>
void singly(const Activations& x, const uint8_t* tiles, int64_t n, float* y, int64_t ldy, int threads) {
    nibbles_over<Bits>(x, tiles, n, y, ldy, threads, nullptr);
}

template <int Bits>
void paired_up(const Activations& x, const uint8_t* tiles, int64_t n, float* y, int64_t ldy, int threads) {
    nibbles_over<Bits>(x, tiles, n, y, ldy, threads, pairs<Bits>());
}

void q8(const Activations& x, const uint8_t* tiles, int64_t n, float* y, int64_t ldy, int threads) {
    constexpr int64_t A = Q8_AHEAD;
    static const Rows single[9] = {nullptr, q8_rows<1, 1, A>, q8_rows<2, 1, A>, q8_rows<3, 1, A>, q8_rows<4, 1, A>,
                                   q8_rows<5, 1, A>, q8_rows<6, 1, A>, q8_rows<7, 1, A>, q8_rows<8, 1, A>};
    matmul<q8_rows<1, 1>, q8_rows<2, 1>, q8_rows<4, 1>, q8_rows<1, 1>, q8_rows<2, 1>, q8_rows<4, 1>, q8_rows<6, 1>,
           Q8_TILE_BYTES, 1>(x, tiles, n, y, ldy, threads, single, nullptr);
}

// The scalar variant's quantization, 16 lanes at a time: the same products, rounded by the same mode (MXCSR's
// round to nearest even, as std::nearbyint's), so the same bytes. vpmovdb truncates to 8 bits: every code is
// within [-127, 127] already.
void quantize(const float* x, int64_t rows, int64_t cols, const QuantizedOut& out, int threads) {
    const int64_t blocks = cols / BLOCK;
    #pragma omp parallel for num_threads(threads) schedule(static) if (quantize_in_parallel(rows, cols))
    for (int64_t m = 0; m < rows; ++m)
        for (int64_t b = 0; b < blocks; ++b) {
            const float* in = x + m * cols + b * BLOCK;
            const __m512 a = _mm512_loadu_ps(in), c = _mm512_loadu_ps(in + 16);
            // vmaxps returns its second operand when either is NaN: a NaN |x| is skipped, as std::fmax skips it
            const __m512 high = _mm512_max_ps(_mm512_abs_ps(a), _mm512_max_ps(_mm512_abs_ps(c), _mm512_setzero_ps()));
            const float amax = _mm512_reduce_max_ps(high);
            const __m512 inverse = _mm512_set1_ps(block_inverse(amax));
            const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse));
            const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, inverse));
            int8_t* codes = out.xq + m * cols + b * BLOCK;
            _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtepi32_epi8(qa));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 16), _mm512_cvtepi32_epi8(qc));
            const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
            finish_block(out, m * blocks + b, amax, total);
        }
}

const QTable table = {"avx512-vnni", singly<4>,  q8,         quantize,   singly<5>,  singly<6>,
                      singly<IQ4>,   singly<3>,  singly<2>,  singly<Q4K>, singly<Q5K>, singly<IQ4XS>};
// Q6, Q3 and Q2: one at a time
const QTable paired = {"avx512-vnni-pairs", paired_up<4>, q8,         quantize,       paired_up<5>,   singly<6>,
                       paired_up<IQ4>,      singly<3>,    singly<2>,  paired_up<Q4K>, paired_up<Q5K>, paired_up<IQ4XS>};

}  // namespace
}  // namespace avx512
}  // namespace corral_qmatmul

#pragma GCC pop_options

namespace corral_qmatmul {
const QTable* avx512_table() { return tile_pairs() == 1 ? &avx512::paired : &avx512::table; }
}  // namespace corral_qmatmul

#else

namespace corral_qmatmul {
const QTable* avx512_table() { return nullptr; }
}  // namespace corral_qmatmul

#endif

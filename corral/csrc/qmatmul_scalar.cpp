// The quantized products in portable C++: the variant for CPUs without AVX2, and the reference the vector
// variants are tested against (the integer block sums are exact in every variant, so all agree up to float32
// summation order).
#include "qmatmul.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace corral_qmatmul {

bool cpu_has_avx512_vnni() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
    return false;
#endif
}

int tile_pairs() {
    static const int chosen = [] {
        const char* forced = std::getenv("CORRAL_QMATMUL_TILE_PAIRS");
        if (forced != nullptr && *forced != 0)
            return std::strcmp(forced, "on") == 0 ? 1 : std::strcmp(forced, "off") == 0 ? 0 : -1;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_cpu_init();
        return __builtin_cpu_is("intel") ? 1 : 0;
#else
        return 0;
#endif
    }();
    return chosen;
}

bool cpu_has_amx_int8() {
#if defined(__x86_64__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    return (d >> 24 & 1u) != 0 && (d >> 25 & 1u) != 0;  // CPUID.7.0:EDX: AMX-TILE, AMX-INT8
#else
    return false;
#endif
}

float half_to_float(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    const uint32_t sign = uint32_t(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else {  // subnormal: normalize
        int shift = 0;
        uint32_t m = mantissa;
        while (!(m & 0x400)) m <<= 1, ++shift;
        bits = sign | ((113 - shift) << 23) | ((m & 0x3FF) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

namespace {

// Every output row of every tile, one activation row at a time; Block(w, head, xq, s, sum, acc) adds one block of 32
// (tile bytes at w; head: its super-block's header, for tiles kept in super-blocks) to the tile's 16 accumulators.
template <int64_t Kind, typename Block>
void each_tile(const Activations& x, const uint8_t* tiles, int64_t n, float* y, int64_t ldy, int threads,
               Block block) {
    const int64_t blocks = x.cols / BLOCK, num_tiles = (n + TILE - 1) / TILE;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < num_tiles; ++t) {
        const uint8_t* tile = tiles + t * blocks * tile_block_bytes(Kind);
        for (int64_t m = 0; m < x.rows; ++m) {
            float acc[TILE] = {};
            for (int64_t b = 0; b < blocks; ++b)
                block(tile + block_at(Kind, b), tile + head_at(Kind, b),
                      x.xq + m * x.cols + b * BLOCK, x.scale[m * blocks + b], x.sum[m * blocks + b], acc);
            for (int r = 0; r < TILE && t * TILE + r < n; ++r) y[m * ldy + t * TILE + r] = acc[r];
        }
    }
}

// Q4 tiles (Bits 4), Q5 tiles (Bits 5: each code's fifth bit from its chunk's masks, qmatmul.h), Q6 tiles (Bits
// 6: a sixth bit too, and a scale per half block, with 32 times the half's activation sum taken off its dot),
// IQ4 tiles (each index's grid value, and a float32 d), Q3 tiles (Bits 3: 2-bit codes and a third bit, a scale
// per half block as Q6's, with 4 times the half's sum taken off), Q2 tiles (Bits 2: 2-bit codes, a scale per
// half block, and a min per half block times the half's sum taken off at dmin), Q4K and Q5K tiles (Bits Q4K,
// Q5K: a Q4 or Q5 tile block's codes, d sc and dmin mn in place of its d and -m) or IQ4XS tiles (IQ4's, with
// d (sc - 32)); Q3, Q2, Q4K, Q5K and IQ4XS tiles read d (and dmin) at `head`.
template <int Bits>
void nibbles(const Activations& x, const uint8_t* tiles, int64_t n, float* y, int64_t ldy, int threads) {
    constexpr int64_t Scales = Bits == 5 || Bits == Q5K ? 320 : 256;  // Q4K, Q5K: the 6-bit scales (mins: + 16)
    each_tile<Bits>(x, tiles, n, y, ldy, threads, [](const uint8_t* w, const uint8_t* head, const int8_t* xq, float s,
                                                     float sum, float* acc) {
        constexpr bool by_halves = Bits == 6 || Bits == 3 || Bits == 2;
        int32_t half_sum[2] = {0, 0};
        if constexpr (by_halves)
            for (int k = 0; k < BLOCK; ++k) half_sum[k / 16] += xq[k];
        for (int r = 0; r < TILE; ++r) {
            int32_t dot[2] = {0, 0};  // Q6, Q3, Q2: the block's two halves (chunks 0-1, 2-3); else all in the first
            for (int c = 0; c < 4; ++c)
                for (int i = 0; i < 4; ++i) {
                    const int j = 4 * r + i;  // the byte in the chunk, and the bit in each of its masks
                    const uint8_t byte = w[64 * c + j];
                    int32_t low = byte & 0x0F, high = byte >> 4;
                    if constexpr (Bits == 3 || Bits == 2) {
                        const uint8_t pair = uint8_t(w[64 * (c / 2) + j] >> (4 * (c % 2)));
                        low = pair & 3, high = pair >> 2 & 3;
                    }
                    if constexpr (Bits == 3) {
                        const uint8_t* third = w + 128 + 16 * c + j / 8;
                        low |= (third[0] >> (j % 8) & 1) << 2;
                        high |= (third[8] >> (j % 8) & 1) << 2;
                    }
                    if constexpr (Bits == IQ4 || Bits == IQ4XS) low = IQ4_VALUES[low], high = IQ4_VALUES[high];
                    if constexpr (Bits == 5 || Bits == 6 || Bits == Q5K) {
                        const uint8_t* fifth = w + 256 + 16 * c + j / 8;
                        low |= (fifth[0] >> (j % 8) & 1) << 4;
                        high |= (fifth[8] >> (j % 8) & 1) << 4;
                    }
                    if constexpr (Bits == 6) {
                        const uint8_t* sixth = w + 320 + 16 * c + j / 8;
                        low |= (sixth[0] >> (j % 8) & 1) << 5;
                        high |= (sixth[8] >> (j % 8) & 1) << 5;
                    }
                    dot[by_halves ? c / 2 : 0] += low * xq[8 * c + i] + high * xq[8 * c + 4 + i];
                }
            if constexpr (Bits == 2) {
                int32_t total = 0, mins = 0;
                for (int h = 0; h < 2; ++h) {
                    const uint8_t both = w[128 + 16 * h + r];
                    total += int32_t(both & 15) * dot[h], mins += int32_t(both >> 4) * half_sum[h];
                }
                acc[r] += float(total) * (half_to_float(head + 2 * r) * s);
                acc[r] -= float(mins) * (half_to_float(head + 32 + 2 * r) * s);
            } else if constexpr (Bits == 3) {
                int32_t total = 0;
                for (int h = 0; h < 2; ++h) total += int32_t(int8_t(w[192 + 16 * h + r])) * (dot[h] - 4 * half_sum[h]);
                acc[r] += float(total) * (half_to_float(head + 2 * r) * s);
            } else if constexpr (Bits == 6) {
                int32_t total = 0;
                for (int h = 0; h < 2; ++h) total += int32_t(int8_t(w[416 + 16 * h + r])) * (dot[h] - 32 * half_sum[h]);
                acc[r] += float(total) * (half_to_float(w + 384 + 2 * r) * s);
            } else if constexpr (Bits == IQ4) {
                float d;
                std::memcpy(&d, w + 256 + 4 * r, 4);
                acc[r] += float(dot[0]) * (d * s);
            } else if constexpr (Bits == IQ4XS) {  // d (sc - 32): exact in float32
                acc[r] += float(dot[0]) * ((half_to_float(head + 2 * r) * float(int8_t(w[256 + r]))) * s);
            } else if constexpr (in_super_blocks(Bits)) {  // d sc and dmin mn: exact in float32
                const float d = half_to_float(head + 2 * r) * float(w[Scales + r]);
                const float mins = half_to_float(head + 32 + 2 * r) * float(w[Scales + 16 + r]);
                acc[r] += float(dot[0]) * (d * s) - mins * sum;
            } else {
                const float d = half_to_float(w + Scales + 2 * r), m = half_to_float(w + Scales + 32 + 2 * r);
                acc[r] += float(dot[0]) * (d * s) + m * sum;
            }
        }
    });
}

void q8(const Activations& x, const uint8_t* tiles, int64_t n, float* y, int64_t ldy, int threads) {
    each_tile<8>(x, tiles, n, y, ldy, threads,
                 [](const uint8_t* w, const uint8_t*, const int8_t* xq, float s, float, float* acc) {
        for (int r = 0; r < TILE; ++r) {
            int32_t dot = 0;
            for (int c = 0; c < 8; ++c)
                for (int i = 0; i < 4; ++i) dot += (int32_t(w[64 * c + 4 * r + i]) - 128) * xq[4 * c + i];
            acc[r] += float(dot) * (half_to_float(w + 512 + 2 * r) * s);
        }
    });
}

void quantize(const float* x, int64_t rows, int64_t cols, const QuantizedOut& out, int threads) {
    const int64_t blocks = cols / BLOCK;
    #pragma omp parallel for num_threads(threads) schedule(static) if (quantize_in_parallel(rows, cols))
    for (int64_t m = 0; m < rows; ++m)
        for (int64_t b = 0; b < blocks; ++b) {
            const float* in = x + m * cols + b * BLOCK;
            int8_t* codes = out.xq + m * cols + b * BLOCK;
            float amax = 0.0f;
            for (int i = 0; i < BLOCK; ++i) amax = std::fmax(amax, std::fabs(in[i]));
            const float inverse = block_inverse(amax);
            int32_t total = 0;
            for (int i = 0; i < BLOCK; ++i) {
                const int32_t q = int32_t(std::nearbyint(in[i] * inverse));
                codes[i] = int8_t(q);
                total += q;
            }
            finish_block(out, m * blocks + b, amax, total);
        }
}

const QTable table = {"scalar",   nibbles<4>,   q8,         quantize,  nibbles<5>,
                      nibbles<6>, nibbles<IQ4>, nibbles<3>, nibbles<2>, nibbles<Q4K>, nibbles<Q5K>, nibbles<IQ4XS>};

}  // namespace

const QTable* scalar_table() { return &table; }

}  // namespace corral_qmatmul

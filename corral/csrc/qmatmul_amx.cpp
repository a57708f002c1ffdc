// The quantized products with AMX-INT8 tiles, for 16 activation rows at a time: one tdpbsud multiplies a 16 x 32
// block of int8 activations (tile A, signed) by one Q4 or Q8 tile block of 16 weight rows (tile B, unsigned) into
// 16 x 16 int32 dot products, which AVX-512 then scales into float32 exactly as the VNNI kernels do (qmatmul.h), in
// the same order, so a row's product has the same bits whichever kernel computes it.
//
// The tile blocks are already laid out for tile B: in B, row k holds, for each of the 16 output rows n, the 4 codes
// that meet activations 4k .. 4k + 3. A Q8 tile block's 8 chunks of 64 bytes are those 8 rows as they lie (codes
// + 128, unsigned: the 128 x the activations' sum is taken back off after, as in the VNNI kernel). A Q4 tile
// block's chunk c holds rows 2c (low nibbles) and 2c + 1 (high nibbles); a tile's blocks are unpacked into 512-byte
// B rows once per product and then serve every group of 16 activation rows.
//
// Rows past the last full group of 16 go through the AVX-512 VNNI kernels (a decode step of fewer than 16 rows
// runs on those alone: a tile product of one row would waste 15 of the tile's 16). Before the tiles are used at
// all, the module asks Linux for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM) and runs one product through both
// kernels, comparing their bits; any failure keeps the VNNI kernels and says why (qmatmul.cpp).
//
// The same kernel also runs against a scalar model of the three tile instructions it uses (CORRAL_QMATMUL_ISA=
// amx-model, never chosen on its own): on a CPU without AMX that tests the layout, the epilogue and the row split,
// though not the instructions themselves.
#include "qmatmul.h"

#include <cstring>
#include <vector>

#if defined(__x86_64__)  // (other CPUs have no <immintrin.h>)
// GCC 12's own AVX-512 headers trip this warning (their _mm512_undefined_* values)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

// The kernels, compiled for the target above, in a namespace named for them (tests/test_native_isa.py). What
// runs before the CPU is known to have AVX-512 and the tiles (the table, the load-time check) is compiled
// after them for the build's own target: the module picks its kernels at every import, on any CPU.
namespace corral_qmatmul {
namespace amx {
namespace {

#define CORRAL_INLINE static inline __attribute__((always_inline))

constexpr int64_t GROUP_ROWS = 16;   // activation rows per tile product
constexpr int64_t B_BYTES = 512;     // one tile B: 8 rows of 64 bytes, a block of 32 codes for 16 outputs

struct alignas(64) Line { uint8_t bytes[64]; };  // one aligned B row

// ldtilecfg's 64 bytes: palette 1; tmm0 the 16 x 16 int32 sums (C), tmm1 16 activation rows of one block's 32
// codes (A), tmm2 the block's 8 rows of 64 weight bytes (B).
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {64, 32, 64};
    uint8_t rows[16] = {16, 16, 8};
};

// The tile instructions, in AT&T order (sources first). The loads name "memory": the tile B of a Q4 block is
// written by vector stores just before, which the compiler must not drop or sink past them.
struct HardwareTiles {
    static void begin() {
        static const TileConfig config;
        asm volatile("ldtilecfg %0" ::"m"(config));
    }
    static void end() { asm volatile("tilerelease" ::: "memory"); }
    CORRAL_INLINE void zero_c() { asm volatile("tilezero %%tmm0" ::); }
    CORRAL_INLINE void load_a(const int8_t* p, int64_t stride) {
        asm volatile("tileloadd (%0,%1,1), %%tmm1" ::"r"(p), "r"(stride) : "memory");
    }
    CORRAL_INLINE void load_b(const uint8_t* p) {
        asm volatile("tileloadd (%0,%1,1), %%tmm2" ::"r"(p), "r"(int64_t(64)) : "memory");
    }
    CORRAL_INLINE void dot() { asm volatile("tdpbsud %%tmm2, %%tmm1, %%tmm0" ::); }  // C += A (signed) B (unsigned)
    CORRAL_INLINE void store_c(int32_t* p) {
        asm volatile("tilestored %%tmm0, (%0,%1,1)" ::"r"(p), "r"(int64_t(64)) : "memory");
    }
};

// The same three tiles in memory, each instruction as the ISA reference states it for this configuration.
struct ModelTiles {
    struct State {
        int32_t c[16][16];
        int8_t a[16][32];
        uint8_t b[8][64];
    };
    static State& state() {
        static thread_local State s;
        return s;
    }
    static void begin() { std::memset(&state(), 0, sizeof(State)); }
    static void end() { std::memset(&state(), 0xA5, sizeof(State)); }  // tilerelease: nothing carries over
    static void zero_c() { std::memset(state().c, 0, sizeof(state().c)); }
    static void load_a(const int8_t* p, int64_t stride) {
        for (int r = 0; r < 16; ++r) std::memcpy(state().a[r], p + r * stride, 32);
    }
    static void load_b(const uint8_t* p) { std::memcpy(state().b, p, sizeof(state().b)); }
    static void dot() {
        State& s = state();
        for (int m = 0; m < 16; ++m)
            for (int n = 0; n < 16; ++n) {
                int32_t total = 0;
                for (int k = 0; k < 8; ++k)
                    for (int i = 0; i < 4; ++i) total += int32_t(s.a[m][4 * k + i]) * int32_t(s.b[k][4 * n + i]);
                s.c[m][n] += total;
            }
    }
    static void store_c(int32_t* p) { std::memcpy(p, state().c, sizeof(state().c)); }
};

CORRAL_INLINE __m512 halves(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// A Q4 tile's blocks as tile B rows: chunk c's low nibbles are row 2c, its high nibbles row 2c + 1.
void unpack_q4(const uint8_t* w, int64_t blocks, uint8_t* out) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; ++b, w += Q4_TILE_BYTES, out += B_BYTES)
        for (int c = 0; c < 4; ++c) {
            const __m512i v = _mm512_loadu_si512(w + 64 * c);
            _mm512_store_si512(out + 128 * c, _mm512_and_si512(v, low));
            _mm512_store_si512(out + 128 * c + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
}

// Activation rows m .. m + 15 against one tile (its blocks at w; for Q4 unpacked at b_rows), into y's 16 columns.
template <class Tiles, bool FourBit>
void group_product(const Activations& x, int64_t m, const uint8_t* w, const uint8_t* b_rows, int64_t blocks,
                   float* y, int64_t ldy, __mmask16 keep) {
    alignas(64) int32_t dots[16][16];
    __m512 acc[16];
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        Tiles::zero_c();
        Tiles::load_a(x.xq + m * x.cols + b * BLOCK, x.cols);
        Tiles::load_b(FourBit ? b_rows + b * B_BYTES : w + b * Q8_TILE_BYTES);
        Tiles::dot();
        Tiles::store_c(&dots[0][0]);
        if (FourBit) {
            const uint8_t* block = w + b * Q4_TILE_BYTES;
            const __m512 d = halves(block + 256), mins = halves(block + 288);
            for (int r = 0; r < 16; ++r) {
                const int64_t at = (m + r) * blocks + b;
                const __m512i dot = _mm512_load_si512(dots[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(x.scale[at])),
                                         acc[r]);
                acc[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(x.sum[at]), acc[r]);
            }
        } else {
            const __m512 d = halves(w + b * Q8_TILE_BYTES + 512);
            for (int r = 0; r < 16; ++r) {
                const int64_t at = (m + r) * blocks + b;
                const __m512i exact = _mm512_sub_epi32(_mm512_load_si512(dots[r]), _mm512_set1_epi32(128 * x.isum[at]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(d, _mm512_set1_ps(x.scale[at])),
                                         acc[r]);
            }
        }
    }
    for (int r = 0; r < 16; ++r) _mm512_mask_storeu_ps(y + (m + r) * ldy, keep, acc[r]);
}

template <class Tiles, bool FourBit>
void product(const Activations& x, const uint8_t* tiles, int64_t n, float* y, int64_t ldy, int threads) {
    const QTable* vnni = avx512_table();
    const int64_t full = x.rows / GROUP_ROWS * GROUP_ROWS;
    if (full > 0) {
        const int64_t blocks = x.cols / BLOCK, num_tiles = (n + TILE - 1) / TILE;
        const int64_t stride = blocks * (FourBit ? Q4_TILE_BYTES : Q8_TILE_BYTES);
        #pragma omp parallel num_threads(threads)
        {
            static thread_local std::vector<Line> unpacked;  // one tile's B rows
            if (FourBit) unpacked.resize(size_t(blocks * B_BYTES / 64));
            Tiles::begin();
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < num_tiles; ++t) {
                const uint8_t* w = tiles + t * stride;
                uint8_t* b_rows = FourBit ? reinterpret_cast<uint8_t*>(unpacked.data()) : nullptr;
                if (FourBit) unpack_q4(w, blocks, b_rows);
                const int64_t valid = n - t * TILE < TILE ? n - t * TILE : TILE;
                const __mmask16 keep = __mmask16((1u << valid) - 1u);
                for (int64_t m = 0; m < full; m += GROUP_ROWS)
                    group_product<Tiles, FourBit>(x, m, w, b_rows, blocks, y + t * TILE, ldy, keep);
            }
            Tiles::end();
        }
    }
    if (x.rows > full) {  // the rest, fewer than 16, through the VNNI kernels
        const int64_t blocks = x.cols / BLOCK;
        const Activations rest = {x.xq + full * x.cols, x.scale + full * blocks, x.sum + full * blocks,
                                  x.isum + full * blocks, x.rows - full, x.cols};
        (FourBit ? vnni->q4 : vnni->q8)(rest, tiles, n, y + full * ldy, ldy, threads);
    }
}

const QTable hardware = {"amx-int8", product<HardwareTiles, true>, product<HardwareTiles, false>, nullptr};
const QTable model = {"amx-model", product<ModelTiles, true>, product<ModelTiles, false>, nullptr};

}  // namespace
}  // namespace amx
}  // namespace corral_qmatmul

#pragma GCC pop_options

namespace corral_qmatmul {
namespace {

QTable with_quantize(const QTable& table) {
    QTable out = table;
    out.quantize = avx512_table()->quantize;  // the same bytes as every variant's
    // Q2, Q3, Q5, Q6, IQ4, IQ4XS, Q4K and Q5K tiles: no tile kernel of their own, the VNNI one at any row count
    out.q5 = avx512_table()->q5;
    out.q6 = avx512_table()->q6;
    out.iq4 = avx512_table()->iq4;
    out.q3 = avx512_table()->q3;
    out.q2 = avx512_table()->q2;
    out.q4k = avx512_table()->q4k;
    out.q5k = avx512_table()->q5k;
    out.iq4xs = avx512_table()->iq4xs;
    return out;
}

// A product of 33 rows (two tile groups and one VNNI row) on two threads through `table` and through the VNNI
// kernels, Q4 and Q8, over three tiles (the last short) and two blocks: whether every output has the same bits.
bool agrees_with_vnni(const QTable& table) {
    const int64_t rows = 33, cols = 64, n = 40, tiles = 3, blocks = cols / BLOCK;
    uint32_t state = 12345;
    auto next = [&state]() { return state = state * 1664525u + 1013904223u; };
    std::vector<float> x(size_t(rows * cols));
    for (float& v : x) v = float(int32_t(next() >> 8) - (1 << 23)) / float(1 << 23);
    std::vector<int8_t> xq(x.size());
    std::vector<float> scale(size_t(rows * blocks)), sum(scale.size());
    std::vector<int32_t> isum(scale.size());
    avx512_table()->quantize(x.data(), rows, cols, {xq.data(), scale.data(), sum.data(), isum.data()}, 1);
    const Activations a = {xq.data(), scale.data(), sum.data(), isum.data(), rows, cols};
    for (const bool four_bit : {true, false}) {
        const int64_t bytes = four_bit ? Q4_TILE_BYTES : Q8_TILE_BYTES, codes = four_bit ? 256 : 512;
        std::vector<uint8_t> w(size_t(tiles * blocks * bytes));
        for (int64_t i = 0; i < int64_t(w.size()); ++i) {
            const int64_t at = i % bytes;
            const uint8_t random = uint8_t(next() >> 24);
            // codes anything; each float16 d and m of either sign, 2^-7 to under 2^-5 in size (high byte 0x20..0x27)
            const bool high_byte = at >= codes && at % 2 == 1;
            w[size_t(i)] = high_byte ? uint8_t((random & 0x80) | 0x20 | (random & 0x07)) : random;
        }
        std::vector<float> got(size_t(rows * n)), want(got.size());
        (four_bit ? table.q4 : table.q8)(a, w.data(), n, got.data(), n, 2);
        (four_bit ? avx512_table()->q4 : avx512_table()->q8)(a, w.data(), n, want.data(), n, 2);
        if (std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) != 0) return false;
    }
    return true;
}

}  // namespace

const QTable* amx_model_table() {
    static const QTable table = with_quantize(amx::model);
    return avx512_table() == nullptr || !cpu_has_avx512_vnni() ? nullptr : &table;
}

const QTable* amx_table(const char** why_not) {
    static const char* reason = nullptr;
    static const QTable* chosen = [] () -> const QTable* {
        static const QTable table = with_quantize(amx::hardware);
        if (!cpu_has_amx_int8()) reason = "this CPU has no AMX-INT8";
        // the epilogue and the rows past the last group run AVX-512 (a virtual machine may show AMX, hide AVX-512)
        else if (avx512_table() == nullptr || !cpu_has_avx512_vnni()) reason = "this CPU or build lacks AVX-512 VNNI";
        // Linux hands out the tile state only on request (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA)
        else if (syscall(SYS_arch_prctl, long(0x1023), long(18)) != 0)
            reason = "Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)";
        else if (!agrees_with_vnni(table)) reason = "its load-time check disagreed with the AVX-512 VNNI kernels";
        return reason == nullptr ? &table : nullptr;
    }();
    if (why_not != nullptr) *why_not = reason;
    return chosen;
}

// For the tests: the load-time check, run on the model (an AMX machine runs it on the tiles when the module loads).
bool amx_model_agrees() { return amx_model_table() != nullptr && agrees_with_vnni(*amx_model_table()); }

}  // namespace corral_qmatmul

#else

namespace corral_qmatmul {
const QTable* amx_model_table() { return nullptr; }
const QTable* amx_table(const char** why_not) {
    if (why_not != nullptr) *why_not = "not an x86-64 build";
    return nullptr;
}
bool amx_model_agrees() { return false; }
}  // namespace corral_qmatmul

#endif

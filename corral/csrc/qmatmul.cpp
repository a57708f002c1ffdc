// The quantized products' Python entry points (see qmatmul.h for the layouts and the numerics): every buffer is
// checked before a kernel reads it, the GIL is released while it runs, and the variant is the one chosen for this
// CPU when the module loads (CORRAL_QMATMUL_ISA=scalar|avx2|avx512|amx|amx-model picks another the CPU has,
// for tests; CORRAL_QMATMUL_TILE_PAIRS=on|off the AVX-512 kernels' way with 1-4 rows, see qmatmul_avx512.cpp).
#include "arrays.h"
#include "common.h"
#include "qmatmul.h"

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace corral_native {
namespace {

using corral_qmatmul::Activations;
using corral_qmatmul::QTable;
using corral_qmatmul::cpu_has_avx512_vnni;

const QTable* chosen_q = nullptr;

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    return false;
#endif
}

// Why the AMX tiles are not used on a CPU that has them (nullptr when they are, or when the CPU lacks them).
const char* amx_refusal = nullptr;

// nullptr with a Python error set when CORRAL_QMATMUL_ISA names a variant this CPU cannot run. By default: AMX
// where the CPU has it and it passes its load-time check, else AVX-512 VNNI, else AVX2, else scalar.
const QTable* choose_q() {
    if (corral_qmatmul::tile_pairs() < 0) {
        PyErr_Format(PyExc_ImportError, "CORRAL_QMATMUL_TILE_PAIRS=%s: on or off",
                     std::getenv("CORRAL_QMATMUL_TILE_PAIRS"));
        return nullptr;
    }
    const char* forced = std::getenv("CORRAL_QMATMUL_ISA");
    const std::string want = forced == nullptr ? "" : forced;
    const char* why_not = nullptr;
    const QTable* amx = want.empty() || want == "amx" ? corral_qmatmul::amx_table(&why_not) : nullptr;
    if (amx == nullptr && corral_qmatmul::cpu_has_amx_int8()) amx_refusal = why_not;
    if (want == "amx" && amx == nullptr) {
        PyErr_Format(PyExc_ImportError, "CORRAL_QMATMUL_ISA=amx: %s", why_not);
        return nullptr;
    }
    if (amx != nullptr) return amx;
    if (want == "amx-model") {
        if (corral_qmatmul::amx_model_table() != nullptr) return corral_qmatmul::amx_model_table();
    } else if (want == "scalar") {
        return corral_qmatmul::scalar_table();
    } else if (want == "avx2" || (want.empty() && !cpu_has_avx512_vnni() && cpu_has_avx2())) {
        if (cpu_has_avx2() && corral_qmatmul::avx2_table() != nullptr) return corral_qmatmul::avx2_table();
    } else if (want == "avx512" || want.empty()) {
        if (cpu_has_avx512_vnni() && corral_qmatmul::avx512_table() != nullptr) return corral_qmatmul::avx512_table();
    }
    if (want.empty()) return corral_qmatmul::scalar_table();
    PyErr_Format(PyExc_ImportError, "CORRAL_QMATMUL_ISA=%s: this CPU or build has no such variant (scalar, avx2, "
                 "avx512, amx, amx-model)", want.c_str());
    return nullptr;
}

// x's int8 codes, scales and sums per block of 32 (qmatmul.h), in buffers kept per thread between calls.
struct QuantizedRows {
    std::vector<int8_t> xq;
    std::vector<float> scale, sum;
    std::vector<int32_t> isum;

    Activations of(const float* x, int64_t rows, int64_t cols, int threads) {
        const int64_t blocks = cols / corral_qmatmul::BLOCK;
        xq.resize(size_t(rows * cols));
        scale.resize(size_t(rows * blocks));
        sum.resize(size_t(rows * blocks));
        isum.resize(size_t(rows * blocks));
        chosen_q->quantize(x, rows, cols, {xq.data(), scale.data(), sum.data(), isum.data()}, threads);
        return {xq.data(), scale.data(), sum.data(), isum.data(), rows, cols};
    }
};

thread_local QuantizedRows scratch;

// 32 times each block's halves' codes summed, for the Q6 and Q3 tiles' scale per half block (their codes less 32
// or 4) and the Q2 tiles' min per half block, into a buffer kept per thread
void add_halves(Activations& a) {
    static thread_local std::vector<int32_t> halves;
    const int64_t blocks = a.cols / corral_qmatmul::BLOCK;
    halves.resize(size_t(2 * a.rows * blocks));
    for (int64_t i = 0; i < a.rows * blocks; ++i) {
        const int8_t* codes = a.xq + i * corral_qmatmul::BLOCK;
        int32_t first = 0;
        for (int k = 0; k < 16; ++k) first += codes[k];
        halves[size_t(2 * i)] = 32 * first, halves[size_t(2 * i + 1)] = 32 * (a.isum[i] - first);
    }
    a.halves32 = halves.data();
}

corral_qmatmul::Matmul kernel_of(int64_t kind) {
    return kind == 8 ? chosen_q->q8 : kind == 6 ? chosen_q->q6 : kind == 5 ? chosen_q->q5
         : kind == corral_qmatmul::IQ4 ? chosen_q->iq4 : kind == 3 ? chosen_q->q3 : kind == 2 ? chosen_q->q2
         : kind == corral_qmatmul::Q4K ? chosen_q->q4k : kind == corral_qmatmul::Q5K ? chosen_q->q5k
         : kind == corral_qmatmul::IQ4XS ? chosen_q->iq4xs : chosen_q->q4;
}

}  // namespace

void tiles_products(const float* x, int64_t rows, int64_t cols, const ProductPart* parts, int count, int64_t ldy,
                    int threads) {
    Activations a = scratch.of(x, rows, cols, threads);
    int64_t total = 0;  // every part's tiles, one list the threads share
    bool halves = false;
    for (int i = 0; i < count; ++i)
        total += (parts[i].n + 15) / 16, halves = halves || corral_qmatmul::reads_halves(parts[i].kind);
    if (halves) add_halves(a);
    const int64_t blocks = cols / corral_qmatmul::BLOCK;
    #pragma omp parallel num_threads(threads)
    {
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t first = total * me / team, last = total * (me + 1) / team;  // this thread's tiles
        int64_t start = 0;  // the part's first tile in the list
        for (int i = 0; i < count; start += (parts[i].n + 15) / 16, ++i) {
            const int64_t tiles = (parts[i].n + 15) / 16, from = std::max(first, start) - start,
                          to = std::min(last, start + tiles) - start;
            if (from >= to) continue;
            const int64_t bytes = corral_qmatmul::tile_block_bytes(parts[i].kind);
            const int64_t n = std::min(parts[i].n, 16 * to) - 16 * from;  // the last tile may be short
            kernel_of(parts[i].kind)(a, parts[i].tiles + from * blocks * bytes, n, parts[i].y + 16 * from, ldy, 1);
        }
    }
}

void tiles_product(int64_t bits, const float* x, int64_t rows, int64_t cols, const uint8_t* tiles, int64_t n,
                   float* y, int threads, int64_t ldy) {
    Activations a = scratch.of(x, rows, cols, threads);
    if (corral_qmatmul::reads_halves(bits)) add_halves(a);
    kernel_of(bits)(a, tiles, n, y, ldy > 0 ? ldy : n, threads);
}

void tile_row(int64_t bits, const uint8_t* tiles, int64_t blocks, int64_t id, float* out) {
    const int64_t t = id / 16, r = id % 16, bytes = corral_qmatmul::tile_block_bytes(bits);
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* w = tiles + (t * blocks + b) * bytes;
        float* row = out + b * 32;
        if (bits == 8) {
            const float d = corral_qmatmul::half_to_float(w + 512 + 2 * r);
            for (int k = 0; k < 32; ++k) row[k] = d * float(int32_t(w[64 * (k / 4) + 4 * r + k % 4]) - 128);
            continue;
        }
        // Q6: column 8 c + i (i < 4) is the low nibble of chunk c's byte 4 r + i, 8 c + 4 + i its high one; the
        // fifth and sixth bits sit at that byte's bit in the chunk's low-nibble or high-nibble mask
        const float d = corral_qmatmul::half_to_float(w + 384 + 2 * r);
        for (int k = 0; k < 32; ++k) {
            const int c = k / 8, high = (k % 8) / 4, byte = 4 * int(r) + k % 4;
            const uint8_t nibble = high ? w[64 * c + byte] >> 4 : w[64 * c + byte] & 0x0F;
            const int fifth = (w[256 + 16 * c + 8 * high + byte / 8] >> (byte % 8)) & 1;
            const int sixth = (w[320 + 16 * c + 8 * high + byte / 8] >> (byte % 8)) & 1;
            const int code = nibble + 16 * fifth + 32 * sixth;
            const float scale = d * float(int8_t(w[416 + 16 * (k / 16) + r]));  // exact: 11 by 8 bits
            row[k] = float(code - 32) * scale;  // as Q6Blocks.dequantize: one rounding
        }
    }
}

namespace {

// q2_matmul / q3_matmul / q4_matmul / q5_matmul / q6_matmul / q8_matmul / iq4_matmul / q4k_matmul / q5k_matmul /
// iq4xs_matmul(x [M, K] float32, tiles [ceil(N / 16), K / 32, tile bytes] uint8, N, out [M, N] float32, threads):
// out = x W^T (tiles in super-blocks: K a multiple of 256, each tile's super-blocks viewed as K / 32 blocks of
// tile_block_bytes).
template <int bits>
void matmul(nb::handle x_in, nb::handle tiles_in, int64_t n, nb::handle out_in, int threads_in) {
    const Array x(x_in, "x", false), tiles(tiles_in, "tiles", false), out(out_in, "out", true);
    x.expect_ndim(2);
    x.expect_float32();
    tiles.expect_uint8();
    out.expect_float32();
    if (n < 1) fail(PyExc_ValueError, "N must be positive");
    const Py_ssize_t rows = x.dim(0), cols = x.dim(1);
    if (cols % 32 != 0) fail(PyExc_ValueError, "x: K must be a multiple of 32");
    if (corral_qmatmul::in_super_blocks(bits) && cols % 256 != 0)
        fail(PyExc_ValueError, "x: K must be a multiple of 256 for tiles in super-blocks (Q2, Q3, Q4K, Q5K, IQ4XS)");
    tiles.expect_shape({Py_ssize_t((n + 15) / 16), cols / 32, corral_qmatmul::tile_block_bytes(bits)});
    out.expect_shape({rows, Py_ssize_t(n)});
    const int threads = checked_threads(threads_in);
    if (rows > 0) {
        NoGil nogil;
        tiles_product(bits, x.data<const float>(), rows, cols, tiles.data<const uint8_t>(), n, out.data<float>(),
                      threads, n);
    }
}

// tile_rows(tiles [ceil(N / 16), K / 32, 544 or 448] uint8, N, ids [T] int64, out [T, K] float32): the rows ids of
// W, dequantized from Q8 tiles or Q6 tiles (by the tile block's bytes): an embedding lookup in the LM head's tiles.
void tile_rows(nb::handle tiles_in, int64_t n, nb::handle ids_in, nb::handle out_in) {
    const Array tiles(tiles_in, "tiles", false), ids(ids_in, "ids", false), out(out_in, "out", true);
    tiles.expect_ndim(3);
    tiles.expect_uint8();
    ids.expect_ndim(1);
    ids.expect_int64();
    out.expect_float32();
    const Py_ssize_t blocks = tiles.dim(1);
    const int64_t bits = row_tile_bits(tiles.dim(2));
    if (bits == 0) fail(PyExc_ValueError, "tile_rows: tiles must be Q8 (544 bytes a block) or Q6 (448)");
    tiles.expect_shape({Py_ssize_t((n + 15) / 16), blocks, corral_qmatmul::tile_block_bytes(bits)});
    out.expect_shape({ids.dim(0), blocks * 32});
    const int64_t* id = ids.data<const int64_t>();
    for (Py_ssize_t i = 0; i < ids.dim(0); ++i)
        if (id[i] < 0 || id[i] >= n) fail(PyExc_IndexError, "tile_rows: an id outside the rows");
    for (Py_ssize_t i = 0; i < ids.dim(0); ++i)
        tile_row(bits, tiles.data<const uint8_t>(), blocks, id[i], out.data<float>() + i * blocks * 32);
}


}  // namespace

void add_qmatmul(nb::module_& m) {
    chosen_q = choose_q();
    if (chosen_q == nullptr) throw nb::python_error();
    m.attr("qmatmul_isa") = chosen_q->isa;
    // A CPU with AMX whose tiles are not used says why, loudly: the VNNI kernels run instead
    m.attr("qmatmul_amx_refused") = amx_refusal == nullptr ? nb::object(nb::none()) : nb::object(nb::str(amx_refusal));
    if (amx_refusal != nullptr) {
        const std::string warning = std::string("AMX-INT8 tiles not used: ") + amx_refusal + "; running " +
                                    chosen_q->isa + " instead";
        if (PyErr_WarnEx(PyExc_RuntimeWarning, warning.c_str(), 1) != 0) throw nb::python_error();
    }
    m.def("qmatmul_amx_model_agrees", &corral_qmatmul::amx_model_agrees);
    m.def("q2_matmul", &matmul<2>);
    m.def("q3_matmul", &matmul<3>);
    m.def("q4_matmul", &matmul<4>);
    m.def("q5_matmul", &matmul<5>);
    m.def("q6_matmul", &matmul<6>);
    m.def("q8_matmul", &matmul<8>);
    m.def("iq4_matmul", &matmul<corral_qmatmul::IQ4>);
    m.def("q4k_matmul", &matmul<corral_qmatmul::Q4K>);
    m.def("q5k_matmul", &matmul<corral_qmatmul::Q5K>);
    m.def("iq4xs_matmul", &matmul<corral_qmatmul::IQ4XS>);
    m.def("tile_rows", &tile_rows);
}

}  // namespace corral_native

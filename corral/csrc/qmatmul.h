// Quantized matrix products with 8-bit activations: y[M, N] = x[M, K] W[N, K]^T in float32, W as 4-bit (Q4) or
// 8-bit (Q8) codes in blocks of 32 along K, x quantized on the fly to int8 per block of 32 (one scale each), the
// block dot products taken in integers (AMX-INT8 tdpbsud for 16 rows at a time, AVX-512 VNNI vpdpbusd, AVX2
// vpmaddubsw, or scalar), one variant chosen for this CPU when the module loads.
//
// Weights are repacked at load into tiles of 16 output rows, block after block, so that one 64-byte load feeds 16
// rows' dot products and the stream through memory is sequential:
//
//   Q4 tile block (320 bytes): 4 chunks of 64 bytes, then 16 float16 d, then 16 float16 m (w = d q + m, q 0..15).
//     In chunk c, byte 4 r + i holds q[r][8 c + i] in its low nibble and q[r][8 c + 4 + i] in its high one
//     (r: the row in the tile, i: 0..3, the column within the block).
//   Q5 tile block (384 bytes): a Q4 tile block's 4 chunks of the codes' low 4 bits, then 4 x 16 bytes of their
//     fifth bits, then 16 float16 d, then 16 float16 m (w = d q + m, q 0..31). Chunk c's 16 bytes are two 64-bit
//     masks: bit j of the first is the fifth bit of the code in byte j's low nibble, of the second of the code in
//     its high nibble (bytes 256 + 16 c .. + 7, and + 8 .. + 15).
//   Q6 tile block (448 bytes): a Q5 tile block's 4 chunks and fifth-bit masks (the codes' low 5 bits), then 4 x 16
//     bytes of their sixth bits (bytes 320 + 16 c .., laid out as the fifth bits), then 16 float16 d (384), then
//     16 int8 scales of the block's first 16 columns (416: chunks 0 and 1), then 16 of its last 16 (432):
//     w = d sc (q - 32), q 0..63, llama.cpp's Q6_K exactly (its d per 256 columns and scale per 16).
//   Tiles in super-blocks (kinds Q4K, Q5K, IQ4XS, 3 and 2; K a multiple of 256): per 256 columns, as llama.cpp's
//     K-quants keep a d (and dmin) per 256, a 64-byte header of each row's float16 d, then its float16 dmin (32;
//     unused by Q3 and IQ4XS tiles), then the super-block's 8 blocks. Block b of a tile row starts at
//     block_at(kind, b), its header at head_at(kind, b); tile_block_bytes counts a super-block's bytes over its 8
//     blocks (a tile row of K / 32 blocks takes K / 32 times them).
//   Q4K tiles (kind Q4K = 41), llama.cpp's Q4_K as shipped (w = d sc q - dmin mn, q 0..15, a 6-bit scale sc and
//     min mn per 32): a block (288 bytes) is a Q4 tile block's 4 chunks, then 16 uint8 sc (256), then 16 uint8 mn
//     (272). 2368 bytes a super-block, 0.578 bytes a weight where Q4 tiles keep 0.625 (and round d sc to float16).
//   Q5K tiles (kind Q5K = 51), llama.cpp's Q5_K as shipped (the same with q 0..31): a block (352 bytes) is a Q5
//     tile block's 4 chunks and fifth-bit masks, then 16 uint8 sc (320), then 16 uint8 mn (336); 2880 bytes a
//     super-block, 0.703 bytes a weight where Q5 tiles keep 0.75.
//   Q3 tiles (kind 3): a block (224 bytes) is 2 chunks of 64 bytes of the codes' low 2 bits, then 4 x 16 bytes of
//     their third bits (128 + 16 c .., laid out as a Q5 tile block's fifth bits, for the Q4 tile block's chunk c),
//     then 16 int8 scales of the block's first 16 columns (192), then 16 of its last 16 (208): w = d sc (q - 4), q
//     0..7, llama.cpp's Q3_K exactly (its 6-bit scale per 16 less 32). Byte 4 r + i of 2-bit chunk p holds, from
//     its low bits up, the codes a Q4 tile block keeps in the low and high nibbles of chunk 2 p's byte 4 r + i,
//     then those of chunk 2 p + 1's: chunk c's are 4 (c % 2) bits up. 1856 bytes a super-block, 0.453 bytes a
//     weight (llama.cpp 0.430).
//   Q2 tiles (kind 2): a block (160 bytes) is a Q3 tile block's 2 chunks of 2-bit codes, then for each row a byte
//     of the block's first 16 columns' 4-bit scale sc (low nibble) and 4-bit min mn (high nibble) (128), then 16
//     of its last 16 columns' (144): w = d sc q - dmin mn, q 0..3, llama.cpp's Q2_K (a scale and a min per 16).
//     1344 bytes a super-block, 0.328 bytes a weight, as llama.cpp's.
//   IQ4XS tiles (kind IQ4XS = 42), llama.cpp's IQ4_XS as shipped (w = d (sc - 32) IQ4_VALUES[q], a 6-bit scale per
//     32): a block (272 bytes) is a Q4 tile block's 4 chunks of indices, then each row's scale less 32 as an int8
//     (256); the header's dmin half unused. 2240 bytes a super-block, 0.547 bytes a weight where IQ4 tiles keep
//     0.625 (a float32 d (sc - 32) per block; llama.cpp 0.531).
//   Q8 tile block (544 bytes): 8 chunks of 64 bytes, then 16 float16 d (w = d q, q -127..127). In chunk c, byte
//     4 r + i holds q[r][4 c + i] + 128 (an unsigned byte: vpdpbusd multiplies unsigned by signed bytes).
//   IQ4 tile block (320 bytes, kind IQ4 = 40): a Q4 tile block's 4 chunks of 4-bit indices, then 16 float32 d
//     (256): w = d IQ4_VALUES[q], llama.cpp's IQ4_NL and IQ4_XS exactly (its non-linear grid of 16 int8 values;
//     an IQ4_XS block's d is its super-block's float16 d times its 6-bit scale less 32, exact in float32).
//
// Rows past N in the last tile are zero codes; their outputs are not stored.
//
// Activations, per row and block b of 32: s = max|x| / 127, xq = round(x * (127 / max|x|)) (ties to even; all
// zero when max|x| = 0), also isum = the sum of its xq and sum = s * isum. Then
//   Q4, Q5: y[n] = sum_b (d[n,b] s_b (sum_k q xq) + m[n,b] sum_b)
//   Q4K, Q5K: the same with d[n,b] = d sc[n,b] and m[n,b] = -dmin mn[n,b], each exact in float32 (11 by 6 bits)
//   Q8: y[n] = sum_b d[n,b] s_b (sum_k q xq)
//   IQ4: y[n] = sum_b d[n,b] s_b (sum_k IQ4_VALUES[q] xq), the block's sum an exact integer (at most 32 x 127^2)
//   IQ4XS: the same with d[n,b] = d (sc[n,b] - 32), exact in float32 (11 by 6 bits)
//   Q6: y[n] = sum_b d[n,b] s_b sum_h sc[n,b,h] (sum_{k in half h} q xq - 32 isum_h), isum_h the sum of the
//       block's xq over that half (halves32, below, holds 32 isum_h); a block's sum over h in integers (at most
//       2 x 128 x 16 x 32 x 127 < 2^24)
//   Q3: the same with q - 4 (4 isum_h: halves32 / 8) and d[n,b] its super-block's, a block's sum at most 2 x 32 x
//       16 x 4 x 127 < 2^20
//   Q2: y[n] = sum_b s_b (d[n,b] sum_h sc[n,b,h] (sum_{k in half h} q xq) - dmin[n,b] sum_h mn[n,b,h] isum_h)
//       (d and dmin its super-block's),
//       both sums over h in integers (at most 2 x 15 x 16 x 3 x 127 and 2 x 15 x 16 x 127)
// that is W times the quantized x (s xq), exactly (float32 summation order aside). The only error against the
// product with the dequantized weights is x's rounding: at most s_b / 2 per element, so
// |y - y_ref| <= sum_b (s_b / 2) sum_k |W[n, k]|. (Taking the m term over the exact x instead, as this once did,
// breaks that: the d q part alone is all positive, so its rounding errors do not cancel the way those of the
// centred d q + m do; on real activations the error was 1.4-3x larger.)
#pragma once

#include <cstdint>

namespace corral_qmatmul {

constexpr int64_t TILE = 16, BLOCK = 32, Q4_TILE_BYTES = 320, Q5_TILE_BYTES = 384, Q6_TILE_BYTES = 448,
                  Q8_TILE_BYTES = 544, IQ4_TILE_BYTES = 320;
// The kinds of IQ4, Q4K, IQ4XS and Q5K tiles, beside the Q tiles' bits (2, 3, 4, 5, 6, 8) that name theirs.
constexpr int64_t IQ4 = 40, Q4K = 41, IQ4XS = 42, Q5K = 51;
// Tiles in super-blocks: 8 blocks for 16 rows, their header (d, dmin), then each block's bytes.
constexpr int64_t SUPER_BLOCKS = 8, SUPER_HEAD_BYTES = 64, Q4K_BLOCK_BYTES = 288, Q5K_BLOCK_BYTES = 352,
                  Q3_BLOCK_BYTES = 224, Q2_BLOCK_BYTES = 160, IQ4XS_BLOCK_BYTES = 272;
// Whether tiles of kind `bits` keep their blocks in super-blocks of 8 (K a multiple of 256).
constexpr bool in_super_blocks(int64_t bits) {
    return bits == Q4K || bits == Q5K || bits == 3 || bits == 2 || bits == IQ4XS;
}
// A super-block's block bytes (header aside), and its whole bytes, for tiles kept in super-blocks.
constexpr int64_t super_block_body(int64_t bits) {
    return bits == Q5K ? Q5K_BLOCK_BYTES : bits == 3 ? Q3_BLOCK_BYTES : bits == 2 ? Q2_BLOCK_BYTES
         : bits == IQ4XS ? IQ4XS_BLOCK_BYTES : Q4K_BLOCK_BYTES;
}
constexpr int64_t super_block_bytes(int64_t bits) { return SUPER_HEAD_BYTES + SUPER_BLOCKS * super_block_body(bits); }
// llama.cpp's IQ4_NL / IQ4_XS grid: the weight of index q is d IQ4_VALUES[q].
constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// A tile block's bytes for tiles of kind `bits` (2, 3, 4, 5, 6 or 8 bits, IQ4, Q4K or Q5K; tiles in super-blocks:
// a super-block's bytes over its 8 blocks): a tile row of K / 32 blocks takes K / 32 times these.
constexpr int64_t tile_block_bytes(int64_t bits) {
    return in_super_blocks(bits) ? super_block_bytes(bits) / SUPER_BLOCKS : bits == 8 ? Q8_TILE_BYTES
         : bits == 6 ? Q6_TILE_BYTES : bits == 5 ? Q5_TILE_BYTES : bits == IQ4 ? IQ4_TILE_BYTES : Q4_TILE_BYTES;
}
// Where block b of a tile row starts, from the row's start (in a super-block: past its header), and where its
// super-block's header does.
constexpr int64_t block_at(int64_t bits, int64_t b) {
    return in_super_blocks(bits) ? b / SUPER_BLOCKS * super_block_bytes(bits) + SUPER_HEAD_BYTES +
                                   b % SUPER_BLOCKS * super_block_body(bits) : b * tile_block_bytes(bits);
}
constexpr int64_t head_at(int64_t bits, int64_t b) {
    return in_super_blocks(bits) ? b / SUPER_BLOCKS * super_block_bytes(bits) : 0;
}
// Whether products on tiles of kind `bits` read each block's halves' activation sums (Activations::halves32).
constexpr bool reads_halves(int64_t bits) { return bits == 6 || bits == 3 || bits == 2; }

struct Activations {
    const int8_t* xq;    // [M, K]
    const float* scale;  // [M, K / 32]
    const float* sum;    // [M, K / 32]
    const int32_t* isum; // [M, K / 32]
    int64_t rows, cols;
    const int32_t* halves32 = nullptr;  // [M, K / 32, 2]: 32 times each block's halves' xq sums (Q6, Q3, Q2 only)
};

// Where the quantized activations go: the arrays an Activations then reads.
struct QuantizedOut {
    int8_t* xq;
    float* scale;
    float* sum;
    int32_t* isum;
};

// x [rows, cols] float32 to int8 per block of 32, as above. Every variant computes the same float32 operations
// (|x| max, 127 / max, one product and a round to nearest even per element), so for finite x all give the same
// bytes; rows are split between the threads when there are enough of them to pay for the team.
using Quantize = void (*)(const float* x, int64_t rows, int64_t cols, const QuantizedOut& out, int threads);

// The two scalar steps every variant's quantize shares: the multiplier of a block whose largest |x| is amax, and
// the block's scale and sums once its codes (summing to total) are written.
inline float block_inverse(float amax) { return amax > 0.0f ? 127.0f / amax : 0.0f; }
inline void finish_block(const QuantizedOut& out, int64_t at, float amax, int32_t total) {
    out.scale[at] = amax / 127.0f;
    out.sum[at] = (amax / 127.0f) * float(total);  // the quantized block's sum
    out.isum[at] = total;
}

// Whether quantizing rows x cols is worth a thread team (each wake-up costs a few microseconds; a decode row of
// 576 takes well under one).
inline bool quantize_in_parallel(int64_t rows, int64_t cols) { return rows > 1 && rows * cols >= 16384; }

// y[M, ldy] (the first N columns written); tiles [ceil(N / 16), K / 32, tile bytes].
using Matmul = void (*)(const Activations& x, const uint8_t* tiles, int64_t n, float* y, int64_t ldy, int threads);

struct QTable {
    const char* isa;
    Matmul q4;
    Matmul q8;
    Quantize quantize;
    Matmul q5;
    Matmul q6;
    Matmul iq4;
    Matmul q3;
    Matmul q2;
    Matmul q4k;
    Matmul q5k;
    Matmul iq4xs;
};

// A float16 (IEEE half) at p, read without F16C.
float half_to_float(const uint8_t* p);

const QTable* scalar_table();
const QTable* avx2_table();
// The AVX-512 VNNI variant, with or without tile pairs at 1-4 rows as tile_pairs() says (qmatmul_avx512.cpp).
const QTable* avx512_table();
// Whether a decode step's AVX-512 Q4 products of 1-4 rows take a group's two tiles at once: 1 on Intel CPUs, 0
// elsewhere, or what CORRAL_QMATMUL_TILE_PAIRS says (on or off); -1 when that names neither. The products are the
// same bits either way: the choice is speed alone, measured on the CPUs that qmatmul_avx512.cpp names.
int tile_pairs();
// What the CPU runs (false off x86): the VNNI kernels' instructions (AVX-512 F, BW, VL, VNNI), and the tiles'.
bool cpu_has_avx512_vnni();
bool cpu_has_amx_int8();
// The AMX-INT8 tiles (qmatmul_amx.cpp): nullptr, with *why_not saying why, unless this CPU has them, Linux grants
// their state and their load-time check agrees with the VNNI kernels bit for bit.
const QTable* amx_table(const char** why_not);
// The same kernel on a scalar model of its tile instructions (tests only; needs the AVX-512 kernels).
const QTable* amx_model_table();
bool amx_model_agrees();

}  // namespace corral_qmatmul

namespace corral_native {

// With the GIL released: x [rows, cols] float32 quantized per block, times the n rows of tiles of kind `bits` (2, 3,
// 4, 5, 6 or 8 bits, IQ4, IQ4XS, Q4K or Q5K) into y [rows, n] (its rows ldy apart; 0: n), on the kernel this CPU's
// variant has.
void tiles_product(int64_t bits, const float* x, int64_t rows, int64_t cols, const uint8_t* tiles, int64_t n,
                   float* y, int threads, int64_t ldy = 0);
// Several products of the same x, each on its own tiles (of any kind) into its columns of y [rows, ldy], in one
// thread team (a team per product costs each one a wake-up of the threads): the products tiles_product gives,
// bit for bit (a tile's outputs do not depend on which tiles share its call).
struct ProductPart {
    int64_t kind;          // 2, 3, 4, 5, 6 or 8 bits, IQ4, IQ4XS, Q4K or Q5K
    const uint8_t* tiles;  // [ceil(n / 16), cols / 32, tile bytes]
    int64_t n;
    float* y;              // its first column
};
void tiles_products(const float* x, int64_t rows, int64_t cols, const ProductPart* parts, int count, int64_t ldy,
                    int threads);
// Row id of Q8 or Q6 tiles (bits 8 or 6) with `blocks` blocks, dequantized into out [blocks * 32] (for Q6, as
// Q6Blocks.dequantize computes it: (q - 32) (d sc), one rounding).
void tile_row(int64_t bits, const uint8_t* tiles, int64_t blocks, int64_t id, float* out);
// The bits of row tiles (an embedding's or LM head's) whose blocks take `bytes`: 8 (Q8) or 6 (Q6); 0 for neither.
constexpr int64_t row_tile_bits(int64_t bytes) {
    return bytes == corral_qmatmul::Q8_TILE_BYTES ? 8 : bytes == corral_qmatmul::Q6_TILE_BYTES ? 6 : 0;
}

}  // namespace corral_native

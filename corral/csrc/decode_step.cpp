// The native step of a W4A8 Llama model: for a batch of single-query rows (decodes, a draft's rows) and prompt
// spans (a sequence's new tokens, fresh or over cached context), the embedding lookup, every layer (RMSNorm, QKV,
// RoPE, the K/V write into the paged cache, attention, the output projection, RMSNorm, gate/up, SiLU * up, down)
// and the final norm, in one call with the GIL released. Python schedules once per step; the block tables, the
// prefix cache and the guides stay in Python.
//
// It runs exactly the kernels the torch path of the same model runs (corral/engine/model.py with Q4Tiles, Q5Tiles,
// Q6Tiles and Q8Linear linears and the fused ops, float32 activations), in the same order on the same buffers, so its
// hidden states equal that path's bit for bit; tests/engine/test_native_step.py holds it to that.
#include "arrays.h"
#include "common.h"
#include "draws.h"
#include "kernels.h"
#include "qmatmul.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <algorithm>
#include <vector>

namespace corral_native {
namespace {

constexpr int SPEC = 8;  // layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, block_size

// One linear's tiles: Q2, Q3, Q4, Q5, Q6, Q8 (bits 2, 3, 4, 5, 6, 8), IQ4, IQ4XS, Q4K or Q5K tiles, n rows of k.
int64_t tile_bytes(int64_t bits, int64_t n, int64_t k) {
    return (n + 15) / 16 * (k / 32) * corral_qmatmul::tile_block_bytes(bits);
}

// A layer's linear (qkv, o, gate_up or down) as its parts run: one product over all its rows where its parts (Q,
// K and V; gate and up) share a kind, their tiles fused; else a product per part, each into its columns of the
// output, in one thread team (a file that keeps them in different kinds: each runs as shipped). Column for column
// the same products.
struct Linear {
    struct Part {
        int64_t kind, rows, column, start;  // start: its tiles' offset in layer_tiles
    };
    Part parts[3];
    int parts_count = 0;
    int64_t n = 0, k = 0;

    void run(const float* x, int64_t rows, const uint8_t* tiles, float* y, int threads) const {
        if (parts_count == 1) {
            tiles_product(parts[0].kind, x, rows, k, tiles + parts[0].start, n, y, threads);
            return;
        }
        ProductPart each[3];
        for (int i = 0; i < parts_count; ++i)
            each[i] = {parts[i].kind, tiles + parts[i].start, parts[i].rows, y + parts[i].column};
        tiles_products(x, rows, k, each, parts_count, n, threads);
    }
};

// The parts a profile splits a step into (seconds added to timings[part] when a timings buffer is given).
enum Part { EMBED, NORM, MATMUL, ROPE, KV_WRITE, ATTENTION, SILU, LM_HEAD, PARTS };

// A per-row int64 argument: a Python list of ints (what the engine's scheduler holds, read here without a
// conversion through numpy or torch, whose calls cost tens of microseconds after a step has left the caches cold)
// or a 1-dimensional int64 buffer.
struct Ints {
    std::vector<int64_t> owned;
    std::unique_ptr<Array> array;
    const int64_t* data = nullptr;
    Py_ssize_t size = 0;

    Ints(nb::handle in, const char* name) {
        if (PyList_Check(in.ptr())) {
            size = PyList_GET_SIZE(in.ptr());
            owned.resize(size);
            for (Py_ssize_t i = 0; i < size; ++i) owned[i] = exact_int_of(PyList_GET_ITEM(in.ptr(), i));
            data = owned.data();
            return;
        }
        array = std::make_unique<Array>(in, name, false);
        array->expect_ndim(1);
        array->expect_int64();
        size = array->dim(0);
        data = array->data<const int64_t>();
    }
};

// The block tables: an int64 buffer [B, W], or a list of B lists (each sequence's own block table, as long as it
// is), copied here into [B, W] with W the most blocks a row's context needs (its context length plus `extra`
// tokens: a burst's later steps), the rest of a row 0. A list row shorter than its context needs is an error.
struct Tables {
    std::vector<int64_t> owned;
    std::unique_ptr<Array> array;
    const int64_t* data = nullptr;
    int64_t width = 0;

    Tables(nb::handle in, const Ints& lens, int64_t block_size, int64_t extra) {
        const Py_ssize_t B = lens.size;
        if (PyList_Check(in.ptr())) {
            if (PyList_GET_SIZE(in.ptr()) != B) fail(PyExc_ValueError, "tables: one row per sequence");
            std::vector<int64_t> need(B);
            for (Py_ssize_t b = 0; b < B; ++b) {  // each row's blocks, checked against its list before any copy
                PyObject* row = PyList_GET_ITEM(in.ptr(), b);
                if (!PyList_Check(row)) fail(PyExc_TypeError, "tables: a list of lists of block ids expected");
                need[b] = lens.data[b] < 1 ? 0 : (lens.data[b] + extra - 1) / block_size + 1;
                if (PyList_GET_SIZE(row) < need[b])
                    fail(PyExc_IndexError, "decode_step: a context length outside its block table");
                width = std::max(width, need[b]);
            }
            owned.assign(B * width, 0);
            for (Py_ssize_t b = 0; b < B; ++b) {
                PyObject* row = PyList_GET_ITEM(in.ptr(), b);
                for (int64_t j = 0; j < need[b]; ++j) owned[b * width + j] = exact_int_of(PyList_GET_ITEM(row, j));
            }
            data = owned.data();
            return;
        }
        array = std::make_unique<Array>(in, "tables", false);
        array->expect_ndim(2);
        array->expect_int64();
        if (array->dim(0) != B) fail(PyExc_ValueError, "tables: one row per sequence");
        width = array->dim(1);
        data = array->data<const int64_t>();
    }
};

// A prompt span of a step (decode_step's spans): rows [start, end) of the batch are one sequence's new tokens at
// positions num_context - (end - start) .. num_context - 1. Without a table they are its first tokens and attend
// to their own fresh K/V (causal_prefill, reading the float32 QKV rows, as the torch path does); with one, its
// block ids hold every key up to num_context, the span's own just written, and the queries read them from the
// cache (prefill_paged).
struct Span {
    int64_t start, end, num_context;
    std::unique_ptr<Ints> table;
};

std::vector<Span> read_spans(nb::handle in, Py_ssize_t rows, int64_t blocks, int64_t block_size) {
    std::vector<Span> spans;
    if (in.is_none()) return spans;
    if (!PyList_Check(in.ptr())) fail(PyExc_TypeError, "spans: a list of (start, end, table, num_context) expected");
    const Py_ssize_t n = PyList_GET_SIZE(in.ptr());
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* item = PyList_GET_ITEM(in.ptr(), i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4)
            fail(PyExc_TypeError, "spans: a list of (start, end, table, num_context) expected");
        Span span{exact_int_of(PyTuple_GET_ITEM(item, 0)), exact_int_of(PyTuple_GET_ITEM(item, 1)),
                  exact_int_of(PyTuple_GET_ITEM(item, 3)), nullptr};
        const nb::handle table(PyTuple_GET_ITEM(item, 2));
        if (span.start < 0 || span.end > rows || span.end <= span.start || (i > 0 && span.start != spans.back().end))
            fail(PyExc_ValueError, "decode_step: spans must be nonempty, one after another, within the batch");
        const int64_t tokens = span.end - span.start;  // both within [0, rows]: no overflow
        if (table.is_none()) {
            if (span.num_context != tokens)
                fail(PyExc_ValueError, "decode_step: a span without a table must see its own tokens only");
        } else {
            span.table = std::make_unique<Ints>(table, "span table");
            if (span.num_context < tokens || span.num_context > span.table->size * block_size)
                fail(PyExc_IndexError, "decode_step: a span's context outside its block table");
            for (int64_t j = 0; j < (span.num_context + block_size - 1) / block_size; ++j)
                if (span.table->data[j] < 0 || span.table->data[j] >= blocks)
                    fail(PyExc_IndexError, "decode_step: a block id outside the cache");
        }
        spans.push_back(std::move(span));
    }
    if (!spans.empty() && spans.back().end != rows) fail(PyExc_ValueError, "decode_step: the spans must end the batch");
    return spans;
}

// Adds the time since the last mark to a part; a no-op without a timings buffer.
struct Clock {
    double* timings;
    std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
    void mark(Part part) {
        if (timings == nullptr) return;
        const auto now = std::chrono::steady_clock::now();
        timings[part] += std::chrono::duration<double>(now - last).count();
        last = now;
    }
};

// An int8 cache row as corral/engine/quant.py's quantize_int8_rows writes it: the same float32 operations, so the
// same codes and scale.
// The maximum of |x| is taken on the bits (non-negative floats order as their bits do; a NaN wins, as in torch's
// amax), and the clamps are comparisons: both vectorize, where fmax and fmin were calls into libm, 16 times slower.
void quantize_row(const float* x, int64_t n, int8_t* codes, float* scale) {
    uint32_t top = 0;
    for (int64_t i = 0; i < n; ++i) {
        uint32_t bits;
        std::memcpy(&bits, x + i, 4);
        bits &= 0x7FFFFFFFu;
        top = bits > top ? bits : top;
    }
    float amax;
    std::memcpy(&amax, &top, 4);
    const float s = amax / 127.0f, safe = s > 0.0f ? s : 1.0f;
    for (int64_t i = 0; i < n; ++i) {
        const float r = std::nearbyint(x[i] / safe);
        const float low = r >= -127.0f ? r : -127.0f;
        codes[i] = int8_t(low <= 127.0f ? low : 127.0f);
    }
    *scale = s;
}

uint16_t to_bf16(float x) {  // round to nearest even, as torch's .to(torch.bfloat16)
    uint32_t u;
    std::memcpy(&u, &x, 4);
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// decode_step(spec int64 [8], eps, ids [B], positions [B], slots [B], tables, lens [B], embed Q8 tiles [ceil(vocab /
//             16), hidden / 32, 544] (or Q6 tiles, 448), layer tiles (uint8, every layer's qkv, o, gate_up, down, one
//             after another, of the kinds `kinds` gives), norms float32 [2 layers + 1, hidden], cos, sin float32
//             [max_position, head_dim], k_cache, v_cache [layers, blocks, block_size, kv_heads, head_dim] float32,
//             bfloat16 (as int16) or int8, out float32 [B, hidden], threads, timings float64 [8] or None: seconds added
//             per part: embedding, norms, matmuls, RoPE, KV write, attention, SiLU, LM head; k_scale, v_scale float32
//             [layers, blocks, block_size, kv_heads] for an int8 cache, else None; head: the LM head's Q8 tiles [ceil(n
//             / 16), hidden / 32, 544] (or Q6 tiles, 448) and logits float32 [B, n], or both None; steps: how many
//             tokens each sequence decodes (a burst, > 1: with a head, logits [B * steps, n]), pick_columns: the
//             columns each step's greedy pick reads (0: no pick, for a single step only), end_ids: None or token ids (a
//             list of ints or an int64 buffer) that end a burst, interrupt: None or an int64 buffer [1] that ends a
//             burst once nonzero, draws: None (greedy picks) or (temperature, top_k, top_p, min_p: one number per row,
//             uniform: B * steps numbers, step-major) for sample_pick's draws) -> None without a pick, else (picks: B
//             lists of the steps done's token ids, their logprobs: B lists of floats, decided: whether the native pass
//             decided every pick); spans: None or a list of (start, end, table or None, num_context), see Span; kinds:
//             None (every linear Q4 tiles) or int64 [layers, 7]: each of a layer's q, k, v, o, gate, up and down
//             projections as Q2 (2), Q3 (3), Q4 (4), Q5 (5), Q6 (6), Q8 (8), IQ4 (40), Q4K (41), IQ4XS (42) or
//             Q5K tiles (51), in
//             layer_tiles one linear after another (qkv, o, gate_up, down), a linear's parts fused into one tiles
//             buffer where they share a kind, else each its own, in order (see Linear); qkv_bias: None or float32
//             [layers, (heads + 2 kv_heads) head_dim], each layer's QKV bias (Qwen2's), added to the QKV product's
//             rows before RoPE
// ids, positions, slots and lens are int64 buffers or lists of ints; tables an int64 buffer [B, W] or a list of B
// block tables (lists of ints). out gets the final norm's output; with a head, logits get out times the head.
//
// With spans, B counts every row, and only the rows before the first span are single queries, with lens and
// tables (one entry each); the spans take the rest of the batch, one after another, each its own attention call
// per layer. Such a step is a single one, without the LM head (the engine takes the rows it samples from out).
//
// A burst decodes `steps` tokens per sequence in this one call: after each step's LM head (and after a single
// step's, where pick_columns > 0), every row's greedy token (greedy_pick's: the first column at the max of its first pick_columns, with its logprob over them; id 0
// where that pass cannot decide, a NaN or +inf in the row) is picks[b][s] and, but for the last step, the row's
// next input, at the next
// position of its block table. Row b's logits of step s are logits row b * steps + s: the layout of a sequence's
// draft rows, which is what the engine makes of them (the picks but the last are its draft, verified as any is).
// The block tables must cover every step's position; out holds the last step's final norm.
//
// A burst ends early, after the step that gave it cause, where a row's decided pick is one of end_ids (a stop
// token: what follows it would be thrown away) or where interrupt holds a nonzero value when a step ends (another
// thread sets it: a request arrived or left, and should not wait for the rest). Every row then has the same
// number of picks, the steps done, and its logits rows b * steps + s for s below that.
//
// With draws, each step's picks are sample_pick's (no mask, no shaping, no top logprobs) with that step's uniforms:
// a greedy row (temperature 0) gets greedy_pick's token, a sampled row the draw the sampler makes with that
// uniform. A draw the native pass cannot decide (id -1: a NaN or +inf in the row) ends the burst at its step.
nb::object decode_step(nb::handle spec_in, double eps_in, nb::handle ids_in, nb::handle positions_in, nb::handle slots_in,
                 nb::handle tables_in, nb::handle lens_in, nb::handle embed_in, nb::handle layer_tiles_in,
                 nb::handle norms_in, nb::handle cos_in, nb::handle sin_in, nb::handle k_cache_in,
                 nb::handle v_cache_in, nb::handle out_in, int threads_in, nb::handle timings_in,
                 nb::handle k_scale_in, nb::handle v_scale_in, nb::handle head_in, nb::handle logits_in,
                 int64_t steps, int64_t pick_columns, nb::handle end_ids_in, nb::handle interrupt_in,
                 nb::handle draws_in, nb::handle spans_in, nb::handle kinds_in, nb::handle qkv_bias_in) {
    const Array spec_array(spec_in, "spec", false);
    spec_array.expect_shape({SPEC});
    spec_array.expect_int64();
    const int64_t* spec = spec_array.data<const int64_t>();
    const int64_t L = spec[0], H = spec[1], heads = spec[2], kv_heads = spec[3], D = spec[4], I = spec[5],
                  vocab = spec[6], block_size = spec[7];
    for (int i = 0; i < SPEC; ++i)
        if (spec[i] < 1) fail(PyExc_ValueError, "decode_step: spec values must be positive");
    if (H % 32 || I % 32 || (heads * D) % 32 || heads % kv_heads || D % 2)
        fail(PyExc_ValueError, "decode_step: hidden, intermediate and heads x head_dim must be multiples of 32");
    const float eps = float(eps_in);
    const Ints ids(ids_in, "ids"), positions(positions_in, "positions"), slots(slots_in, "slots"),
        lens(lens_in, "lens");
    const Py_ssize_t B = ids.size;
    for (const Ints* a : {&positions, &slots})
        if (a->size != B) fail(PyExc_ValueError, "decode_step: ids, positions and slots differ in length");
    if (steps < 1 || steps > 64) fail(PyExc_ValueError, "decode_step: steps must be 1 to 64");
    const Tables tables(tables_in, lens, block_size, steps - 1);
    const int64_t width = tables.width;
    const Array embed(embed_in, "embed", false), layer_tiles(layer_tiles_in, "layer_tiles", false),
        norms(norms_in, "norms", false), cos(cos_in, "cos", false), sin(sin_in, "sin", false),
        k_cache(k_cache_in, "k_cache", true), v_cache(v_cache_in, "v_cache", true), out(out_in, "out", true);
    embed.expect_uint8();
    embed.expect_ndim(3);  // Q8 tiles, or Q6 tiles (a Q6_K embedding as shipped)
    const int64_t embed_bits = row_tile_bits(embed.dim(2));
    if (embed_bits == 0) fail(PyExc_ValueError, "decode_step: embed must be Q8 tiles (544 bytes a block) or Q6 (448)");
    embed.expect_shape(
        {Py_ssize_t((vocab + 15) / 16), Py_ssize_t(H / 32), corral_qmatmul::tile_block_bytes(embed_bits)});
    const int64_t QKV = (heads + 2 * kv_heads) * D, Q = heads * D, KVW = kv_heads * D;
    norms.expect_float32();  // (first: its rows bound the layer count the tables below are sized by)
    norms.expect_shape({Py_ssize_t(2 * L + 1), Py_ssize_t(H)});
    // each layer's parts' kinds (q, k, v, o, gate, up, down: 2, 3, 4, 5, 6 or 8 bits, IQ4, IQ4XS, Q4K or Q5K)
    std::vector<int64_t> bits(L * 7, 4);
    if (!kinds_in.is_none()) {
        const Array kinds(kinds_in, "kinds", false);
        kinds.expect_shape({Py_ssize_t(L), 7});
        kinds.expect_int64();
        for (int64_t i = 0; i < L * 7; ++i) {
            bits[i] = kinds.data<const int64_t>()[i];
            if (bits[i] != 2 && bits[i] != 3 && bits[i] != 4 && bits[i] != 5 && bits[i] != 6 && bits[i] != 8 &&
                bits[i] != corral_qmatmul::IQ4 && !corral_qmatmul::in_super_blocks(bits[i]))
                fail(PyExc_ValueError,
                     "decode_step: kinds must be 2, 3, 4, 5, 6, 8, 40 (IQ4), 41 (Q4K), 42 (IQ4XS) or 51 (Q5K)");
            const int64_t k = i % 7 == 3 ? heads * D : i % 7 == 6 ? I : H;  // the projection's K
            if (corral_qmatmul::in_super_blocks(bits[i]) && k % 256 != 0)
                fail(PyExc_ValueError,
                     "decode_step: tiles in super-blocks (Q2, Q3, Q4K, Q5K, IQ4XS) need a K that is a multiple of 256");
        }
    }
    const bool has_qkv_bias = !qkv_bias_in.is_none();
    const Array qkv_bias(has_qkv_bias ? qkv_bias_in : spec_in, "qkv_bias", false);
    if (has_qkv_bias) {
        qkv_bias.expect_float32();
        qkv_bias.expect_shape({Py_ssize_t(L), Py_ssize_t(QKV)});
    }
    // each layer's qkv, o, gate_up and down, their tiles one after another in layer_tiles
    const int64_t part_rows[7] = {Q, KVW, KVW, H, I, I, H}, part_k[4] = {H, Q, H, I}, first_part[5] = {0, 3, 4, 6, 7};
    std::vector<Linear> linears(L * 4);
    int64_t offset = 0;
    for (int64_t l = 0; l < L; ++l)
        for (int j = 0; j < 4; ++j) {
            Linear& lin = linears[l * 4 + j];
            const int64_t* kind = bits.data() + l * 7;
            lin.k = part_k[j];
            bool fused = true;
            for (int64_t p = first_part[j]; p < first_part[j + 1]; ++p) {
                lin.n += part_rows[p];
                fused = fused && kind[p] == kind[first_part[j]];
            }
            if (fused) {
                lin.parts[lin.parts_count++] = {kind[first_part[j]], lin.n, 0, offset};
                offset += tile_bytes(kind[first_part[j]], lin.n, lin.k);
                continue;
            }
            for (int64_t p = first_part[j], column = 0; p < first_part[j + 1]; column += part_rows[p++]) {
                lin.parts[lin.parts_count++] = {kind[p], part_rows[p], column, offset};
                offset += tile_bytes(kind[p], part_rows[p], lin.k);
            }
        }
    layer_tiles.expect_uint8();
    layer_tiles.expect_shape({Py_ssize_t(offset)});
    cos.expect_float32();
    cos.expect_ndim(2);
    if (cos.dim(1) != D) fail(PyExc_ValueError, "cos: head_dim columns expected");
    sin.expect_float32();
    sin.expect_shape({cos.dim(0), Py_ssize_t(D)});
    k_cache.expect_ndim(5);
    const int kv_kind = k_cache.cache_kind();
    const int64_t blocks = k_cache.dim(1);
    k_cache.expect_shape({Py_ssize_t(L), Py_ssize_t(blocks), Py_ssize_t(block_size), Py_ssize_t(kv_heads),
                          Py_ssize_t(D)});
    v_cache.expect_shape({Py_ssize_t(L), Py_ssize_t(blocks), Py_ssize_t(block_size), Py_ssize_t(kv_heads),
                          Py_ssize_t(D)});
    v_cache.expect_like(k_cache);
    if (v_cache.cache_kind() != kv_kind) fail(PyExc_TypeError, "k_cache and v_cache differ in dtype");
    const bool has_scales = !k_scale_in.is_none() || !v_scale_in.is_none();
    if (has_scales != (kv_kind == 1)) fail(PyExc_TypeError, "k_scale and v_scale go with an int8 cache, only");
    const std::vector<Span> spans = read_spans(spans_in, B, blocks, block_size);
    const Py_ssize_t decodes = spans.empty() ? B : spans.front().start;  // the single-query rows come first
    if (lens.size != decodes) fail(PyExc_ValueError, "decode_step: lens must have one entry per row before the spans");
    if (!spans.empty() && (steps > 1 || !head_in.is_none()))
        fail(PyExc_TypeError, "decode_step: spans go with a single step without the LM head");
    if (!spans.empty() && D != 64 && D != 128) fail(PyExc_ValueError, "decode_step: spans need head_dim 64 or 128");
    const Array k_scale(has_scales ? k_scale_in : spec_in, "k_scale", has_scales),
        v_scale(has_scales ? v_scale_in : spec_in, "v_scale", has_scales);
    if (has_scales)
        for (const Array* scales : {&k_scale, &v_scale}) {
            scales->expect_float32();
            scales->expect_shape({Py_ssize_t(L), Py_ssize_t(blocks), Py_ssize_t(block_size),
                                  Py_ssize_t(kv_heads)});
        }
    out.expect_float32();
    out.expect_shape({B, Py_ssize_t(H)});
    const int threads = checked_threads(threads_in);
    const bool profiled = !timings_in.is_none();
    const Array timings(profiled ? timings_in : spec_in, "timings", profiled);
    if (profiled) {
        timings.expect_shape({PARTS});
        timings.expect_format('d', 8, "float64");
    }
    const int64_t* table = tables.data;
    // the rows' inputs, positions, slots and lengths: a burst moves each on by one a step
    std::vector<int64_t> id(ids.data, ids.data + B), pos(positions.data, positions.data + B),
        slot(slots.data, slots.data + B), len(lens.data, lens.data + lens.size);
    const bool has_head = !head_in.is_none();
    if (has_head == logits_in.is_none()) fail(PyExc_TypeError, "decode_step: head and logits go together");
    const Array head(has_head ? head_in : spec_in, "head", false), logits(has_head ? logits_in : spec_in, "logits",
                                                                            has_head);
    int64_t head_rows = 0, head_bits = 8;
    if (has_head) {
        logits.expect_float32();
        logits.expect_ndim(2);
        if (logits.dim(0) != B * steps) fail(PyExc_ValueError, "logits: one row per sequence and step");
        head_rows = logits.dim(1);
        head.expect_uint8();
        head.expect_ndim(3);  // Q8 tiles, or Q6 tiles (a Q6_K head as shipped)
        head_bits = row_tile_bits(head.dim(2));
        if (head_bits == 0)
            fail(PyExc_ValueError, "decode_step: head must be Q8 tiles (544 bytes a block) or Q6 (448)");
        head.expect_shape({Py_ssize_t((head_rows + 15) / 16), Py_ssize_t(H / 32),
                           corral_qmatmul::tile_block_bytes(head_bits)});
    }
    const bool burst = steps > 1, picking = burst || pick_columns != 0;
    if (picking && !has_head) fail(PyExc_TypeError, "decode_step: a burst or a pick needs the LM head");
    if (picking && (pick_columns < 1 || pick_columns > head_rows || pick_columns > vocab))
        fail(PyExc_ValueError, "decode_step: pick_columns outside the head's rows or the vocabulary");
    const bool has_ends = !end_ids_in.is_none(), interruptible = !interrupt_in.is_none();
    if ((has_ends || interruptible) && !burst) fail(PyExc_TypeError, "decode_step: end_ids and interrupt end a burst");
    const std::unique_ptr<Ints> end_ids = has_ends ? std::make_unique<Ints>(end_ids_in, "end_ids") : nullptr;
    const int64_t* end_id = has_ends ? end_ids->data : nullptr;
    const Py_ssize_t num_end_ids = has_ends ? end_ids->size : 0;
    const Array interrupt(interruptible ? interrupt_in : spec_in, "interrupt", false);
    if (interruptible) {
        interrupt.expect_shape({1});
        interrupt.expect_int64();
    }
    const int64_t* interrupt_flag = interruptible ? interrupt.data<const int64_t>() : nullptr;
    const bool sampled = !draws_in.is_none();
    if (sampled && !picking) fail(PyExc_TypeError, "decode_step: draws go with a pick");
    if (sampled && (!PyTuple_Check(draws_in.ptr()) || PyTuple_GET_SIZE(draws_in.ptr()) != 5))
        fail(PyExc_TypeError, "decode_step: draws must be (temperature, top_k, top_p, min_p, uniform)");
    auto draw_item = [&](int i) { return nb::handle(sampled ? PyTuple_GET_ITEM(draws_in.ptr(), i) : nullptr); };
    const std::unique_ptr<DrawLists> draws =
        sampled ? std::make_unique<DrawLists>(draw_item(0), draw_item(1), draw_item(2), draw_item(3), draw_item(4), B,
                                              steps, "decode_step")
                : nullptr;
    for (Py_ssize_t b = 0; b < B; ++b) {
        if (id[b] < 0 || id[b] >= vocab) fail(PyExc_IndexError, "decode_step: a token id outside the vocabulary");
        if (pos[b] < 0 || pos[b] + steps - 1 >= cos.dim(0))
            fail(PyExc_IndexError, "decode_step: a position past the table");
        if (slot[b] < 0 || slot[b] >= blocks * block_size)
            fail(PyExc_IndexError, "decode_step: a slot outside the cache");
        if (b >= decodes) continue;
        if (len[b] < 1 || len[b] + steps - 1 > width * block_size)
            fail(PyExc_IndexError, "decode_step: a context length outside its block table");
        if (burst && (slot[b] != table[b * width + pos[b] / block_size] * block_size + pos[b] % block_size
                      || len[b] != pos[b] + 1))
            fail(PyExc_ValueError, "decode_step: a burst's row must be at its position's slot, its length past it");
        for (int64_t j = 0; j < (len[b] + steps - 1 + block_size - 1) / block_size; ++j)
            if (table[b * width + j] < 0 || table[b * width + j] >= blocks)
                fail(PyExc_IndexError, "decode_step: a block id outside the cache");
    }
    if (B == 0) return picking ? nb::object(nb::make_tuple(nb::list(), nb::list(), nb::bool_(true))) : nb::none();
    std::vector<float> h(B * H), normed(B * H), delta(B * H), qkv(B * QKV), q(decodes * Q), attn(B * Q),
        gate_up(B * 2 * I), act(B * I);
    std::vector<int64_t> picks(picking ? B * steps : 0);  // the picks, row by row, and their logprobs
    std::vector<float> pick_logprobs(picking ? B * steps : 0);
    bool decided = true;
    int64_t done = steps;  // the steps made: fewer where the burst ended early
    {
        NoGil nogil;
        Clock clock{profiled ? timings.data<double>() : nullptr};
        const corral_kernels::KernelTable* k = kernel_table();
        const uint8_t* embed_tiles = embed.data<const uint8_t>();
        const float* norm = norms.data<const float>();
        const int64_t layer_cache = blocks * block_size * KVW;
        const float scale = float(std::pow(double(D), -0.5));  // Python's head_dim ** -0.5, as the torch path's
        std::vector<int64_t> picked(picking ? B : 0);
        std::vector<float> picked_logprobs(picking ? B : 0);
        const std::vector<int64_t> no_tops(sampled ? B : 0);  // sampled picks report no top logprobs
        std::vector<int64_t> top_ids(sampled ? B * corral_kernels::TOP_LOGPROBS : 0);
        std::vector<float> top_logprobs(sampled ? B * corral_kernels::TOP_LOGPROBS : 0);
        for (int64_t step = 0; step < steps; ++step) {
            for (Py_ssize_t b = 0; b < B; ++b) tile_row(embed_bits, embed_tiles, H / 32, id[b], h.data() + b * H);
            clock.mark(EMBED);
            bool has_delta = false;
            for (int64_t l = 0; l < L; ++l) {
                const uint8_t* tiles = layer_tiles.data<const uint8_t>();
                const Linear* lin = linears.data() + 4 * l;  // this layer's qkv, o, gate_up, down
                k->add_rms_norm_f32(h.data(), has_delta ? delta.data() : nullptr, norm + 2 * l * H, normed.data(), B,
                                    H, eps, threads);
                clock.mark(NORM);
                lin[0].run(normed.data(), B, tiles, qkv.data(), threads);
                if (has_qkv_bias) {  // each row plus the layer's bias: the torch path's y + bias, the same adds
                    const float* bias = qkv_bias.data<const float>() + l * QKV;
                    for (Py_ssize_t b = 0; b < B; ++b)
                        for (int64_t i = 0; i < QKV; ++i) qkv[b * QKV + i] += bias[i];
                }
                clock.mark(MATMUL);
                k->rope_f32(qkv.data(), QKV, pos.data(), cos.data<const float>(), sin.data<const float>(), B,
                            heads + kv_heads, D, threads);
                clock.mark(ROPE);
                for (Py_ssize_t b = 0; b < B; ++b) {
                    const float* row = qkv.data() + b * QKV;
                    if (b < decodes) std::memcpy(q.data() + b * Q, row, sizeof(float) * Q);
                    const int64_t at = l * layer_cache + slot[b] * KVW;
                    if (kv_kind == 1) {  // per (token, KV head): scale max|x| / 127, codes round(x / scale)
                        const int64_t scale_at = (l * blocks * block_size + slot[b]) * kv_heads;
                        for (int half = 0; half < 2; ++half) {
                            const float* x = row + Q + half * KVW;
                            int8_t* codes = (half ? v_cache : k_cache).data<int8_t>() + at;
                            float* scales = (half ? v_scale : k_scale).data<float>() + scale_at;
                            for (int64_t g = 0; g < kv_heads; ++g)
                                quantize_row(x + g * D, D, codes + g * D, scales + g);
                        }
                    } else if (kv_kind == 4) {
                        std::memcpy(k_cache.data<float>() + at, row + Q, sizeof(float) * KVW);
                        std::memcpy(v_cache.data<float>() + at, row + Q + KVW, sizeof(float) * KVW);
                    } else {
                        uint16_t* kd = k_cache.data<uint16_t>() + at;
                        uint16_t* vd = v_cache.data<uint16_t>() + at;
                        for (int64_t i = 0; i < KVW; ++i)
                            kd[i] = to_bf16(row[Q + i]), vd[i] = to_bf16(row[Q + KVW + i]);
                    }
                }
                clock.mark(KV_WRITE);
                const int64_t scale_layer = l * blocks * block_size * kv_heads;
                if (decodes > 0) {  // the single-query rows, in one call
                    if (kv_kind == 1)
                        k->paged_decode_f32_i8(q.data(), k_cache.data<const int8_t>() + l * layer_cache,
                                               v_cache.data<const int8_t>() + l * layer_cache,
                                               k_scale.data<const float>() + scale_layer,
                                               v_scale.data<const float>() + scale_layer, table, width, len.data(),
                                               attn.data(), decodes, heads, kv_heads, D, block_size, scale, threads);
                    else if (kv_kind == 4)
                        k->paged_decode_f32(q.data(), k_cache.data<const float>() + l * layer_cache,
                                            v_cache.data<const float>() + l * layer_cache, nullptr, nullptr, table,
                                            width, len.data(), attn.data(), decodes, heads, kv_heads, D, block_size,
                                            scale, threads);
                    else
                        k->paged_decode_f32_bf16(q.data(), k_cache.data<const uint16_t>() + l * layer_cache,
                                                 v_cache.data<const uint16_t>() + l * layer_cache, nullptr, nullptr,
                                                 table, width, len.data(), attn.data(), decodes, heads, kv_heads, D,
                                                 block_size, scale, threads);
                }
                for (const Span& span : spans) {
                    const float* qs = qkv.data() + span.start * QKV;
                    float* o = attn.data() + span.start * Q;
                    const int64_t tokens = span.end - span.start;
                    if (span.table == nullptr) {
                        k->causal_prefill(qs, QKV, qs + Q, QKV, qs + Q + KVW, QKV, o, tokens, heads, kv_heads, D,
                                          scale, threads);
                        continue;
                    }
                    corral_kernels::prefill_paged_of_kind(  // kv_kind is also a cache element's bytes
                        k, kv_kind, qs, QKV, k_cache.data<const char>() + l * layer_cache * kv_kind,
                        v_cache.data<const char>() + l * layer_cache * kv_kind,
                        kv_kind == 1 ? k_scale.data<const float>() + scale_layer : nullptr,
                        kv_kind == 1 ? v_scale.data<const float>() + scale_layer : nullptr, span.table->data,
                        span.num_context, o, tokens, heads, kv_heads, D, block_size, scale, threads);
                }
                clock.mark(ATTENTION);
                lin[1].run(attn.data(), B, tiles, delta.data(), threads);
                clock.mark(MATMUL);
                k->add_rms_norm_f32(h.data(), delta.data(), norm + (2 * l + 1) * H, normed.data(), B, H, eps, threads);
                clock.mark(NORM);
                lin[2].run(normed.data(), B, tiles, gate_up.data(), threads);
                clock.mark(MATMUL);
                k->silu_mul_f32(gate_up.data(), act.data(), B, I, threads);
                clock.mark(SILU);
                lin[3].run(act.data(), B, tiles, delta.data(), threads);
                clock.mark(MATMUL);
                has_delta = true;
            }
            k->add_rms_norm_f32(h.data(), delta.data(), norm + 2 * L * H, out.data<float>(), B, H, eps, threads);
            clock.mark(NORM);
            if (has_head) {
                float* step_logits = logits.data<float>() + step * head_rows;
                tiles_product(head_bits, out.data<const float>(), B, H, head.data<const uint8_t>(), head_rows,
                              step_logits, threads, steps * head_rows);
                clock.mark(LM_HEAD);
            }
            if (!picking) break;
            if (sampled)
                k->sample_pick(logits.data<const float>() + step * head_rows, B, steps * head_rows, pick_columns,
                               nullptr, 0, nullptr, draws->params(step), {no_tops.data(), top_ids.data(),
                                                                            top_logprobs.data()},
                               picked.data(), picked_logprobs.data(), threads);
            else
                k->greedy_pick(logits.data<const float>() + step * head_rows, B, steps * head_rows, pick_columns,
                               nullptr, 0, nullptr, picked.data(), picked_logprobs.data(), threads);
            bool ended = step + 1 < steps && interrupt_flag != nullptr &&
                         __atomic_load_n(interrupt_flag, __ATOMIC_RELAXED) != 0;
            for (Py_ssize_t b = 0; b < B && sampled && !ended; ++b) ended = picked[b] < 0;
            for (Py_ssize_t b = 0; b < B && !ended; ++b)
                for (Py_ssize_t e = 0; e < num_end_ids && !ended; ++e) ended = picked[b] == end_id[e];
            if (ended) done = step + 1;
            for (Py_ssize_t b = 0; b < B; ++b) {
                decided = decided && picked[b] >= 0;
                const int64_t token = picked[b] < 0 ? 0 : picked[b];  // undecided: any token, verification decides
                picks[b * steps + step] = token;
                pick_logprobs[b * steps + step] = picked_logprobs[b];
                if (step + 1 == done) continue;
                id[b] = token;
                pos[b] += 1;
                len[b] += 1;
                slot[b] = table[b * width + pos[b] / block_size] * block_size + pos[b] % block_size;
            }
            clock.mark(LM_HEAD);
            if (step + 1 == done) break;
        }
    }
    if (!picking) return nb::none();
    nb::list tokens, logprobs;
    for (Py_ssize_t b = 0; b < B; ++b) {
        nb::list row, row_logprobs;
        for (int64_t step = 0; step < done; ++step) {
            row.append(nb::int_(picks[b * steps + step]));
            row_logprobs.append(nb::float_(pick_logprobs[b * steps + step]));
        }
        tokens.append(row);
        logprobs.append(row_logprobs);
    }
    return nb::make_tuple(tokens, logprobs, nb::bool_(decided));
}


}  // namespace

void add_decode_step(nb::module_& m) {
    m.def("decode_step", &decode_step, nb::arg("spec"), nb::arg("eps"), nb::arg("ids"), nb::arg("positions"),
          nb::arg("slots"), nb::arg("tables"), nb::arg("lens"), nb::arg("embed"), nb::arg("layer_tiles"),
          nb::arg("norms"), nb::arg("cos"), nb::arg("sin"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("out"),
          nb::arg("threads"), nb::arg("timings").none(), nb::arg("k_scale").none(), nb::arg("v_scale").none(),
          nb::arg("head").none() = nb::none(), nb::arg("logits").none() = nb::none(), nb::arg("steps") = 1,
          nb::arg("pick_columns") = 0, nb::arg("end_ids").none() = nb::none(),
          nb::arg("interrupt").none() = nb::none(), nb::arg("draws").none() = nb::none(),
          nb::arg("spans").none() = nb::none(), nb::arg("kinds").none() = nb::none(),
          nb::arg("qkv_bias").none() = nb::none());
}

}  // namespace corral_native

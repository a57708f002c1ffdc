"""The native W4A8 / W8A8 products (``corral/csrc/qmatmul*.cpp``): every instruction-set variant this CPU runs
against the float64 value of the numerics they state (integer block dot products are exact, so only float32
summation order may differ), the stated error bound against the dequantized weights, the tile packing, and the
checks on what Python hands in."""

import os
import platform
import subprocess
import sys

import pytest
import torch

from corral import native
from corral.engine.quant import (IQ4_VALUES, IQ4Blocks, IQ4XSBlocks, Q2Blocks, Q3Blocks, Q4Blocks, Q4KBlocks,
                                 Q5Blocks, Q5KBlocks, Q6Blocks, iq4_reference, k_reference, pack_iq4_tiles,
                                 pack_iq4xs_tiles, pack_q2_tiles, pack_q3_tiles, pack_q4_tiles, pack_q4k_tiles,
                                 pack_q5_tiles, pack_q5k_tiles, pack_q6_tiles, pack_q8_tiles, quantize_activations,
                                 quantize_int4, quantize_q8_blocks, w2a8_reference, w3a8_reference, w4a8_reference,
                                 w6a8_reference, w8a8_reference)
from corral.kernels.cpu_ops import buffer
from tests.kernels.variants import report_in_variant

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(native.module() is None, reason="the native module is off or missing")
# M, N, K; the last two quantize their activations on a thread team (qmatmul.h: quantize_in_parallel)
SHAPES = [(1, 16, 32), (3, 17, 96), (4, 40, 64), (5, 100, 576), (16, 160, 576), (7, 576, 1536), (33, 48, 576),
          (24, 40, 1536)]
FLAGS = native.cpu_flags()
VNNI = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= FLAGS
# amx-model: the AMX kernel on a scalar model of its tile instructions (its epilogue needs AVX-512)
VARIANTS = ["scalar"] + (["avx2"] if {"avx2", "fma", "f16c"} <= FLAGS else []) + \
    (["avx512", "amx-model"] if VNNI else []) + (["amx"] if VNNI and {"amx_tile", "amx_int8"} <= FLAGS else [])


def native_product(kind: str):
    """The product x [M, K] times the ``kind`` tiles' n rows (``native.module().<kind>_matmul``, 2 threads)."""
    def product(x, tiles, n):
        out = torch.empty(x.shape[0], n)
        getattr(native.module(), f"{kind}_matmul")(buffer(x), buffer(tiles), n, buffer(out), 2)
        return out
    return product


q2_product, q3_product, q4_product, q5_product, q6_product, q8_product, iq4_product, q4k_product, q5k_product, \
    iq4xs_product = (native_product(kind) for kind in ("q2", "q3", "q4", "q5", "q6", "q8", "iq4", "q4k", "q5k",
                                                       "iq4xs"))


def random_q5(n: int, k: int) -> Q5Blocks:
    """5-bit codes over every value 0..31, with scales and zeros as a GGUF Q5_1 block's (d and m in float16)."""
    d = (torch.rand(n, k // 32) * 0.02 + 1e-3).half().float()
    m = (-16 * d * (0.5 + torch.rand(n, k // 32))).half().float()
    return Q5Blocks(torch.randint(0, 32, (n, k), dtype=torch.uint8), d, m + 8 * d)


def random_iq4(n: int, k: int) -> IQ4Blocks:
    """Indices over the whole grid, each block's d as an IQ4_XS block's: a float16 d per 256 times a 6-bit scale
    less 32 (exact in float32, not in float16)."""
    d = (torch.rand(n, -(-k // 256)) * 0.002 + 1e-4).half().float().repeat_interleave(8, dim=1)[:, : k // 32]
    scales = torch.randint(0, 64, (n, k // 32)).float() - 32
    return IQ4Blocks(torch.randint(0, 16, (n, k), dtype=torch.uint8), (d * scales).contiguous())


def random_iq4xs(n: int, k: int) -> IQ4XSBlocks:
    """Indices over the whole grid with an IQ4_XS tensor's float16 d per 256 and 6-bit scale less 32 per 32 over its
    whole range (k a multiple of 256)."""
    return IQ4XSBlocks(torch.randint(0, 16, (n, k), dtype=torch.uint8),
                       (torch.rand(n, k // 256) * 0.002 + 1e-4).half().float(),
                       torch.randint(-32, 32, (n, k // 32), dtype=torch.int8))


def w8_terms(x, values: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """sum_b |d s_b (v . xq)| for weights ``values`` (float64 [N, K]) with a ``d`` per block of 32."""
    xq, scale, _ = (t.double() for t in quantize_activations(x))
    (m, k), n = x.shape, values.shape[0]
    dots = torch.einsum("abk,nbk->anb", xq.view(m, k // 32, 32), values.view(n, k // 32, 32)).abs()
    return torch.einsum("anb,nb,ab->an", dots, d.double().abs(), scale)


def random_q6(n: int, k: int) -> Q6Blocks:
    """6-bit codes over every value 0..63 with int8 scales over their whole range per 16 and a float16 d per 256
    (repeated per block of 32), as a GGUF Q6_K tensor's."""
    d = (torch.rand(n, -(-k // 256)) * 0.002 + 1e-4).half().float().repeat_interleave(8, dim=1)[:, : k // 32]
    return Q6Blocks(torch.randint(0, 64, (n, k), dtype=torch.uint8), d.contiguous(),
                    torch.randint(-128, 128, (n, k // 16), dtype=torch.int8))


def per_super_block(n: int, k: int) -> torch.Tensor:
    """A float16 value per row and super-block of 256 along k (a multiple of 256), repeated over its 8 blocks of 32,
    as Q3 and Q2 blocks hold a GGUF K-quant's d and dmin (distinct super-blocks' show one read with another's)."""
    return (torch.rand(n, k // 256) * 0.002 + 1e-4).half().float().repeat_interleave(8, dim=1).contiguous()


def random_q3(n: int, k: int) -> Q3Blocks:
    """3-bit codes over every value 0..7 with scales over a Q3_K's whole range (6 bits less 32) per 16 and a
    float16 d per super-block of 256 (k a multiple of 256)."""
    return Q3Blocks(torch.randint(0, 8, (n, k), dtype=torch.uint8), per_super_block(n, k),
                    torch.randint(-32, 32, (n, k // 16), dtype=torch.int8))


def random_q2(n: int, k: int) -> Q2Blocks:
    """2-bit codes over every value 0..3 with 4-bit scales and mins over their whole range per 16 and a float16 d and
    dmin per super-block of 256 (k a multiple of 256)."""
    return Q2Blocks(torch.randint(0, 4, (n, k), dtype=torch.uint8), per_super_block(n, k), per_super_block(n, k),
                    torch.randint(0, 16, (n, k // 16), dtype=torch.uint8),
                    torch.randint(0, 16, (n, k // 16), dtype=torch.uint8))


def random_k(n: int, k: int, bits: int = 4) -> Q4KBlocks | Q5KBlocks:
    """``bits``-bit codes (4 or 5) over every value with 6-bit scales and mins over their whole range per 32 and a
    float16 d and dmin per 256, as a GGUF Q4_K or Q5_K tensor's (k a multiple of 256)."""
    supers = k // 256
    return (Q4KBlocks if bits == 4 else Q5KBlocks)(torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8),
                                                   (torch.rand(n, supers) * 0.002 + 1e-4).half().float(),
                                                   (torch.rand(n, supers) * 0.002 + 1e-4).half().float(),
                                                   torch.randint(0, 64, (n, k // 32), dtype=torch.uint8),
                                                   torch.randint(0, 64, (n, k // 32), dtype=torch.uint8))


def k_terms(x, blocks: Q4KBlocks | Q5KBlocks) -> torch.Tensor:
    """sum_b |d sc_b s_b (q . xq)| + |dmin mn_b sum_b|: the magnitude a Q4K or Q5K product's float32 rounding scales
    with."""
    return q4_terms(x, blocks.as_q4() if isinstance(blocks, Q4KBlocks) else blocks.as_q5())


def q2_terms(x, blocks: Q2Blocks) -> torch.Tensor:
    """sum_b sum_h (|d sc_h s_b (q . xq)_h| + |dmin mn_h s_b isum_h|): the magnitude a Q2 product's float32
    rounding scales with."""
    xq, scale, _ = (t.double() for t in quantize_activations(x))
    (m, k), n = x.shape, blocks.codes.shape[0]
    xh = xq.view(m, k // 16, 16)
    sc = blocks.d.double().repeat_interleave(2, dim=1) * blocks.sc.double()
    mn = blocks.dmin.double().repeat_interleave(2, dim=1) * blocks.mn.double()
    s = scale.repeat_interleave(2, dim=1)
    dots = torch.einsum("ahk,nhk->anh", xh, blocks.codes.double().view(n, k // 16, 16)).abs()
    return torch.einsum("anh,nh,ah->an", dots, sc, s) + torch.einsum("ah,nh,ah->an", xh.sum(-1).abs(), mn, s)


def summation_bound(terms: torch.Tensor, blocks: int) -> torch.Tensor:
    """float32 accumulation of ``blocks`` block terms (each a product and an FMA): (2 B + 8) u sum |terms|."""
    return (2 * blocks + 8) * 2.0 ** -24 * terms


def q4_terms(x, blocks: Q4Blocks) -> torch.Tensor:
    """sum_b |d s_b (q . xq)| + |m sum_b|: the magnitude the float32 rounding scales with."""
    codes, scale, sums = (t.double() for t in quantize_activations(x))
    n, k = blocks.codes.shape
    q = blocks.codes.double().view(n, k // 32, 32)
    d = blocks.scale.to(torch.float16).double()
    m = (blocks.zero.float() - 8 * blocks.scale.float()).to(torch.float16).double()
    dots = torch.einsum("abk,nbk->anb", codes, q).abs()
    return torch.einsum("anb,nb,ab->an", dots, d.abs(), scale) + sums.abs() @ m.abs().T


@pytest.mark.parametrize("m, n, k", SHAPES)
def test_q4_equals_its_stated_numerics(m, n, k):
    torch.manual_seed(m * 1000 + n + k)
    blocks = quantize_int4(torch.randn(n, k), 32)
    x = torch.randn(m, k) * torch.rand(m, 1) * 4
    x[0, :32] = 0  # an all-zero block: scale 0, codes 0
    got = q4_product(x, pack_q4_tiles(blocks), n)
    bound = summation_bound(q4_terms(x, blocks), k // 32).float()
    assert ((got - w4a8_reference(x, blocks)).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("m, n, k", SHAPES)
def test_q4_error_against_the_dequantized_weights_is_within_the_stated_bound(m, n, k):
    """|y - x W_deq^T| <= sum_b (s_b / 2) sum_k |W| (each activation off by at most half its block's step)."""
    torch.manual_seed(7 + n)
    blocks = quantize_int4(torch.randn(n, k), 32)
    x = torch.randn(m, k)
    d = blocks.scale.to(torch.float16).float()
    m_ = (blocks.zero.float() - 8 * blocks.scale.float()).to(torch.float16).float()
    weights = blocks.codes.float() * d.repeat_interleave(32, 1) + m_.repeat_interleave(32, 1)
    exact = x.double() @ weights.double().T
    _, scale, _ = quantize_activations(x)
    step = torch.einsum("ab,nb->an", scale.double() / 2, weights.double().abs().view(n, k // 32, 32).sum(-1))
    got = q4_product(x, pack_q4_tiles(blocks), n).double()
    assert ((got - exact).abs() <= step * (1 + 1e-5) + 1e-4 * exact.abs().max()).all()
    # and it is the product with the quantized activations (s xq), to float32 rounding
    codes, scale_, _ = quantize_activations(x)
    quantized = (codes * scale_[..., None]).view(m, k).double() @ weights.double().T
    assert torch.allclose(got, quantized, rtol=1e-5, atol=1e-4 * float(exact.abs().max()))


def q6_terms(x, blocks: Q6Blocks, offset: int = 32) -> torch.Tensor:
    """sum_b sum_h |d sc_h s_b (q - 32) . xq|: the magnitude a Q6 product's float32 rounding scales with (a Q3
    product's with ``offset`` 4)."""
    xq, scale, _ = (t.double() for t in quantize_activations(x))
    (m, k), n = x.shape, blocks.codes.shape[0]
    halves = (blocks.codes.double() - offset).view(n, k // 16, 16)
    sc = blocks.d.double().repeat_interleave(2, dim=1) * blocks.sc.double()
    return torch.einsum("anh,nh,ah->an", torch.einsum("ahk,nhk->anh", xq.view(m, k // 16, 16), halves).abs(),
                        sc.abs(), scale.repeat_interleave(2, dim=1))


@pytest.mark.parametrize("kind", ["q5", "q6", "iq4", "q3", "q2", "q4k", "q5k", "iq4xs"])
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_q5_q6_iq4_q3_q2_q4k_q5k_and_iq4xs_equal_their_stated_numerics(kind, m, n, k):
    """Q5 tiles: the Q4 numerics (``sum_b d s_b (q . xq) + m sum_b``) with codes up to 31. Q6 tiles:
    ``sum_b sum_h d sc_h s_b (q . xq - 32 isum_h)``, each half block of 16 with its own scale. IQ4 tiles:
    ``sum_b d s_b (IQ4_VALUES[q] . xq)``. Q3 tiles: Q6's with codes 0..7 less 4. Q2 tiles:
    ``sum_b s_b (d sum_h sc_h (q . xq)_h - dmin sum_h mn_h isum_h)``. Q4K and Q5K tiles: the Q4 numerics with
    ``d sc`` and ``-dmin mn``. IQ4XS tiles: IQ4's with ``d (sc - 32)``. Tiles in super-blocks (Q3, Q2, Q4K, Q5K,
    IQ4XS): K rounded up to whole super-blocks of 256."""
    seed = ("q5", "q6", "iq4", "q3", "q2", "q4k", "q5k", "iq4xs").index(kind)
    torch.manual_seed(m * 31 + n + k + seed)
    k = -(-k // 256) * 256 if kind in ("q3", "q2", "q4k", "q5k", "iq4xs") else k
    x = torch.randn(m, k) * torch.rand(m, 1) * 4
    x[0, :32] = 0
    if kind == "iq4xs":
        shipped = random_iq4xs(n, k)
        blocks = shipped.as_iq4()  # the product's numerics: IQ4's with each block's d = d (sc - 32)
        got, want = iq4xs_product(x, pack_iq4xs_tiles(shipped), n), iq4_reference(x, blocks)
        values = torch.tensor(IQ4_VALUES, dtype=torch.float64)[blocks.codes.long()]
        bound = summation_bound(w8_terms(x, values, blocks.d), k // 32)
    elif kind in ("q4k", "q5k"):
        blocks = random_k(n, k, bits=int(kind[1]))
        product, pack = (q4k_product, pack_q4k_tiles) if kind == "q4k" else (q5k_product, pack_q5k_tiles)
        got, want = product(x, pack(blocks), n), k_reference(x, blocks)
        bound = summation_bound(k_terms(x, blocks), k // 32)
    elif kind == "iq4":
        blocks = random_iq4(n, k)
        got, want = iq4_product(x, pack_iq4_tiles(blocks), n), iq4_reference(x, blocks)
        values = torch.tensor(IQ4_VALUES, dtype=torch.float64)[blocks.codes.long()]
        bound = summation_bound(w8_terms(x, values, blocks.d), k // 32)
    elif kind == "q2":
        blocks = random_q2(n, k)
        got, want = q2_product(x, pack_q2_tiles(blocks), n), w2a8_reference(x, blocks)
        bound = summation_bound(q2_terms(x, blocks), k // 16)
    elif kind == "q3":
        blocks = random_q3(n, k)
        got, want = q3_product(x, pack_q3_tiles(blocks), n), w3a8_reference(x, blocks)
        bound = summation_bound(q6_terms(x, blocks, offset=4), k // 16)
    elif kind == "q5":
        blocks = random_q5(n, k)
        got, want = q5_product(x, pack_q5_tiles(blocks), n), w4a8_reference(x, blocks)
        bound = summation_bound(q4_terms(x, blocks), k // 32)
    else:
        blocks = random_q6(n, k)
        got, want = q6_product(x, pack_q6_tiles(blocks), n), w6a8_reference(x, blocks)
        bound = summation_bound(q6_terms(x, blocks), k // 16)
    assert ((got - want).abs() <= bound.float() + 1e-30).all()


def code_in_tile(w: torch.Tensor, r: int, col: int, bits: int) -> int:
    """The code of row r, column col of a tile block ``w`` with ``bits`` (2 to 6), read as the kernels read it
    (qmatmul.h): its low 4 bits from its nibble, its fifth (and sixth) from its chunk's masks; with 2 or 3 bits, its
    low 2 bits from 2-bit chunk c // 2, 4 (c % 2) bits up from where the nibble would be, and a third bit from
    its chunk's masks."""
    c, within = divmod(col, 8)
    half, i = divmod(within, 4)
    j = 4 * r + i
    if bits <= 3:
        code = (int(w[64 * (c // 2) + j]) >> (4 * (c % 2) + 2 * half)) & 3
        return code | (((int(w[128 + 16 * c + 8 * half + j // 8]) >> (j % 8)) & 1) << 2 if bits == 3 else 0)
    code = (int(w[64 * c + j]) >> (4 * half)) & 0x0F
    for bit, masks in ((4, 256), (5, 320))[: bits - 4]:
        code |= ((int(w[masks + 16 * c + 8 * half + j // 8]) >> (j % 8)) & 1) << bit
    return code


def tile_blocks(tiles: torch.Tensor, n: int, k: int):
    """(row, its place r in its tile, block b, that tile's block b) for every row and block of ``tiles``."""
    for row in range(n):
        t, r = divmod(row, 16)
        for b in range(k // 32):
            yield row, r, b, tiles[t, b]


# the bytes of a block of tiles in super-blocks (qmatmul.h), by their codes' bits (IQ4XS tiles: "iq4xs")
SUPER_BODY = {2: 160, 3: 224, 4: 288, 5: 352, "iq4xs": 272}


def super_tile_blocks(tiles: torch.Tensor, n: int, k: int, bits: int):
    """(row, its place r in its tile, block b, that tile's block b, its super-block's 64-byte header) for every row
    and block of tiles in super-blocks (Q2, Q3, Q4K, Q5K or IQ4XS tiles: ``bits`` 2, 3, 4, 5 or "iq4xs")."""
    body = SUPER_BODY[bits]
    flat = tiles.reshape(tiles.shape[0], k // 256, 64 + 8 * body)  # [tile, super-block, bytes]
    for row in range(n):
        t, r = divmod(row, 16)
        for b in range(k // 32):
            s, j = divmod(b, 8)
            yield row, r, b, flat[t, s, 64 + body * j: 64 + body * (j + 1)], flat[t, s, :64]


def packed_with_every_code(bits: int, seed: int, n: int = 20, k: int = 64):
    """Random Q2, Q3, Q5 or Q6 blocks [n, k] (Q2, Q3: k a multiple of 256), every code among them, and their tiles,
    each code checked to read back from the tiles."""
    torch.manual_seed(seed)
    random, pack, size = {2: (random_q2, pack_q2_tiles, 168), 3: (random_q3, pack_q3_tiles, 232),
                          5: (random_q5, pack_q5_tiles, 384), 6: (random_q6, pack_q6_tiles, 448)}[bits]
    blocks = random(n, k)
    tiles = pack(blocks)
    assert tiles.shape == (-(-n // 16), k // 32, size) and tiles.dtype == torch.uint8
    assert set(blocks.codes.flatten().tolist()) == set(range(2 ** bits))
    places = super_tile_blocks(tiles, n, k, bits) if bits <= 3 else tile_blocks(tiles, n, k)
    for row, r, b, w, *_ in places:
        assert [code_in_tile(w, r, col, bits) for col in range(32)] == blocks.codes[row, 32 * b: 32 * b + 32].tolist()
    return blocks, tiles


def test_q6_tiles_hold_every_code_and_scale_and_give_each_weight_back():
    """The tile bytes read back, as the kernels read them (qmatmul.h): each code's low 4 bits from its nibble, its
    fifth and sixth bits from its chunk's masks, d as float16 and each half block's int8 scale; and one activation
    picks out a column's weight, d sc (q - 32), in either half of a block."""
    n, k = 20, 64
    blocks, tiles = packed_with_every_code(6, seed=6, n=n, k=k)
    for row, r, b, w in tile_blocks(tiles, n, k):
        assert float(w[384 + 2 * r: 386 + 2 * r].view(torch.float16).float()) == float(blocks.d[row, b])
        for h in range(2):
            assert int(w[416 + 16 * h + r: 417 + 16 * h + r].view(torch.int8)) == int(blocks.sc[row, 2 * b + h])
    dense = blocks.dequantize()
    for col in (3, 20, 45):  # first half, second half, the next block
        x = torch.zeros(1, k)
        x[0, col] = 1.0  # code 127 at scale 1/127
        assert torch.allclose(q6_product(x, tiles, n)[0], dense[:, col] * (127 * (1 / 127)), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="0..63"):
        pack_q6_tiles(Q6Blocks(torch.full((16, 32), 64, dtype=torch.uint8), torch.ones(16, 1),
                               torch.ones(16, 2, dtype=torch.int8)))


def test_iq4_tiles_hold_every_index_and_d_and_give_each_weight_back():
    """The tile bytes read back, as the kernels read them (qmatmul.h): each index from its nibble, each row's d as
    float32; and one activation picks out a column's weight, d IQ4_VALUES[q], the whole grid among them."""
    torch.manual_seed(12)
    n, k = 20, 64
    blocks = random_iq4(n, k)
    tiles = pack_iq4_tiles(blocks)
    assert tiles.shape == (2, 2, 320) and tiles.dtype == torch.uint8
    assert set(blocks.codes.flatten().tolist()) == set(range(16))
    for row, r, b, w in tile_blocks(tiles, n, k):
        assert [code_in_tile(w, r, col, 4) for col in range(32)] == blocks.codes[row, 32 * b: 32 * b + 32].tolist()
        assert float(w[256 + 4 * r: 260 + 4 * r].view(torch.float32)) == float(blocks.d[row, b])
    dense = blocks.dequantize()
    for col in (3, 20, 45):
        x = torch.zeros(1, k)
        x[0, col] = 1.0  # code 127 at scale 1/127
        assert torch.allclose(iq4_product(x, tiles, n)[0], dense[:, col], rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="0..15"):
        pack_iq4_tiles(IQ4Blocks(torch.full((16, 32), 16, dtype=torch.uint8), torch.ones(16, 1)))


def test_iq4xs_tiles_hold_every_index_d_and_scale_and_give_each_weight_back():
    """The tile bytes read back, as the kernels read them (qmatmul.h): each index from its nibble, each row's d as
    float16 in its super-block's header and its block's scale less 32 as an int8; and one activation picks out a
    column's weight, d (sc - 32) IQ4_VALUES[q], exactly (as llama.cpp's dequantization rounds it), the whole grid
    and every scale among them."""
    torch.manual_seed(16)
    n, k = 20, 512
    blocks = random_iq4xs(n, k)
    blocks.sc.view(-1)[:64] = torch.arange(-32, 32)
    tiles = pack_iq4xs_tiles(blocks)
    assert tiles.shape == (2, 16, 280) and tiles.dtype == torch.uint8
    assert set(blocks.codes.flatten().tolist()) == set(range(16)) and set(blocks.sc.flatten().tolist()) == set(
        range(-32, 32))
    for row, r, b, w, head in super_tile_blocks(tiles, n, k, "iq4xs"):
        assert [code_in_tile(w, r, col, 4) for col in range(32)] == blocks.codes[row, 32 * b: 32 * b + 32].tolist()
        assert float(head[2 * r: 2 * r + 2].view(torch.float16).float()) == float(blocks.d[row, b // 8])
        assert int(w[256 + r: 257 + r].view(torch.int8)) == int(blocks.sc[row, b])
    dense = blocks.dequantize()
    x = torch.eye(k)  # row i: code 127 at scale 1/127 in column i alone
    assert torch.allclose(iq4xs_product(x, tiles, n), dense.T, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="-32..31"):
        pack_iq4xs_tiles(IQ4XSBlocks(torch.ones((16, 256), dtype=torch.uint8), torch.ones(16, 1),
                                     torch.full((16, 8), 32, dtype=torch.int8)))
    with pytest.raises(ValueError, match="super-blocks of 256"):
        pack_iq4xs_tiles(IQ4XSBlocks(torch.ones((16, 96), dtype=torch.uint8), torch.ones(16, 1),
                                     torch.ones((16, 3), dtype=torch.int8)))


def test_q3_tiles_hold_every_code_and_scale_and_give_each_weight_back():
    """The tile bytes read back, as the kernels read them (qmatmul.h): each code's low 2 bits from its 2-bit chunk
    (the Q4 tile block's chunk c in chunk c // 2, 4 (c % 2) bits up), its third bit from its chunk's masks, d as
    float16 in its super-block's header and each half block's int8 scale; and one activation picks out a column's
    weight, d sc (q - 4), in either half of a block, every code among them. Blocks of one super-block that differ in
    d are refused (the tiles keep one per 256 columns, as Q3_K does)."""
    n, k = 20, 512
    blocks, tiles = packed_with_every_code(3, seed=13, n=n, k=k)
    for row, r, b, w, head in super_tile_blocks(tiles, n, k, 3):
        assert float(head[2 * r: 2 * r + 2].view(torch.float16).float()) == float(blocks.d[row, b])
        for h in range(2):
            assert int(w[192 + 16 * h + r: 193 + 16 * h + r].view(torch.int8)) == int(blocks.sc[row, 2 * b + h])
    dense = blocks.dequantize()
    for col in range(k):
        x = torch.zeros(1, k)
        x[0, col] = 1.0  # code 127 at scale 1/127
        assert torch.allclose(q3_product(x, tiles, n)[0], dense[:, col], rtol=1e-6, atol=0), col
    with pytest.raises(ValueError, match="0..7"):
        pack_q3_tiles(Q3Blocks(torch.full((16, 256), 8, dtype=torch.uint8), torch.ones(16, 8),
                               torch.ones(16, 16, dtype=torch.int8)))
    with pytest.raises(ValueError, match="one d per super-block"):
        pack_q3_tiles(Q3Blocks(torch.ones((16, 256), dtype=torch.uint8), torch.arange(8.0).repeat(16, 1),
                               torch.ones(16, 16, dtype=torch.int8)))
    with pytest.raises(ValueError, match="super-blocks of 256"):
        pack_q3_tiles(Q3Blocks(torch.ones((16, 96), dtype=torch.uint8), torch.ones(16, 3),
                               torch.ones(16, 6, dtype=torch.int8)))


def test_q2_tiles_hold_every_code_scale_and_min_and_give_each_weight_back():
    """The tile bytes read back, as the kernels read them (qmatmul.h): each code from its 2-bit chunk, d and dmin as
    float16 in its super-block's header, each half block's scale and min in one byte's low and high nibbles; and one
    activation picks out a column's weight, d sc q - dmin mn (to float32 rounding: two products where llama.cpp
    rounds once), in either half of a block, every code among them. Blocks of one super-block that differ in dmin
    are refused (the tiles keep one per 256 columns, as Q2_K does)."""
    n, k = 20, 256
    blocks, tiles = packed_with_every_code(2, seed=14, n=n, k=k)
    for row, r, b, w, head in super_tile_blocks(tiles, n, k, 2):
        assert float(head[2 * r: 2 * r + 2].view(torch.float16).float()) == float(blocks.d[row, b])
        assert float(head[32 + 2 * r: 34 + 2 * r].view(torch.float16).float()) == float(blocks.dmin[row, b])
        for h in range(2):
            both = int(w[128 + 16 * h + r])
            assert (both & 15, both >> 4) == (int(blocks.sc[row, 2 * b + h]), int(blocks.mn[row, 2 * b + h]))
    dense = blocks.dequantize()
    # both terms' size, which their rounding scales with (a weight may be their small difference)
    terms = (blocks.d.repeat_interleave(2, 1) * blocks.sc + blocks.dmin.repeat_interleave(2, 1) * blocks.mn) * 3
    for col in range(k):
        x = torch.zeros(1, k)
        x[0, col] = 1.0  # code 127 at scale 1/127
        got = q2_product(x, tiles, n)[0]
        assert ((got - dense[:, col]).abs() <= 2.0 ** -21 * terms[:, col // 16]).all(), col
    with pytest.raises(ValueError, match="0..3"):
        pack_q2_tiles(Q2Blocks(torch.full((16, 256), 4, dtype=torch.uint8), torch.ones(16, 8), torch.ones(16, 8),
                               torch.ones(16, 16, dtype=torch.uint8), torch.ones(16, 16, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="0..15"):
        pack_q2_tiles(Q2Blocks(torch.ones((16, 256), dtype=torch.uint8), torch.ones(16, 8), torch.ones(16, 8),
                               torch.ones(16, 16, dtype=torch.uint8), torch.full((16, 16), 16, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="one dmin per super-block"):
        pack_q2_tiles(Q2Blocks(torch.ones((16, 256), dtype=torch.uint8), torch.ones(16, 8),
                               torch.arange(8.0).repeat(16, 1), torch.ones(16, 16, dtype=torch.uint8),
                               torch.ones(16, 16, dtype=torch.uint8)))


@pytest.mark.parametrize("bits", [4, 5])
def test_q4k_and_q5k_tiles_hold_every_code_scale_and_min_and_give_each_weight_back(bits):
    """The tile bytes read back, as the kernels read them (qmatmul.h): per tile and super-block of 8 blocks, each
    row's d and dmin as float16 in its 64-byte header, then each block's codes as a Q4 (Q5) tile block's and each
    row's 6-bit scale and min as a byte; and one activation picks out a column's weight, d sc q - dmin mn (to float32
    rounding: two products where llama.cpp rounds once), every code, scale and min among them."""
    torch.manual_seed(15 + bits)
    n, k = 20, 512
    blocks = random_k(n, k, bits)
    blocks.sc.view(-1)[:64], blocks.mn.view(-1)[:64] = torch.arange(64), torch.randperm(64)  # every one, surely
    pack, product = (pack_q4k_tiles, q4k_product) if bits == 4 else (pack_q5k_tiles, q5k_product)
    tiles = pack(blocks)
    assert tiles.shape == (2, 16, (64 + 8 * SUPER_BODY[bits]) // 8) and tiles.dtype == torch.uint8
    assert set(blocks.codes.flatten().tolist()) == set(range(1 << bits))
    assert set(blocks.sc.flatten().tolist()) == set(blocks.mn.flatten().tolist()) == set(range(64))
    scales = SUPER_BODY[bits] - 32
    for row, r, b, w, head in super_tile_blocks(tiles, n, k, bits):
        assert float(head[2 * r: 2 * r + 2].view(torch.float16).float()) == float(blocks.d[row, b // 8])
        assert float(head[32 + 2 * r: 34 + 2 * r].view(torch.float16).float()) == float(blocks.dmin[row, b // 8])
        assert [code_in_tile(w, r, col, bits) for col in range(32)] == blocks.codes[row, 32 * b: 32 * b + 32].tolist()
        assert (int(w[scales + r]), int(w[scales + 16 + r])) == (int(blocks.sc[row, b]), int(blocks.mn[row, b]))
    dense = blocks.dequantize()
    sc = blocks.d.repeat_interleave(8, 1) * blocks.sc
    terms = (((1 << bits) - 1) * sc + blocks.dmin.repeat_interleave(8, 1) * blocks.mn).repeat_interleave(32, 1)
    x = torch.zeros(k, k)
    x[torch.arange(k), torch.arange(k)] = 1.0  # row i: code 127 at scale 1/127 in column i alone
    got = product(x, tiles, n)
    assert bool(((got - dense.T).abs() <= 2.0 ** -21 * terms.T).all())
    kind, top = type(blocks), (1 << bits) - 1
    with pytest.raises(ValueError, match=f"0..{top}"):
        pack(kind(torch.full((16, 256), top + 1, dtype=torch.uint8), torch.ones(16, 1), torch.ones(16, 1),
                  torch.ones(16, 8, dtype=torch.uint8), torch.ones(16, 8, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="0..63"):
        pack(kind(torch.ones((16, 256), dtype=torch.uint8), torch.ones(16, 1), torch.ones(16, 1),
                  torch.ones(16, 8, dtype=torch.uint8), torch.full((16, 8), 64, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="super-blocks of 256"):
        pack(kind(torch.ones((16, 96), dtype=torch.uint8), torch.ones(16, 1), torch.ones(16, 1),
                  torch.ones(16, 3, dtype=torch.uint8), torch.ones(16, 3, dtype=torch.uint8)))


def test_q5_tiles_hold_every_code_and_their_d_and_m():
    """The tile bytes read back, as the kernels read them (qmatmul.h): each code's low 4 bits from its nibble, its
    fifth bit from its chunk's masks, and d and m as float16."""
    blocks, tiles = packed_with_every_code(5, seed=4)
    for row, r, b, w in tile_blocks(tiles, 20, 64):
        d = w[320 + 2 * r: 322 + 2 * r].view(torch.float16).float()
        m_ = w[352 + 2 * r: 354 + 2 * r].view(torch.float16).float()
        assert float(d) == float(blocks.scale[row, b])
        assert float(m_) == float(blocks.zero[row, b] - 8 * blocks.scale[row, b])


@pytest.mark.parametrize("m, n, k", SHAPES)
def test_q8_equals_its_stated_numerics(m, n, k):
    torch.manual_seed(n + 3 * k)
    codes, d = quantize_q8_blocks(torch.randn(n, k))
    x = torch.randn(m, k)
    got = q8_product(x, pack_q8_tiles(codes, d), n)
    xq, scale, _ = (t.double() for t in quantize_activations(x))
    terms = torch.einsum("anb,nb,ab->an", torch.einsum("abk,nbk->anb", xq, codes.double().view(n, k // 32, 32)).abs(),
                         d.double().abs(), scale)
    assert ((got - w8a8_reference(x, codes, d)).abs() <= summation_bound(terms, k // 32).float() + 1e-30).all()


@pytest.mark.parametrize("kind", ["q4", "q5", "q6", "q8", "q3", "q2", "q4k", "q5k", "iq4xs"])
def test_a_rows_product_is_the_same_bits_in_any_number_of_rows(kind):
    """Rows go through the kernels in different passes by their count (one or two passes of up to 8 over one tile,
    sixes, fours, a two and a one past 16): a row's product must not depend on which, as drafts and batches rely
    on, and no pass may write past its rows (two NaN guard rows follow the output)."""
    torch.manual_seed(5)
    n, k = 100, 768 if kind in ("q3", "q2", "q4k", "q5k", "iq4xs") else 576  # seven tiles: pairs, a short last one
    weights = torch.randn(n, k)
    if kind == "iq4xs":
        tiles, matmul = pack_iq4xs_tiles(random_iq4xs(n, k)), native.module().iq4xs_matmul
    elif kind == "q4k":
        tiles, matmul = pack_q4k_tiles(random_k(n, k)), native.module().q4k_matmul
    elif kind == "q5k":
        tiles, matmul = pack_q5k_tiles(random_k(n, k, 5)), native.module().q5k_matmul
    elif kind == "q4":
        tiles, matmul = pack_q4_tiles(quantize_int4(weights, 32)), native.module().q4_matmul
    elif kind == "q5":
        tiles, matmul = pack_q5_tiles(random_q5(n, k)), native.module().q5_matmul
    elif kind == "q6":
        tiles, matmul = pack_q6_tiles(random_q6(n, k)), native.module().q6_matmul
    elif kind == "q3":
        tiles, matmul = pack_q3_tiles(random_q3(n, k)), native.module().q3_matmul
    elif kind == "q2":
        tiles, matmul = pack_q2_tiles(random_q2(n, k)), native.module().q2_matmul
    else:
        tiles, matmul = pack_q8_tiles(*quantize_q8_blocks(weights)), native.module().q8_matmul

    def product(x):
        guarded = torch.full((len(x) + 2, n), float("nan"))
        matmul(buffer(x), buffer(tiles), n, buffer(guarded[: len(x)]), 2)
        assert guarded[len(x):].isnan().all()
        return guarded[: len(x)]
    x = torch.randn(40, k)
    alone = torch.cat([product(x[i: i + 1]) for i in range(len(x))])
    assert not alone.isnan().any()
    for m in list(range(2, 20)) + [24, 33, 40]:
        assert torch.equal(product(x[:m]), alone[:m]), m


def test_q8_blocks_give_q8_0_back_exactly_and_the_rows_dequantize_exactly():
    torch.manual_seed(3)
    codes = torch.randint(-127, 128, (40, 64), dtype=torch.int8)
    codes[:, ::32] = 127  # llama.cpp's Q8_0: each block's largest magnitude is code 127
    d = (torch.rand(40, 2) * 0.02 + 1e-3).to(torch.float16)
    dense = codes.float() * d.float().repeat_interleave(32, 1)
    again, d_again = quantize_q8_blocks(dense)
    assert torch.equal(again, codes) and torch.equal(d_again, d)
    tiles = pack_q8_tiles(codes, d)
    ids = torch.tensor([0, 39, 17, 17])
    rows = torch.empty(4, 64)
    native.module().tile_rows(buffer(tiles), 40, buffer(ids), buffer(rows))
    assert torch.equal(rows, dense[ids])


def test_q6_rows_dequantize_as_the_blocks_do_bit_for_bit():
    """An embedding looked up in Q6 tiles (a Q6_K token embedding kept as shipped): each row is the blocks'
    dequantized row, every code 0..63 and scale -128..127 among them, from rows in every place of a tile and a
    last short tile."""
    n, k = 40, 96
    blocks, tiles = packed_with_every_code(6, seed=9, n=n, k=k)
    ids = torch.tensor([0, 39, 17, 17, 15, 16, 31, 32])
    rows = torch.empty(len(ids), k)
    native.module().tile_rows(buffer(tiles), n, buffer(ids), buffer(rows))
    assert torch.equal(rows, blocks.dequantize()[ids])
    every = torch.empty(n, k)
    native.module().tile_rows(buffer(tiles), n, buffer(torch.arange(n)), buffer(every))
    assert torch.equal(every, blocks.dequantize())


def test_q4_tiles_keep_a_q4_1_blocks_own_d_and_m():
    """From GGUF Q4_1 (scale = d, zero = m + 8 d, d and m float16) the tiles hold d and m exactly."""
    torch.manual_seed(5)
    d = (torch.rand(16, 2) * 0.05).to(torch.float16).float()
    m = (torch.randn(16, 2) * 0.1).to(torch.float16).float()
    blocks = Q4Blocks(torch.randint(0, 16, (16, 64), dtype=torch.uint8), d, m + 8 * d, 32)
    tiles = pack_q4_tiles(blocks)
    assert torch.equal(tiles[0, :, 256:288].contiguous().view(torch.float16).float(), d.T)
    assert torch.equal(tiles[0, :, 288:320].contiguous().view(torch.float16).float(), m.T)
    x = torch.zeros(1, 64)
    x[0, 3] = 1.0  # one activation of code 127 at scale 1/127: y = d q + m for column 3, up to xq rounding
    y = q4_product(x, tiles, 16)
    expected = blocks.codes[:, 3].float() * d[:, 0] * (127 * (1 / 127)) + m[:, 0]
    assert torch.allclose(y[0], expected, rtol=1e-6, atol=1e-7)


_VARIANT_CHECK = """
import json, torch
from corral import native
from corral.engine.quant import *
from corral.kernels.cpu_ops import buffer
mod = native.module()
torch.manual_seed(11)
worst = 0.0


def check(matmul, tiles, ref):  # the variant's product on tiles against the float64 ref: the worst error so far
    global worst
    out = torch.empty(m, n)
    matmul(buffer(x), buffer(tiles), n, buffer(out), 2)
    worst = max(worst, ((out - ref).abs() / ref.abs().max()).max().item())


def halves_of(n, k):  # float16 values per block of 32, as K-quants' d and dmin
    return (torch.rand(n, k // 32) * 0.002).half().float()


def supers_of(n, k):  # float16 values per super-block of 256, repeated over its blocks of 32
    return halves_of(n, k // 8).repeat_interleave(8, dim=1)


for m, n, k in [(1, 16, 32), (3, 17, 96), (6, 100, 576), (9, 40, 1536), (24, 40, 1536), (16, 33, 64),
                (48, 100, 576), (1, 16, 256), (5, 40, 768), (17, 33, 512), (3, 40, 512), (2, 33, 768)]:
    x = torch.randn(m, k)
    blocks = quantize_int4(torch.randn(n, k), 32)
    check(mod.q4_matmul, pack_q4_tiles(blocks), w4a8_reference(x, blocks))
    codes, d = quantize_q8_blocks(torch.randn(n, k))
    check(mod.q8_matmul, pack_q8_tiles(codes, d), w8a8_reference(x, codes, d))
    five = Q5Blocks(torch.randint(0, 32, (n, k), dtype=torch.uint8), torch.rand(n, k // 32) * 0.02 + 1e-3,
                    torch.randn(n, k // 32) * 0.1)
    check(mod.q5_matmul, pack_q5_tiles(five), w4a8_reference(x, five))
    six = Q6Blocks(torch.randint(0, 64, (n, k), dtype=torch.uint8), halves_of(n, k),
                   torch.randint(-128, 128, (n, k // 16), dtype=torch.int8))
    check(mod.q6_matmul, pack_q6_tiles(six), w6a8_reference(x, six))
    grid = IQ4Blocks(torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.rand(n, k // 32) * 0.02 + 1e-3)
    check(mod.iq4_matmul, pack_iq4_tiles(grid), iq4_reference(x, grid))
    if k % 256 == 0:  # tiles in super-blocks: their d (and dmin) one per 256 columns
        three = Q3Blocks(torch.randint(0, 8, (n, k), dtype=torch.uint8), supers_of(n, k),
                         torch.randint(-32, 32, (n, k // 16), dtype=torch.int8))
        check(mod.q3_matmul, pack_q3_tiles(three), w3a8_reference(x, three))
        two = Q2Blocks(torch.randint(0, 4, (n, k), dtype=torch.uint8), supers_of(n, k), supers_of(n, k),
                       torch.randint(0, 16, (n, k // 16), dtype=torch.uint8),
                       torch.randint(0, 16, (n, k // 16), dtype=torch.uint8))
        check(mod.q2_matmul, pack_q2_tiles(two), w2a8_reference(x, two))
        four = Q4KBlocks(torch.randint(0, 16, (n, k), dtype=torch.uint8), halves_of(n, k // 8), halves_of(n, k // 8),
                         torch.randint(0, 64, (n, k // 32), dtype=torch.uint8),
                         torch.randint(0, 64, (n, k // 32), dtype=torch.uint8))
        check(mod.q4k_matmul, pack_q4k_tiles(four), k_reference(x, four))
        five = Q5KBlocks(torch.randint(0, 32, (n, k), dtype=torch.uint8), *four[1:])
        check(mod.q5k_matmul, pack_q5k_tiles(five), k_reference(x, five))
        xs = IQ4XSBlocks(torch.randint(0, 16, (n, k), dtype=torch.uint8), halves_of(n, k // 8),
                         torch.randint(-32, 32, (n, k // 32), dtype=torch.int8))
        check(mod.iq4xs_matmul, pack_iq4xs_tiles(xs), iq4_reference(x, xs.as_iq4()))
# a row's bits alone and among others, through every pass structure of the variant
blocks = quantize_int4(torch.randn(100, 576), 32)
tiles = pack_q4_tiles(blocks)
codes, d = quantize_q8_blocks(torch.randn(100, 576))
q8_tiles = pack_q8_tiles(codes, d)
q5_tiles = pack_q5_tiles(Q5Blocks(torch.randint(0, 32, (100, 576), dtype=torch.uint8), torch.rand(100, 18) * 0.02,
                                  torch.randn(100, 18) * 0.1))
q6_tiles = pack_q6_tiles(Q6Blocks(torch.randint(0, 64, (100, 576), dtype=torch.uint8), halves_of(100, 576),
                                  torch.randint(-128, 128, (100, 36), dtype=torch.int8)))
iq4_tiles = pack_iq4_tiles(IQ4Blocks(torch.randint(0, 16, (100, 576), dtype=torch.uint8), torch.rand(100, 18) * 0.02))
q3_tiles = pack_q3_tiles(Q3Blocks(torch.randint(0, 8, (100, 768), dtype=torch.uint8), supers_of(100, 768),
                                  torch.randint(-32, 32, (100, 48), dtype=torch.int8)))
q2_tiles = pack_q2_tiles(Q2Blocks(torch.randint(0, 4, (100, 768), dtype=torch.uint8), supers_of(100, 768),
                                  supers_of(100, 768), torch.randint(0, 16, (100, 48), dtype=torch.uint8),
                                  torch.randint(0, 16, (100, 48), dtype=torch.uint8)))
q4k_tiles = pack_q4k_tiles(Q4KBlocks(torch.randint(0, 16, (100, 768), dtype=torch.uint8), halves_of(100, 96),
                                    halves_of(100, 96), torch.randint(0, 64, (100, 24), dtype=torch.uint8),
                                    torch.randint(0, 64, (100, 24), dtype=torch.uint8)))
q5k_tiles = pack_q5k_tiles(Q5KBlocks(torch.randint(0, 32, (100, 768), dtype=torch.uint8), halves_of(100, 96),
                                    halves_of(100, 96), torch.randint(0, 64, (100, 24), dtype=torch.uint8),
                                    torch.randint(0, 64, (100, 24), dtype=torch.uint8)))
iq4xs_tiles = pack_iq4xs_tiles(IQ4XSBlocks(torch.randint(0, 16, (100, 768), dtype=torch.uint8), halves_of(100, 96),
                                          torch.randint(-32, 32, (100, 24), dtype=torch.int8)))
def product(rows, matmul=mod.q4_matmul, tiles=tiles):
    out = torch.empty(len(rows), 100)
    matmul(buffer(rows), buffer(tiles), 100, buffer(out), 2)
    return out
independent = True
for matmul, w in [(mod.q4_matmul, tiles), (mod.q8_matmul, q8_tiles), (mod.q5_matmul, q5_tiles),
                  (mod.q6_matmul, q6_tiles), (mod.iq4_matmul, iq4_tiles), (mod.q3_matmul, q3_tiles),
                  (mod.q2_matmul, q2_tiles), (mod.q4k_matmul, q4k_tiles), (mod.q5k_matmul, q5k_tiles),
                  (mod.iq4xs_matmul, iq4xs_tiles)]:
    x = torch.randn(36, 768 if any(w is t for t in (q3_tiles, q2_tiles, q4k_tiles, q5k_tiles, iq4xs_tiles)) else 576)
    alone = torch.cat([product(x[i: i + 1], matmul, w) for i in range(36)])
    independent &= all(torch.equal(product(x[:m], matmul, w), alone[:m]) for m in list(range(2, 21)) + [32, 33, 36])
print(json.dumps({"isa": mod.qmatmul_isa, "worst": worst, "independent": independent}))
"""


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_this_cpu_runs_agrees_with_the_numerics(variant):
    report = report_in_variant(_VARIANT_CHECK, CORRAL_QMATMUL_ISA=variant)
    assert report["isa"].startswith(variant) and report["worst"] < 1e-5 and report["independent"], report


_PAIRS_CHECK = """
import hashlib, json, torch
from corral import native
from corral.engine.quant import (IQ4Blocks, IQ4XSBlocks, Q4KBlocks, Q5Blocks, Q5KBlocks, pack_iq4_tiles,
                                 pack_iq4xs_tiles, pack_q4_tiles, pack_q4k_tiles, pack_q5_tiles, pack_q5k_tiles,
                                 quantize_int4)
from corral.kernels.cpu_ops import buffer
mod = native.module()
torch.manual_seed(5)
digest = hashlib.sha256()
for n in (100, 90, 96, 576):  # 7 tiles (3 pairs and a last one alone), 6 (the last pair's second short), 6, 36
    tiles = pack_q4_tiles(quantize_int4(torch.randn(n, 576), 32))
    five = pack_q5_tiles(Q5Blocks(torch.randint(0, 32, (n, 576), dtype=torch.uint8), torch.rand(n, 18) * 0.02,
                                  torch.randn(n, 18) * 0.1))
    grid = pack_iq4_tiles(IQ4Blocks(torch.randint(0, 16, (n, 576), dtype=torch.uint8), torch.rand(n, 18) * 0.02))
    four = pack_q4k_tiles(Q4KBlocks(torch.randint(0, 16, (n, 768), dtype=torch.uint8), torch.rand(n, 3) * 0.002,
                                    torch.rand(n, 3) * 0.002, torch.randint(0, 64, (n, 24), dtype=torch.uint8),
                                    torch.randint(0, 64, (n, 24), dtype=torch.uint8)))
    five_k = pack_q5k_tiles(Q5KBlocks(torch.randint(0, 32, (n, 768), dtype=torch.uint8), torch.rand(n, 3) * 0.002,
                                      torch.rand(n, 3) * 0.002, torch.randint(0, 64, (n, 24), dtype=torch.uint8),
                                      torch.randint(0, 64, (n, 24), dtype=torch.uint8)))
    grid_xs = pack_iq4xs_tiles(IQ4XSBlocks(torch.randint(0, 16, (n, 768), dtype=torch.uint8),
                                           torch.rand(n, 3) * 0.002, torch.randint(-32, 32, (n, 24), dtype=torch.int8)))
    for rows in (1, 2, 3, 4, 5, 8):
        for matmul, w in ((mod.q4_matmul, tiles), (mod.q5_matmul, five), (mod.iq4_matmul, grid),
                          (mod.q4k_matmul, four), (mod.q5k_matmul, five_k), (mod.iq4xs_matmul, grid_xs)):
            x = torch.randn(rows, 768 if any(w is t for t in (four, five_k, grid_xs)) else 576)
            out = torch.empty(rows, n)
            matmul(buffer(x), buffer(w), n, buffer(out), 2)
            digest.update(out.numpy().tobytes())
print(json.dumps({"isa": mod.qmatmul_isa, "digest": digest.hexdigest()}))
"""


@pytest.mark.skipif(not VNNI, reason="tile pairs are an AVX-512 kernel's")
def test_tile_pairs_on_and_off_give_the_same_bits_and_the_variant_says_which():
    """A decode step's Q4 products of 1-4 rows over a group's two tiles at once, or one tile at a time (the choice
    is the CPU's, or CORRAL_QMATMUL_TILE_PAIRS's): bit for bit the same products, the chosen way in the name."""
    on = report_in_variant(_PAIRS_CHECK, CORRAL_QMATMUL_ISA="avx512", CORRAL_QMATMUL_TILE_PAIRS="on")
    off = report_in_variant(_PAIRS_CHECK, CORRAL_QMATMUL_ISA="avx512", CORRAL_QMATMUL_TILE_PAIRS="off")
    assert (on["isa"], off["isa"]) == ("avx512-vnni-pairs", "avx512-vnni")
    assert on["digest"] == off["digest"]


@pytest.mark.skipif(not VNNI, reason="tile pairs are an AVX-512 kernel's")
@pytest.mark.parametrize("pairs", ["on", "off"])
def test_the_avx512_variant_agrees_with_the_numerics_with_tile_pairs_and_without(pairs):
    report = report_in_variant(_VARIANT_CHECK, CORRAL_QMATMUL_ISA="avx512", CORRAL_QMATMUL_TILE_PAIRS=pairs)
    assert report["worst"] < 1e-5 and report["independent"], report


def test_a_tile_pairs_setting_that_is_neither_on_nor_off_refuses_to_load():
    result = subprocess.run([sys.executable, "-c", "import corral._native"], capture_output=True, text=True,
                            timeout=120, cwd=ROOT, env={**os.environ, "CORRAL_QMATMUL_TILE_PAIRS": "yes"})
    assert result.returncode != 0 and "CORRAL_QMATMUL_TILE_PAIRS=yes: on or off" in result.stderr


@pytest.mark.skipif(not VNNI, reason="the AMX model's epilogue needs AVX-512")
def test_the_amx_load_check_passes_on_the_tile_model():
    """The check an AMX CPU runs when the module loads (one product through the tiles and through the VNNI kernels,
    compared bit for bit), here on the scalar model of the tile instructions."""
    assert native.module().qmatmul_amx_model_agrees()


@pytest.mark.skipif({"amx_tile", "amx_int8"} <= FLAGS, reason="this CPU has AMX")
def test_amx_forced_on_a_cpu_without_it_says_why():
    result = subprocess.run([sys.executable, "-c", "import corral._native"], capture_output=True, text=True,
                            timeout=120, cwd=ROOT, env={**os.environ, "CORRAL_QMATMUL_ISA": "amx"})
    refusal = "this CPU has no AMX-INT8" if platform.machine().lower() in ("x86_64", "amd64") else "not an x86-64 build"
    assert result.returncode != 0 and f"CORRAL_QMATMUL_ISA=amx: {refusal}" in result.stderr


def test_a_variant_the_cpu_lacks_is_refused_at_import():
    result = subprocess.run([sys.executable, "-c", "import corral._native"], capture_output=True, text=True,
                            timeout=120, cwd=ROOT, env={**os.environ, "CORRAL_QMATMUL_ISA": "sve"})
    assert result.returncode != 0 and "CORRAL_QMATMUL_ISA=sve" in result.stderr


def test_buffers_are_checked():
    mod = native.module()
    tiles = pack_q4_tiles(quantize_int4(torch.randn(32, 64), 32))
    x, out = torch.randn(2, 64), torch.empty(2, 32)
    with pytest.raises(ValueError, match="tiles"):
        mod.q4_matmul(buffer(x), buffer(tiles), 48, buffer(out), 2)  # N does not match the tiles
    with pytest.raises(ValueError, match="K must be a multiple of 32"):
        mod.q4_matmul(buffer(torch.randn(2, 48)), buffer(tiles), 32, buffer(out), 2)
    with pytest.raises(ValueError, match="out"):
        mod.q4_matmul(buffer(x), buffer(tiles), 32, buffer(torch.empty(3, 32)), 2)
    with pytest.raises(TypeError, match="float32"):
        mod.q4_matmul(buffer(x.double()), buffer(tiles), 32, buffer(out), 2)
    with pytest.raises(ValueError, match="tiles"):
        mod.q8_matmul(buffer(x), buffer(tiles), 32, buffer(out), 2)  # Q4 tiles handed to the Q8 product
    with pytest.raises(ValueError, match="multiple of 256"):  # Q4K tiles: whole super-blocks of 256 along K
        mod.q4k_matmul(buffer(x), buffer(torch.zeros(2, 2, 296, dtype=torch.uint8)), 32, buffer(out), 2)
    with pytest.raises(ValueError, match="tiles"):  # Q4 tiles handed to the Q4K product
        mod.q4k_matmul(buffer(torch.randn(2, 256)), buffer(pack_q4_tiles(quantize_int4(torch.randn(32, 256), 32))), 32,
                       buffer(out), 2)
    q8 = pack_q8_tiles(*quantize_q8_blocks(torch.randn(32, 64)))
    with pytest.raises(IndexError, match="outside the rows"):
        mod.tile_rows(buffer(q8), 32, buffer(torch.tensor([0, 32])), buffer(torch.empty(2, 64)))
    with pytest.raises(ValueError, match="Q8 .* or Q6"):  # Q4 tiles hold no rows to look up
        mod.tile_rows(buffer(tiles), 32, buffer(torch.tensor([0])), buffer(torch.empty(1, 64)))

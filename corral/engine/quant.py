"""Quantized weights: the linear layers and the embedding in the formats that torch's CPU kernels run fast.

Three forms of a linear layer ``y = x @ W.T (+ b)``, all called the same way (``layer(x)``, ``x`` [rows, K] in the
activation dtype):

- :class:`Dense`: ``W`` in the activation dtype (``F.linear``; in float32 on the CPU, up to 16 rows, ``W @ x.T``:
  see :class:`Dense`).
- :class:`Int8Rows` (W8A16): ``W[n] = scale[n] * q[n]``, int8 codes, one scale per output row, through
  ``torch._weight_int8pack_mm``. Rounding to nearest, then the scale to the activation dtype:
  ``|error| <= max|W[n]| / 254 + 2**-8 |W[n, k]|`` per weight in bfloat16.
- :class:`Int4Groups` (W4A16): ``W[n, k] = (q - 8) * scale[g, n] + zero[g, n]`` with ``q`` in 0..15 and
  ``g = k // group``, through ``torch._weight_int4pack_mm_for_cpu``; blocks on a CUDA device go through the
  Triton kernel of :mod:`corral.kernels.int4_matmul` (the same rounding of scale and zero, float32 accumulation).
  GGUF Q4_1 blocks (``d * q + m``, 32 weights along K) map onto it exactly with ``scale = d``, ``zero = m + 8 d``;
  Q4_0 (``d * (q - 8)``) with ``zero = 0``. Both kernels want scale and zero in the activation dtype, so they are
  rounded once, to it: in bfloat16 (8 significant bits, unit roundoff 2**-8)
  ``|error| <= 2**-8 * (8 |d| + |m + 8 d|)`` per weight, against the shipped block. Any dense weight quantizes
  group-wise (32, 64 or 128 along K) by round-to-nearest with a zero point. The CPU kernel packs output rows in
  16s: a layer whose N is not a multiple of 16 is padded with zero rows.

:class:`Int8Embedding` keeps the embedding as int8 rows and serves as the (tied) LM head through the same int8
kernel. Under ``w4a8``, :class:`Q4Tiles` runs Q4 blocks (GGUF Q4_0, Q4_1), :class:`Q4KTiles` and :class:`Q5KTiles`
Q4K and Q5K blocks (GGUF Q4_K, Q5_K), :class:`Q5Tiles` Q5 blocks (GGUF Q5_0, Q5_1), :class:`Q6Tiles` Q6 blocks
(GGUF Q6_K), :class:`Q3Tiles` and :class:`Q2Tiles` Q3 and Q2 blocks (GGUF Q3_K, Q2_K), :class:`IQ4Tiles` and
:class:`IQ4XSTiles` IQ4 and IQ4XS blocks (GGUF IQ4_NL, IQ4_XS) and :class:`Q8Linear` Q8 blocks (:class:`Q8Blocks`:
GGUF Q8_0 exactly) on the native kernels; a fused layer whose parts are of different kinds is a :class:`SplitLinear`
of them.
What this leaves out: IQ1-IQ3 kernels (such GGUF blocks are dequantized at load, with a log line, by
:mod:`corral.engine.weights`) and a CUDA path for any form but :class:`Dense` and :class:`Int4Groups`.
Activation-aware scaling before group-wise rounding is :mod:`corral.engine.awq`.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from corral import native
from corral.engine import hugepages
from corral.errors import InvalidRequestError
from corral.kernels.cpu_ops import buffer
from corral.kernels.int4_matmul import int4_matmul, pack_int4

GROUP_SIZES = (32, 64, 128)


class Q4Blocks(NamedTuple):
    """Int4 codes with one (scale, zero) per ``group`` weights along K: ``W = (codes - 8) * scale + zero``."""
    codes: torch.Tensor  # [N, K] uint8, 0..15
    scale: torch.Tensor  # [N, K // group] float32
    zero: torch.Tensor  # [N, K // group] float32
    group: int = 32

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``W`` [N, K] computed in float32 from scale and zero first rounded to ``dtype`` (the kernel's rounding)."""
        scale = self.scale.to(dtype).float().repeat_interleave(self.group, dim=1)
        zero = self.zero.to(dtype).float().repeat_interleave(self.group, dim=1)
        return (self.codes.float() - 8) * scale + zero


class Q5Blocks(NamedTuple):
    """5-bit codes with one (scale, zero) per 32 weights along K, as :class:`Q4Blocks` (``W = (codes - 8) * scale +
    zero``, codes 0..31): what the native Q5 kernel runs (:class:`Q5Tiles`). GGUF Q5_0 (``d (q - 16)``) and Q5_1
    (``d q + m``) load as these under ``w4a8`` (and Q5_K, per sub-block of 32 ``d sc q - dmin mn``, where its bytes
    do not read back as :class:`Q5KBlocks`)."""
    codes: torch.Tensor  # [N, K] uint8, 0..31
    scale: torch.Tensor  # [N, K // 32] float32
    zero: torch.Tensor  # [N, K // 32] float32
    group: int = 32

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return Q4Blocks.dequantize(self, dtype)  # the same form; codes up to 31


class Q6Blocks(NamedTuple):
    """6-bit codes with a float16 ``d`` per 32 weights along K and an int8 scale ``sc`` per 16: ``W = d sc (codes -
    32)``, codes 0..63, GGUF Q6_K exactly (its d per super-block of 256 repeated over its 8 blocks): what the native
    Q6 kernel runs (:class:`Q6Tiles`)."""
    codes: torch.Tensor  # [N, K] uint8, 0..63
    d: torch.Tensor  # [N, K // 32] float32, each a float16 value
    sc: torch.Tensor  # [N, K // 16] int8

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.codes.shape
        scale = (self.d.float().repeat_interleave(2, dim=1) * self.sc.float()).repeat_interleave(16, dim=1)
        return (self.codes.float() - 32) * scale


class Q3Blocks(NamedTuple):
    """3-bit codes with a float16 ``d`` per 32 weights along K and an int8 scale ``sc`` per 16: ``W = d sc (codes -
    4)``, codes 0..7, GGUF Q3_K exactly (its d per super-block of 256 repeated over its 8 blocks, its 6-bit scales
    less 32): what the native Q3 kernel runs (:class:`Q3Tiles`)."""
    codes: torch.Tensor  # [N, K] uint8, 0..7
    d: torch.Tensor  # [N, K // 32] float32, each a float16 value
    sc: torch.Tensor  # [N, K // 16] int8, -32..31

    def dequantize(self) -> torch.Tensor:
        scale = (self.d.float().repeat_interleave(2, dim=1) * self.sc.float()).repeat_interleave(16, dim=1)
        return (self.codes.float() - 4) * scale


def _scales_and_mins(d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor,
                     per_d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each scale's ``d sc`` and ``dmin mn`` in float32 (exact: 11 by at most 6 significant bits), ``d`` and ``dmin``
    each over ``per_d`` of the scales and mins."""
    return (d.float().repeat_interleave(per_d, dim=1) * sc.float(),
            dmin.float().repeat_interleave(per_d, dim=1) * mn.float())


def _dequantize_with_mins(blocks, per_d: int) -> torch.Tensor:
    """``(d sc) q - dmin mn`` in float32, llama.cpp's operations (its values bit for bit), for blocks whose ``d`` and
    ``dmin`` each cover ``per_d`` scales and mins."""
    scale, low = _scales_and_mins(blocks.d, blocks.dmin, blocks.sc, blocks.mn, per_d)
    width = blocks.codes.shape[1] // scale.shape[1]  # columns a scale covers
    return scale.repeat_interleave(width, dim=1) * blocks.codes.float() - low.repeat_interleave(width, dim=1)


class Q2Blocks(NamedTuple):
    """2-bit codes with float16 ``d`` and ``dmin`` per 32 weights along K and a 4-bit scale ``sc`` and min ``mn`` per
    16: ``W = d sc codes - dmin mn``, codes 0..3, GGUF Q2_K exactly (its d and dmin per super-block of 256 repeated
    over its 8 blocks): what the native Q2 kernel runs (:class:`Q2Tiles`)."""
    codes: torch.Tensor  # [N, K] uint8, 0..3
    d: torch.Tensor  # [N, K // 32] float32, each a float16 value
    dmin: torch.Tensor  # [N, K // 32] float32, each a float16 value
    sc: torch.Tensor  # [N, K // 16] uint8, 0..15
    mn: torch.Tensor  # [N, K // 16] uint8, 0..15

    def dequantize(self) -> torch.Tensor:
        """``(d sc) q - dmin mn`` in float32, llama.cpp's operations (its values bit for bit)."""
        return _dequantize_with_mins(self, 2)


class Q4KBlocks(NamedTuple):
    """4-bit codes with float16 ``d`` and ``dmin`` per 256 weights along K and a 6-bit scale ``sc`` and min ``mn``
    per 32: ``W = (d sc) codes - dmin mn``, codes 0..15, GGUF Q4_K exactly (K a multiple of 256): what the native
    Q4K kernel runs (:class:`Q4KTiles`)."""
    codes: torch.Tensor  # [N, K] uint8, 0..15
    d: torch.Tensor  # [N, K // 256] float32, each a float16 value
    dmin: torch.Tensor  # [N, K // 256] float32, each a float16 value
    sc: torch.Tensor  # [N, K // 32] uint8, 0..63
    mn: torch.Tensor  # [N, K // 32] uint8, 0..63

    def dequantize(self) -> torch.Tensor:
        """``(d sc) q - dmin mn`` in float32, llama.cpp's operations (its values bit for bit)."""
        return _dequantize_with_mins(self, 8)

    def as_q4(self) -> Q4Blocks:
        """The same weights as :class:`Q4Blocks` (scale ``d sc``, zero ``8 d sc - dmin mn``, exact in float32)."""
        scale, low = _scales_and_mins(self.d, self.dmin, self.sc, self.mn, 8)
        return Q4Blocks(self.codes, scale, 8 * scale - low, 32)


class Q5KBlocks(NamedTuple):
    """:class:`Q4KBlocks` with 5-bit codes (0..31): GGUF Q5_K exactly, what the native Q5K kernel runs
    (:class:`Q5KTiles`)."""
    codes: torch.Tensor  # [N, K] uint8, 0..31
    d: torch.Tensor  # [N, K // 256] float32, each a float16 value
    dmin: torch.Tensor  # [N, K // 256] float32, each a float16 value
    sc: torch.Tensor  # [N, K // 32] uint8, 0..63
    mn: torch.Tensor  # [N, K // 32] uint8, 0..63

    def dequantize(self) -> torch.Tensor:
        return Q4KBlocks.dequantize(self)  # the same form; codes up to 31

    def as_q5(self) -> Q5Blocks:
        """The same weights as :class:`Q5Blocks` (scale ``d sc``, zero ``8 d sc - dmin mn``, exact in float32)."""
        return Q5Blocks(*Q4KBlocks.as_q4(self)[:3])


IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # llama.cpp's IQ4 grid


class IQ4Blocks(NamedTuple):
    """4-bit indices into llama.cpp's non-linear grid (:data:`IQ4_VALUES`) with a float32 ``d`` per 32 weights
    along K: ``W = d IQ4_VALUES[codes]``, GGUF IQ4_NL (d float16) and IQ4_XS (its super-block's float16 d times
    each block's 6-bit scale less 32) exactly: what the native IQ4 kernel runs (:class:`IQ4Tiles`)."""
    codes: torch.Tensor  # [N, K] uint8, 0..15
    d: torch.Tensor  # [N, K // 32] float32

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.codes.shape
        values = torch.tensor(IQ4_VALUES, dtype=torch.float32)[self.codes.long()]
        return (values.view(rows, cols // 32, 32) * self.d.float()[..., None]).view(rows, cols)


class IQ4XSBlocks(NamedTuple):
    """4-bit indices into llama.cpp's non-linear grid (:data:`IQ4_VALUES`) with a float16 ``d`` per 256 weights along
    K and a 6-bit scale per 32 less 32 (``sc``, -32..31): ``W = (d sc) IQ4_VALUES[codes]``, GGUF IQ4_XS exactly (K a
    multiple of 256): what the native IQ4XS kernel runs (:class:`IQ4XSTiles`)."""
    codes: torch.Tensor  # [N, K] uint8, 0..15
    d: torch.Tensor  # [N, K // 256] float32, each a float16 value
    sc: torch.Tensor  # [N, K // 32] int8, -32..31

    def as_iq4(self) -> IQ4Blocks:
        """The same weights as :class:`IQ4Blocks` (each block's d = d sc, exact in float32)."""
        return IQ4Blocks(self.codes, self.d.float().repeat_interleave(8, dim=1) * self.sc.float())

    def dequantize(self) -> torch.Tensor:
        """``(d sc) IQ4_VALUES[q]`` in float32, llama.cpp's operations (its values bit for bit)."""
        return self.as_iq4().dequantize()


class Q8Blocks(NamedTuple):
    """Int8 codes with one float16 scale per 32 weights along K, as GGUF Q8_0: ``W = codes * d``. What the native
    W8A8 kernel runs (:class:`Q8Linear`); a GGUF's Q8_0 linears load as these under ``w4a8``."""
    codes: torch.Tensor  # [N, K] int8, -127..127
    d: torch.Tensor  # [N, K // 32] float16

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.codes.shape
        return (self.codes.float().view(rows, cols // 32, 32) * self.d.float()[..., None]).view(rows, cols)


def concat_blocks(parts: list):
    """Blocks of several layers, all of one type (:class:`Q4Blocks`, :class:`Q5Blocks`, :class:`Q6Blocks`,
    :class:`Q3Blocks`, :class:`Q2Blocks` or :class:`IQ4Blocks`), stacked along N (the fused QKV and gate/up
    projections)."""
    kind = type(parts[0])
    assert all(type(p) is kind for p in parts) and len({getattr(p, "group", 32) for p in parts}) == 1
    return kind(**{f: parts[0].group if f == "group" else torch.cat([getattr(p, f) for p in parts])
                   for f in kind._fields})


def check_group_size(group: int, config) -> None:
    """Refuse, before any weight is touched, an int4 ``group`` that does not divide every linear's K (the hidden
    size, the attention output's width and the MLP's intermediate size) of the model ``config``."""
    widths = {"hidden size": config.hidden_size, "attention width": config.num_heads * config.head_dim,
              "intermediate size": config.intermediate_size}
    for what, k in widths.items():
        if k % group:
            raise InvalidRequestError(f"quant_group_size {group} does not divide the model's {what} ({k})",
                                      param="quant_group_size")


def quantize_int4(weight: torch.Tensor, group: int) -> Q4Blocks:
    """Round-to-nearest int4 with a zero point per ``group`` weights along K: each group's [min, max] spans the
    16 codes (``scale = (max - min) / 15``, so ``|error| <= scale / 2``)."""
    rows, cols = weight.shape
    if group not in GROUP_SIZES or cols % group:
        raise ValueError(f"int4 group size {group}: must be one of {GROUP_SIZES} and divide K = {cols}")
    w = weight.float().reshape(rows, cols // group, group)
    low, high = w.amin(-1), w.amax(-1)
    scale = (high - low) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((w - low[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
    return Q4Blocks(codes.reshape(rows, cols), scale, low + 8 * scale, group)


def quantize_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 along the last dimension: ``(codes int8 like x, scale float32 [x.shape[:-1]])`` with
    ``x ~ codes * scale[..., None]`` (a weight's output rows; a KV cache's (token, head) rows)."""
    w = x.float()
    scale = w.abs().amax(-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / safe[..., None]).clamp_(-127, 127).to(torch.int8), scale


Q4_TILE_BYTES, Q8_TILE_BYTES = 320, 544  # corral/csrc/qmatmul.h: one block of 32 along K for 16 output rows


def _tile_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` [N, ...] padded with zero rows to a multiple of 16."""
    return F.pad(t, (0, 0) * (t.dim() - 1) + (0, -t.shape[0] % 16))


def _halves(values: torch.Tensor, num_tiles: int, num_blocks: int) -> torch.Tensor:
    """Per-(row, block) values [N16, B] as float16 bytes [T, B, 32]: a tile's 16 rows side by side per block."""
    halves = values.to(torch.float16).view(num_tiles, 16, num_blocks).permute(0, 2, 1).contiguous()
    return halves.view(torch.uint8).view(num_tiles, num_blocks, 32)


def pack_q4_tiles(blocks: Q4Blocks) -> torch.Tensor:
    """Q4 blocks of 32 as the native W4A8 kernel's tiles [ceil(N / 16), K / 32, 320] uint8 (layout in
    ``corral/csrc/qmatmul.h``): the codes unchanged, ``d = scale`` and ``m = zero - 8 scale`` (a GGUF Q4_1
    block's own d and m) as float16, exact for GGUF blocks, whose d and m are float16."""
    if blocks.group != 32:
        raise ValueError(f"the W4A8 kernel takes blocks of 32 along K, not {blocks.group}")
    rows, cols = blocks.codes.shape
    codes = _tile_rows(blocks.codes.to(torch.uint8))
    num_tiles, num_blocks = codes.shape[0] // 16, cols // 32
    q = codes.view(num_tiles, 16, num_blocks, 4, 2, 4)  # [tile, row, block, chunk, low/high nibble, byte]
    packed = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(num_tiles, num_blocks, 256)
    d = _tile_rows(blocks.scale.float())
    m = _tile_rows((blocks.zero.float() - 8 * blocks.scale.float()))
    return torch.cat((packed, _halves(d, num_tiles, num_blocks), _halves(m, num_tiles, num_blocks)), -1).contiguous()


def _bit_masks(codes: torch.Tensor, bit: int) -> torch.Tensor:
    """Bit ``bit`` of codes [N, K] as a tile block's 4 x 16 bytes of masks [tiles, blocks, 64] (chunk c's: bit j =
    4 r + i of mask h is that bit of q[r][8 c + 4 h + i]), as Q5 tiles keep their fifth bits."""
    rows, cols = codes.shape
    padded = _tile_rows(codes.to(torch.uint8))
    num_tiles, num_blocks = padded.shape[0] // 16, cols // 32
    q = padded.view(num_tiles, 16, num_blocks, 4, 2, 4)  # [tile, row, block, chunk, low/high nibble, byte]
    plane = ((q >> bit) & 1).permute(0, 2, 3, 4, 1, 5).reshape(num_tiles, num_blocks, 4, 2, 8, 8).to(torch.int32)
    return (plane << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8).view(num_tiles, num_blocks, 64)


def _nibbles_and_masks(codes: torch.Tensor, bits: int) -> tuple[int, int, list[torch.Tensor]]:
    """Codes [N, K] of ``bits`` (4-6) as a tile block's parts: their low 4 bits in 4 chunks (a Q4 tile block's 256
    bytes), then for each bit from the fifth on, its masks (:func:`_bit_masks`). Returns (tiles, blocks, parts),
    each part [tiles, blocks, bytes]."""
    rows, cols = codes.shape
    padded = _tile_rows(codes.to(torch.uint8))
    num_tiles, num_blocks = padded.shape[0] // 16, cols // 32
    nibbles = padded.view(num_tiles, 16, num_blocks, 4, 2, 4) & 0x0F  # [tile, row, block, chunk, nibble, byte]
    packed = nibbles[..., 0, :] | (nibbles[..., 1, :] << 4)
    parts = [packed.permute(0, 2, 3, 1, 4).reshape(num_tiles, num_blocks, 256)]
    return num_tiles, num_blocks, parts + [_bit_masks(codes, bit) for bit in range(4, bits)]


def pack_q5_tiles(blocks: Q5Blocks) -> torch.Tensor:
    """Q5 blocks of 32 as the native kernel's tiles [ceil(N / 16), K / 32, 384] uint8 (layout in
    ``corral/csrc/qmatmul.h``): a Q4 tile block of the codes' low 4 bits, their fifth bits as two 64-bit masks per
    chunk, then ``d = scale`` and ``m = zero - 8 scale`` as float16."""
    if blocks.group != 32:
        raise ValueError(f"the W5A8 kernel takes blocks of 32 along K, not {blocks.group}")
    if blocks.codes.numel() and int(blocks.codes.max()) > 31:  # a sixth bit would land in the next code's fifth
        raise ValueError("Q5 codes must be 0..31")
    num_tiles, num_blocks, parts = _nibbles_and_masks(blocks.codes, 5)
    d = _tile_rows(blocks.scale.float())
    m = _tile_rows((blocks.zero.float() - 8 * blocks.scale.float()))
    return torch.cat((*parts, _halves(d, num_tiles, num_blocks), _halves(m, num_tiles, num_blocks)), -1).contiguous()


def pack_q6_tiles(blocks: Q6Blocks) -> torch.Tensor:
    """Q6 blocks as the native kernel's tiles [ceil(N / 16), K / 32, 448] uint8 (layout in
    ``corral/csrc/qmatmul.h``): a Q5 tile block's codes and fifth-bit masks, the sixth bits as masks laid out
    alike, ``d`` as float16, then each row's int8 scale of the block's first 16 columns, and of its last 16."""
    if blocks.codes.numel() and int(blocks.codes.max()) > 63:
        raise ValueError("Q6 codes must be 0..63")
    num_tiles, num_blocks, parts = _nibbles_and_masks(blocks.codes, 6)
    sc = _tile_rows(blocks.sc.to(torch.int8)).view(num_tiles, 16, num_blocks, 2).permute(0, 2, 3, 1)
    return torch.cat((*parts, _halves(_tile_rows(blocks.d.float()), num_tiles, num_blocks),
                      sc.reshape(num_tiles, num_blocks, 32).view(torch.uint8)), -1).contiguous()


def _two_bit_chunks(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K]'s low 2 bits as a tile block's two 2-bit chunks [tiles, blocks, 128] (``corral/csrc/qmatmul.h``:
    a Q4 tile block's chunks 2p and 2p + 1 in chunk p, each code 4 (c % 2) bits up from where its nibble sits)."""
    rows, cols = codes.shape
    padded = _tile_rows(codes.to(torch.uint8))
    num_tiles, num_blocks = padded.shape[0] // 16, cols // 32
    # [tile, row, block, chunk pair, chunk of the pair, low/high nibble, byte]
    q = (padded & 3).view(num_tiles, 16, num_blocks, 2, 2, 2, 4)
    pairs = (q[..., 0, 0, :] | (q[..., 0, 1, :] << 2) | (q[..., 1, 0, :] << 4) | (q[..., 1, 1, :] << 6))
    return pairs.permute(0, 2, 3, 1, 4).reshape(num_tiles, num_blocks, 128)


def _per_super_block(values: torch.Tensor, name: str, what: str) -> torch.Tensor:
    """A d (or dmin) per block of 32 [N, K / 32] as the one per super-block of 256 [N, K / 256] that tiles in
    super-blocks keep: refused where a super-block's blocks differ in it (a GGUF K-quant's never do)."""
    rows, blocks = values.shape
    if blocks % 8:
        raise ValueError(f"{name} tiles take whole super-blocks of 256 along K, not {blocks * 32} columns")
    grouped = values.float().view(rows, blocks // 8, 8)
    if not bool((grouped == grouped[..., :1]).all()):
        raise ValueError(f"{name} tiles keep one {what} per super-block of 256 columns: its 8 blocks' must be equal")
    return grouped[..., 0]


def pack_q3_tiles(blocks: Q3Blocks) -> torch.Tensor:
    """Q3 blocks as the native kernel's Q3 tiles [ceil(N / 16), K / 32, 232] uint8 (1856 bytes a super-block of
    256; layout in ``corral/csrc/qmatmul.h``): per super-block each row's ``d`` as float16 (one per 256 columns, as
    Q3_K keeps it), then per block the codes' low 2 bits in two chunks (a Q4 tile block's chunks 2p and 2p + 1 in
    chunk p, each code 4 (c % 2) bits up from where a Q4 tile block's nibbles put it), their third bits as masks laid
    out as a Q5 tile block's fifth bits, then each row's int8 scale of the block's first 16 columns, and of its last
    16."""
    if blocks.codes.numel() and int(blocks.codes.max()) > 7:
        raise ValueError("Q3 codes must be 0..7")
    d = _per_super_block(blocks.d, "Q3", "d")
    low = _two_bit_chunks(blocks.codes)
    num_tiles, num_blocks = low.shape[:2]
    sc = _tile_rows(blocks.sc.to(torch.int8)).view(num_tiles, 16, num_blocks, 2).permute(0, 2, 3, 1)
    body = torch.cat((low, _bit_masks(blocks.codes, 2), sc.reshape(num_tiles, num_blocks, 32).view(torch.uint8)), -1)
    return _super_tiles(body, d, torch.zeros_like(d))


def pack_q2_tiles(blocks: Q2Blocks) -> torch.Tensor:
    """Q2 blocks as the native kernel's Q2 tiles [ceil(N / 16), K / 32, 168] uint8 (1344 bytes a super-block of
    256; layout in ``corral/csrc/qmatmul.h``): per super-block each row's ``d`` and ``dmin`` as float16 (one each
    per 256 columns, as Q2_K keeps them), then per block a Q3 tile block's two 2-bit chunks and for each row a byte
    of the block's first 16 columns' scale (low nibble) and min (high nibble), and of its last 16's."""
    if blocks.codes.numel() and int(blocks.codes.max()) > 3:
        raise ValueError("Q2 codes must be 0..3")
    if blocks.sc.numel() and max(int(blocks.sc.max()), int(blocks.mn.max())) > 15:
        raise ValueError("Q2 scales and mins must be 0..15")
    d, dmin = _per_super_block(blocks.d, "Q2", "d"), _per_super_block(blocks.dmin, "Q2", "dmin")
    low = _two_bit_chunks(blocks.codes)
    num_tiles, num_blocks = low.shape[:2]
    both = _tile_rows((blocks.sc.to(torch.uint8) | (blocks.mn.to(torch.uint8) << 4)))
    both = both.view(num_tiles, 16, num_blocks, 2).permute(0, 2, 3, 1).reshape(num_tiles, num_blocks, 32)
    return _super_tiles(torch.cat((low, both), -1), d, dmin)


def _super_tiles(body: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor) -> torch.Tensor:
    """Tiles in super-blocks (``corral/csrc/qmatmul.h``) from each block's bytes ``body`` [tiles, K / 32, bytes] and
    each row's ``d`` and ``dmin`` per super-block of 256 [N, K / 256]: per tile and super-block a 64-byte header of
    the rows' d, then their dmin, as float16, then its 8 blocks; returned as [tiles, K / 32, super-block bytes / 8]
    uint8 (a super-block's bytes over its blocks, the shape the kernels check)."""
    num_tiles, num_blocks, size = body.shape
    supers = num_blocks // 8
    head = torch.cat((_halves(_tile_rows(d.float()), num_tiles, supers),
                      _halves(_tile_rows(dmin.float()), num_tiles, supers)), -1)
    tiles = torch.cat((head, body.reshape(num_tiles, supers, 8 * size)), -1).contiguous()
    return tiles.view(num_tiles, num_blocks, tiles.shape[-1] // 8)


def _pack_super_tiles(blocks: "Q4KBlocks | Q5KBlocks", bits: int) -> torch.Tensor:
    """Q4_K (``bits`` 4) or Q5_K (5) blocks as the native kernels' Q4K or Q5K tiles (layout in
    ``corral/csrc/qmatmul.h``): per tile and super-block of 256 columns, each row's ``d`` and ``dmin`` as float16,
    then per block of 32 a Q4 or Q5 tile block's codes and each row's 6-bit scale and min as a byte; returned as
    [ceil(N / 16), K / 32, super-block bytes / 8] uint8 (a super-block's bytes over its 8 blocks, the shape the
    kernels check)."""
    name, rows, cols = f"Q{bits}K", *blocks.codes.shape
    if cols % 256:
        raise ValueError(f"{name} tiles take whole super-blocks of 256 along K, not {cols} columns")
    if blocks.codes.numel() and int(blocks.codes.max()) >= 1 << bits:
        raise ValueError(f"{name} codes must be 0..{(1 << bits) - 1}")
    if blocks.sc.numel() and max(int(blocks.sc.max()), int(blocks.mn.max())) > 63:
        raise ValueError(f"{name} scales and mins must be 0..63")
    num_tiles, num_blocks, parts = _nibbles_and_masks(blocks.codes, bits)

    def per_row(values: torch.Tensor) -> torch.Tensor:  # [N, B] bytes -> [T, B, 16]: a tile's rows side by side
        return _tile_rows(values.to(torch.uint8)).view(num_tiles, 16, num_blocks).permute(0, 2, 1)

    return _super_tiles(torch.cat((*parts, per_row(blocks.sc), per_row(blocks.mn)), -1), blocks.d, blocks.dmin)


def pack_q4k_tiles(blocks: Q4KBlocks) -> torch.Tensor:
    """Q4_K blocks as Q4K tiles [ceil(N / 16), K / 32, 296] (2368 bytes a super-block): see
    :func:`_pack_super_tiles`."""
    return _pack_super_tiles(blocks, 4)


def pack_q5k_tiles(blocks: Q5KBlocks) -> torch.Tensor:
    """Q5_K blocks as Q5K tiles [ceil(N / 16), K / 32, 360] (2880 bytes a super-block): a Q4K tile's layout with a
    Q5 tile block's codes and fifth-bit masks in each block (see :func:`_pack_super_tiles`)."""
    return _pack_super_tiles(blocks, 5)


def pack_iq4xs_tiles(blocks: IQ4XSBlocks) -> torch.Tensor:
    """IQ4_XS blocks as the native kernel's IQ4XS tiles [ceil(N / 16), K / 32, 280] uint8 (2240 bytes a super-block
    of 256; layout in ``corral/csrc/qmatmul.h``): per super-block each row's ``d`` as float16, then per block a Q4
    tile block of the indices and each row's scale less 32 as an int8."""
    rows, cols = blocks.codes.shape
    if cols % 256:
        raise ValueError(f"IQ4XS tiles take whole super-blocks of 256 along K, not {cols} columns")
    if blocks.codes.numel() and int(blocks.codes.max()) > 15:
        raise ValueError("IQ4XS indices must be 0..15")
    if blocks.sc.numel() and not -32 <= int(blocks.sc.min()) <= int(blocks.sc.max()) <= 31:
        raise ValueError("IQ4XS scales must be -32..31 (6 bits less 32)")
    num_tiles, num_blocks, (codes,) = _nibbles_and_masks(blocks.codes, 4)
    sc = _tile_rows(blocks.sc.to(torch.int8)).view(num_tiles, 16, num_blocks).permute(0, 2, 1).view(torch.uint8)
    return _super_tiles(torch.cat((codes, sc), -1), blocks.d, torch.zeros_like(blocks.d))


def pack_iq4_tiles(blocks: IQ4Blocks) -> torch.Tensor:
    """IQ4 blocks as the native kernel's tiles [ceil(N / 16), K / 32, 320] uint8 (layout in
    ``corral/csrc/qmatmul.h``): a Q4 tile block of the indices, then each row's ``d`` as float32."""
    if blocks.codes.numel() and int(blocks.codes.max()) > 15:
        raise ValueError("IQ4 indices must be 0..15")
    num_tiles, num_blocks, parts = _nibbles_and_masks(blocks.codes, 4)
    d = _tile_rows(blocks.d.float()).view(num_tiles, 16, num_blocks).permute(0, 2, 1).contiguous()
    return torch.cat((*parts, d.view(torch.uint8).view(num_tiles, num_blocks, 64)), -1).contiguous()


def quantize_q8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per block of 32 along K, as GGUF Q8_0 (``w = d q``, d float16): ``(codes [N, K] int8,
    d [N, K / 32] float16)``. Exact on a dequantized Q8_0 tensor: a block's largest code is 127, so
    ``max|w| / 127`` is its d again."""
    rows, cols = weight.shape
    w = weight.float().view(rows, cols // 32, 32)
    d = (w.abs().amax(-1) / 127).to(torch.float16)
    safe = torch.where(d > 0, d.float(), torch.ones_like(d, dtype=torch.float32))
    codes = torch.round(w / safe[..., None]).clamp_(-127, 127).to(torch.int8).view(rows, cols)
    return codes, d


def pack_q8_tiles(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q8 blocks of 32 as the native kernel's tiles [ceil(N / 16), K / 32, 544] uint8 (codes + 128)."""
    rows, cols = codes.shape
    shifted = _tile_rows((codes.to(torch.int16) + 128).to(torch.uint8))
    num_tiles, num_blocks = shifted.shape[0] // 16, cols // 32
    packed = shifted.view(num_tiles, 16, num_blocks, 8, 4).permute(0, 2, 3, 1, 4).reshape(num_tiles, num_blocks, 512)
    return torch.cat((packed, _halves(_tile_rows(d.float()), num_tiles, num_blocks)), -1).contiguous()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The W4A8 kernel's activations, in torch: per row and block of 32, ``(codes, scale, sum)`` with
    ``scale = max|x| / 127``, ``codes = round(x * (127 / max|x|))`` (float32 codes [M, B, 32]; zero where the block
    is) and ``sum = scale * codes.sum()``, the quantized block's sum."""
    rows, cols = x.shape
    blocks = x.float().view(rows, cols // 32, 32)
    amax = blocks.abs().amax(-1)
    # 127 / amax, one correctly rounded division as the kernels take it (``127 / tensor`` would be torch's
    # reciprocal-then-multiply, a unit in the last place off at times, which can move a code across a tie)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127).div(amax), torch.zeros_like(amax))
    codes = torch.round(blocks * inverse[..., None])
    scale = amax / 127
    return codes, scale, scale * codes.sum(-1)


def w4a8_reference(x: torch.Tensor, blocks: Q4Blocks) -> torch.Tensor:
    """What the W4A8 kernel computes, in float64: ``sum_b d s_b (q . xq) + m sum_b`` (float32 [M, N])."""
    codes, scale, sums = (t.double() for t in quantize_activations(x))
    rows, cols = blocks.codes.shape
    q = blocks.codes.double().view(rows, cols // 32, 32)
    d = blocks.scale.to(torch.float16).double()
    m = (blocks.zero.float() - 8 * blocks.scale.float()).to(torch.float16).double()
    dots = torch.einsum("abk,nbk->anb", codes, q)
    return (torch.einsum("anb,nb,ab->an", dots, d, scale) + sums @ m.T).float()


def k_reference(x: torch.Tensor, blocks: "Q4KBlocks | Q5KBlocks") -> torch.Tensor:
    """What the Q4K and Q5K kernels compute, in float64: ``sum_b (d sc_b) s_b (q . xq) - (dmin mn_b) sum_b``
    (float32 [M, N])."""
    codes, scale, sums = (t.double() for t in quantize_activations(x))
    rows, cols = blocks.codes.shape
    q = blocks.codes.double().view(rows, cols // 32, 32)
    d, low = (t.double() for t in _scales_and_mins(blocks.d, blocks.dmin, blocks.sc, blocks.mn, 8))  # exact
    dots = torch.einsum("abk,nbk->anb", codes, q)
    return (torch.einsum("anb,nb,ab->an", dots, d, scale) - sums @ low.T).float()


def iq4_reference(x: torch.Tensor, blocks: IQ4Blocks) -> torch.Tensor:
    """What the IQ4 kernel computes, in float64: ``sum_b d s_b (IQ4_VALUES[q] . xq)`` (float32 [M, N])."""
    xq, scale, _ = (t.double() for t in quantize_activations(x))
    rows, cols = blocks.codes.shape
    values = torch.tensor(IQ4_VALUES, dtype=torch.float64)[blocks.codes.long()].view(rows, cols // 32, 32)
    dots = torch.einsum("abk,nbk->anb", xq.view(xq.shape[0], cols // 32, 32), values)
    return torch.einsum("anb,nb,ab->an", dots, blocks.d.double(), scale).float()


def w6a8_reference(x: torch.Tensor, blocks: Q6Blocks) -> torch.Tensor:
    """What the Q6 kernel computes, in float64: ``sum_b sum_h d sc_h s_b (q . xq - 32 isum_h)`` over each block's
    halves of 16, that is the quantized activations times the weights (float32 [M, N])."""
    xq, scale, _ = (t.double() for t in quantize_activations(x))
    rows, cols = blocks.codes.shape
    halves = (blocks.codes.double() - 32).view(rows, cols // 16, 16)
    sc = blocks.d.double().repeat_interleave(2, dim=1) * blocks.sc.double()
    dots = torch.einsum("ahk,nhk->anh", xq.view(xq.shape[0], cols // 16, 16), halves)
    return torch.einsum("anh,nh,ah->an", dots, sc, scale.repeat_interleave(2, dim=1)).float()


def w3a8_reference(x: torch.Tensor, blocks: Q3Blocks) -> torch.Tensor:
    """What the Q3 kernel computes, in float64: ``sum_b sum_h d sc_h s_b (q . xq - 4 isum_h)`` over each block's
    halves of 16, that is the quantized activations times the weights (float32 [M, N])."""
    return w6a8_reference(x, Q6Blocks(blocks.codes.to(torch.int16) + 28, blocks.d, blocks.sc))


def w2a8_reference(x: torch.Tensor, blocks: Q2Blocks) -> torch.Tensor:
    """What the Q2 kernel computes, in float64: ``sum_b s_b (d sum_h sc_h (q . xq)_h - dmin sum_h mn_h isum_h)``
    over each block's halves of 16, that is the quantized activations times the weights (float32 [M, N])."""
    xq, scale, _ = (t.double() for t in quantize_activations(x))
    rows, cols = blocks.codes.shape
    halves = blocks.codes.double().view(rows, cols // 16, 16)
    xh = xq.view(xq.shape[0], cols // 16, 16)
    sc = blocks.d.double().repeat_interleave(2, dim=1) * blocks.sc.double()
    mn = blocks.dmin.double().repeat_interleave(2, dim=1) * blocks.mn.double()
    s = scale.repeat_interleave(2, dim=1)
    return (torch.einsum("anh,nh,ah->an", torch.einsum("ahk,nhk->anh", xh, halves), sc, s)
            - torch.einsum("ah,nh,ah->an", xh.sum(-1), mn, s)).float()


def w8a8_reference(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """What the Q8 kernel computes, in float64: ``sum_b d s_b (q . xq)`` (float32 [M, N])."""
    xq, scale, _ = (t.double() for t in quantize_activations(x))
    rows, cols = codes.shape
    dots = torch.einsum("abk,nbk->anb", xq, codes.double().view(rows, cols // 32, 32))
    return torch.einsum("anb,nb,ab->an", dots, d.double(), scale).float()


class _Biased:
    """The bias, in the activation dtype, added after a kernel that takes none."""

    def __init__(self, bias: torch.Tensor | None, dtype: torch.dtype):
        self.bias = None if bias is None else bias.to(dtype)

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias


SMALL_ROWS = 16  # float32 products of at most this many rows take the weights on the left (see Dense)


class Dense(_Biased):
    """``W`` in the activation dtype. In float32 on the CPU, a product of 2-16 rows is ``(W @ x.T).T``, and one row is
    taken as two: torch's ``F.linear`` there ran the 49,152 x 576 LM head in 7 ms at one row (a GEMV on one
    thread) and 14-24 ms at two or three (a GEMM that repacks the whole weight), where the weight-on-the-left GEMM
    takes 2.4-4.4 ms (2-core AVX-512 EPYC, torch 2.13). A draft's verification rows paid that: a float32 step
    at a 550-token context went from 36 ms alone to 76 ms with two draft rows. Like ``F.linear``'s, this sums a row
    in an order that may depend on how many rows there are: dense float32 rows are not bit for bit independent of
    their batch (the native W4A8 kernels are)."""

    kind = "dense"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__(bias, dtype)
        self.weight = weight.to(dtype).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else 0
        if 0 < rows <= SMALL_ROWS and x.dtype == torch.float32 and x.device.type == "cpu":
            left = torch.mm(self.weight, (x if rows > 1 else torch.cat((x, x))).T).T
            return self._add_bias((left if rows > 1 else left[:1]).contiguous())
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


class Int8Rows(_Biased):
    kind = "w8a16"

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__(bias, dtype)
        self.codes, self.scale = codes.contiguous(), scale.to(dtype).contiguous()

    @classmethod
    def from_dense(cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> "Int8Rows":
        return cls(*quantize_int8_rows(weight), bias, dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._add_bias(torch._weight_int8pack_mm(x, self.codes, self.scale))

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes


class Int4Groups(_Biased):
    kind = "w4a16"

    def __init__(self, blocks: Q4Blocks, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__(bias, dtype)
        self.out_features, self.group = blocks.codes.shape[0], blocks.group
        # blocks on a CUDA device run through the Triton kernel, in its own layout
        self.cuda_weight = pack_int4(blocks, dtype) if blocks.codes.is_cuda else None
        if self.cuda_weight is not None:
            return
        pad = -self.out_features % 16
        codes, scale, zero = (F.pad(t, (0, 0, 0, pad)) for t in blocks[:3])  # zero rows: outputs sliced off
        self.packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        # [K // group, N, 2]: the kernel's layout, rounded once to the activation dtype
        self.scale_zero = torch.stack((scale, zero), dim=-1).transpose(0, 1).to(dtype).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.cuda_weight is not None:
            return self._add_bias(int4_matmul(x, self.cuda_weight))
        y = torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scale_zero)
        return self._add_bias(y[:, : self.out_features] if y.shape[-1] != self.out_features else y)

    @property
    def nbytes(self) -> int:
        if self.cuda_weight is not None:
            return self.cuda_weight.nbytes
        return self.packed.nbytes + self.scale_zero.nbytes


class _TileLinear(_Biased):
    """A linear layer on a native integer kernel (``corral/csrc/qmatmul.h``): the blocks packed into its tiles by
    ``_pack``, the product ``_kernel``, float32 activations quantized to int8 per block of 32 on the fly: the product
    of the weights with the quantized activations."""

    _kernel: str

    def __init__(self, blocks, bias: torch.Tensor | None):
        super().__init__(bias, torch.float32)
        self.out_features, self.in_features = blocks.codes.shape
        self.tiles = self._pack(blocks)

    @staticmethod
    def _pack(blocks) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._add_bias(native_matmul(self._kernel, x, self.tiles, self.out_features))

    @property
    def nbytes(self) -> int:
        return self.tiles.nbytes


class Q4Tiles(_TileLinear):
    """W4A8: Q4 blocks of 32 (GGUF Q4_1/Q4_0/Q4_K as shipped, or :func:`quantize_int4` at group 32)."""

    kind, _kernel, _pack = "w4a8", "q4_matmul", staticmethod(pack_q4_tiles)


class Q5Tiles(_TileLinear):
    """W5A8: :class:`Q5Blocks`, as :class:`Q4Tiles` with codes up to 31: a ``w4a8`` linear whose file keeps 5 bits a
    weight (GGUF Q5_0, Q5_1), 0.75 bytes a weight where Q8 blocks take 1.06."""

    kind, _kernel, _pack = "w5a8", "q5_matmul", staticmethod(pack_q5_tiles)


class Q6Tiles(_TileLinear):
    """W6A8: :class:`Q6Blocks` (GGUF Q6_K as shipped): 0.875 bytes a weight where Q8 blocks take 1.06 and round it."""

    kind, _kernel, _pack = "w6a8", "q6_matmul", staticmethod(pack_q6_tiles)


class Q3Tiles(_TileLinear):
    """W3A8: :class:`Q3Blocks` (GGUF Q3_K as shipped): 0.453 bytes a weight where Q4 tiles take 0.625 and would round
    each weight to their even steps."""

    kind, _kernel, _pack = "w3a8", "q3_matmul", staticmethod(pack_q3_tiles)


class Q2Tiles(_TileLinear):
    """W2A8: :class:`Q2Blocks` (GGUF Q2_K as shipped): 0.328 bytes a weight where Q4 tiles take 0.625 and would round
    each weight to their even steps."""

    kind, _kernel, _pack = "w2a8", "q2_matmul", staticmethod(pack_q2_tiles)


class Q4KTiles(_TileLinear):
    """W4A8 on llama.cpp's Q4_K as shipped: :class:`Q4KBlocks`, 0.578 bytes a weight where Q4 tiles take 0.625 (and
    round each block's d sc and dmin mn to float16)."""

    kind, _kernel, _pack = "w4a8", "q4k_matmul", staticmethod(pack_q4k_tiles)


class Q5KTiles(_TileLinear):
    """W5A8 on llama.cpp's Q5_K as shipped: :class:`Q5KBlocks`, 0.703 bytes a weight where Q5 tiles take 0.75 (and
    round each block's d sc and dmin mn to float16)."""

    kind, _kernel, _pack = "w5a8", "q5k_matmul", staticmethod(pack_q5k_tiles)


class IQ4Tiles(_TileLinear):
    """W4A8 on llama.cpp's non-linear 4-bit grid: :class:`IQ4Blocks` (GGUF IQ4_NL and IQ4_XS as shipped), 0.625 bytes
    a weight as Q4 tiles, where rounding them to Q4 blocks' even steps would move every weight."""

    kind, _kernel, _pack = "w4a8", "iq4_matmul", staticmethod(pack_iq4_tiles)


class IQ4XSTiles(_TileLinear):
    """W4A8 on llama.cpp's non-linear 4-bit grid with its IQ4_XS scales as shipped: :class:`IQ4XSBlocks`, 0.547 bytes
    a weight where IQ4 tiles take 0.625."""

    kind, _kernel, _pack = "w4a8", "iq4xs_matmul", staticmethod(pack_iq4xs_tiles)


class SplitLinear(_Biased):
    """A fused linear (QKV, gate/up) whose parts a file keeps in different kinds (a Q4_K_M file's Q6_K value
    projection beside Q4_K query and key, an IQ4_XS file's Q5_K one beside IQ4 ones): each part on its own native
    kernel as shipped, their outputs side by side, then the bias; column for column the products a fused layer of
    that kind would give."""

    kind = "w4a8"

    def __init__(self, parts: list[_TileLinear], bias: torch.Tensor | None):
        super().__init__(bias, torch.float32)
        self.parts = parts
        self.out_features, self.in_features = sum(p.out_features for p in parts), parts[0].in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._add_bias(torch.cat([part(x) for part in self.parts], dim=1))

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


class Q8Linear(_TileLinear):
    """W8A8: Q8 blocks of 32 (:class:`Q8Blocks`): a linear layer under ``w4a8`` whose weights have 8 bits (a GGUF's
    Q8_0 tensors)."""

    kind, _kernel = "w8a8", "q8_matmul"

    @staticmethod
    def _pack(blocks: Q8Blocks) -> torch.Tensor:
        return pack_q8_tiles(blocks.codes, blocks.d)


class _HeadTiles:
    """An LM head on a native kernel: its tiles on huge pages where granted (streamed whole each step); also the
    embedding (``rows(ids)``: the dequantized rows), from the same tiles when tied."""

    _kernel: str

    def __init__(self, tiles: torch.Tensor, out_features: int, in_features: int):
        self.out_features, self.in_features = out_features, in_features
        self.tiles = hugepages.copy(tiles)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return native_matmul(self._kernel, x, self.tiles, self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty(len(ids), self.in_features)
        native.module().tile_rows(buffer(self.tiles), self.out_features, buffer(ids.contiguous()), buffer(out))
        return out

    @property
    def nbytes(self) -> int:
        return self.tiles.nbytes


class Q6Head(_HeadTiles):
    """An LM head or embedding of GGUF Q6_K blocks as shipped (:class:`Q6Blocks` in Q6 tiles, the W6A8 kernel;
    ``rows(ids)`` as ``blocks.dequantize()[ids]``, bit for bit), where Q8 rows would round it and take 1.06 bytes a
    weight against 0.875."""

    kind, _kernel = "w6a8", "q6_matmul"

    def __init__(self, blocks: Q6Blocks):
        super().__init__(pack_q6_tiles(blocks), *blocks.codes.shape)


class Q8Tiles(_HeadTiles):
    """W8A8 rows in blocks of 32 (GGUF Q8_0 as shipped: :func:`quantize_q8_blocks` gives its codes back) through
    the native kernel."""

    kind, _kernel = "w8a8", "q8_matmul"

    def __init__(self, weight: torch.Tensor):
        super().__init__(pack_q8_tiles(*quantize_q8_blocks(weight)), *weight.shape)


def native_matmul(name: str, x: torch.Tensor, tiles: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` [M, K] (any float dtype; float32 inside) times the tiles' ``n`` rows: float32 [M, n]."""
    out = torch.empty(x.shape[0], n)
    getattr(native.module(), name)(buffer(x.float().contiguous()), buffer(tiles), n, buffer(out),
                                   torch.get_num_threads())
    return out


class Int8Embedding:
    """Embedding rows as int8 with one scale each; also the tied LM head (``head(x)``: logits over the rows)."""

    kind = "w8a16"

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        self.codes, scale = quantize_int8_rows(weight)
        self.scale, self.dtype = scale.to(dtype).contiguous(), dtype
        self.head = Int8Rows(self.codes, scale, None, dtype)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.codes[ids].to(self.dtype) * self.scale[ids, None]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

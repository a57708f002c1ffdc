"""Weight loading: a GGUF file or a local HF folder (safetensors) → a flat dict of torch tensors in HF naming.

GGUF tensors are dequantized with the ``gguf`` package's numpy dequantizer (Q4_1, Q8_0, F16, K-quants, ...),
except that with ``keep_q4`` the Q4_1, Q4_0 and Q4_K blocks of linear layers stay as int4 codes with their scale
and zero per 32 weights (:class:`~corral.engine.quant.Q4Blocks`), which the int4 kernels run as shipped, and with
``keep_q8`` (``w4a8``) its Q4_K and Q5_K linears stay as 4- and 5-bit codes with their super-block's d and dmin
and 6-bit scales and mins (:class:`~corral.engine.quant.Q4KBlocks`, :class:`~corral.engine.quant.Q5KBlocks`), its
Q5_0 and Q5_1 linears as 5-bit codes the same way as Q4 blocks
(:class:`~corral.engine.quant.Q5Blocks`), its Q6_K ones (and a Q6_K embedding or LM head) as 6-bit codes with
their scales (:class:`~corral.engine.quant.Q6Blocks`), its Q3_K ones as 3-bit codes with their scales
(:class:`~corral.engine.quant.Q3Blocks`), its Q2_K ones as 2-bit codes with their scales and mins
(:class:`~corral.engine.quant.Q2Blocks`), its IQ4_NL ones as 4-bit indices into llama.cpp's grid with a float32
scale per 32 (:class:`~corral.engine.quant.IQ4Blocks`), its IQ4_XS ones as such indices with their super-block's d
and 6-bit scales (:class:`~corral.engine.quant.IQ4XSBlocks`) and its Q8_0 ones as int8 codes with one
float16 scale per 32 weights (:class:`~corral.engine.quant.Q8Blocks`). A Llama's Q/K projections (and biases) are
un-permuted: llama.cpp's converter interleaves each head's rotary halves, HF's layout (which
:mod:`corral.engine.model` uses, ``rotate_half`` RoPE) keeps them as two halves. A Qwen2's are as HF has them.

Converting the shipped GGUF takes a few seconds, so the converted tensors are cached as one safetensors file
per (source file, size, mtime, dtype, blocks kept) under ``$CORRAL_CACHE_DIR`` (default ``~/.cache/corral``).
What this leaves out: sharded ``.bin`` checkpoints.
"""

import glob
import hashlib
import logging
import os

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from corral.cache import cache_dir
from corral.engine.quant import (IQ4Blocks, IQ4XSBlocks, Q2Blocks, Q3Blocks, Q4Blocks, Q4KBlocks, Q5Blocks,
                                 Q5KBlocks, Q6Blocks, Q8Blocks,
                                 quantize_q8_blocks)
from corral.errors import ModelNotFoundError
from corral.models import ModelConfig, ModelFiles

log = logging.getLogger(__name__)

# GGUF tensor name (after "blk.{i}.") → HF name (after "model.layers.{i}.").
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleave of the rotary halves (rows of a Q or K projection, or its bias)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _gguf_name(name: str) -> str | None:
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    if name.startswith("blk."):
        _, layer, rest = name.split(".", 2)
        if rest in _GGUF_LAYER_NAMES:
            return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[rest]}"
    return None  # e.g. rope_freqs: derived from the config instead


_Q4_KINDS = ("Q4_0", "Q4_1", "Q4_K")
# linears with more than 4 bits a weight, kept under w4a8 at 5 (Q5 blocks of 32), 6 (Q6 blocks) or 8 (Q8 blocks of
# 32), where Q4 blocks would lose bits
_Q5_KINDS = ("Q5_0", "Q5_1", "Q5_K")
_Q6_KINDS = ("Q6_K",)
_IQ4_KINDS = ("IQ4_NL", "IQ4_XS")  # llama.cpp's non-linear 4-bit grid: IQ4 blocks under w4a8
# 2 and 3 bits a weight: Q2 and Q3 blocks under w4a8, where Q4 blocks' even steps would move every weight
_Q2_KINDS, _Q3_KINDS = ("Q2_K",), ("Q3_K",)
_Q8_KINDS = ("Q8_0",)
_KEPT_KINDS = (*_Q2_KINDS, *_Q3_KINDS, *_Q5_KINDS, *_Q6_KINDS, *_Q8_KINDS, *_IQ4_KINDS)  # w4a8's beside Q4 ones
# a tensor kept as shipped
Blocks = Q2Blocks | Q3Blocks | Q4Blocks | Q4KBlocks | Q5Blocks | Q5KBlocks | Q6Blocks | Q8Blocks | IQ4Blocks | \
    IQ4XSBlocks


def q4_blocks(raw: np.ndarray, kind: str, rows: int, cols: int) -> Q4Blocks:
    """The codes, scale and zero of GGUF Q4_1 (``w = d q + m``), Q4_0 (``w = d (q - 8)``) or Q4_K rows ``raw``
    (bytes [rows, blocks * block_bytes]), as ``w = (q - 8) scale + zero``: scale = d, zero = m + 8 d (Q4_1) or 0
    (Q4_0). A block is its float16 d (and m), then 16 bytes: the low nibbles are weights 0-15, the high ones 16-31.
    Q4_K: :func:`q4k_blocks` as Q4 blocks (:meth:`Q4KBlocks.as_q4`)."""
    if kind == "Q4_K":
        return q4k_blocks(raw, rows, cols).as_q4()
    head = 4 if kind == "Q4_1" else 2
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // 32, head + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., head:]
    codes = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1).reshape(rows, cols)
    zero = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) + 8 * d if kind == "Q4_1" \
        else np.zeros_like(d)
    return Q4Blocks(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zero), 32)


Q4K_BYTES, Q5K_BYTES = 144, 176  # K-quant super-blocks of 256: float16 d and dmin, 12 bytes of 6-bit scales, codes
Q6K_BYTES = 210  # 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales, float16 d


def _k_fields(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_K or Q5_K tensor's super-blocks [rows, S, bytes] → ``(d, dmin)`` [rows, S] float32 (float16 values) and
    each sub-block of 32's 6-bit scale and min ``(sc, mn)`` [rows, S, 8] uint8, as llama.cpp unpacks them from
    their 12 bytes."""
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 4:16].astype(np.uint8)
    sc = np.empty(packed.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = packed[..., 0:4] & 63, packed[..., 4:8] & 63
    sc[..., 4:] = (packed[..., 8:12] & 0x0F) | ((packed[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)
    return d, dmin, sc, mn


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_K or Q5_K tensor's super-blocks [rows, S, bytes] → each sub-block of 32's scale ``d sc`` and min
    ``dmin mn`` [rows, S * 8] in float32 (exact: 11 by 6 significant bits)."""
    d, dmin, sc, mn = _k_fields(blocks)
    rows = blocks.shape[0]
    return (d[..., None] * sc).reshape(rows, -1), (dmin[..., None] * mn).reshape(rows, -1)


def _k_blocks(kind: type, blocks: np.ndarray, fifth: np.ndarray | None = None) -> "Q4KBlocks | Q5KBlocks":
    """Q4_K or Q5_K super-blocks [rows, S, bytes] as ``kind`` (:class:`Q4KBlocks` or :class:`Q5KBlocks`): their d,
    dmin, scales and mins (:func:`_k_fields`), and their codes from the last 128 bytes (bytes 32j .. 32j + 31 hold
    sub-blocks 2j in their low nibbles and 2j + 1 in their high ones) plus ``fifth`` [rows, S, 8, 32] (Q5_K's fifth
    bits, as 0 or 16)."""
    rows, supers = blocks.shape[:2]
    d, dmin, sc, mn = _k_fields(blocks)
    qs = blocks[..., -128:].reshape(rows, supers, 4, 32)
    codes = np.stack((qs & 0x0F, qs >> 4), axis=3).reshape(rows, supers, 8, 32)
    if fifth is not None:
        codes = codes | fifth
    tensor = lambda v: torch.from_numpy(np.ascontiguousarray(v))  # noqa: E731
    return kind(tensor(codes.reshape(rows, -1).astype(np.uint8)), tensor(d), tensor(dmin),
                tensor(sc.reshape(rows, -1)), tensor(mn.reshape(rows, -1)))


def q4k_blocks(raw: np.ndarray, rows: int, cols: int) -> Q4KBlocks:
    """GGUF Q4_K rows ``raw`` (bytes [rows, cols / 256 * 144]) as Q4K blocks, in the file's row order. A
    super-block of 256 weights is float16 ``d`` and ``dmin``, eight 6-bit scales ``sc`` and mins ``mn`` packed in
    12 bytes, then 128 bytes of codes (see :func:`_k_blocks`). Sub-block s's weight is ``(d sc[s]) q - dmin mn[s]``
    (llama.cpp's dequantization)."""
    if cols % 256:
        raise ValueError(f"Q4_K rows of {cols} weights: not whole super-blocks of 256")
    return _k_blocks(Q4KBlocks, np.ascontiguousarray(raw).reshape(rows, cols // 256, Q4K_BYTES))


def q5k_blocks(raw: np.ndarray, values: torch.Tensor) -> Q5KBlocks | None:
    """GGUF Q5_K rows as Q5K blocks, in the file's row order, from ``raw`` (its bytes [rows, cols / 256 * 176]): a
    super-block is Q4_K's float16 d and dmin and 12 bytes of 6-bit scales and mins, then 32 bytes ``qh`` of fifth
    bits, then 128 bytes ``qs`` of low 4 bits as Q4_K keeps its codes: weight l of sub-block j has its fifth bit at
    bit j of ``qh[l]``. Checked to give llama.cpp's dequantized ``values`` [rows, cols] back exactly. None where
    they do not (the caller then reads the tensor as Q5 blocks)."""
    rows, cols = values.shape
    if cols % 256:
        return None
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // 256, Q5K_BYTES)
    qh = blocks[..., 16:48].reshape(rows, cols // 256, 1, 32)
    kept = _k_blocks(Q5KBlocks, blocks, ((qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1) << 4)
    return kept if torch.equal(kept.dequantize(), values) else None


def q5_blocks(raw: np.ndarray, kind: str, values: torch.Tensor) -> Q5Blocks | None:
    """GGUF Q5_0 (``d (q - 16)``), Q5_1 (``d q + m``) or Q5_K (per sub-block of 32, ``d sc q - dmin mn``) rows as
    Q5 blocks of 32, in the file's row order: each block's d and m from ``raw`` (its bytes [rows, ...]), its codes
    0..31 from llama.cpp's dequantized ``values`` [rows, cols], as ``round((w - m) / d)``, checked to give those
    values back (to float32 rounding). None where they do not: the caller then rounds the tensor to Q8 blocks."""
    rows, cols = values.shape
    if kind == "Q5_K":
        if cols % 256:
            return None
        scale, low = _k_scales(np.ascontiguousarray(raw).reshape(rows, cols // 256, Q5K_BYTES))
        d, m = scale, -low
    else:
        blocks = np.ascontiguousarray(raw).reshape(rows, cols // 32, 22 if kind == "Q5_0" else 24)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = -16 * d if kind == "Q5_0" else blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    d, m = torch.from_numpy(np.ascontiguousarray(d, np.float32)), torch.from_numpy(np.ascontiguousarray(m, np.float32))
    w = values.view(rows, cols // 32, 32)
    codes = torch.round((w - m[..., None]) / torch.where(d == 0, 1.0, d)[..., None]).clamp_(0, 31)
    back = codes * d[..., None] + m[..., None]
    if not bool(((back - w).abs() <= 2.0 ** -20 * (31 * d.abs() + m.abs())[..., None]).all()):
        return None
    return Q5Blocks(codes.to(torch.uint8).view(rows, cols), d, m + 8 * d)


def q6_blocks(raw: np.ndarray, values: torch.Tensor) -> Q6Blocks | None:
    """GGUF Q6_K rows as Q6 blocks, in the file's row order: each super-block of 256's float16 ``d`` and its 16 int8
    scales (weight ``w`` of the super-block takes scale ``w // 16``) from ``raw`` (its bytes [rows, ...]), the codes
    0..63 from llama.cpp's dequantized ``values`` [rows, cols] (``d sc (q - 32)``), checked to give those values back
    (to float32 rounding). None where they do not: the caller then rounds the tensor to Q8 blocks."""
    rows, cols = values.shape
    if cols % 256:
        return None
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // 256, Q6K_BYTES)
    d = blocks[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, S]
    sc = blocks[..., 192:208].copy().view(np.int8)  # [rows, S, 16]
    d, sc = torch.from_numpy(np.ascontiguousarray(d)), torch.from_numpy(np.ascontiguousarray(sc))
    scale = d[..., None] * sc.float()  # exact: 11 by 8 significant bits
    w = values.view(rows, cols // 256, 16, 16)
    codes = (torch.round(w / torch.where(scale == 0, 1.0, scale)[..., None]) + 32).clamp_(0, 63)
    back = (codes - 32) * scale[..., None]
    if not bool(((back - w).abs() <= 2.0 ** -20 * 32 * scale.abs()[..., None]).all()):
        return None
    return Q6Blocks(codes.to(torch.uint8).view(rows, cols), d.repeat_interleave(8, dim=1), sc.reshape(rows, -1))


Q3K_BYTES = 110  # 32 bytes of third bits, 64 of low 2 bits, 12 of 6-bit scales, float16 d


def q3_blocks(raw: np.ndarray, values: torch.Tensor) -> Q3Blocks | None:
    """GGUF Q3_K rows as Q3 blocks, in the file's row order, from ``raw`` (its bytes [rows, ...]). Weight k = 128 h
    + 32 j + 16 s + l of a super-block of 256 (h, s 0..1, j 0..3, l 0..15) has its low 2 bits at bit 2 j of byte 32 h
    + 16 s + l of ``qs``, its third bit at bit 4 h + j of byte 16 s + l of ``hmask``, and scale k // 16: 6 bits, the
    low 4 in the low (scales 0-7) or high (8-15) nibble of byte k // 16 % 8, the high 2 at bits 2 (k // 64) of byte
    8 + k // 16 % 4 of the 12; ``w = d (scale - 32) (q - 4)``. Checked to give llama.cpp's dequantized ``values``
    [rows, cols] back exactly. None where they do not: the caller then rounds the tensor to Q8 blocks."""
    rows, cols = values.shape
    if cols % 256:
        return None
    supers = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // 256, Q3K_BYTES)
    hmask = supers[..., :32].reshape(rows, -1, 1, 1, 2, 16)  # [rows, S, h, j, s, l]
    qs = supers[..., 32:96].reshape(rows, -1, 2, 1, 2, 16)
    j = np.arange(4).reshape(1, 1, 1, 4, 1, 1)
    h = np.arange(2).reshape(1, 1, 2, 1, 1, 1)
    codes = ((qs >> (2 * j)) & 3) | (((hmask >> (4 * h + j)) & 1) << 2)
    b = supers[..., 96:108].astype(np.int16)
    sub = np.arange(16)
    low = np.where(sub < 8, b[..., sub % 8] & 0x0F, b[..., sub % 8] >> 4)
    sc = (low | (((b[..., 8 + sub % 4] >> (2 * (sub // 4))) & 3) << 4)) - 32  # [rows, S, 16]
    d = supers[..., 108:110].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, S]
    kept = Q3Blocks(torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, cols).astype(np.uint8))),
                    torch.from_numpy(np.ascontiguousarray(d)).repeat_interleave(8, dim=1),
                    torch.from_numpy(np.ascontiguousarray(sc.reshape(rows, -1).astype(np.int8))))
    return kept if torch.equal(kept.dequantize(), values) else None


Q2K_BYTES = 84  # 16 bytes of 4-bit scales and mins, 64 of 2-bit codes, float16 d and dmin


def q2_blocks(raw: np.ndarray, values: torch.Tensor) -> Q2Blocks | None:
    """GGUF Q2_K rows as Q2 blocks, in the file's row order, from ``raw`` (its bytes [rows, ...]). Weight k = 128 h
    + 32 j + 16 s + l of a super-block of 256 (h, s 0..1, j 0..3, l 0..15) has its code at bit 2 j of byte 32 h +
    16 s + l of ``qs`` (as Q3_K's), and byte k // 16 of ``scales`` holds its scale (low nibble) and min (high);
    ``w = (d sc) q - dmin mn``. Checked to give llama.cpp's dequantized ``values`` [rows, cols] back exactly. None
    where they do not: the caller then rounds the tensor to Q8 blocks."""
    rows, cols = values.shape
    if cols % 256:
        return None
    supers = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // 256, Q2K_BYTES)
    qs = supers[..., 16:80].reshape(rows, -1, 2, 1, 32)  # [rows, S, h, j, 16 s + l]
    codes = ((qs >> (2 * np.arange(4).reshape(1, 1, 1, 4, 1))) & 3).astype(np.uint8)
    scales = supers[..., :16]
    d = supers[..., 80:82].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, S]
    dmin = supers[..., 82:84].copy().view(np.float16)[..., 0].astype(np.float32)
    per_block = lambda v: torch.from_numpy(np.ascontiguousarray(v)).repeat_interleave(8, dim=1)  # noqa: E731
    kept = Q2Blocks(torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, cols))), per_block(d), per_block(dmin),
                    torch.from_numpy(np.ascontiguousarray((scales & 0x0F).reshape(rows, -1))),
                    torch.from_numpy(np.ascontiguousarray((scales >> 4).reshape(rows, -1))))
    return kept if torch.equal(kept.dequantize(), values) else None


_ROW_TABLES = ("model.embed_tokens.weight", "lm_head.weight")  # looked up by row or run as the head: w4a8 keeps Q6_K
IQ4_NL_BYTES, IQ4_XS_BYTES = 18, 136  # a block of 32 (float16 d, 16 bytes of indices); a super-block of 256


def iq4_blocks(raw: np.ndarray, kind: str, values: torch.Tensor) -> IQ4Blocks | IQ4XSBlocks | None:
    """GGUF IQ4_NL rows as IQ4 blocks, or IQ4_XS rows as IQ4XS blocks, in the file's row order, from ``raw`` (its
    bytes [rows, ...]): each block's 16 bytes of indices (byte j: index j in its low nibble, j + 16 in its high one)
    and IQ4_NL's float16 d, or IQ4_XS's super-block float16 d and each block's 6-bit scale less 32 (the scale's low
    4 bits in ``scales_l``, its high 2 in ``scales_h``); checked to give llama.cpp's dequantized ``values`` [rows,
    cols] back exactly. None where they do not: the caller then rounds the tensor to Q8 blocks."""
    rows, cols = values.shape
    raw = np.ascontiguousarray(raw).view(np.uint8)
    if kind == "IQ4_NL":
        blocks = raw.reshape(rows, cols // 32, IQ4_NL_BYTES)
        d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        indices = blocks[..., 2:]
    else:
        if cols % 256:
            return None
        supers = raw.reshape(rows, cols // 256, IQ4_XS_BYTES)
        d = supers[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, S]
        high = supers[..., 2:4].copy().view(np.uint16)[..., 0]  # [rows, S]: 2 bits a block
        low = supers[..., 4:8]  # [rows, S, 4]: 4 bits a block
        block = np.arange(8)
        scale = ((low[..., block // 2] >> (4 * (block % 2))) & 0x0F) | (((high[..., None] >> (2 * block)) & 3) << 4)
        sc = (scale.astype(np.int16) - 32).astype(np.int8).reshape(rows, cols // 32)
        indices = supers[..., 8:].reshape(rows, cols // 32, 16)
    codes = torch.from_numpy(np.ascontiguousarray(np.concatenate((indices & 0x0F, indices >> 4), axis=-1)
                                                  .reshape(rows, cols)))
    kept = IQ4Blocks(codes, torch.from_numpy(np.ascontiguousarray(d))) if kind == "IQ4_NL" else \
        IQ4XSBlocks(codes, torch.from_numpy(np.ascontiguousarray(d)), torch.from_numpy(np.ascontiguousarray(sc)))
    return kept if torch.equal(kept.dequantize(), values) else None


def _is_layer_linear(name: str) -> bool:
    """Whether HF-named ``name`` is a layer's linear weight (a projection: what the native kernels run)."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def gguf_linear_kinds(files: ModelFiles) -> set[str]:
    """The GGUF block types of ``files``' layers' linear weights (empty for an HF folder)."""
    if files.kind != "gguf":
        return set()
    from corral.models.gguf_file import gguf_tensors

    return {t.tensor_type.name for t in gguf_tensors(files.path) if _is_layer_linear(_gguf_name(t.name) or "")}


def gguf_has_q4(files: ModelFiles) -> bool:
    """Whether ``files`` is a GGUF whose layers' linear weights are Q4_0, Q4_1 or Q4_K blocks (the int4 kernels')."""
    return bool(gguf_linear_kinds(files) & set(_Q4_KINDS))


def gguf_has_q8(files: ModelFiles) -> bool:
    """Whether ``files`` is a GGUF whose layers' linear weights are Q2_K, Q3_K, Q5, Q6_K, Q8_0, IQ4_NL or IQ4_XS
    blocks (Q2, Q3, Q5, Q6, Q8 or IQ4 blocks under w4a8)."""
    return bool(gguf_linear_kinds(files) & set(_KEPT_KINDS))


def _log_dequantized(path: str, keep_q8: bool = False) -> None:
    """With Q4 blocks kept: say which GGUF types have no kernel here and were dequantized (on every load)."""
    from corral.models.gguf_file import gguf_tensors

    linear_kinds = {*_Q4_KINDS, *(_KEPT_KINDS if keep_q8 else ())}  # linears

    def kept(name: str, kind: str) -> bool:
        return kind in ("F32", "F16", "BF16") or (_is_layer_linear(name) and kind in linear_kinds) or \
            (keep_q8 and name in _ROW_TABLES and kind in _Q6_KINDS)  # a Q6_K embedding or head runs as shipped

    kinds = sorted({t.tensor_type.name for t in gguf_tensors(path)
                    if (name := _gguf_name(t.name)) and not kept(name, t.tensor_type.name)})
    if kinds:
        log.info("GGUF blocks with no kernel here were dequantized at load: %s (Q4_0, Q4_1 and Q4_K linears run as "
                 "shipped%s; an embedding or LM head is then requantized to int8 rows)", ", ".join(kinds),
                 " (Q4_K ones as Q4K blocks), Q2_K, Q3_K, Q5_0, Q5_1, Q5_K and Q6_K ones as Q2, Q3, Q5, Q5K and Q6 "
                 "blocks, Q8_0 ones as Q8 blocks, IQ4_NL and IQ4_XS ones as IQ4 and IQ4XS blocks"
                 if keep_q8 else "")


def _unpermuted(kept: Blocks, heads: int | None) -> Blocks:
    """Blocks with every tensor field's rows in the rotary order the dense values take (GGUF Llama files permute
    the query and key rows); as they are for other tensors (``heads`` None)."""
    return type(kept)(*(torch.from_numpy(np.ascontiguousarray(unpermute_rotary(f.numpy(), heads)))
                        if heads and isinstance(f, torch.Tensor) else f for f in kept))


def _read_gguf(path: str, config: ModelConfig, keep_q4: bool = False,
               keep_q8: bool = False) -> dict[str, torch.Tensor | Blocks]:
    from gguf.quants import dequantize

    from corral.models.gguf_file import gguf_tensors

    tensors = {}
    for tensor in gguf_tensors(path):
        name = _gguf_name(tensor.name)
        if name is None:
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists dims innermost first
        kind = tensor.tensor_type.name
        heads = None if config.architecture != "llama" else \
            config.num_heads if ".q_proj." in name else config.num_kv_heads if ".k_proj." in name else None
        if keep_q8 and kind == "Q4_K" and _is_layer_linear(name):  # w4a8: Q4K blocks, as shipped
            tensors[name] = _unpermuted(q4k_blocks(tensor.data, *shape), heads)
            continue
        if keep_q4 and kind in _Q4_KINDS and name.startswith("model.layers."):
            blocks = q4_blocks(tensor.data, kind, *shape)
            if heads:
                blocks = Q4Blocks(*(torch.from_numpy(unpermute_rotary(f.numpy(), heads)) for f in blocks[:3]), 32)
            tensors[name] = blocks
            continue
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        linear = _is_layer_linear(name)
        kept = None
        if keep_q8 and linear and kind in _Q5_KINDS:
            exact = torch.from_numpy(np.array(values, copy=True))
            kept = (q5k_blocks(tensor.data, exact) if kind == "Q5_K" else None) or q5_blocks(tensor.data, kind, exact)
        elif keep_q8 and linear and kind in _Q2_KINDS:
            kept = q2_blocks(tensor.data, torch.from_numpy(np.array(values, copy=True)))
        elif keep_q8 and linear and kind in _Q3_KINDS:
            kept = q3_blocks(tensor.data, torch.from_numpy(np.array(values, copy=True)))
        elif keep_q8 and linear and kind in _IQ4_KINDS:
            kept = iq4_blocks(tensor.data, kind, torch.from_numpy(np.array(values, copy=True)))
        elif keep_q8 and (linear or name in _ROW_TABLES) and kind in _Q6_KINDS:
            kept = q6_blocks(tensor.data, torch.from_numpy(np.array(values, copy=True)))
        if kept is not None:
            tensors[name] = _unpermuted(kept, heads)
            continue
        if heads:
            values = unpermute_rotary(values, heads)
        values = torch.from_numpy(np.array(values, copy=True))  # writable: torch warns on read-only
        if keep_q8 and linear and kind in _KEPT_KINDS:
            # Q8_0 exactly; a Q2, Q3, Q5, Q6 or IQ4 tensor that failed its check, rounded
            values = Q8Blocks(*quantize_q8_blocks(values))
        tensors[name] = values
    return tensors


def _read_hf(folder: str) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ModelNotFoundError(f"{folder} has no *.safetensors weights")
    tensors = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors


def _cache_path(files: ModelFiles, dtype: torch.dtype, keep_q4: bool, keep_q8: bool = False) -> str:
    stat = os.stat(files.path if files.kind == "gguf" else os.path.join(files.path, "config.json"))
    kept = ("-q4" if keep_q4 else "") + ("-q8" if keep_q8 else "")
    key = f"{files.path}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}|{kept}|v11"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    tag = str(dtype).removeprefix("torch.") + kept
    return os.path.join(cache_dir(), "weights", f"{files.name}-{tag}-{digest}.safetensors")


_BLOCKS = {"q4": Q4Blocks, "q5": Q5Blocks, "q6": Q6Blocks, "q8": Q8Blocks,  # safetensors prefix -> the blocks' type
           "iq4": IQ4Blocks, "q3": Q3Blocks, "q2": Q2Blocks, "q4k": Q4KBlocks, "q5k": Q5KBlocks,
           "iq4xs": IQ4XSBlocks}
_FIELDS = {prefix: tuple(f for f in kind._fields if f != "group") for prefix, kind in _BLOCKS.items()}


def _flatten(tensors: dict) -> dict[str, torch.Tensor]:
    """One safetensors dict: Q4 and Q5 blocks as three tensors each (``<name>.q4_codes`` / ``.q4_scale`` /
    ``.q4_zero``, the same with ``q5_``), Q6 and Q3 blocks as three (``.q6_codes`` / ``.q6_d`` / ``.q6_sc``, the same
    with ``q3_``), Q2, Q4K and Q5K blocks as five (``.q2_codes`` / ``.q2_d`` / ``.q2_dmin`` / ``.q2_sc`` / ``.q2_mn``,
    the same with ``q4k_`` and ``q5k_``), IQ4XS blocks as three (``.iq4xs_codes`` / ``.iq4xs_d`` / ``.iq4xs_sc``), Q8
    and IQ4 blocks as two (``<name>.q8_codes`` / ``.q8_d``, ``.iq4_codes`` / ``.iq4_d``)."""
    flat = {}
    for name, value in tensors.items():
        prefix = next((p for p, kind in _BLOCKS.items() if type(value) is kind), None)
        if prefix is None:
            flat[name] = value
        else:
            flat.update({f"{name}.{prefix}_{field}": getattr(value, field).contiguous() for field in _FIELDS[prefix]})
    return flat


def _unflatten(flat: dict[str, torch.Tensor]) -> dict:
    marks = tuple(f".{prefix}_" for prefix in _BLOCKS)
    tensors = {name: value for name, value in flat.items() if not any(mark in name for mark in marks)}
    for prefix, kind in _BLOCKS.items():
        for name in {n.rsplit(f".{prefix}_", 1)[0] for n in flat if f".{prefix}_" in n}:
            tensors[name] = kind(*(flat[f"{name}.{prefix}_{field}"] for field in _FIELDS[prefix]))
    return tensors


def load_weights(files: ModelFiles, config: ModelConfig, dtype: torch.dtype, keep_q4: bool = False,
                 keep_q8: bool = False) -> dict[str, torch.Tensor | Blocks]:
    """HF-named tensors of ``files`` in ``dtype`` (with ``keep_q4``, GGUF Q4 linears as :class:`Q4Blocks`; with
    ``keep_q8``, its Q4_K and Q5_K linears as :class:`Q4KBlocks` and :class:`Q5KBlocks`, its Q5_0 and Q5_1 ones as
    :class:`Q5Blocks`, its Q6_K ones as
    :class:`Q6Blocks`, its Q3_K and Q2_K ones as :class:`Q3Blocks` and :class:`Q2Blocks`, its IQ4_NL and IQ4_XS ones
    as :class:`IQ4Blocks` and its Q8_0 ones as :class:`Q8Blocks`). GGUF conversions are cached on disk; HF folders
    are read directly."""
    if files.kind == "hf":
        return {name: t.to(dtype) for name, t in _read_hf(files.path).items()}
    if keep_q4:
        _log_dequantized(files.path, keep_q8)
    path = _cache_path(files, dtype, keep_q4, keep_q8)
    if os.path.isfile(path):
        try:
            return _unflatten(load_file(path))
        except Exception as exc:  # a truncated cache file is rebuilt, never trusted
            log.warning("ignoring unreadable weight cache %s: %s", path, exc)
    tensors = {name: t if isinstance(t, Blocks) else t.to(dtype).contiguous()
               for name, t in _read_gguf(files.path, config, keep_q4, keep_q8).items()}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    save_file(_flatten(tensors), tmp)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the whole file or none
    return tensors

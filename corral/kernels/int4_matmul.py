"""W4A16 matmul: activations in bf16/fp16/fp32 times int4 group-quantized weights, the weights dequantized as they
are loaded (the GPU form of :class:`corral.engine.quant.Int4Groups`).

The operation, as reference pseudo-code (``x`` [M, K], output ``y`` [M, N] in ``x``'s dtype)::

    for n in range(N):
        for k in range(K):
            q = (codes[n, k // 2] >> 4 * (k % 2)) & 15       # two codes a byte, even k in the low nibble
            g = k // group
            W[n, k] = (q - 8) * scale[g, n] + zero[g, n]       # in float32
    y = (x.float() @ W.T).to(x.dtype)                          # float32 accumulation

The layout (:class:`PackedInt4`, made by :func:`pack_int4` from :class:`~corral.engine.quant.Q4Blocks`): codes
``[N, K // 2]`` uint8, each output row's codes contiguous along K, so a tile's load walks along K, the axis the
dot product sums over, and packing is a reshape of the blocks' row-major ``[N, K]`` codes. ``scale`` and ``zero``
are ``[K // group, N]`` in the activation dtype, rounded to it once, as ``Q4Blocks.dequantize(dtype)`` rounds
them: a K-tile lies inside one group, and its scale and zero for a tile of output columns are one contiguous
row. K must be a multiple of ``group`` (32, 64 or 128). There is no bias: the caller adds it.

Numerics. A bf16 or fp16 scale has at most 11 significant bits, so ``(q - 8) * scale`` (q - 8 has 4) is exact in
float32 and each ``W[n, k]`` is rounded once, in the add (an FMA gives the same, the product being exact): the
kernel's weights are those of ``Q4Blocks.dequantize(dtype)`` bit for bit. (With float32 activations the scale
stays float32 and the weight can see two roundings, product and add, each relative to ``|q - 8| |s| + |z|``.)
Activations upcast exactly. What is left is the order of the float32 sum: a length-K dot product in any order
is within ``K u sum_k |x_k| |W_nk|`` of the exact one (``u = eps32 / 2 = 2**-24``), so the kernel and the twin,
each that close to the same exact value, differ by at most (to first order in ``K u``)::

    |kernel - twin| <= 2 (K + 2) u sum_k |x[m, k]| (|q[n, k] - 8| |scale| + |zero|)

in float32 (the ``+ 2`` covers the weight's two roundings), plus, for bf16/fp16 outputs, one unit in the last
place of the output dtype: each rounds its own float32 result once, and the two may straddle a rounding edge.
(Triton's interpreter converts float32 to bf16 by truncation, not to nearest: under it, up to two units.)

:func:`int4_matmul_torch` is the twin: the pseudo-code above in torch, the test oracle and the CPU fallback (the
CPU production path is ``torch._weight_int4pack_mm_for_cpu`` in :mod:`corral.engine.quant`). Triton runs on CUDA
tensors (and on CPU tensors under ``TRITON_INTERPRET=1``, for tests only). Its dots take float32 operands at
``input_precision="ieee"``: the interpreter's bf16 ``tl.dot`` is wrong, and a float32 dot on a GPU would default
to TF32, which keeps 10 bits of mantissa and breaks the bound above. What this leaves out: bf16 tensor-core dots
(the dequantized weight rounded to bf16, up to ``2**-9 |W|`` more error per weight, for the speed that prefill-sized
M would want), split-K for decode on wide K, and autotuned tile sizes.
"""

from typing import TYPE_CHECKING, NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is an optional dependency on CPU-only installs
    triton = None

if TYPE_CHECKING:
    from corral.engine.quant import Q4Blocks


class PackedInt4(NamedTuple):
    """Int4 weights in the kernel's layout: ``W[n, k] = (code(n, k) - 8) * scale[k // group, n] + zero[...]``."""
    codes: torch.Tensor  # [N, K // 2] uint8: code(n, 2j) = codes[n, j] & 15, code(n, 2j + 1) = codes[n, j] >> 4
    scale: torch.Tensor  # [K // group, N], the activation dtype
    zero: torch.Tensor  # [K // group, N], the activation dtype
    group: int

    def dequantize(self) -> torch.Tensor:
        """``W`` [N, K] float32, computed as ``Q4Blocks.dequantize`` computes it."""
        scale = self.scale.float().T.repeat_interleave(self.group, dim=1)
        zero = self.zero.float().T.repeat_interleave(self.group, dim=1)
        return (unpack_codes(self.codes).float() - 8) * scale + zero

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + self.zero.nbytes


def pack_int4(blocks: "Q4Blocks", dtype: torch.dtype) -> PackedInt4:
    """``blocks`` (codes [N, K] in 0..15, scale and zero [N, K // group] float32) in the kernel's layout, scale and
    zero rounded once to the activation ``dtype``; on the blocks' device."""
    rows, cols = blocks.codes.shape
    assert cols % blocks.group == 0, f"K = {cols} must be a multiple of the int4 group size {blocks.group}"
    pairs = blocks.codes.to(torch.uint8).reshape(rows, cols // 2, 2)
    codes = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()
    return PackedInt4(codes, blocks.scale.T.to(dtype).contiguous(), blocks.zero.T.to(dtype).contiguous(),
                      blocks.group)


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Packed codes [N, K // 2] back to [N, K] uint8 in 0..15."""
    return torch.stack((codes & 15, codes >> 4), dim=-1).view(codes.shape[0], -1)


def int4_matmul(x: torch.Tensor, weight: PackedInt4) -> torch.Tensor:
    """``x`` [M, K] times the weight's transpose: [M, N] in ``x``'s dtype. Dispatch: the Triton kernel for CUDA
    tensors, the torch twin otherwise."""
    if x.is_cuda:
        return int4_matmul_triton(x, weight)
    return int4_matmul_torch(x, weight)


def int4_matmul_torch(x: torch.Tensor, weight: PackedInt4) -> torch.Tensor:
    """The twin: the module's pseudo-code, in float32."""
    return (x.float() @ weight.dequantize().T).to(x.dtype)


def int4_matmul_triton(x: torch.Tensor, weight: PackedInt4, block_m: int | None = None, block_n: int = 64,
                       block_k: int | None = None) -> torch.Tensor:
    """The Triton kernel. Tiles of ``block_m`` rows (by default the rows' power of 2, 16 to 64), ``block_n``
    output columns and ``block_k`` along K (by default ``min(group, 64)``; it must divide the group, so that a
    tile has one scale and zero per column)."""
    assert triton is not None, "triton is not installed"
    num_rows, k = x.shape
    n, group = weight.codes.shape[0], weight.group
    assert k % group == 0, f"K = {k} must be a multiple of the int4 group size {group}"
    assert weight.codes.shape[1] * 2 == k and weight.scale.shape == (k // group, n), "x and weight disagree on K"
    block_m = block_m or min(64, max(16, triton.next_power_of_2(num_rows)))
    block_k = block_k or min(group, 64)
    assert group % block_k == 0 and block_k >= 16, f"block_k {block_k}: >= 16 and dividing the group {group}"
    x = x.contiguous()
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(n, block_n))
    _int4_matmul_kernel[grid](x, weight.codes, weight.scale, weight.zero, out, num_rows, n, k,
                              x.stride(0), weight.codes.stride(0), weight.scale.stride(0), out.stride(0),
                              GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


if triton is not None:

    @triton.jit
    def _int4_matmul_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, out_ptr, num_rows, n, k,
                            stride_xm, stride_codes, stride_group, stride_om, GROUP: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < num_rows, cols < n
        offsets = tl.arange(0, BLOCK_K)
        # subtle: both k of a byte load the same byte; even k keeps its low nibble, odd k its high one
        shifts = (offsets % 2) * 4
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, k, BLOCK_K):
            x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + offsets)[None, :], mask=row_ok[:, None],
                        other=0.0).to(tl.float32)
            packed = tl.load(codes_ptr + cols[None, :] * stride_codes + ((k0 + offsets) // 2)[:, None],
                             mask=col_ok[None, :], other=0).to(tl.int32)  # [BLOCK_K, BLOCK_N]
            codes = (packed >> shifts[:, None]) & 15
            group_row = (k0 // GROUP) * stride_group
            scale = tl.load(scale_ptr + group_row + cols, mask=col_ok, other=0.0).to(tl.float32)
            zero = tl.load(zero_ptr + group_row + cols, mask=col_ok, other=0.0).to(tl.float32)
            w = (codes.to(tl.float32) - 8.0) * scale[None, :] + zero[None, :]
            acc += tl.dot(x, w, input_precision="ieee")  # float32 operands: see the module docstring
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])

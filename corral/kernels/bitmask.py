"""Apply a packed token bitmask to a batch of logits, in place: the Triton kernel and the dispatcher between it,
the CPU path and the pure-torch twin (``bitmask_torch.py``).

The operation, as reference pseudo-code (``vocab_size`` defaults to ``min(logits.shape[1], 32 * bitmask.shape[1])``)::

    for i in (indices if indices is not None else range(logits.shape[0])):
        for j in range(logits.shape[1]):
            allowed = j < vocab_size and (bitmask[i, j // 32] >> (j % 32)) & 1
            if not allowed:
                logits[i, j] = -inf

Unlike XGrammar's kernel, columns at or past ``vocab_size`` (a padded vocabulary, or bits past the tokenizer's
last token) are always masked rather than left alone: a padded id is never a valid token. ``indices`` picks
rows of both ``logits`` and ``bitmask``, so unconstrained rows of a mixed batch are not touched at all.

Left out: 1-D inputs (the caller adds the batch axis) and non-contiguous columns (logits rows may be strided,
columns must be dense, which is what a model's lm_head produces).
"""

import torch

from corral.kernels.bitmask_torch import (apply_checked_cpu_, apply_token_bitmask_cpu_, apply_token_bitmask_torch_,
                                          check_bitmask_args, unpack_bitmask)

__all__ = ["apply_token_bitmask_", "apply_token_bitmask_cpu_", "apply_token_bitmask_torch_",
           "apply_token_bitmask_triton_", "unpack_bitmask"]

_BLOCK_SIZE = 4096  # columns per Triton program: 128 int32 words; large enough to amortize the row lookup


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None,
                         *, vocab_size: int | None = None) -> None:
    """Mask ``logits`` (float ``[rows, width]``) in place by ``bitmask`` (int32 ``[rows, words]``), see the
    module docstring. The Triton kernel runs on CUDA tensors, a word-skipping CPU path on CPU tensors, and the
    torch twin on any other device."""
    vocab_size = check_bitmask_args(logits, bitmask, indices, vocab_size)
    if logits.is_cpu:
        apply_checked_cpu_(logits, bitmask, indices, vocab_size)
    elif logits.is_cuda:
        apply_token_bitmask_triton_(logits, bitmask, indices, vocab_size=vocab_size)
    else:
        apply_token_bitmask_torch_(logits, bitmask, indices, vocab_size=vocab_size)


# --- the Triton kernel ----------------------------------------------------------------------------------------

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with every CUDA build of torch
    triton = None

if triton is not None:

    @triton.jit
    def _apply_token_bitmask_kernel(logits_ptr, bitmask_ptr, indices_ptr, width, vocab_size, num_words,
                                    logits_row_stride, bitmask_row_stride,
                                    HAS_INDICES: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        """Program (r, b) masks columns [b*BLOCK_SIZE, (b+1)*BLOCK_SIZE) of row ``indices[r]`` (or r).
        Only masked columns are stored; allowed logits are neither read nor written."""
        r = tl.program_id(0)
        b = tl.program_id(1)
        row = tl.load(indices_ptr + r).to(tl.int64) if HAS_INDICES else r.to(tl.int64)
        word_offsets = b * (BLOCK_SIZE // 32) + tl.arange(0, BLOCK_SIZE // 32)
        words = tl.load(bitmask_ptr + row * bitmask_row_stride + word_offsets,
                        mask=word_offsets < num_words, other=0)
        bits = (words[:, None] >> tl.arange(0, 32)[None, :]) & 1
        columns = b * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        is_masked = (tl.reshape(bits, (BLOCK_SIZE,)) == 0) | (columns >= vocab_size)
        tl.store(logits_ptr + row * logits_row_stride + columns, float("-inf"),
                 mask=is_masked & (columns < width))


def apply_token_bitmask_triton_(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None,
                                *, vocab_size: int | None = None) -> None:
    """Launch the Triton kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``)."""
    assert triton is not None, "triton is not installed"
    vocab_size = check_bitmask_args(logits, bitmask, indices, vocab_size)
    width = logits.shape[1]
    if indices is not None:
        indices = torch.as_tensor(indices, dtype=torch.int32).to(logits.device, non_blocking=True)
    num_rows = logits.shape[0] if indices is None else indices.numel()
    if num_rows == 0 or width == 0:
        return
    grid = (num_rows, triton.cdiv(width, _BLOCK_SIZE))
    _apply_token_bitmask_kernel[grid](
        logits, bitmask, indices if indices is not None else bitmask, width, vocab_size, bitmask.shape[1],
        logits.stride(0), bitmask.stride(0), HAS_INDICES=indices is not None, BLOCK_SIZE=_BLOCK_SIZE,
        num_warps=8)

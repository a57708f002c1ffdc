"""Apply a packed token bitmask to a batch of logits, in place: the Triton kernel, its pure-torch twin, and the
dispatcher between them.

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

_BLOCK_SIZE = 4096  # columns per Triton program: 128 int32 words; large enough to amortize the row lookup


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None,
                         *, vocab_size: int | None = None) -> None:
    """Mask ``logits`` (float ``[rows, width]``) in place by ``bitmask`` (int32 ``[rows, words]``), see the
    module docstring. The Triton kernel runs on CUDA tensors, the torch twin on everything else."""
    vocab_size = _check(logits, bitmask, indices, vocab_size)
    if logits.is_cuda:
        apply_token_bitmask_triton_(logits, bitmask, indices, vocab_size=vocab_size)
    else:
        apply_token_bitmask_torch_(logits, bitmask, indices, vocab_size=vocab_size)


def _check(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None,
           vocab_size: int | None) -> int:
    assert logits.dim() == 2 and bitmask.dim() == 2, "logits and bitmask must be [rows, columns]"
    assert bitmask.dtype == torch.int32, f"bitmask must be int32, not {bitmask.dtype}"
    assert logits.stride(1) == 1, "logits columns must be contiguous"
    assert logits.device == bitmask.device, "logits and bitmask must be on one device"
    if indices is None:
        assert logits.shape[0] == bitmask.shape[0], "without indices, logits and bitmask rows must match"
    detected = min(logits.shape[1], 32 * bitmask.shape[1])
    assert vocab_size is None or 0 <= vocab_size <= detected, f"vocab_size {vocab_size} > {detected}"
    return detected if vocab_size is None else vocab_size


# --- the pure-torch twin: the CPU path and the oracle --------------------------------------------------------

_BYTE_BITS: dict[torch.device, torch.Tensor] = {}


def _byte_bits(device: torch.device) -> torch.Tensor:
    """int64 [256]: entry b is the eight bools of byte b's bits (least significant first), packed in one word,
    because a 1-D int64 gather is about 14x faster than gathering rows of a [256, 8] bool table."""
    if device not in _BYTE_BITS:
        byte = torch.arange(256, dtype=torch.int32, device=device)
        bits = ((byte[:, None] >> torch.arange(8, dtype=torch.int32, device=device)) & 1).bool()
        _BYTE_BITS[device] = bits.contiguous().view(torch.int64).reshape(256)
    return _BYTE_BITS[device]


def unpack_bitmask(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """bool ``[rows, width]``: True where a token is allowed. Columns past ``32 * words`` are False."""
    rows, words = bitmask.shape
    # subtle: int32 words are little-endian in memory on every platform torch supports, so byte k of word w holds
    # tokens 32w+8k .. 32w+8k+7 and one 256-entry table lookup unpacks eight tokens at a time.
    as_bytes = bitmask.contiguous().view(torch.uint8).reshape(-1).long()
    allowed = _byte_bits(bitmask.device).index_select(0, as_bytes).view(torch.bool).reshape(rows, 32 * words)
    if width <= 32 * words:
        return allowed[:, :width]
    return torch.cat([allowed, allowed.new_zeros(rows, width - 32 * words)], dim=1)


def apply_token_bitmask_torch_(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None,
                               *, vocab_size: int | None = None) -> None:
    """The twin of the Triton kernel (same contract as :func:`apply_token_bitmask_`), in plain torch ops."""
    vocab_size = _check(logits, bitmask, indices, vocab_size)
    width = logits.shape[1]
    if indices is None:
        allowed = unpack_bitmask(bitmask, vocab_size)
        logits[:, :vocab_size].masked_fill_(~allowed, float("-inf"))
        logits[:, vocab_size:] = float("-inf")
        return
    indices = torch.as_tensor(indices, dtype=torch.long, device=logits.device)
    if indices.numel() == 0:
        return
    allowed = unpack_bitmask(bitmask.index_select(0, indices), width)
    if vocab_size < width:
        allowed[:, vocab_size:] = False
    rows = logits.index_select(0, indices).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, indices, rows)


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
    vocab_size = _check(logits, bitmask, indices, vocab_size)
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

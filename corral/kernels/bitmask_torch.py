"""The bitmask operation of ``bitmask.py`` without Triton: the pure-torch twin (any device, and the oracle the
Triton kernel is tested against) and the CPU path, which skips the words a grammar leaves fully open.

Both implement the pseudo-code in ``corral.kernels.bitmask``'s docstring exactly; tests hold all three to a numpy
rendering of it.
"""

import numpy as np
import torch


def check_bitmask_args(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None,
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




# --- the pure-torch twin ----------------------------------------------------------------------------------------

_NEG_INF_BITS = -8388608  # 0xFF800000: float32 -inf as an int32 bit pattern


def _bit_shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(32, dtype=torch.int32, device=device)


def unpack_bitmask(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """bool ``[rows, width]``: True where a token is allowed. Columns past ``32 * words`` are False."""
    rows, words = bitmask.shape
    allowed = ((bitmask[:, :, None] >> _bit_shifts(bitmask.device)) & 1).bool().reshape(rows, 32 * words)
    if width <= 32 * words:
        return allowed[:, :width]
    return torch.cat([allowed, allowed.new_zeros(rows, width - 32 * words)], dim=1)


def _mask_addend(bitmask: torch.Tensor) -> torch.Tensor:
    """float32 ``[rows, 32 * words]``: 0 where allowed, -inf where masked. Adding it is branch-free, so a random
    mask costs the same as a regular one (``masked_fill_`` measured 3-5x slower on random masks here)."""
    rows, words = bitmask.shape
    # subtle: shifting bit j up to the sign and back down arithmetically gives -1 (allowed) or 0 (masked).
    spread = bitmask[:, :, None] << (31 - _bit_shifts(bitmask.device))
    spread >>= 31
    spread.bitwise_not_()
    spread &= _NEG_INF_BITS
    return spread.view(torch.float32).reshape(rows, 32 * words)


def apply_token_bitmask_torch_(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None,
                               *, vocab_size: int | None = None) -> None:
    """The twin of the Triton kernel (same contract as ``apply_token_bitmask_``), in plain torch ops: one
    branch-free pass adds a 0 / -inf addend to every selected row. (Logits are finite, so ``x + 0 == x``.)"""
    vocab_size = check_bitmask_args(logits, bitmask, indices, vocab_size)
    bitmask = bitmask[:, : (vocab_size + 31) // 32]
    if indices is None:
        logits[:, vocab_size:] = float("-inf")
        logits[:, :vocab_size] += _mask_addend(bitmask)[:, :vocab_size]
        return
    indices = torch.as_tensor(indices, dtype=torch.long, device=logits.device)
    if indices.numel() == 0:
        return
    rows = logits.index_select(0, indices)
    rows[:, vocab_size:] = float("-inf")
    rows[:, :vocab_size] += _mask_addend(bitmask.index_select(0, indices))[:, :vocab_size]
    logits.index_copy_(0, indices, rows)


# --- the CPU path -------------------------------------------------------------------------------------------------

# Each dtype's -inf as the bit pattern of a same-width integer, so one code path serves fp32, bf16 and fp16
# (numpy has no bfloat16).
_INT_VIEWS = {torch.float32: (torch.int32, -8388608), torch.bfloat16: (torch.int16, -128),
              torch.float16: (torch.int16, -1024)}


def apply_token_bitmask_cpu_(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None,
                             *, vocab_size: int | None = None) -> None:
    """The CPU path: same contract and result as the twin, but the cost follows the mask's structure, like
    XGrammar's CPU kernel. Words that allow all 32 tokens are skipped, words that allow none are filled, and
    only mixed words are unpacked bit by bit. A mask of mostly mixed words (no structure) goes to the twin's
    branch-free pass instead, which is faster there."""
    vocab_size = check_bitmask_args(logits, bitmask, indices, vocab_size)
    if logits.dtype not in _INT_VIEWS or not logits.is_contiguous():
        return apply_token_bitmask_torch_(logits, bitmask, indices, vocab_size=vocab_size)
    int_dtype, neg_inf = _INT_VIEWS[logits.dtype]
    if indices is None:
        _mask_words(logits.view(int_dtype).numpy(), bitmask.numpy(), vocab_size, neg_inf, logits, bitmask)
        return
    indices = torch.as_tensor(indices, dtype=torch.long)
    if indices.numel() == 0:
        return
    rows, masks = logits.index_select(0, indices), bitmask.index_select(0, indices)
    _mask_words(rows.view(int_dtype).numpy(), masks.numpy(), vocab_size, neg_inf, rows, masks)
    logits.index_copy_(0, indices, rows)


def _mask_words(x: np.ndarray, masks: np.ndarray, vocab_size: int, neg_inf: int, logits: torch.Tensor,
                bitmask: torch.Tensor) -> None:
    """Mask ``x`` (the logits' integer view, shared memory) word by word; see apply_token_bitmask_cpu_."""
    num_rows, num_full = x.shape[0], vocab_size // 32
    words = np.ascontiguousarray(masks[:, :num_full])
    # subtle: as uint32, w + 1 maps an open word (-1) to 0 and a closed word (0) to 1: mixed words are > 1.
    plus_one = words.view(np.uint32) + np.uint32(1)
    mixed_ids = np.flatnonzero(plus_one > 1)
    if 2 * len(mixed_ids) > words.size:
        return apply_token_bitmask_torch_(logits, bitmask, vocab_size=vocab_size)
    x[:, vocab_size:] = neg_inf
    blocks = x[:, : 32 * num_full].reshape(num_rows, num_full, 32)  # splits the last axis: a view, not a copy
    blocks = blocks.reshape(-1, 32) if x.shape[1] == 32 * num_full else blocks  # flat word ids need a flat view
    closed = np.flatnonzero(plus_one == 1)
    blocks[closed if blocks.ndim == 2 else np.divmod(closed, num_full)] = neg_inf
    if len(mixed_ids):
        where = mixed_ids if blocks.ndim == 2 else np.divmod(mixed_ids, num_full)
        segments = blocks[where]
        np.copyto(segments, neg_inf, where=~_unpack(words.reshape(-1)[mixed_ids]))
        blocks[where] = segments
    if vocab_size % 32:  # the tokenizer's last, partial word
        tail = x[:, 32 * num_full: vocab_size]
        np.copyto(tail, neg_inf, where=~_unpack(masks[:, num_full])[:, : vocab_size % 32])


def _unpack(words: np.ndarray) -> np.ndarray:
    """bool ``[n, 32]`` from int32 ``[n]``, bit j of each word in column j."""
    as_bytes = np.ascontiguousarray(words, dtype="<i4").view(np.uint8).reshape(-1, 4)
    return np.unpackbits(as_bytes, axis=1, bitorder="little").view(bool)

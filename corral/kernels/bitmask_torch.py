"""The bitmask operation of ``bitmask.py`` without Triton: the pure-torch twin (any device, and the oracle the
Triton kernel is tested against) and the CPU path, which skips the words a grammar leaves fully open.

Both implement the pseudo-code in ``corral.kernels.bitmask``'s docstring exactly, for every value (a masked column
is -inf even where the model wrote NaN or +inf there); tests hold all three to a numpy rendering of it.
"""

import threading
from typing import NamedTuple

import numpy as np
import torch


def check_bitmask_args(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None,
                       vocab_size: int | None) -> int:
    """Assert the contract of ``apply_token_bitmask_`` and return the effective ``vocab_size``."""
    shape, mask_shape = logits.shape, bitmask.shape
    assert len(shape) == 2 and len(mask_shape) == 2, "logits and bitmask must be [rows, columns]"
    assert bitmask.dtype == torch.int32, f"bitmask must be int32, not {bitmask.dtype}"
    assert logits.stride(1) == 1, "logits columns must be contiguous"
    assert logits.device == bitmask.device, "logits and bitmask must be on one device"
    (num_rows, width), (num_mask_rows, num_words) = shape, mask_shape
    assert indices is not None or num_rows == num_mask_rows, "without indices, logits and bitmask rows must match"
    detected = min(width, 32 * num_words)
    if vocab_size is None:
        return detected
    assert 0 <= vocab_size <= detected, f"vocab_size {vocab_size} > {detected}"
    return vocab_size


# --- the pure-torch twin ----------------------------------------------------------------------------------------

_NEG_INF_BITS = -8388608  # 0xFF800000: float32 -inf as an int32 bit pattern
_NAN_BITS = 0x7FC00000  # float32's quiet NaN


def _bit_shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(32, dtype=torch.int32, device=device)


def unpack_bitmask(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """bool ``[rows, width]``: True where a token is allowed. Columns past ``32 * words`` are False."""
    rows, words = bitmask.shape
    allowed = ((bitmask[:, :, None] >> _bit_shifts(bitmask.device)) & 1).bool().reshape(rows, 32 * words)
    if width <= 32 * words:
        return allowed[:, :width]
    return torch.cat([allowed, allowed.new_zeros(rows, width - 32 * words)], dim=1)


def _mask_operand(bitmask: torch.Tensor) -> torch.Tensor:
    """float32 ``[rows, 32 * words]``: NaN where allowed, -inf where masked, so that ``fmin(x, operand)`` is ``x``
    or -inf whatever ``x`` is (``fmin`` takes the operand that is not NaN). Branch-free, so a random mask costs the
    same as a regular one (``masked_fill_`` measured 3-5x slower on random masks here)."""
    rows, words = bitmask.shape
    # subtle: shifting bit j up to the sign and back down arithmetically gives -1 (allowed) or 0 (masked).
    spread = bitmask[:, :, None] << (31 - _bit_shifts(bitmask.device))
    spread >>= 31
    spread &= _NAN_BITS ^ _NEG_INF_BITS
    spread ^= _NEG_INF_BITS
    return spread.view(torch.float32).reshape(rows, 32 * words)


def apply_token_bitmask_torch_(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None,
                               *, vocab_size: int | None = None) -> None:
    """The twin of the Triton kernel (same contract as ``apply_token_bitmask_``), in plain torch ops: one
    branch-free ``fmin`` with a NaN / -inf operand over every selected row (see ``_mask_operand``)."""
    vocab_size = check_bitmask_args(logits, bitmask, indices, vocab_size)
    bitmask = bitmask[:, : (vocab_size + 31) // 32]
    if indices is None:
        logits[:, vocab_size:] = float("-inf")
        columns = logits[:, :vocab_size]
        torch.fmin(columns, _mask_operand(bitmask)[:, :vocab_size], out=columns)
        return
    indices = torch.as_tensor(indices, dtype=torch.long, device=logits.device)
    if indices.numel() == 0:
        return
    rows = logits.index_select(0, indices)
    rows[:, vocab_size:] = float("-inf")
    columns = rows[:, :vocab_size]
    torch.fmin(columns, _mask_operand(bitmask.index_select(0, indices))[:, :vocab_size], out=columns)
    logits.index_copy_(0, indices, rows)


# --- the CPU path -------------------------------------------------------------------------------------------------

class _Masker(NamedTuple):
    """How the CPU path masks one logits dtype, through numpy views of the logits.

    A bitmask byte stands for 8 columns, so ``tables[i][byte]`` holds those 8 columns' operand, as one numpy void
    element: a single ``take`` turns mask bytes into a row of operands. fp32 and fp16 mask with
    ``fmin(x, table[byte])``, the table holding NaN (allowed: ``fmin`` takes the other operand, even a NaN) or -inf
    (masked: -inf, even for a NaN logit, as the Triton kernel writes). bf16, which numpy lacks, is
    masked through its int16 bit pattern as ``(x & keep[byte]) | fill[byte]``."""
    int_view: torch.dtype | None  # the tensor view that numpy can hold, if the dtype itself is not one
    fill: float | int  # -inf, as a value of the numpy view
    tables: tuple[np.ndarray, ...]
    ops: tuple[np.ufunc, ...]  # x = op(x, table[byte]) for each table in turn
    block: np.dtype  # a word's 32 columns as one void element


def _masker(operands: list[np.ndarray], fill: float | int, int_view: torch.dtype | None = None) -> _Masker:
    tables = tuple(op.view(f"V{op.strides[0]}").reshape(256) for op in operands)
    ops = (np.fmin,) if len(tables) == 1 else (np.bitwise_and, np.bitwise_or)
    return _Masker(int_view, fill, tables, ops, np.dtype(f"V{32 * operands[0].itemsize}"))


# row b: the 8 bits of byte value b, least significant first. Bitmask words are read as little-endian bytes, the
# byte order of every platform torch ships for.
_KEEP = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool)
_MASKERS = {
    torch.float32: _masker([np.where(_KEEP, np.nan, -np.inf).astype(np.float32)], -np.inf),
    torch.float16: _masker([np.where(_KEEP, np.nan, -np.inf).astype(np.float16)], -np.inf),
    torch.bfloat16: _masker([np.where(_KEEP, -1, 0).astype(np.int16), np.where(_KEEP, 0, -128).astype(np.int16)],
                            -128, torch.int16),  # -128 is 0xFF80, bf16 -inf
}
# Bitmask bytes per pass of the dense path (128k columns): their operands (512 KiB in fp32) are still in L2 when
# the masking op reads them. 64 x 152k random, one thread: 1k and 4k bytes measured ~90% and ~15% slower, 64k
# about the same.
_CHUNK_BYTES = 16384
# The word path wins while at most this share of the words has a masked bit: it moves 32-column blocks one by
# one, the dense path streams every column. Measured crossover ~0.3 at 1 x 49k, 8 x 128k and 64 x 152k (random
# words among all-allowed ones, one thread).
_MAX_SPARSE_SHARE = 0.25
# Below this many bytes, a temporary array costs less than looking up this thread's buffer; from ~128 KiB, glibc
# mmaps each new array and every call page-faults it afresh (the word path on 64 x 128k-152k open masks measured
# ~1.2-1.7x slower with fresh arrays).
_SCRATCH_FROM = 65536
_local = threading.local()


def apply_token_bitmask_cpu_(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None,
                             *, vocab_size: int | None = None) -> None:
    """The CPU path: same contract and result as the twin, in place, on numpy views of the tensors (one thread).
    When few words have a masked bit (a grammar state that allows almost everything), only those words' columns
    are read and written. Otherwise every column is masked in one pass, in cache-sized chunks, through a byte
    lookup table: no branch per bit, so the cost does not depend on the mask's pattern.

    Every value, NaN and infinities included, gets exactly the kernel's result: a masked column is -inf whatever
    the model wrote there, so a NaN the mask rules out does not reach the sampler."""
    apply_checked_cpu_(logits, bitmask, indices, check_bitmask_args(logits, bitmask, indices, vocab_size))


def apply_checked_cpu_(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None,
                       vocab_size: int) -> None:
    """``apply_token_bitmask_cpu_`` once ``check_bitmask_args`` has passed (the dispatcher runs it)."""
    masker = _MASKERS.get(logits.dtype)
    if masker is None:
        return apply_token_bitmask_torch_(logits, bitmask, indices, vocab_size=vocab_size)
    x = (logits if masker.int_view is None else logits.view(masker.int_view)).numpy()
    masks, rows = bitmask.numpy(), None
    if indices is not None:
        rows = torch.as_tensor(indices, dtype=torch.long, device="cpu").numpy()
        if not len(rows):
            return
        masks = masks.take(rows, axis=0)
    if vocab_size < x.shape[1]:
        x[slice(None) if rows is None else rows, vocab_size:] = masker.fill
    num_full = vocab_size // 32
    words = masks if num_full == masks.shape[1] else masks[:, :num_full]
    # the flat ids of the words with a masked bit (-1: all 32 tokens allowed)
    needs_mask = None if words.size < _SCRATCH_FROM else _scratch("needs_mask", np.bool_, words.size)
    word_ids = np.not_equal(words, -1, out=None if needs_mask is None else needs_mask.reshape(words.shape))
    word_ids = word_ids.ravel().nonzero()[0]
    if len(word_ids) > _MAX_SPARSE_SHARE * words.size:
        _mask_dense(x, words, rows, masker)
    elif len(word_ids):
        _mask_words(x, words, rows, masker, word_ids)
    if vocab_size % 32:
        _mask_last_word(x, masks[:, num_full], rows, masker, vocab_size)


def _mask_words(x: np.ndarray, words: np.ndarray, rows: np.ndarray | None, masker: _Masker,
                word_ids: np.ndarray) -> None:
    """Mask only the words ``word_ids`` (flat ids into ``words``): gather their 32-column blocks, mask them, and
    scatter them back. A block is one numpy void element, so gather and scatter are a ``take`` and a ``put``."""
    num_words = words.shape[1]
    if not x.flags.c_contiguous or x.shape[1] % 32:  # strided rows, or a width that is not a whole number of words
        row_ids, column_ids = np.divmod(word_ids, num_words)
        where = (row_ids if rows is None else rows.take(row_ids), column_ids)
        blocks = x[:, : 32 * num_words].view(masker.block)
        segments = blocks[where]
        _mask(segments.view(x.dtype), words.take(word_ids).view(np.uint8), masker)
        blocks[where] = segments
        return
    blocks = x.reshape(-1).view(masker.block)  # every row's blocks, back to back
    block_ids = word_ids
    if rows is not None or num_words != x.shape[1] // 32:
        row_ids, column_ids = np.divmod(word_ids, num_words)
        block_ids = (row_ids if rows is None else rows.take(row_ids)) * (x.shape[1] // 32) + column_ids
    if len(word_ids) * masker.block.itemsize < _SCRATCH_FROM:
        segments = blocks.take(block_ids)
        _mask(segments.view(x.dtype), words.take(word_ids).view(np.uint8), masker)
        blocks.put(block_ids, segments)
        return
    chunk = _CHUNK_BYTES // 4
    for start in range(0, len(word_ids), chunk):
        ids, as_bytes = block_ids[start: start + chunk], words.take(word_ids[start: start + chunk]).view(np.uint8)
        segments = blocks.take(ids, out=_scratch("blocks", masker.block, len(ids)), mode="wrap")
        _mask(segments.view(x.dtype), as_bytes, masker, _scratch("operands", masker.tables[0].dtype, as_bytes.size))
        blocks.put(ids, segments)


def _mask_dense(x: np.ndarray, words: np.ndarray, rows: np.ndarray | None, masker: _Masker) -> None:
    """Mask the first ``32 * words.shape[1]`` columns of the selected rows, ``_CHUNK_BYTES`` mask bytes at a time
    through one reused buffer."""
    as_bytes = words.view(np.uint8)
    row_bytes = as_bytes.shape[1]
    step = max(1, _CHUNK_BYTES // row_bytes) if rows is None else 1
    buffer = _scratch("operands", masker.tables[0].dtype, _CHUNK_BYTES)
    for first in range(0, len(as_bytes), step):
        x_rows = slice(first, first + step) if rows is None else slice(rows[first], rows[first] + 1)
        for start in range(0, row_bytes, _CHUNK_BYTES):
            chunk = as_bytes[first: first + step, start: start + _CHUNK_BYTES]
            _mask(x[x_rows, 8 * start: 8 * (start + chunk.shape[1])], chunk, masker,
                  buffer[: chunk.size].reshape(chunk.shape))


def _mask_last_word(x: np.ndarray, last_words: np.ndarray, rows: np.ndarray | None, masker: _Masker,
                    vocab_size: int) -> None:
    """The tokenizer's last, partial word: its bits past ``vocab_size`` are ignored (those columns are masked)."""
    columns = slice(vocab_size // 32 * 32, vocab_size)
    tail = x[:, columns] if rows is None else x[rows, columns]  # a copy when rows is an index array
    _mask(tail, np.ascontiguousarray(last_words).view(np.uint8).reshape(-1, 4), masker)
    if rows is not None:
        x[rows, columns] = tail


def _mask(x: np.ndarray, as_bytes: np.ndarray, masker: _Masker, buffer: np.ndarray | None = None) -> None:
    """Mask ``x`` ``[..., c]`` in place by the bits of ``as_bytes`` ``[..., b]``, ``c <= 8 * b``: bit j of byte k
    is column 8k + j. ``buffer``: where to look the operands up (``as_bytes``'s shape), rather than a new array."""
    width = x.shape[-1]
    for table, op in zip(masker.tables, masker.ops):
        # subtle: mode="wrap", because take() fills `out` through a temporary in its default mode ("raise")
        operand = table.take(as_bytes, out=buffer, mode="wrap").view(x.dtype)
        op(x, operand if operand.shape[-1] == width else operand[..., :width], out=x)


def _scratch(name: str, dtype: np.dtype, size: int) -> np.ndarray:
    """``size`` elements of this thread's buffer ``name``, kept across calls (and grown when needed): a fresh
    array of a few hundred KiB or more is a fresh mmap, page-faulted on every call."""
    buffers = _local.__dict__.setdefault("buffers", {})
    buffer = buffers.get((name, dtype))
    if buffer is None or buffer.size < size:
        buffer = buffers[name, dtype] = np.empty(max(size, _CHUNK_BYTES), dtype=dtype)
    return buffer[:size]

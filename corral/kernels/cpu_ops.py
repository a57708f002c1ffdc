"""Fused elementwise CPU ops of the Llama forward: residual add + RMSNorm, RoPE in place, SiLU(gate) * up.

On a 2-core CPU a decode step's elementwise work was dozens of small torch ops per layer, each a pass over
memory plus dispatch, and in bf16 each with its own conversions. These kernels (``corral/csrc/kernels_impl.h``,
in the native module) do each group in one pass and round exactly where the torch expressions they replace round
(bf16 after every op HF's modeling code does in bf16), so their results equal the torch path's up to the order of
the RMSNorm sum of squares. The torch expressions stay as the fallback and as the oracle of
``tests/kernels/test_cpu_ops.py``. float32 and bfloat16; the native side checks every buffer's shape and dtype.
"""

import numpy as np
import torch

from corral import native

_DTYPES = (torch.float32, torch.bfloat16)


def buffer(tensor: torch.Tensor):
    """A CPU tensor as a numpy array over its memory, which the native module checks as a buffer (bfloat16 as
    16-bit integers, which numpy has)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    try:
        return tensor.numpy()
    except RuntimeError:  # a tensor that requires grad (never in the engine, which runs under inference mode)
        return tensor.detach().numpy()


# Output buffers that live across steps (the native step's logits views), with their arrays made once: see
# register_buffer. Each entry holds its tensor, so no other tensor can take its id while it is here.
_REGISTERED: dict[int, tuple[torch.Tensor, object]] = {}
_MAX_REGISTERED = 256


def register_buffer(tensor: torch.Tensor):
    """``buffer(tensor)`` for a float32 CPU tensor that lives across steps, remembered, so that :func:`greedy_pick`
    on it later makes no torch call (after a step's weight stream each cost 10-30 us). When the registry is full
    it is emptied: a caller that registers fresh tensors costs conversions, never memory."""
    assert tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.is_contiguous()
    if len(_REGISTERED) >= _MAX_REGISTERED:
        _REGISTERED.clear()
    array = buffer(tensor)
    _REGISTERED[id(tensor)] = (tensor, array)
    return array


def forget_buffers(tensors) -> None:
    """Drop ``tensors`` from the registry (their buffer is being replaced)."""
    for tensor in tensors:
        known = _REGISTERED.get(id(tensor))
        if known is not None and known[0] is tensor:
            _REGISTERED.pop(id(tensor), None)


def available(dtype: torch.dtype) -> bool:
    """Whether the fused ops serve ``dtype`` here (the native module loaded; float32 or bfloat16)."""
    return dtype in _DTYPES and native.module() is not None


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += delta`` in place (when given), then return ``RMSNorm(h) * weight``; ``h`` [rows, n] contiguous."""
    out = torch.empty_like(h)
    native.module().add_rms_norm(buffer(h), None if delta is None else buffer(delta.contiguous()), buffer(weight),
                                 buffer(out), eps, torch.get_num_threads())
    return out


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``x`` [rows, heads, dim] in place (rows may be strided, heads and dims contiguous); ``cos``/``sin``
    [max_position, dim] tables in ``x``'s dtype, ``positions`` int64 [rows]."""
    native.module().rope(buffer(x), buffer(positions.contiguous()), buffer(cos), buffer(sin), torch.get_num_threads())


def log_normalizers(logits: torch.Tensor, n: int) -> torch.Tensor | None:
    """``logsumexp`` of each row's first ``n`` columns of float32 CPU ``logits`` [rows, width] (relative error a few
    float32 ulp: a vectorized exp), or None where the native kernel cannot take them (torch's then runs). torch's
    CPU ``logsumexp`` took 50-170 us for one row of 49k, a few percent of a single-client step."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or not logits.is_contiguous() or \
            native.module() is None:
        return None
    out = torch.empty(logits.shape[0])
    native.module().log_normalizers(buffer(logits), n, buffer(out), torch.get_num_threads())
    return out


def token_tally():
    """A new native ``TokenTally`` (the distinct tokens of one sequence's prompt and output and their output counts,
    kept from step to step for its penalties: see ``corral/csrc/kernels.cpp``), or None without the native module."""
    module = native.module()
    return None if module is None else module.TokenTally()


def greedy_pick(logits: torch.Tensor, n: int, bitmask: torch.Tensor | np.ndarray | None,
                masked_rows: torch.Tensor | list[int] | None) -> tuple[list[int], list[float]] | None:
    """The greedy sampler's rows in one native pass each: per row of float32 CPU ``logits`` [rows, width], the
    first largest of its first ``n`` columns that the int32 ``bitmask`` row allows (rows ``masked_rows``; no
    bitmask: all; ``bitmask`` a tensor or a numpy array, ``masked_rows`` a list or tensor of row indices or a bool
    tensor over the rows), and that logit less the row's log-normalizer over all ``n`` columns (as
    :func:`log_normalizers`). None where the kernel cannot take the arguments, or where a row has no allowed
    finite column or holds a NaN or +inf: the torch path then decides, as before. About 13 us per 49k-column row,
    where the torch ops (copy, mask, argmax, gathers, checks) took about a tenth of a millisecond. Logits from
    :func:`register_buffer` go in with no torch call at all."""
    args = _pick_args(logits, n, bitmask, masked_rows)
    if args is None:
        return None
    module, array, bitmask, masked = args
    ids, logprobs = module.greedy_pick(array, n, bitmask, masked, torch.get_num_threads())
    if ids and min(ids) < 0:
        return None
    return ids, logprobs


def greedy_pick_row(logits: torch.Tensor, row: int, n: int, bitmask: np.ndarray) -> tuple[int, float] | None:
    """:func:`greedy_pick` of ``logits[row]`` alone under one int32 ``bitmask`` row ([1, words] numpy): (id,
    logprob), with no torch call where ``logits`` is a registered buffer (the row is a numpy view), or None where
    :func:`greedy_pick` of the one-row slice would return None."""
    args = _pick_args(logits, n, None, None)
    if args is None or not 0 <= row < len(args[1]):
        return None
    module, array = args[0], args[1]
    if bitmask.dtype != np.int32 or bitmask.shape != (1, (n + 31) // 32):
        return None
    ids, logprobs = module.greedy_pick(array[row:row + 1], n, bitmask, [0], torch.get_num_threads())
    return (ids[0], logprobs[0]) if ids[0] >= 0 else None


def sample_pick(logits: torch.Tensor, n: int, bitmask: torch.Tensor | np.ndarray | None,
                masked_rows: torch.Tensor | list[int] | None, temperature: list[float], top_k: list[int],
                top_p: list[float], min_p: list[float], uniform: list[float], top_n: list[int],
                shaping: list | None = None, partial: bool = False
                ) -> tuple[list[int], list[float], list[list[tuple[int, float]]]] | None:
    """The sampler's steps 2-7 in one native pass per row (see ``sample_pick`` in ``corral/csrc/kernels_impl.h``):
    :func:`greedy_pick`'s arguments, and per row its temperature (0: greedy; negative: skip the row, its id is -2),
    top_k, top_p, min_p, uniform and how many top logprobs to report (0-20; out of range: ValueError); ``shaping``:
    None, or per row None or ``(hold, bias, repetition, frequency, presence, seen, output[, tallied])``: the stop ids
    that ``min_tokens`` holds back, the (id, value) bias pairs, the three penalties, and the token runs ``(tokens,
    start, stop)`` that the repetition penalty reads and that the frequency and presence penalties count; ``tallied``:
    None or ``(tally, tokens, split, stop)``, a :func:`token_tally` caught up on ``tokens[:stop]`` (its output from
    ``split``) that stands for the prompt and output, the runs then naming only a draft's tokens. (ids, logprobs,
    per row its top (id, logprob) pairs of the raw distribution, largest first), or None where the kernel cannot
    take the arrays, or a row it was asked for has no allowed finite column, holds a NaN or +inf anywhere (or its
    shaping makes one, or a penalty is past float32's range), or its running sum never passes its target (float64
    rounding, when u is within it of 1): the torch path then decides. ``partial``: those rows get id -1 instead,
    and the others their draws."""
    args = _pick_args(logits, n, bitmask, masked_rows)
    if args is None:
        return None
    module, array, bitmask, masked = args
    ids, logprobs, tops = module.sample_pick(array, n, bitmask, masked, temperature, top_k, top_p, min_p, uniform,
                                             top_n, shaping, torch.get_num_threads())
    if -1 in ids and not partial:
        return None
    return ids, logprobs, tops


def _pick_args(logits, n, bitmask, masked_rows):
    """(module, the logits' buffer, the bitmask's, the masked rows as a list) for the native picks, or None."""
    known = _REGISTERED.get(id(logits))
    if known is not None and known[0] is logits:
        array = known[1]
    elif logits.dtype != torch.float32 or logits.device.type != "cpu" or not logits.is_contiguous():
        return None
    else:
        array = buffer(logits)
    module = native.module()
    if module is None:
        return None
    masked = None
    if bitmask is not None:
        if isinstance(bitmask, np.ndarray):  # the engine's own array: no conversion (the native side checks it)
            if bitmask.dtype != np.int32 or bitmask.shape != (len(array), (n + 31) // 32):
                return None
        elif bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or \
                bitmask.shape != (len(array), (n + 31) // 32):
            return None
        else:
            bitmask = buffer(bitmask.contiguous())
        if masked_rows is None:
            masked = list(range(len(array)))
        elif isinstance(masked_rows, list):
            masked = masked_rows
        else:  # row indices or a mask over the rows
            masked = (masked_rows.nonzero().flatten() if masked_rows.dtype == torch.bool else masked_rows).tolist()
    return module, array, bitmask, masked


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` [rows, 2n] = [gate | up] (contiguous); [rows, n]."""
    rows, width = gate_up.shape
    out = gate_up.new_empty(rows, width // 2)
    native.module().silu_mul(buffer(gate_up), buffer(out), torch.get_num_threads())
    return out

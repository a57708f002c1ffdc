"""Paged decode attention on the CPU: one query token per sequence against K/V read straight from the block
pool, with no gather and no padding.

The operation is :mod:`corral.kernels.paged_attention`'s with ``q_len = 1`` for every sequence (its pseudo-code
is the contract; :func:`~corral.kernels.paged_attention.paged_attention_torch` is the oracle). Per (sequence, KV
head) the kernel reads each visible key once to score the query heads of that group, takes a float32 softmax,
then reads each value once to accumulate the output. The torch path it replaces gathered every context into a
padded copy, layer after layer, and that copy was most of a CPU decode step.

The kernel is C++ in the native module (``corral/csrc/kernels_impl.h``), OpenMP over (sequence, KV head); it
checks every buffer, and every block id and context length it is handed, before it reads the cache. Where the
module is off or missing, :func:`load` returns None and callers keep the torch path. The cache may be the
queries' dtype, bfloat16 under float32 queries, or int8 with a float32 scale per (token, KV head): a key's score
is ``scale * (q . codes)`` and a value's weight ``p * scale``, so rows are dequantized as they are read. What this
leaves out: prefill (many queries per sequence is compute-bound, and torch's flash attention does it well),
float16.
"""

import torch

from corral import native
from corral.kernels.cpu_ops import buffer


def load():
    """The native module when it serves this kernel, else None (callers use torch)."""
    return native.module()


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``out[s]`` [heads * D] for the single query ``q[s]`` [heads, D] of each sequence, over its first
    ``context_lens[s]`` keys through ``block_tables[s]`` (int64 ``[S, width]``). float32 or bfloat16 queries; an
    int8 cache comes with ``k_scale``/``v_scale`` [blocks, block_size, kv_heads] float32."""
    module = load()
    if module is None:
        raise RuntimeError("the native paged-decode kernel is not available (see corral.native.status())")
    num_seqs, num_heads, head_dim = q.shape
    out = q.new_empty(num_seqs, num_heads * head_dim)
    module.paged_decode(buffer(q.contiguous()), buffer(k_cache), buffer(v_cache), buffer(block_tables.contiguous()),
                        buffer(context_lens.contiguous()), buffer(out), scale, torch.get_num_threads(),
                        None if k_scale is None else buffer(k_scale), None if v_scale is None else buffer(v_scale))
    return out

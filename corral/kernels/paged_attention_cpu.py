"""Paged decode attention on the CPU: one query token per sequence against K/V read straight from the block
pool, with no gather and no padding.

The operation is :mod:`corral.kernels.paged_attention`'s with ``q_len = 1`` for every sequence (its pseudo-code
is the contract; :func:`~corral.kernels.paged_attention.paged_attention_torch` is the oracle). Consecutive rows
with one block table (a decode and its draft) form a run, whose keys are read once for all its queries, each
query seeing its own context length. For head sizes 64 and 128 the kernel is flash-decoding: per (run, chunk
of 256 keys, one KV head or all of them) it widens a block of 16 keys' rows into an L1 buffer, takes each
query's 16 scores as vector FMAs reduced together, keeps a running max and sum, and accumulates the weighted
values in registers; the chunks' partial results are merged per query. The chunks keep both threads busy on one
sequence's three KV heads (a job takes all of a chunk's heads, reading each token's slot whole, only where there
are chunks enough for that), and their fixed size keeps a row's arithmetic the same in any batch and on any
thread count. Other head sizes take a two-pass kernel (scores, exact softmax, weighted sum). The torch path it
replaces gathered every context into a padded copy, layer after layer, and that copy was most of a CPU decode
step.

The kernels are C++ in the native module (``corral/csrc/kernels_impl.h``), OpenMP; they check every buffer, and
every block id and context length they are handed, before they read the cache. Where the module is off or
missing, :func:`load` returns None and callers keep the torch path. The cache may be the queries' dtype, bfloat16
under float32 queries, or int8 with a float32 scale per (token, KV head): a key's row is widened times its scale
as it is read.

:func:`causal_prefill` is the prefill of a sequence with nothing cached (queries over their own fresh K/V, float32,
head size 64 or 128): a flash-style kernel in the same module that scores several query rows against a block of
keys with vector FMAs and serves every query head of a KV group from one read of its K and V. On a 2-core AVX-512
EPYC, torch's CPU flash attention took 3.1-3.7 ms per layer for 455 tokens of SmolLM2's 9 heads, about half of a
whole prefill; this kernel about 1.4 ms for 521 tokens.
:func:`prefill_paged` is the prefill of new tokens over cached context (a prefix-cache hit, a long prompt's later
chunk, a recompute): the same kernel's rows, at an offset, over every key of the paged cache (the new tokens' own
written there first), which it widens to float32 into the calling thread's scratch before it attends. Before it,
these prefills ran torch's masked SDPA over a gathered copy: a 500-token prompt behind a 20-token cached prefix took
240 ms where the same prompt with nothing cached took 160.
What this leaves out: bfloat16 prefill, float16.
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


def causal_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` [T, heads * D] (allocated when None) for float32 queries ``q`` [T, heads, D] over their own keys and
    values ``k``/``v`` [T, kv_heads, D], query t seeing keys 0 .. t (rows may be strided views, as the fused QKV
    output gives them). D must be 64 or 128 (see :func:`serves_prefill`)."""
    num_tokens, num_heads, head_dim = q.shape
    if out is None:
        out = q.new_empty(num_tokens, num_heads * head_dim)
    load().causal_prefill(buffer(q), buffer(k), buffer(v), buffer(out), scale, torch.get_num_threads())
    return out


def prefill_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  num_context: int, scale: float, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` [T, heads * D] for float32 queries ``q`` [T, heads, D] (rows may be strided views) at positions
    ``num_context - T`` .. ``num_context - 1``, each over the keys up to its own position, read from the cache
    [blocks, block_size, kv_heads, D] through ``block_table`` (int64 [width]); an int8 cache comes with its scales.
    D must be 64 or 128 (see :func:`serves_prefill`)."""
    num_tokens, num_heads, head_dim = q.shape
    out = q.new_empty(num_tokens, num_heads * head_dim)
    load().prefill_paged(buffer(q), buffer(k_cache), buffer(v_cache), buffer(block_table.contiguous()), num_context,
                         buffer(out), scale, torch.get_num_threads(), None if k_scale is None else buffer(k_scale),
                         None if v_scale is None else buffer(v_scale))
    return out


def serves_prefill(q: torch.Tensor) -> bool:
    """Whether :func:`causal_prefill` and :func:`prefill_paged` take these queries (see :func:`serves_prefills`)."""
    return q.device.type == "cpu" and serves_prefills(q.dtype, q.shape[-1])


def serves_prefills(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the prefill kernels take CPU queries of this dtype and head size: float32, head size 64 or 128, the
    module loaded."""
    return dtype == torch.float32 and head_dim in (64, 128) and load() is not None

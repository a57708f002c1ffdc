"""Attention over the paged KV cache, CPU path: what each query may see, and the batched torch code that does it.

The cache of one layer is two tensors ``[num_blocks, block_size, kv_heads, head_dim]``; viewed flat, a *slot*
``block_id * block_size + offset`` holds one token's K (or V). The model runner builds one
:class:`AttentionMetadata` per step, shared by all layers, so the per-layer work is tensor ops only.

Decodes (one query each) run as one batched SDPA over their gathered, padded contexts, the query heads of a
KV group stacked as the query length so GQA needs no repeat. A prefill chunk runs alone; when nothing of it is
cached its own fresh K/V are used directly (no gather) with the causal flash path. On a GPU the same
contract is served by the Triton kernel in :mod:`corral.kernels.paged_attention`, whose torch twin checks this
code as well.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F


class PrefillSpan(NamedTuple):
    start: int  # rows [start, end) of the flat batch are this sequence's new tokens
    end: int
    context_slots: torch.Tensor | None  # [num_context] slots of every visible key; None: the new tokens only


class AttentionMetadata(NamedTuple):
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    num_decodes: int  # rows [0, num_decodes) are decodes, one row per sequence
    decode_slots: torch.Tensor  # [num_decodes, max_context] int64, padded with slot 0
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_context] bool, True where a key is real
    prefills: tuple[PrefillSpan, ...]


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V [T, kv_heads, head_dim] at their slots."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Attention output [T, heads * head_dim] for queries ``q`` [T, heads, head_dim] (K/V already written)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    out = q.new_empty(num_tokens, num_heads * head_dim)
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode(q[: meta.num_decodes], flat_k, flat_v, meta)
    for span in meta.prefills:
        out[span.start: span.end] = _prefill(q[span.start: span.end], k[span.start: span.end],
                                             v[span.start: span.end], flat_k, flat_v, span.context_slots)
    return out


def _decode(q, flat_k, flat_v, meta: AttentionMetadata) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads = flat_k.shape[1]
    group = num_heads // num_kv_heads
    keys = flat_k[meta.decode_slots].transpose(1, 2)  # [B, kv_heads, L, D]
    values = flat_v[meta.decode_slots].transpose(1, 2)
    queries = q.view(batch, num_kv_heads, group, head_dim)  # a KV group's query heads act as its query rows
    out = F.scaled_dot_product_attention(queries, keys.to(q.dtype), values.to(q.dtype), attn_mask=meta.decode_mask)
    return out.reshape(batch, num_heads * head_dim)


def _prefill(q, k, v, flat_k, flat_v, context_slots) -> torch.Tensor:
    num_new, num_heads, head_dim = q.shape
    if context_slots is None:
        keys, values, mask = k, v, None
    else:
        keys, values = flat_k[context_slots].to(q.dtype), flat_v[context_slots].to(q.dtype)
        num_context = context_slots.shape[0]
        # query i sits at position num_context - num_new + i and sees every key up to and including it
        rows = torch.arange(num_context - num_new, num_context).unsqueeze(1)
        mask = torch.arange(num_context).unsqueeze(0) <= rows
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                                         values.transpose(0, 1).unsqueeze(0), attn_mask=mask,
                                         is_causal=mask is None, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1).reshape(num_new, num_heads * head_dim)

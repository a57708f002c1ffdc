"""Attention over the paged KV cache, CPU path: what each query may see, and the batched torch code that does it.

The cache of one layer is two tensors ``[num_blocks, block_size, kv_heads, head_dim]``; viewed flat, a *slot*
``block_id * block_size + offset`` holds one token's K (or V). The model runner builds one
:class:`AttentionMetadata` per step, shared by all layers, so the per-layer work is tensor ops only.

Decodes (one query each) run, when the compiled CPU kernel of :mod:`corral.kernels.paged_attention_cpu` is
available, as one call over all of them that reads K/V in place from the blocks: gathering K/V was the dominant
cost of CPU decode. Without it they run as batched SDPA calls over their gathered, padded contexts, the query
heads of a KV group stacked as the query length so GQA needs no repeat; the runner then sorts decodes by context
length and cuts them into a few groups, each padded only to its own longest context. A prefill chunk with nothing
cached runs alone over its own fresh K/V (no gather): in float32 through the native causal kernel
(:func:`~corral.kernels.paged_attention_cpu.causal_prefill`), else torch's causal flash path. A chunk over cached
context (a prefix-cache hit, a later chunk of a long prompt, a recompute) runs alone through the same kernel over
the paged cache (:func:`~corral.kernels.paged_attention_cpu.prefill_paged`) in float32; in other dtypes, or without
the module, such chunks are sorted by context length and attended in padded groups, one gather and one SDPA call
per group and layer. On a GPU the same
contract is served by the Triton kernel in :mod:`corral.kernels.paged_attention`, whose torch twin checks this
code as well.

An int8 cache (:class:`KVCache` with scales) stores each token's K and V per KV head as int8 codes times one
float32 scale (``max|x| / 127``, so ``|error| <= max|x| / 254`` per element): 64 + 4 bytes per head of 64 where
bfloat16 takes 128. Every reader dequantizes what it reads (the kernel while it reads a row); a prefill over its
own fresh tokens attends to their unquantized K/V, as it has them at hand.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from corral.engine import hugepages
from corral.engine.quant import quantize_int8_rows
from corral.kernels.paged_attention_cpu import causal_prefill, paged_decode, prefill_paged, serves_prefill


class KVCache(NamedTuple):
    """One layer's cache: ``k``/``v`` [num_blocks, block_size, kv_heads, head_dim] (float32, bfloat16 or int8)
    and, for int8, the scales ``k_scale``/``v_scale`` [num_blocks, block_size, kv_heads] float32."""
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> "KVCache":
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        zeros = hugepages.zeros  # on 2 MiB pages where the OS gives them: a long context's keys are read each step
        if dtype != torch.int8:
            return cls(zeros(shape, dtype), zeros(shape, dtype))
        return cls(zeros(shape, dtype), zeros(shape, dtype), zeros(shape[:3], torch.float32),
                   zeros(shape[:3], torch.float32))

    def layer(self, index: int) -> "KVCache":
        """Layer ``index`` of a cache allocated for every layer at once (a leading layer dimension): views."""
        return KVCache(*(None if t is None else t[index] for t in self))

    @property
    def is_int8(self) -> bool:
        return self.k_scale is not None

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for tensor in self:
            if tensor is not None:
                tensor[dst] = tensor[src]


class PrefillSpan(NamedTuple):
    start: int  # rows [start, end) of the flat batch are this sequence's new tokens
    end: int
    context_blocks: torch.Tensor | None  # int64 block ids covering every visible key; None: the new tokens only
    num_context: int  # visible keys: cached ones plus the new tokens


class DecodeGroup(NamedTuple):
    start: int  # rows [start, end) of the flat batch are single-query sequences
    end: int
    block_tables: torch.Tensor  # [end - start, width] int64: each sequence's block table, padded with block 0
    context_lens: torch.Tensor  # [end - start] int64: keys each query sees, its own included
    mask: torch.Tensor | None  # [end - start, 1, 1, width * block_size] bool, True where a key is real; None: kernel


class PrefillGroup(NamedTuple):
    """Prefill chunks that attend to cached context, padded into one SDPA call per layer (see
    :func:`group_prefills`): B chunks of up to N queries over up to W blocks of keys."""
    rows: torch.Tensor  # [B * N] int64: the flat-batch row of each query slot (a padding slot repeats a real one)
    valid: torch.Tensor  # [B * N] bool: the slot is a real query
    block_ids: torch.Tensor  # [B * W] int64: each chunk's context blocks, padded with block 0
    mask: torch.Tensor  # [B, 1, N, W * block_size] bool: what each query may see


class AttentionMetadata(NamedTuple):
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    decodes: tuple[DecodeGroup, ...]  # they cover rows [0, number of decodes)
    prefills: tuple[PrefillSpan, ...]  # attended one at a time
    prefill_groups: tuple[PrefillGroup, ...] = ()


PREFILL_GROUP_SIZE = 16  # chunks per padded call; they are sorted by context length first, so padding stays small


def group_prefills(spans, block_size: int) -> tuple[tuple[PrefillSpan, ...], tuple[PrefillGroup, ...]]:
    """Split prefill spans into those over their own new tokens only (kept as spans: causal flash attention over
    fresh K/V needs no gather) and those over cached context, grouped. Thirty-one requests behind one cached
    system prompt, each with a 40-token tail, used to run 31 gathers and SDPA calls per layer."""
    fresh = tuple(span for span in spans if span.context_blocks is None)
    cached = sorted((span for span in spans if span.context_blocks is not None), key=lambda span: span.num_context)
    groups = []
    for i in range(0, len(cached), PREFILL_GROUP_SIZE):
        chunk = cached[i: i + PREFILL_GROUP_SIZE]
        num_queries = max(span.end - span.start for span in chunk)
        width = max(len(span.context_blocks) for span in chunk)
        rows = torch.empty(len(chunk), num_queries, dtype=torch.long)
        valid = torch.zeros(len(chunk), num_queries, dtype=torch.bool)
        block_ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), 1, num_queries, width * block_size, dtype=torch.bool)
        keys = torch.arange(width * block_size)
        for b, span in enumerate(chunk):
            count = span.end - span.start
            rows[b, :count] = torch.arange(span.start, span.end)
            rows[b, count:] = span.start
            valid[b, :count] = True
            block_ids[b, : len(span.context_blocks)] = span.context_blocks
            # query i sits at position num_context - count + i and sees every key up to and including it
            positions = torch.arange(span.num_context - count, span.num_context)
            mask[b, 0, :count] = keys[None, :] <= positions[:, None]
            mask[b, 0, count:, 0] = True  # padding slots see one key, so their softmax stays finite
        groups.append(PrefillGroup(rows.flatten(), valid.flatten(), block_ids.flatten(), mask))
    return fresh, tuple(groups)


def write_kv(k: torch.Tensor, v: torch.Tensor, cache: KVCache, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V [T, kv_heads, head_dim] at their slots (quantized, for an int8 cache)."""
    if cache.is_int8:
        for x, codes, scales in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
            q, scale = quantize_int8_rows(x)  # one scale per (token, KV head)
            codes.view(-1, *x.shape[1:]).index_copy_(0, slot_mapping, q)
            scales.view(-1, x.shape[1]).index_copy_(0, slot_mapping, scale)
        return
    cache.k.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k.to(cache.k.dtype))
    cache.v.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v.to(cache.v.dtype))


def paged_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                            meta: AttentionMetadata) -> torch.Tensor:
    """Attention output [T, heads * head_dim] for queries ``q`` [T, heads, head_dim] (K/V already written)."""
    num_tokens, num_heads, head_dim = q.shape
    out = q.new_empty(num_tokens, num_heads * head_dim)
    for group in meta.decodes:
        out[group.start: group.end] = _decode(q[group.start: group.end], cache, group)
    for span in meta.prefills:
        out[span.start: span.end] = _prefill(q[span.start: span.end], k[span.start: span.end],
                                             v[span.start: span.end], cache, span)
    for group in meta.prefill_groups:
        out[group.rows[group.valid]] = _prefill_group(q, cache, group)[group.valid]
    return out


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[num_seqs, kv_heads, keys, head_dim] from whole blocks of ``cache`` [num_blocks, block_size, kv_heads, D]."""
    _, _, num_kv_heads, head_dim = cache.shape
    return cache.index_select(0, block_ids).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)


def read_blocks(cache: KVCache, block_ids: torch.Tensor, num_seqs: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [num_seqs, kv_heads, keys, head_dim] in ``dtype`` from whole blocks, dequantized when int8."""
    keys, values = gather_blocks(cache.k, block_ids, num_seqs), gather_blocks(cache.v, block_ids, num_seqs)
    if not cache.is_int8:
        return keys.to(dtype), values.to(dtype)
    num_kv_heads = cache.k.shape[2]

    def scales(s):
        return s.index_select(0, block_ids).view(num_seqs, -1, num_kv_heads).transpose(1, 2)[..., None]
    return (keys * scales(cache.k_scale)).to(dtype), (values * scales(cache.v_scale)).to(dtype)


def _decode(q, cache: KVCache, group: DecodeGroup) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    if group.mask is None:  # the compiled kernel reads the blocks in place
        return paged_decode(q, cache.k, cache.v, group.block_tables, group.context_lens, head_dim ** -0.5,
                            cache.k_scale, cache.v_scale)
    num_kv_heads = cache.k.shape[2]
    keys, values = read_blocks(cache, group.block_tables.flatten(), batch, q.dtype)  # [B, kv_heads, L, D]
    # the query heads sharing a KV head act as that head's query rows
    queries = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask)
    return out.reshape(batch, num_heads * head_dim)


def _prefill_group(q, cache: KVCache, group: PrefillGroup) -> torch.Tensor:
    """[B * N, heads * head_dim]: every query slot of the group, padding included."""
    batch, _, num_queries, _ = group.mask.shape
    _, num_heads, head_dim = q.shape
    queries = q.index_select(0, group.rows).view(batch, num_queries, num_heads, head_dim).transpose(1, 2)
    keys, values = read_blocks(cache, group.block_ids, batch, q.dtype)  # [B, kv_heads, W * block_size, D]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask, enable_gqa=True)
    return out.transpose(1, 2).reshape(batch * num_queries, num_heads * head_dim)


def _prefill(q, k, v, cache: KVCache, span: PrefillSpan) -> torch.Tensor:
    num_new, num_heads, head_dim = q.shape
    if serves_prefill(q):
        if span.context_blocks is None:
            return causal_prefill(q, k, v, head_dim ** -0.5)
        return prefill_paged(q, cache.k, cache.v, span.context_blocks, span.num_context, head_dim ** -0.5,
                             cache.k_scale, cache.v_scale)
    if span.context_blocks is None:
        keys, values, mask = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), None
    else:
        num_context = span.num_context
        keys, values = read_blocks(cache, span.context_blocks, 1, q.dtype)  # [1, kv_heads, keys, D]
        keys, values = keys[:, :, :num_context], values[:, :, :num_context]
        # query i sits at position num_context - num_new + i and sees every key up to and including it
        rows = torch.arange(num_context - num_new, num_context).unsqueeze(1)
        mask = torch.arange(num_context).unsqueeze(0) <= rows
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask,
                                         is_causal=mask is None, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1).reshape(num_new, num_heads * head_dim)

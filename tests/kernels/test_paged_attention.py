"""Paged attention: the torch twin against plain causal attention over contiguous K/V, the Triton kernel (under
TRITON_INTERPRET=1 on CPU) against the twin, and the engine's batched CPU path against the twin."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run kernels on CPU tensors

import pytest
import torch
import torch.nn.functional as F

from corral.engine.attention import (AttentionMetadata, DecodeGroup, KVCache, PrefillSpan, group_prefills,
                                     paged_attention_forward)
from corral.engine.quant import quantize_int8_rows as quantize_rows
from corral.kernels import paged_attention_cpu
from corral.kernels.paged_attention import paged_attention, paged_attention_torch, paged_attention_triton

BLOCK_SIZE = 16


def make_case(query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=0):
    """Random caches with shuffled block tables (so no sequence's blocks are contiguous) and queries."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    total = sum(num_blocks_per_seq) + 3
    k_cache = torch.randn(total, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(total, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(total, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(num_blocks_per_seq), dtype=torch.int32)
    for s, n in enumerate(num_blocks_per_seq):
        tables[s, :n] = torch.tensor([order.pop() for _ in range(n)])
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl


def contiguous_reference(q, k_cache, v_cache, tables, seq_lens, qsl, scale):
    """Each sequence's K/V copied out in order, then SDPA with the causal mask shifted by the cached length."""
    outs = []
    group = q.shape[1] // k_cache.shape[2]
    for s in range(len(seq_lens)):
        n, start, end = int(seq_lens[s]), int(qsl[s]), int(qsl[s + 1])
        keys = torch.cat([k_cache[b] for b in tables[s].tolist()])[:n].float()
        values = torch.cat([v_cache[b] for b in tables[s].tolist()])[:n].float()
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        mask = torch.ones(end - start, n, dtype=torch.bool).tril(diagonal=n - (end - start))
        outs.append(F.scaled_dot_product_attention(q[start:end].float().transpose(0, 1), keys.transpose(0, 1),
                                                   values.transpose(0, 1), attn_mask=mask, scale=scale).transpose(0, 1))
    return torch.cat(outs)


CASES = {
    "decode": ([1, 1, 1], [1, 17, 40]),
    "prefill": ([5, 16, 33], [5, 16, 33]),
    "prefill over a cached prefix": ([3, 20], [19, 52]),
    "mixed": ([1, 7, 1, 18], [30, 7, 16, 50]),
}


@pytest.mark.parametrize("name", CASES)
def test_twin_matches_contiguous_attention(name):
    case = make_case(*CASES[name])
    expected = contiguous_reference(*case, scale=0.25)
    torch.testing.assert_close(paged_attention_torch(*case, scale=0.25), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_matches_twin(name, dtype):
    case = make_case(*CASES[name], dtype=dtype, seed=1)
    expected = paged_attention_torch(*case, scale=0.25).float()
    got = paged_attention_triton(*case, scale=0.25).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


def test_dispatch_uses_the_twin_on_cpu():
    case = make_case([2, 1], [9, 20])
    assert torch.equal(paged_attention(*case, scale=0.5), paged_attention_torch(*case, scale=0.5))


def quantized(case):
    """The case's caches as int8 codes with per-(token, KV head) scales, as the engine writes them."""
    q, k_cache, v_cache, tables, lens, qsl = case
    (k_codes, k_scale), (v_codes, v_scale) = quantize_rows(k_cache.flatten(0, 1)), quantize_rows(v_cache.flatten(0, 1))
    shape = k_cache.shape
    return (q, k_codes.view(shape), v_codes.view(shape), tables, lens, qsl,
            k_scale.view(shape[:3]), v_scale.view(shape[:3]))


def test_int8_rows_are_within_half_a_step():
    x = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(3)) * 4
    codes, scale = quantize_rows(x)
    assert codes.dtype == torch.int8 and scale.shape == (50, 3)
    assert ((codes.float() * scale[..., None] - x).abs() <= scale[..., None] / 2 + 1e-6).all()
    assert torch.equal(codes.abs().amax(-1), torch.full((50, 3), 127, dtype=torch.int8))


@pytest.mark.parametrize("name", CASES)
def test_int8_twin_is_the_twin_over_dequantized_caches(name):
    q, k, v, tables, lens, qsl, ks, vs = quantized(make_case(*CASES[name], seed=4))
    expected = paged_attention_torch(q, k.float() * ks[..., None], v.float() * vs[..., None], tables, lens, qsl, 0.25)
    torch.testing.assert_close(paged_attention_torch(q, k, v, tables, lens, qsl, 0.25, ks, vs), expected)


@pytest.mark.parametrize("name", CASES)
def test_triton_kernel_reads_an_int8_cache(name):
    q, k, v, tables, lens, qsl, ks, vs = quantized(make_case(*CASES[name], seed=5))
    expected = paged_attention_torch(q, k, v, tables, lens, qsl, 0.25, ks, vs)
    got = paged_attention_triton(q, k, v, tables, lens, qsl, 0.25, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("decode_path", ["torch", "kernel"])
@pytest.mark.parametrize("grouped", [False, True], ids=["spans", "grouped"])
@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
def test_engine_cpu_path_matches_twin(name, decode_path, grouped, cache_dtype):
    """The engine's batched path (decodes first, prefill spans after) on the same caches and tables; decodes
    through gathered SDPA (a mask given) or the compiled kernel (no mask); prefill spans over their context one
    by one, or padded into groups as the runner does (``group_prefills``); float32 or int8 caches."""
    if decode_path == "kernel" and paged_attention_cpu.load() is None:
        pytest.skip("native module off or missing: the CPU kernel is unavailable")
    query_lens, seq_lens = CASES[name]
    case = make_case(query_lens, seq_lens, seed=2)
    q, k_cache, v_cache, tables, lens, qsl = case
    scales = (None, None)
    if cache_dtype == "int8":
        q, k_cache, v_cache, tables, lens, qsl, *scales = quantized(case)
    order = sorted(range(len(query_lens)), key=lambda s: query_lens[s] != 1)  # the engine puts decodes first
    rows = torch.cat([torch.arange(int(qsl[s]), int(qsl[s + 1])) for s in order])
    block_lists = [tables[s].long()[: -(-seq_lens[s] // BLOCK_SIZE)] for s in order]
    decodes = [s for s in order if query_lens[s] == 1]
    width = max((len(block_lists[i]) for i in range(len(decodes))), default=1)
    padded = torch.zeros(len(decodes), width, dtype=torch.long)
    mask = torch.zeros(len(decodes), 1, 1, width * BLOCK_SIZE, dtype=torch.bool)
    for i, s in enumerate(decodes):
        padded[i, : len(block_lists[i])] = block_lists[i]
        mask[i, ..., : seq_lens[s]] = True
    context_lens = torch.tensor([seq_lens[s] for s in decodes], dtype=torch.long)
    masks = (mask[:1], mask[1:]) if decode_path == "torch" else (None, None)
    groups = (DecodeGroup(0, 1, padded[:1], context_lens[:1], masks[0]),
              DecodeGroup(1, len(decodes), padded[1:], context_lens[1:], masks[1]))
    spans, start = [], len(decodes)
    for i, s in enumerate(order[len(decodes):], start=len(decodes)):
        end = start + query_lens[s]
        spans.append(PrefillSpan(start, end, block_lists[i], seq_lens[s]))  # always read back through the cache
        start = end
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), groups if decodes else (), tuple(spans))
    if grouped:
        fresh, prefill_groups = group_prefills(spans, BLOCK_SIZE)
        assert not fresh and sum(int(g.valid.sum()) for g in prefill_groups) == sum(s.end - s.start for s in spans)
        meta = meta._replace(prefills=fresh, prefill_groups=prefill_groups)
    q_sorted = q[rows]
    dummy_kv = torch.zeros(q_sorted.shape[0], k_cache.shape[2], k_cache.shape[3])
    got = paged_attention_forward(q_sorted, dummy_kv, dummy_kv, KVCache(k_cache, v_cache, *scales), meta)
    expected = paged_attention_torch(q, k_cache, v_cache, tables, lens, qsl, q.shape[-1] ** -0.5, *scales)[rows]
    torch.testing.assert_close(got.view_as(expected), expected, atol=1e-5, rtol=1e-5)

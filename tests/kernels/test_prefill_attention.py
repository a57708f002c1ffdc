"""The native prefill kernels against torch's attention in float64: ``causal_prefill`` (new tokens over their own
keys) and ``prefill_paged`` (new tokens over cached context, read through a block table from a float32, bfloat16 or
int8 cache). GQA groups, both head sizes they take, lengths around their blocks of 4 rows and 32 keys, strided
views as the fused QKV output gives them, every instruction-set variant this CPU runs, and the checks on what
Python hands in."""

import pytest
import torch
import torch.nn.functional as F

from corral import native
from corral.kernels import paged_attention_cpu
from tests.kernels.variants import report_in_variant

pytestmark = pytest.mark.skipif(native.module() is None, reason="the native module is off or missing")
FLAGS = native.cpu_flags()
VARIANTS = ["baseline"] + (["avx2"] if {"avx2", "fma", "f16c", "bmi2"} <= FLAGS else [])


def fused_qkv(tokens, heads, kv_heads, head_dim, seed=0):
    """q, k, v as views into one [T, (H + 2 KVH) * D] tensor, the layout the model hands the kernel."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 2
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    return q, k, v


def reference(q, k, v, scale):
    """Causal attention in float64, the query heads of a group reading their KV head."""
    group = q.shape[1] // k.shape[1]
    keys, values = (t.double().repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1), keys, values, is_causal=True, scale=scale)
    return out.transpose(0, 1).reshape(q.shape[0], -1)


# (tokens, heads, KV heads, head size): one token; a block of rows cut short; a key block's edge; many blocks
SHAPES = [(1, 9, 3, 64), (3, 9, 3, 64), (31, 4, 4, 64), (32, 9, 3, 64), (33, 8, 2, 128), (130, 9, 3, 64),
          (455, 9, 3, 64)]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_equals_causal_attention(shape):
    q, k, v = fused_qkv(*shape)
    scale = shape[3] ** -0.5
    got = paged_attention_cpu.causal_prefill(q, k, v, scale).double()
    ref = reference(q, k, v, scale)
    # float32 sums of at most T terms and a few-ulp exp: relative to the values' scale, well under 1e-5
    assert (got - ref).abs().max() <= 1e-5 * v.abs().max(), float((got - ref).abs().max())


def test_k_and_v_may_lie_apart():
    """RoPE'd q and k in a tensor of their own, v still a view into the fused output (the unfused path)."""
    q, k, v = fused_qkv(50, 9, 3, 64, seed=3)
    qk = torch.cat((q, k), dim=1)
    got = paged_attention_cpu.causal_prefill(qk[:, :9], qk[:, 9:], v, 0.125).double()
    assert (got - reference(q, k, v, 0.125)).abs().max() <= 1e-5 * v.abs().max()


def test_query_t_sees_nothing_after_t():
    """Changing the last token's K and V changes only the last row."""
    q, k, v = fused_qkv(70, 9, 3, 64, seed=1)
    before = paged_attention_cpu.causal_prefill(q, k, v, 0.125)
    k[-1] += 5
    v[-1] -= 5
    after = paged_attention_cpu.causal_prefill(q, k, v, 0.125)
    assert torch.equal(before[:-1], after[:-1]) and not torch.equal(before[-1], after[-1])


def test_the_engine_prefill_takes_the_kernel_and_agrees_with_torch_flash():
    from corral.engine.attention import PrefillSpan, _prefill
    q, k, v = fused_qkv(100, 9, 3, 64, seed=2)
    span = PrefillSpan(0, 100, None, 100)
    got = _prefill(q, k, v, None, span)
    assert torch.equal(got, paged_attention_cpu.causal_prefill(q, k, v, 64 ** -0.5))  # the kernel's bits, not torch's
    torch_flash = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                                 v.transpose(0, 1).unsqueeze(0), is_causal=True, enable_gqa=True)
    torch_flash = torch_flash.squeeze(0).transpose(0, 1).reshape(100, -1)
    assert torch.allclose(got, torch_flash, rtol=0, atol=1e-5 * float(v.abs().max()))
    assert paged_attention_cpu.serves_prefill(q) and not paged_attention_cpu.serves_prefill(q.bfloat16())


# ---- over cached context --------------------------------------------------------------------------------------
def paged_case(tokens, context, heads, kv_heads, head_dim, block_size, cache, seed=0):
    """Queries for the last ``tokens`` of ``context`` positions, and a cache [blocks, block_size, KVH, D] (with
    int8 scales) holding every one of them in shuffled blocks, with other blocks' garbage around them."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-context // block_size) + 3
    q = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen)[:, :heads]  # rows apart, as fused QKV
    keys, values = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen) * 2 for _ in range(2))
    table = torch.randperm(num_blocks, generator=gen)
    scales = (None, None)
    if cache == "int8":
        k_scale, v_scale = (t.abs().amax(-1) / 127 for t in (keys, values))
        keys, values = (torch.round(t / s[..., None]).to(torch.int8) for t, s in ((keys, k_scale), (values, v_scale)))
        scales = (k_scale, v_scale)
    else:
        keys, values = keys.to(getattr(torch, cache)), values.to(getattr(torch, cache))
    return q, keys, values, table, scales


def paged_reference(q, keys, values, table, context, scales=(None, None)):
    """Masked attention in float64 over the widened cache: query t at position context - T + t sees keys up to it."""
    tokens, heads, head_dim = q.shape
    k, v = (t.double()[table].flatten(0, 1)[:context] for t in (keys, values))
    if scales[0] is not None:
        k = k * scales[0].double()[table].flatten(0, 1)[:context, :, None]
        v = v * scales[1].double()[table].flatten(0, 1)[:context, :, None]
    group = heads // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
    mask = torch.arange(context)[None, :] <= torch.arange(context - tokens, context)[:, None]
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1), k, v, attn_mask=mask, scale=head_dim ** -0.5)
    return out.transpose(0, 1).reshape(tokens, -1), float(v.abs().max())


# (new tokens, context, heads, KV heads, head size, block size): one token over one key; a short tail behind a
# cached prefix; nothing cached before (the whole context new); a long prompt's later chunk; a few rows over a
# long context; head size 128; blocks smaller and larger than the kernel's 32 keys
PAGED_SHAPES = [(1, 1, 9, 3, 64, 16), (5, 40, 9, 3, 64, 16), (37, 37, 9, 3, 64, 16), (100, 530, 9, 3, 64, 16),
                (3, 700, 9, 3, 64, 16), (33, 90, 8, 2, 128, 16), (20, 75, 4, 4, 64, 8), (9, 300, 9, 3, 64, 32)]


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("shape", PAGED_SHAPES)
def test_the_paged_kernel_equals_masked_attention_over_the_cache(shape, cache):
    tokens, context, *_ = shape
    q, keys, values, table, scales = paged_case(*shape, cache)
    got = paged_attention_cpu.prefill_paged(q, keys, values, table, context, shape[4] ** -0.5, *scales).double()
    ref, size = paged_reference(q, keys, values, table, context, scales)
    assert (got - ref).abs().max() <= 1e-5 * size, float((got - ref).abs().max())


def test_a_paged_query_sees_nothing_after_its_position():
    """Changing the cached K and V of the last position changes only the last row; keys past the context (the rest
    of its last block) are never read."""
    q, keys, values, table, _ = paged_case(20, 61, 9, 3, 64, 16, "bfloat16", seed=4)
    before = paged_attention_cpu.prefill_paged(q, keys, values, table, 61, 0.125)
    last, past = table[60 // 16], table[61 // 16]
    keys[past, 61 % 16:] = float("nan")
    values[past, 61 % 16:] = float("nan")
    assert torch.equal(before, paged_attention_cpu.prefill_paged(q, keys, values, table, 61, 0.125))
    keys[last, 60 % 16] += 5
    values[last, 60 % 16] -= 5
    after = paged_attention_cpu.prefill_paged(q, keys, values, table, 61, 0.125)
    assert torch.equal(before[:-1], after[:-1]) and not torch.equal(before[-1], after[-1])


def test_the_engine_prefill_over_context_takes_the_paged_kernel():
    """A prefill span with cached context goes through ``prefill_paged`` (its bits, not torch's)."""
    from corral.engine.attention import KVCache, PrefillSpan, _prefill
    q, keys, values, table, _ = paged_case(30, 130, 9, 3, 64, 16, "bfloat16", seed=5)
    span = PrefillSpan(0, 30, table[: -(-130 // 16)], 130)
    got = _prefill(q, None, None, KVCache(keys, values, None, None), span)
    assert torch.equal(got, paged_attention_cpu.prefill_paged(q, keys, values, table, 130, 0.125))


def test_paged_buffers_are_checked():
    module = native.module()
    q, keys, values, table, (k_scale, v_scale) = paged_case(8, 40, 9, 3, 64, 16, "int8")
    _, bf_keys, bf_values, _, _ = paged_case(8, 40, 9, 3, 64, 16, "bfloat16")
    out = torch.empty(8, 9 * 64)
    buf = paged_attention_cpu.buffer

    def call(q=q, keys=bf_keys, values=bf_values, table=table, context=40, out=out, scales=(None, None)):
        module.prefill_paged(buf(q), buf(keys), buf(values), buf(table), context, buf(out), 0.125, 2,
                             *(None if s is None else buf(s) for s in scales))
    call()  # as given, it runs
    with pytest.raises(IndexError, match="block id"):
        call(table=torch.tensor([0, 99, 1]))
    with pytest.raises(IndexError, match="num_context"):
        call(context=7)  # fewer keys than queries
    with pytest.raises(IndexError, match="num_context"):
        call(context=len(table) * 16 + 1)  # past the block table
    with pytest.raises(TypeError, match="int8"):
        call(scales=(k_scale, v_scale))  # scales with a bfloat16 cache
    with pytest.raises(TypeError, match="int8"):
        call(keys=keys, values=values)  # an int8 cache without scales
    with pytest.raises(TypeError, match="dtype"):
        call(values=values, keys=keys.float())
    with pytest.raises(ValueError, match="head size"):
        call(q=torch.randn(8, 9, 32), out=torch.empty(8, 9 * 32))
    with pytest.raises(ValueError):
        call(out=torch.empty(8, 100))
    with pytest.raises(TypeError):
        call(table=table.int())


_VARIANT_CHECK = """
import json, torch, sys
sys.path.insert(0, "tests/kernels")
from test_prefill_attention import PAGED_SHAPES, SHAPES, fused_qkv, paged_case, paged_reference, reference
from corral import native
from corral.kernels import paged_attention_cpu
worst = 0.0
for shape in SHAPES:
    q, k, v = fused_qkv(*shape)
    got = paged_attention_cpu.causal_prefill(q, k, v, shape[3] ** -0.5).double()
    worst = max(worst, float((got - reference(q, k, v, shape[3] ** -0.5)).abs().max() / v.abs().max()))
for shape in PAGED_SHAPES:
    for cache in ("float32", "bfloat16", "int8"):
        q, keys, values, table, scales = paged_case(*shape, cache)
        got = paged_attention_cpu.prefill_paged(q, keys, values, table, shape[1], shape[4] ** -0.5, *scales)
        ref, size = paged_reference(q, keys, values, table, shape[1], scales)
        worst = max(worst, float((got.double() - ref).abs().max() / size))
print(json.dumps({"isa": native.module().kernel_isa, "worst": worst}))
"""


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_this_cpu_runs_agrees(variant):
    report = report_in_variant(_VARIANT_CHECK, CORRAL_NATIVE_BUILD=variant)
    assert report["isa"].startswith(variant) and report["worst"] < 1e-5, report


def test_buffers_are_checked():
    module = native.module()
    q, k, v = fused_qkv(8, 9, 3, 64)
    out = torch.empty(8, 9 * 64)
    buf = paged_attention_cpu.buffer
    with pytest.raises(ValueError, match="head size"):
        module.causal_prefill(buf(q[..., :32]), buf(k[..., :32]), buf(v[..., :32]), buf(out[:, :288]), 1.0, 2)
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        module.causal_prefill(buf(q[:, :8]), buf(k), buf(v), buf(out[:, :512]), 1.0, 2)
    with pytest.raises(ValueError):
        module.causal_prefill(buf(q), buf(k[:7]), buf(v), buf(out), 1.0, 2)  # fewer keys than queries
    with pytest.raises(ValueError):
        module.causal_prefill(buf(q), buf(k), buf(v), buf(torch.empty(8, 100)), 1.0, 2)
    with pytest.raises(ValueError, match="contiguous"):
        module.causal_prefill(buf(torch.randn(8, 9, 128)[..., :64]), buf(k), buf(v), buf(out), 1.0, 2)  # heads apart
    with pytest.raises(TypeError):
        module.causal_prefill(buf(q.double()), buf(k), buf(v), buf(out), 1.0, 2)

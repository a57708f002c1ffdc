"""The native causal prefill kernel (``paged_attention_cpu.causal_prefill``) against torch's attention in float64:
GQA groups, both head sizes it takes, lengths around its blocks of 4 rows and 32 keys, strided views as the fused QKV
output gives them, every instruction-set variant this CPU runs, and the checks on what Python hands in."""

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


_VARIANT_CHECK = """
import json, torch, sys
sys.path.insert(0, "tests/kernels")
from test_prefill_attention import SHAPES, fused_qkv, reference
from corral import native
from corral.kernels import paged_attention_cpu
worst = 0.0
for shape in SHAPES:
    q, k, v = fused_qkv(*shape)
    got = paged_attention_cpu.causal_prefill(q, k, v, shape[3] ** -0.5).double()
    worst = max(worst, float((got - reference(q, k, v, shape[3] ** -0.5)).abs().max() / v.abs().max()))
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

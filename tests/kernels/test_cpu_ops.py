"""The fused CPU ops against the torch expressions they replace in the model (the fallback path), float32 and
bfloat16: RoPE and the residual add round exactly as torch does; RMSNorm may differ only through the order of
its sum of squares, SiLU only through its exp (both within one bf16 rounding step)."""

import pytest
import torch

from corral.engine.model import apply_rope, rms_norm, silu_mul
from corral.kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(torch.float32), reason="native module off or missing: kernels unavailable")

DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 3, 64, 300]  # 300 x 576 crosses the size where the kernels go parallel


def close(dtype):
    # one bf16 step (2^-8 relative) for a rounding that went the other way; float32 a few ulp
    return dict(rtol=2 ** -7, atol=1e-6) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)


def assert_rarely_differs(got, expected):
    """In bf16 a different last float32 bit changes the rounded result only near a rounding boundary."""
    if got.dtype == torch.bfloat16:
        mismatched = (got != expected).float().mean().item()
        assert mismatched < 0.01, f"{mismatched:.2%} of the outputs differ from torch's"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm_equals_add_then_torch_norm(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 576, generator=gen).to(dtype)
    delta = torch.randn(rows, 576, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    summed = h + delta
    expected = rms_norm(summed, weight, 1e-5)
    got = cpu_ops.add_rms_norm(h, delta, weight, 1e-5)
    assert torch.equal(h, summed), "the residual add is done in place and rounds as torch's add"
    torch.testing.assert_close(got, expected, **close(dtype))
    assert_rarely_differs(got, expected)
    torch.testing.assert_close(cpu_ops.add_rms_norm(h.clone(), None, weight, 1e-5), rms_norm(h, weight, 1e-5),
                               **close(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rope_in_place_equals_torch_rope_on_a_strided_view(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    heads, kv_heads, dim = 9, 3, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)  # Q | K | V, as the model has
    qk = qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim)
    positions = torch.randint(0, 2048, (rows,), generator=gen)
    angles = torch.outer(torch.arange(2048, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
    expected = apply_rope(qk, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    untouched = qkv[:, (heads + kv_heads) * dim:].clone()
    cpu_ops.rope_(qk, positions, cos, sin)
    torch.testing.assert_close(qk, expected, rtol=0, atol=0)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], untouched), "V must not be touched"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_equals_torch(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    gate_up = (3 * torch.randn(rows, 2 * 1536, generator=gen)).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)  # the exp's clamps and zero
    expected, got = silu_mul(gate_up), cpu_ops.silu_mul(gate_up)
    torch.testing.assert_close(got, expected, **close(dtype))
    assert_rarely_differs(got, expected)



@pytest.mark.parametrize("rows, width, n", [(1, 49152, 49152), (3, 1000, 997), (16, 49152, 49152), (2, 40, 1)])
def test_log_normalizers_equal_torch_logsumexp(rows, width, n):
    torch.manual_seed(rows + n)
    logits = torch.randn(rows, width) * 8
    logits[0, : n // 2] = float("-inf")  # masked columns add nothing
    got = cpu_ops.log_normalizers(logits, n)
    expected = torch.logsumexp(logits[:, :n], dim=-1)
    assert torch.allclose(got, expected, rtol=2e-6, atol=0)



def test_log_normalizers_of_a_row_with_nothing_allowed_is_minus_infinity_and_odd_inputs_fall_back():
    logits = torch.full((2, 8), float("-inf"))
    logits[1, 3] = 2.5
    assert cpu_ops.log_normalizers(logits, 8).tolist() == [float("-inf"), 2.5]
    assert cpu_ops.log_normalizers(logits.double(), 8) is None  # torch's logsumexp then runs
    assert cpu_ops.log_normalizers(torch.randn(4, 8)[:, :4], 4) is None  # not contiguous


_GREEDY_CHECK = """
import json, sys, numpy as np, torch
from corral import native
from corral.kernels import cpu_ops
rng = np.random.default_rng(3)
wrong = []
for trial in range(60):
    rows, n = int(rng.integers(1, 9)), int(rng.choice([1, 63, 64, 65, 1000, 4099, 49152]))
    width = n + int(rng.integers(0, 40))
    logits = torch.from_numpy(rng.integers(-8, 8, (rows, width)).astype(np.float32) / 4)  # ties everywhere
    logits[:, n:] = 100.0  # padding past the vocabulary is never chosen
    logits[torch.from_numpy(rng.random((rows, width)) < 0.2)] = float("-inf")
    for r in range(rows):  # one clear winner, anywhere in the row (past the first chunks too), sometimes twice
        at = int(rng.integers(0, n))
        logits[r, at] = 3.0
        if rng.random() < 0.5:
            logits[r, int(rng.integers(at, n))] = 3.0
    picked = cpu_ops.greedy_pick(logits, n, None, None)
    expected = [int(np.argmax(row)) for row in logits[:, :n].numpy()]  # numpy's argmax: the first largest
    lse = torch.logsumexp(logits[:, :n], dim=-1)
    if picked is None or picked[0] != expected or not torch.allclose(
            torch.tensor(picked[1]), logits[torch.arange(rows), expected] - lse, rtol=2e-6, atol=2e-6):
        wrong.append(trial)
print(json.dumps({"isa": native.module().kernel_isa, "wrong": wrong}))
"""


@pytest.mark.parametrize("variant", [None, "baseline"] + (
    ["avx2"] if {"avx2", "fma", "f16c", "bmi2"} <= __import__("corral.native", fromlist=["x"]).cpu_flags() else []))
def test_the_greedy_pass_picks_the_first_largest_column_in_every_variant(variant):
    """Unmasked rows of every width around the 64-column chunks the first-largest search tests at once, with the
    largest anywhere and tied: the first of them, and its logit less torch's logsumexp."""
    from tests.kernels.variants import report_in_variant

    report = report_in_variant(_GREEDY_CHECK, **({"CORRAL_NATIVE_BUILD": variant} if variant else {}))
    assert (variant is None or report["isa"].startswith(variant)) and report["wrong"] == [], report

"""Quantized linears against their references: GGUF Q4_1/Q4_0 blocks read as int4 codes reproduce the ``gguf``
package's dequantizer exactly; the int4 and int8 kernels equal the dequantized weights' matmul (with the same
rounding of scale and zero) within float rounding; group-wise and per-row quantization stay within half a step.

Tolerance of the kernel checks: the kernels take bfloat16 activations, dequantize each weight exactly and
accumulate in float32, then round the output to bfloat16. The reference computes the same products in float64.
So the only differences are the order of the float32 sum (about ``K * 2**-24`` relative to ``sum |x w|``) and
the output's rounding to bfloat16 (``2**-9`` relative): the bound used is ``2**-8 * |y| + 2**-16 * sum |x w|``.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from corral.engine.quant import Dense, Int4Groups, Int8Embedding, Int8Rows, Q4Blocks, concat_blocks, quantize_int4
from corral.engine.weights import q4_blocks


def gguf_blocks(kind: str, rows=48, cols=96, seed=0) -> tuple[np.ndarray, np.ndarray]:
    """(raw blocks, the gguf package's float32 dequantization of them) for random weights."""
    w = np.random.default_rng(seed).normal(size=(rows, cols)).astype(np.float32) * 0.05
    raw = quantize(w, GGMLQuantizationType[kind])
    return raw, np.asarray(dequantize(raw, GGMLQuantizationType[kind]), dtype=np.float32).reshape(rows, cols)


def within_float_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
    exact = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    bound = 2**-8 * exact.abs() + 2**-16 * magnitude
    assert ((got.double() - exact).abs() <= bound).all(), float(((got.double() - exact).abs() - bound).max())


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0"])
def test_q4_codes_reproduce_the_gguf_dequantizer_exactly(kind):
    raw, reference = gguf_blocks(kind)
    blocks = q4_blocks(raw, kind, *reference.shape)
    assert blocks.codes.dtype == torch.uint8 and int(blocks.codes.max()) <= 15 and blocks.group == 32
    assert torch.equal(blocks.dequantize(torch.float32), torch.from_numpy(reference))


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0"])
@pytest.mark.parametrize("rows", [1, 5, 16, 64])
def test_int4_kernel_is_the_dequantized_matmul(kind, rows):
    raw, _ = gguf_blocks(kind, seed=1)
    blocks = q4_blocks(raw, kind, 48, 96)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = Int4Groups(blocks, None, torch.bfloat16)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 48)
    # the same rounding of scale and zero (to bfloat16) as the kernel's
    within_float_rounding(got.float(), x.float(), blocks.dequantize(torch.bfloat16))


def test_rounding_scale_and_zero_to_bfloat16_stays_within_the_stated_bound():
    raw, reference = gguf_blocks("Q4_1", seed=2)
    blocks = q4_blocks(raw, "Q4_1", *reference.shape)
    error = (blocks.dequantize(torch.bfloat16) - torch.from_numpy(reference)).abs()
    d = blocks.scale.repeat_interleave(32, dim=1)
    zero = blocks.zero.repeat_interleave(32, dim=1)
    assert (error <= 2**-8 * (8 * d.abs() + zero.abs()) + 1e-9).all()
    assert error.max() > 0  # the rounding is real: bfloat16 keeps 8 significant bits of float16's 11


@pytest.mark.parametrize("group", [32, 64, 128])
def test_group_wise_int4_is_within_half_a_step(group):
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(group))
    blocks = quantize_int4(w, group)
    step = blocks.scale.repeat_interleave(group, dim=1)
    assert ((blocks.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    x = torch.randn(3, 256).bfloat16()
    within_float_rounding(Int4Groups(blocks, None, torch.bfloat16)(x).float(), x.float(),
                          blocks.dequantize(torch.bfloat16))


def test_output_rows_not_a_multiple_of_16_are_padded_and_sliced_off():
    blocks = quantize_int4(torch.randn(20, 64), 32)
    x = torch.randn(3, 64).bfloat16()
    got = Int4Groups(blocks, None, torch.bfloat16)(x)
    assert got.shape == (3, 20)
    within_float_rounding(got.float(), x.float(), blocks.dequantize(torch.bfloat16))


def test_a_group_that_does_not_divide_k_is_refused():
    with pytest.raises(ValueError, match="group size 128: must be one of .* and divide K = 576"):
        quantize_int4(torch.randn(4, 576), 128)


def test_constant_groups_quantize_exactly():
    w = torch.full((2, 64), 0.5)
    assert torch.equal(quantize_int4(w, 32).dequantize(), w)


def test_fused_blocks_are_the_parts_stacked():
    a, b = quantize_int4(torch.randn(8, 64), 32), quantize_int4(torch.randn(4, 64), 32)
    assert torch.equal(concat_blocks([a, b]).dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


def test_int8_rows_kernel_is_the_dequantized_matmul_and_within_half_a_step():
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(7))
    layer = Int8Rows.from_dense(w, None, torch.bfloat16)
    scale = layer.scale.float()
    dequantized = layer.codes.float() * scale[:, None]
    # half a step, plus the scale's rounding to bfloat16 (relative 2**-8, times the code)
    assert ((dequantized - w).abs() <= w.abs().amax(-1, keepdim=True) / 254 * 1.0001 + 2**-8 * w.abs() * 1.01).all()
    x = torch.randn(9, 96).bfloat16()
    within_float_rounding(layer(x).float(), x.float(), dequantized)


def test_int8_embedding_looks_up_the_rows_its_head_multiplies():
    w = torch.randn(100, 32, generator=torch.Generator().manual_seed(8))
    embed = Int8Embedding(w, torch.bfloat16)
    ids = torch.tensor([0, 99, 7, 7])
    rows = embed.codes.float() * embed.scale.float()[:, None]
    torch.testing.assert_close(embed(ids).float(), rows[ids], atol=0, rtol=2**-8)
    x = torch.randn(2, 32).bfloat16()
    within_float_rounding(embed.head(x).float(), x.float(), rows)


def test_bias_is_added_after_the_kernel():
    blocks = quantize_int4(torch.randn(8, 32), 32)
    bias = torch.arange(8, dtype=torch.float32)
    x = torch.randn(2, 32).bfloat16()
    with_bias = Int4Groups(blocks, bias, torch.bfloat16)(x)
    torch.testing.assert_close(with_bias, Int4Groups(blocks, None, torch.bfloat16)(x) + bias.bfloat16())


@pytest.mark.parametrize("kind", ["q4", "q5", "q6", "q8"])
def test_blocks_round_trip_the_weight_cache_file(tmp_path, kind):
    """Each kind of blocks through the converted-weights cache (a safetensors file) and back: the same type, fields
    and dtypes (Q6's int8 scales included)."""
    from safetensors.torch import load_file, save_file

    from corral.engine.quant import Q5Blocks, Q6Blocks, Q8Blocks, quantize_q8_blocks
    from corral.engine.weights import _flatten, _unflatten

    q4 = quantize_int4(torch.randn(4, 64), 32)
    blocks = {"q4": q4, "q5": Q5Blocks(*q4[:3]),
              "q6": Q6Blocks(torch.randint(0, 64, (4, 64), dtype=torch.uint8), torch.rand(4, 2).half().float(),
                             torch.randint(-128, 128, (4, 4), dtype=torch.int8)),
              "q8": Q8Blocks(*quantize_q8_blocks(torch.randn(4, 64)))}[kind]
    save_file(_flatten({"a.weight": blocks, "b": torch.ones(3)}), str(tmp_path / "cache.safetensors"))
    back = _unflatten(load_file(str(tmp_path / "cache.safetensors")))
    assert type(back["a.weight"]) is type(blocks) and torch.equal(back["b"], torch.ones(3))
    fields = [f for f in type(blocks)._fields if f != "group"]
    for field in fields:
        got, want = getattr(back["a.weight"], field), getattr(blocks, field)
        assert got.dtype == want.dtype and torch.equal(got, want), field


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 17])
def test_dense_float32_small_products_equal_f_linear(rows):
    """Up to 16 rows take the weights on the left (one row as two); the result is F.linear's to float32 rounding,
    with its bias, as contiguous rows."""
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(300, 96, generator=gen), torch.randn(300, generator=gen)
    x = torch.randn(rows, 96, generator=gen)
    for b in (None, bias):
        got = Dense(weight, b, torch.float32)(x)
        assert got.shape == (rows, 300) and got.is_contiguous()
        torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)

"""The W4A16 matmul: the packing round trip and its nibble order, the torch twin against the matmul of
``Q4Blocks.dequantize``, and the Triton kernel against the twin within the module's stated bound (under
TRITON_INTERPRET=1 on CPU tensors, about 100x slower than torch, so the shapes are small).

The CUDA cases compile the kernel only with ``TRITON_INTERPRET=0`` set (``TRITON_INTERPRET=0 pytest -m gpu
tests/kernels/test_int4_matmul.py``); a compiled kernel skips the cases that run it on CPU tensors.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run kernels on CPU tensors

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from corral.engine.quant import Int4Groups, Q4Blocks, quantize_int4
from corral.kernels import int4_matmul as int4_module
from corral.kernels.int4_matmul import (int4_matmul, int4_matmul_torch, int4_matmul_triton, pack_int4,
                                        unpack_codes)

# subtle: the kernel is interpreted iff TRITON_INTERPRET was 1 when its module was first imported, which the
# engine's modules (collected earlier) may have done before the line above set it
INTERPRETED = isinstance(int4_module._int4_matmul_kernel, InterpretedFunction)
interpreted = pytest.mark.skipif(not INTERPRETED, reason="the kernel is compiled: it takes CUDA tensors only")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_case(m, n, k, group, dtype, seed=0):
    """Random activations (rows of different magnitudes) and weights quantized group-wise."""
    gen = torch.Generator().manual_seed(seed)
    blocks = quantize_int4(torch.randn(n, k, generator=gen), group)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    return x.to(dtype), blocks


def stated_bound(x, weight, twin, output_ulps: int) -> torch.Tensor:
    """The module docstring's bound: ``2 (K + 2) u sum_k |x| (|q - 8| |scale| + |zero|)``, plus ``output_ulps``
    units in the last place of a bf16/fp16 output (one on a GPU; two under the interpreter, which truncates)."""
    k = x.shape[1]
    scale = weight.scale.double().T.repeat_interleave(weight.group, dim=1)
    zero = weight.zero.double().T.repeat_interleave(weight.group, dim=1)
    magnitude = (unpack_codes(weight.codes).double() - 8).abs() * scale.abs() + zero.abs()
    bound = 2 * (k + 2) * 2.0**-24 * (x.double().abs() @ magnitude.T)
    if x.dtype == torch.float32:
        return bound
    eps = torch.finfo(x.dtype).eps
    return bound + output_ulps * eps * (twin.double().abs() + bound)


def assert_within_bound(got, twin, x, weight, output_ulps=2):
    excess = (got.double() - twin.double()).abs() - stated_bound(x, weight, twin, output_ulps)
    assert (excess <= 0).all(), f"off the stated bound by up to {float(excess.max()):.3g}"


def test_packing_puts_even_k_in_the_low_nibble_and_round_trips():
    codes = torch.tensor([[1, 2, 3, 4], [15, 0, 0, 15]], dtype=torch.uint8)
    blocks = Q4Blocks(codes, torch.ones(2, 1), torch.zeros(2, 1), 4)
    assert pack_int4(blocks, torch.float32).codes.tolist() == [[0x21, 0x43], [0x0F, 0xF0]]
    random = torch.randint(0, 16, (37, 256), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    packed = pack_int4(Q4Blocks(random, torch.ones(37, 8), torch.zeros(37, 8), 32), torch.float32)
    assert packed.codes.shape == (37, 128) and torch.equal(unpack_codes(packed.codes), random)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_twin_is_the_matmul_of_the_dequantized_blocks(group, dtype):
    x, blocks = make_case(5, 40, 256, group, dtype, seed=group)
    weight = pack_int4(blocks, dtype)
    assert weight.scale.dtype == dtype and weight.scale.shape == (256 // group, 40)
    assert torch.equal(weight.dequantize(), blocks.dequantize(dtype))
    expected = (x.float() @ blocks.dequantize(dtype).T).to(dtype)
    assert torch.equal(int4_matmul_torch(x, weight), expected)


@interpreted
@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_is_the_twin_within_the_stated_bound(m, group, dtype):
    x, blocks = make_case(m, 48 + 5, 256, group, dtype, seed=m + group)
    weight = pack_int4(blocks, dtype)
    got = int4_matmul_triton(x, weight)
    assert got.dtype == dtype and got.shape == (m, 53)
    assert_within_bound(got, int4_matmul_torch(x, weight), x, weight)


@interpreted
def test_triton_kernel_over_many_tiles_in_each_direction():
    """Two row tiles (the second masked), four column tiles (the last masked), four K-tiles per group."""
    x, blocks = make_case(17, 53, 256, 64, torch.float32, seed=9)
    weight = pack_int4(blocks, torch.float32)
    got = int4_matmul_triton(x, weight, block_m=16, block_n=16, block_k=16)
    assert_within_bound(got, int4_matmul_torch(x, weight), x, weight)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_reads_each_weight_column_exactly(dtype):
    """One-hot activations pick single columns, even and odd k, at group edges: each output is one weight, with
    no sum to round, so any mix-up of nibbles, groups or columns shows as a wrong value."""
    _, blocks = make_case(1, 53, 256, 32, dtype, seed=3)
    assert (blocks.codes[:, 0::2] != blocks.codes[:, 1::2]).float().mean() > 0.8  # a nibble swap would show
    columns = [0, 1, 2, 3, 30, 31, 32, 33, 127, 128, 200, 255]
    x = torch.zeros(len(columns), 256, dtype=dtype)
    x[range(len(columns)), columns] = 1
    got = int4_matmul_triton(x, pack_int4(blocks, dtype))
    expected = blocks.dequantize(dtype)[:, columns].T.contiguous()
    # the interpreter converts float32 to bf16 by truncation (a GPU rounds to nearest): either is exact here
    truncated = (expected.view(torch.int32) & -(1 << 16)).view(torch.float32) if dtype == torch.bfloat16 else expected
    assert ((got == expected.to(dtype)) | (got == truncated.to(dtype))).all()


def test_k_not_a_multiple_of_the_group_is_refused():
    blocks = Q4Blocks(torch.zeros(4, 96, dtype=torch.uint8), torch.ones(4, 1), torch.zeros(4, 1), 64)
    with pytest.raises(AssertionError, match="K = 96 must be a multiple of the int4 group size 64"):
        pack_int4(blocks, torch.bfloat16)


def test_dispatch_uses_the_twin_on_cpu():
    x, blocks = make_case(3, 20, 64, 32, torch.bfloat16)
    weight = pack_int4(blocks, torch.bfloat16)
    assert torch.equal(int4_matmul(x, weight), int4_matmul_torch(x, weight))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("group", [32, 128])
def test_cuda_kernel_is_the_twin_within_the_stated_bound(m, group):
    x, blocks = make_case(m, 2048 + 5, 1024, group, torch.bfloat16, seed=m)
    weight = pack_int4(blocks, torch.bfloat16)
    on_gpu = pack_int4(Q4Blocks(*(t.cuda() for t in blocks[:3]), group), torch.bfloat16)
    got = int4_matmul(x.cuda(), on_gpu).cpu()
    assert_within_bound(got, int4_matmul_torch(x, weight), x, weight, output_ulps=2 if INTERPRETED else 1)


@pytest.mark.gpu
@needs_cuda
def test_int4_groups_on_cuda_run_the_kernel_and_add_the_bias():
    x, blocks = make_case(9, 200, 512, 64, torch.bfloat16, seed=2)
    x, blocks = x.cuda(), Q4Blocks(*(t.cuda() for t in blocks[:3]), 64)
    bias = torch.randn(200, device="cuda")
    layer = Int4Groups(blocks, bias, torch.bfloat16)
    weight = pack_int4(blocks, torch.bfloat16)
    assert layer.nbytes == weight.nbytes
    assert torch.equal(layer(x), int4_matmul_triton(x, weight) + bias.bfloat16())

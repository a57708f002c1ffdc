"""The bitmask kernel against its reference pseudo-code (numpy), and the Triton kernel against its torch twin.

The Triton cases run under TRITON_INTERPRET=1 (set by tests/conftest.py) on CPU tensors, about 100x slower than
torch, so that table is small in rows but covers every vocabulary size the kernel must handle.
"""

import numpy as np
import pytest
import torch

from corral.kernels.bitmask import (apply_token_bitmask_, apply_token_bitmask_cpu_, apply_token_bitmask_torch_,
                                    apply_token_bitmask_triton_, unpack_bitmask)

# (tokenizer vocabulary, logits width): SmolLM2, an odd size, Llama 3, Qwen2 (151,665 tokens, lm_head of 151,936)
VOCABS = [(49152, 49152), (49153, 49153), (128256, 128256), (151665, 151936)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def reference(logits: np.ndarray, bitmask: np.ndarray, indices, vocab_size: int) -> np.ndarray:
    """The module docstring's pseudo-code, in numpy: column j of row i survives iff j < vocab_size and bit j."""
    out = logits.copy()
    bits = np.unpackbits(bitmask.astype("<i4").view(np.uint8), axis=1, bitorder="little").astype(bool)
    allowed = np.zeros(logits.shape, dtype=bool)
    width = min(logits.shape[1], bits.shape[1], vocab_size)
    allowed[:, :width] = bits[:, :width]
    for i in (range(logits.shape[0]) if indices is None else indices):
        out[i, ~allowed[i]] = -np.inf
    return out


def make_case(num_rows: int, width: int, vocab_size: int, dtype: torch.dtype, seed: int, density="random"):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, width, generator=generator).to(dtype)
    num_words = (vocab_size + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (num_rows, num_words), dtype=torch.int32, generator=generator)
    # The CPU path treats open, closed and mixed words differently: cover masks dominated by each.
    if density == "mostly_allowed":
        bitmask[torch.rand(num_rows, num_words, generator=generator) > 0.05] = -1
        return logits, bitmask
    if density == "mostly_masked":
        bitmask[torch.rand(num_rows, num_words, generator=generator) > 0.3] = 0
        return logits, bitmask
    # Rows of every density: all allowed, none allowed, and sparse (a grammar usually allows few tokens).
    if num_rows > 1:
        bitmask[1] = -1
    if num_rows > 2:
        bitmask[2] = 0
    if num_rows > 3:
        bitmask[3] &= torch.randint(0, 2, (num_words,), dtype=torch.int32, generator=generator) << 7
    return logits, bitmask


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.float().numpy()


@pytest.mark.parametrize("vocab_size,width", VOCABS)
@pytest.mark.parametrize("density", ["random", "mostly_allowed", "mostly_masked"])
@pytest.mark.parametrize("kernel", [apply_token_bitmask_torch_, apply_token_bitmask_cpu_], ids=["twin", "cpu"])
def test_cpu_kernels_match_reference(vocab_size, width, density, kernel):
    for dtype, num_rows, indices in [(torch.float32, 1, None), (torch.bfloat16, 33, None),
                                     (torch.float16, 64, [63, 0, 17, 5]), (torch.float32, 64, [2])]:
        logits, bitmask = make_case(num_rows, width, vocab_size, dtype, seed=vocab_size + num_rows, density=density)
        expected = reference(as_numpy(logits), bitmask.numpy(), indices, vocab_size)
        kernel(logits, bitmask, None if indices is None else torch.tensor(indices), vocab_size=vocab_size)
        np.testing.assert_array_equal(as_numpy(logits), expected, err_msg=f"{dtype} {num_rows} {indices}")


# One row per vocabulary size, rotating dtype, batch size and indices; batch 64 appears with and without indices.
TRITON_CASES = [
    (49152, 49152, torch.float16, 64, None),
    (49152, 49152, torch.float32, 1, None),
    (49153, 49153, torch.bfloat16, 5, [4, 1]),
    (49153, 49153, torch.float32, 3, None),
    (128256, 128256, torch.float16, 3, None),
    (128256, 128256, torch.float32, 64, [0, 31, 63]),
    (151665, 151936, torch.float32, 2, [1]),
    (151665, 151936, torch.bfloat16, 3, None),
]


@pytest.mark.parametrize("vocab_size,width,dtype,num_rows,indices", TRITON_CASES)
def test_triton_matches_twin(vocab_size, width, dtype, num_rows, indices):
    logits, bitmask = make_case(num_rows, width, vocab_size, dtype, seed=7 * vocab_size + num_rows)
    twin = logits.clone()
    index_tensor = None if indices is None else torch.tensor(indices)
    apply_token_bitmask_torch_(twin, bitmask, index_tensor, vocab_size=vocab_size)
    apply_token_bitmask_triton_(logits, bitmask, index_tensor, vocab_size=vocab_size)
    assert torch.equal(logits, twin)
    assert not torch.equal(twin, make_case(num_rows, width, vocab_size, dtype, seed=7 * vocab_size + num_rows)[0])


@pytest.mark.parametrize("kernel", [apply_token_bitmask_torch_, apply_token_bitmask_cpu_, apply_token_bitmask_triton_])
def test_columns_past_the_bitmask_are_masked_without_vocab_size(kernel):
    # 40 tokens in 2 words, a 70-wide lm_head: columns 64..69 have no bit at all and must be masked.
    logits = torch.zeros(2, 70)
    bitmask = torch.full((2, 2), -1, dtype=torch.int32)
    kernel(logits, bitmask)
    assert torch.equal(torch.isinf(logits[0]), torch.arange(70) >= 64)
    kernel(logits, bitmask, vocab_size=40)
    assert torch.equal(torch.isinf(logits[1]), torch.arange(70) >= 40)


def test_indices_leave_other_rows_bitwise_untouched():
    logits, bitmask = make_case(6, 1000, 1000, torch.float32, seed=3)
    bitmask[:] = 0
    before = logits.clone()
    apply_token_bitmask_(logits, bitmask, torch.tensor([2, 4]))
    assert torch.isinf(logits[[2, 4]]).all()
    assert torch.equal(logits[[0, 1, 3, 5]], before[[0, 1, 3, 5]])


def test_dispatch_on_cpu_is_the_twin_on_strided_rows():
    # Rows of a wider buffer (a stride larger than the width) are what a sliced lm_head output looks like.
    buffer, bitmask = make_case(4, 1100, 1000, torch.float32, seed=11)
    logits = buffer[:, :1000]
    expected = reference(as_numpy(logits), bitmask.numpy(), None, 1000)
    apply_token_bitmask_(logits, bitmask)
    np.testing.assert_array_equal(as_numpy(logits), expected)
    assert not torch.isinf(buffer[:, 1000:]).any()


def test_unpack_bit_order():
    bitmask = torch.tensor([[1 | (1 << 9) | (-2**31), 0b101]], dtype=torch.int32)
    allowed = unpack_bitmask(bitmask, 70)
    assert torch.nonzero(allowed[0]).flatten().tolist() == [0, 9, 31, 32, 34]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("vocab_size,width", VOCABS)
def test_cuda_kernel_matches_twin(vocab_size, width):
    logits, bitmask = make_case(64, width, vocab_size, torch.bfloat16, seed=5)
    twin = logits.clone()
    apply_token_bitmask_torch_(twin, bitmask, vocab_size=vocab_size)
    logits, bitmask = logits.cuda(), bitmask.cuda()
    apply_token_bitmask_(logits, bitmask, vocab_size=vocab_size)
    assert torch.equal(logits.cpu(), twin)

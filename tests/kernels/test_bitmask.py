"""The bitmask kernel against its reference pseudo-code (numpy), and the Triton kernel against its torch twin. The
CPU path has two ways through a mask (only the words with a masked bit, or every column); both are held to the
reference at the edges: one masked token, the last partial word, padded columns, indices, strided rows, buffers.

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


@pytest.mark.parametrize("vocab_size,width,dtype,num_rows,indices", [
    (151665, 151936, torch.float32, 3, [2, 0]),
    (1050, 1100, torch.bfloat16, 4, None),
])
def test_triton_matches_twin_and_cpu_path_on_mostly_allowed_masks(vocab_size, width, dtype, num_rows, indices):
    # The masks the CPU path's word path serves: the three implementations must agree there too.
    logits, bitmask = make_case(num_rows, width, vocab_size, dtype, seed=vocab_size, density="mostly_allowed")
    index_tensor = None if indices is None else torch.tensor(indices)
    twin, cpu = logits.clone(), logits.clone()
    apply_token_bitmask_torch_(twin, bitmask, index_tensor, vocab_size=vocab_size)
    apply_token_bitmask_cpu_(cpu, bitmask, index_tensor, vocab_size=vocab_size)
    apply_token_bitmask_triton_(logits, bitmask, index_tensor, vocab_size=vocab_size)
    assert torch.equal(logits, twin) and torch.equal(cpu, twin)


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


@pytest.mark.parametrize("density", ["random", "mostly_allowed"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_path_on_strided_rows(density, dtype):
    # Rows of a wider buffer (a stride larger than the width) are what a sliced lm_head output looks like.
    buffer, bitmask = make_case(4, 1100, 1024, dtype, seed=11, density=density)
    logits = buffer[:, :1024]
    expected = reference(as_numpy(logits), bitmask.numpy(), None, 1024)
    apply_token_bitmask_(logits, bitmask)
    np.testing.assert_array_equal(as_numpy(logits), expected)
    assert not torch.isinf(buffer[:, 1024:]).any()


# --- the CPU path's word path: masks where few words have a masked bit --------------------------------------------

def check_cpu_path(logits: torch.Tensor, bitmask: torch.Tensor, indices=None, vocab_size=None):
    """The CPU path (through the dispatcher) against the reference pseudo-code and against the twin."""
    vocab_size = min(logits.shape[1], 32 * bitmask.shape[1]) if vocab_size is None else vocab_size
    index_tensor = None if indices is None else torch.tensor(indices)
    expected = reference(as_numpy(logits), bitmask.numpy(), indices, vocab_size)
    twin = logits.clone()
    apply_token_bitmask_torch_(twin, bitmask, index_tensor, vocab_size=vocab_size)
    apply_token_bitmask_(logits, bitmask, index_tensor, vocab_size=vocab_size)
    np.testing.assert_array_equal(as_numpy(logits), expected)
    assert torch.equal(logits, twin)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_allowed_rows_change_nothing_but_padding(dtype):
    logits = torch.randn(3, 1100).to(dtype)
    before = logits.clone()
    bitmask = torch.full((3, 33), -1, dtype=torch.int32)  # 1,056 bits, 1,050 tokens, 1,100 columns
    apply_token_bitmask_(logits, bitmask, vocab_size=1050)
    assert torch.equal(logits[:, :1050], before[:, :1050])
    assert torch.isinf(logits[:, 1050:]).all() and (logits[:, 1050:] < 0).all()


@pytest.mark.parametrize("vocab_size,width", VOCABS + [(1050, 1100), (5, 7)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_with_exactly_one_masked_token(vocab_size, width, dtype):
    # One zero bit per row, at the edges of a word and in the last (possibly partial) word.
    num_words = (vocab_size + 31) // 32
    masked = sorted({t for t in (0, 31, 32, vocab_size - 1, (vocab_size - 1) // 32 * 32) if t < vocab_size})
    bitmask = torch.full((len(masked), num_words), -1, dtype=torch.int32)
    for row, token in enumerate(masked):
        bitmask[row, token // 32] = ~(1 << (token % 32)) if token % 32 != 31 else 2**31 - 1
    logits = torch.randn(len(masked), width, generator=torch.Generator().manual_seed(width)).to(dtype)
    check_cpu_path(logits, bitmask, vocab_size=vocab_size)
    for row, token in enumerate(masked):
        assert torch.isinf(logits[row, :vocab_size]).nonzero().flatten().tolist() == [token]


@pytest.mark.parametrize("vocab_size,width", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_word_path_with_indices_and_padded_vocab(vocab_size, width, dtype):
    logits, bitmask = make_case(16, width, vocab_size, dtype, seed=vocab_size, density="mostly_allowed")
    before = logits.clone()
    check_cpu_path(logits, bitmask, [15, 3, 8], vocab_size)
    untouched = [i for i in range(16) if i not in (15, 3, 8)]
    assert torch.equal(logits[untouched], before[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
def test_word_path_in_several_chunks(dtype):
    # 64 rows x 1,536 words, ~5% of them with a masked bit: ~4,900 words, more than one chunk of reused buffers.
    logits, bitmask = make_case(64, 49152, 49152, dtype, seed=1, density="mostly_allowed")
    check_cpu_path(logits, bitmask)


def test_buffers_serve_shapes_and_dtypes_in_turn():
    # The reused per-thread buffers must not carry anything from one call (shape, dtype) into the next.
    for num_rows, vocab_size, dtype, density in [(64, 49152, torch.float32, "mostly_allowed"),
                                                  (2, 1000, torch.bfloat16, "mostly_allowed"),
                                                  (64, 49152, torch.float16, "random"),
                                                  (64, 128256, torch.float32, "mostly_allowed"),
                                                  (3, 49152, torch.float32, "random")]:
        logits, bitmask = make_case(num_rows, vocab_size, vocab_size, dtype, seed=num_rows, density=density)
        check_cpu_path(logits, bitmask)


@pytest.mark.parametrize("dtype", DTYPES)
def test_infinite_logits_are_masked_exactly(dtype):
    # +inf at a masked column must become -inf (adding -inf would give NaN); -inf at an allowed one stays.
    logits = torch.randn(2, 64).to(dtype)
    logits[:, ::3] = float("inf")
    logits[:, 1::3] = float("-inf")
    bitmask = torch.tensor([[0x0F0F0F0F, -1], [-1, 0x12345678]], dtype=torch.int32)
    expected = reference(as_numpy(logits), bitmask.numpy(), None, 64)
    apply_token_bitmask_(logits, bitmask)
    np.testing.assert_array_equal(as_numpy(logits), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", [apply_token_bitmask_torch_, apply_token_bitmask_cpu_, apply_token_bitmask_triton_],
                         ids=["twin", "cpu", "triton"])
@pytest.mark.parametrize("indices", [None, [1]])
def test_nan_logits_are_masked_like_any_other_value(dtype, kernel, indices):
    """A NaN at a masked column becomes -inf in every path, as the Triton kernel writes it (the CPU path and the
    twin left it NaN, so a NaN the grammar rules out ended a sequence on CPU only); one at an allowed column stays."""
    logits = torch.randn(2, 70).to(dtype)
    logits[:, ::2] = float("nan")
    logits[:, 5::7] = float("inf")
    bitmask = torch.tensor([[0x0F0F0F0F, 0x3], [0x12345678, -1]], dtype=torch.int32)
    expected = reference(as_numpy(logits), bitmask.numpy(), indices, 64)
    kernel(logits, bitmask, None if indices is None else torch.tensor(indices), vocab_size=64)
    np.testing.assert_array_equal(as_numpy(logits), expected)
    assert np.isnan(expected).any() and (np.isnan(as_numpy(logits)) == np.isnan(expected)).all()


def test_cpu_path_without_rows_or_full_words():
    empty_logits = torch.zeros(0, 64)
    apply_token_bitmask_(empty_logits, torch.zeros(0, 2, dtype=torch.int32))
    logits = torch.zeros(2, 8)
    apply_token_bitmask_(logits, torch.tensor([[0b101], [-1]], dtype=torch.int32), vocab_size=3)
    assert torch.isinf(logits).tolist() == [[False, True, False] + [True] * 5, [False] * 3 + [True] * 5]
    apply_token_bitmask_(logits, torch.tensor([[-1], [-1]], dtype=torch.int32), vocab_size=0)
    assert torch.isinf(logits).all()


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

"""The compiled CPU decode kernel against the torch twin, over a table of shapes (GQA groups, head sizes with
and without a compile-time specialisation, contexts from one key to several blocks, float32 and bfloat16)."""

import pytest
import torch

from corral import native
from corral.engine.quant import quantize_int8_rows as quantize_rows
from corral.kernels import paged_attention_cpu
from corral.kernels.paged_attention import paged_attention_torch
from tests.kernels.variants import report_in_variant

pytestmark = pytest.mark.skipif(paged_attention_cpu.load() is None, reason="native module off or missing: kernel unavailable")

SHAPES = {  # (num_heads, num_kv_heads, head_dim, block_size, context lengths)
    "smollm-like": (9, 3, 64, 16, [1, 15, 16, 17, 300]),
    "mha": (4, 4, 32, 16, [5, 64]),
    "head_dim 128": (8, 2, 128, 16, [33, 1]),
    "odd head_dim": (6, 2, 40, 8, [9, 100, 2]),
    # contexts over several of the kernel's 256-key chunks, whose partial softmaxes are merged
    "chunks": (9, 3, 64, 16, [256, 257, 700]),
    "chunks, block size 8": (9, 3, 64, 8, [7, 300]),
    "chunks, head_dim 128, block size 32": (8, 2, 128, 32, [513, 40]),
}


def make_case(num_heads, num_kv_heads, head_dim, block_size, lens, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-n // block_size) for n in lens]
    num_blocks = sum(widths) + 2
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lens), max(widths), dtype=torch.long)  # padded with block 0, as the runner does
    for s, w in enumerate(widths):
        tables[s, :w] = torch.tensor([order.pop() for _ in range(w)])
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens)


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_twin(name, dtype):
    q, k_cache, v_cache, tables, lens = make_case(*SHAPES[name], dtype=dtype)
    scale = q.shape[-1] ** -0.5
    got = paged_attention_cpu.paged_decode(q, k_cache, v_cache, tables, lens, scale)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    expected = paged_attention_torch(q.float(), k_cache.float(), v_cache.float(), tables.int(), lens.int(), qsl, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: only the final rounding of the output differs
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.reshape(len(lens), -1), atol=tol, rtol=tol)


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_an_int8_cache(name, dtype):
    """Codes with a float32 scale per (token, KV head): the same as the twin over the dequantized cache."""
    q, k_cache, v_cache, tables, lens = make_case(*SHAPES[name], dtype=torch.float32, seed=1)
    (k, ks), (v, vs) = (quantize_rows(c.flatten(0, 1)) for c in (k_cache, v_cache))
    k, v, ks, vs = k.view_as(k_cache), v.view_as(v_cache), ks.view(k_cache.shape[:3]), vs.view(k_cache.shape[:3])
    scale = q.shape[-1] ** -0.5
    got = paged_attention_cpu.paged_decode(q.to(dtype), k, v, tables, lens, scale, ks, vs)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    expected = paged_attention_torch(q.to(dtype).float(), k.float() * ks[..., None], v.float() * vs[..., None],
                                     tables.int(), lens.int(), qsl, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.reshape(len(lens), -1), atol=tol, rtol=tol)


def test_kernel_reads_a_bfloat16_cache_under_float32_queries():
    q, k_cache, v_cache, tables, lens = make_case(*SHAPES["smollm-like"], dtype=torch.bfloat16, seed=2)
    q = q.float()
    got = paged_attention_cpu.paged_decode(q, k_cache, v_cache, tables, lens, 0.125)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    expected = paged_attention_torch(q, k_cache.float(), v_cache.float(), tables.int(), lens.int(), qsl, 0.125)
    torch.testing.assert_close(got, expected.reshape(len(lens), -1), atol=1e-5, rtol=1e-5)


def test_int8_cache_needs_its_scales_and_nothing_else_takes_them():
    q, k_cache, v_cache, tables, lens = make_case(9, 3, 64, 16, [3], dtype=torch.float32)
    codes = torch.zeros(k_cache.shape, dtype=torch.int8)
    with pytest.raises(TypeError, match="go with an int8 cache"):
        paged_attention_cpu.paged_decode(q, codes, codes, tables, lens, 0.125)
    scales = torch.ones(k_cache.shape[:3])
    with pytest.raises(TypeError, match="go with an int8 cache"):
        paged_attention_cpu.paged_decode(q, k_cache, v_cache, tables, lens, 0.125, scales, scales)
    with pytest.raises(ValueError, match="k_scale: size"):
        paged_attention_cpu.paged_decode(q, codes, codes, tables, lens, 0.125, scales[:1], scales)


def test_keys_past_the_context_are_never_read():
    """Poisoning (NaN) the unused tail of each sequence's last block must not change the output."""
    q, k_cache, v_cache, tables, lens = make_case(9, 3, 64, 16, [3, 20], dtype=torch.float32)
    clean = paged_attention_cpu.paged_decode(q, k_cache, v_cache, tables, lens, 0.125)
    for s, n in enumerate(lens.tolist()):
        last = int(tables[s, (n - 1) // 16])
        k_cache[last, n % 16:] = float("nan")
        v_cache[last, n % 16:] = float("nan")
    assert torch.equal(paged_attention_cpu.paged_decode(q, k_cache, v_cache, tables, lens, 0.125), clean)


def test_a_key_a_row_does_not_see_never_weighs_in_even_when_its_run_reads_it():
    """Rows of one run (a decode and its draft) see 34 and 35 keys: the kernel reads key 34 for the second row.
    Whatever it holds must not reach the first row, not even through the running max of its softmax."""
    q, k_cache, v_cache, tables, _ = make_case(9, 3, 64, 16, [40], dtype=torch.float32, seed=3)
    rows = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(5))
    pair, lens = tables.expand(2, -1).contiguous(), torch.tensor([34, 35])
    block, offset = int(tables[0, 34 // 16]), 34 % 16
    alone = paged_attention_cpu.paged_decode(rows[:1], k_cache, v_cache, pair[:1], lens[:1], 0.125)
    for value in (0.0, 1e6, -1e6):
        k_cache[block, offset] = value
        together = paged_attention_cpu.paged_decode(rows, k_cache, v_cache, pair, lens, 0.125)
        assert torch.equal(together[:1], alone), value


def test_loading_the_kernel_keeps_subnormal_floats():
    """A library built with -ffast-math would set flush-to-zero for the whole process when it loads."""
    if paged_attention_cpu.load() is None:
        pytest.skip("native module off or missing: the kernel is unavailable")
    import numpy as np

    tiny = np.float32(1e-40)  # subnormal in float32
    assert tiny * np.float32(1.0) != 0 and float(torch.tensor(1e-40) * 1.0) != 0


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("context", [40, 300])
@pytest.mark.parametrize("dim", [64, 128])
def test_a_run_of_queries_on_one_table_equals_each_query_alone(kv, context, dim):
    """A decode and its draft are consecutive rows with one block table and contexts n, n+1, ...: the kernel reads
    their K/V once for the whole run, and each row's output is bit for bit what it gives alone (and the twin's).
    At 300 keys each row reads two of the kernel's 256-key chunks, whose partial sums are merged. A run's queries
    that see all of a key block take its V rows several at a time, a query alone takes them by itself: the same
    bits."""
    q, k_cache, v_cache, tables, _ = make_case(9, 3, dim, 16, [context], dtype=torch.float32, seed=3)
    scales = (None, None)
    if kv == "bfloat16":
        k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    elif kv == "int8":
        (k, ks), (v, vs) = (quantize_rows(c.flatten(0, 1)) for c in (k_cache, v_cache))
        k_cache, v_cache = k.view_as(k_cache), v.view_as(v_cache)
        scales = (ks.view(k_cache.shape[:3]), vs.view(k_cache.shape[:3]))
    other = make_case(9, 3, dim, 16, [context], dtype=torch.float32, seed=4)[3]  # another sequence's table between
    rows_q = torch.randn(7, 9, dim, generator=torch.Generator().manual_seed(5))
    row_tables = torch.cat([tables.expand(3, -1), other, tables.expand(3, -1)])
    lens = torch.tensor([31, 32, 33, 40, 34, 35, 36]) + (context - 40)
    together = paged_attention_cpu.paged_decode(rows_q, k_cache, v_cache, row_tables, lens, 0.125, *scales)
    for r in range(7):
        alone = paged_attention_cpu.paged_decode(rows_q[r:r + 1], k_cache, v_cache, row_tables[r:r + 1],
                                                 lens[r:r + 1], 0.125, *scales)
        assert torch.equal(together[r:r + 1], alone), r
    if kv != "int8":
        qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
        expected = paged_attention_torch(rows_q, k_cache.float(), v_cache.float(), row_tables.int(), lens.int(), qsl,
                                         0.125)
        torch.testing.assert_close(together, expected.reshape(7, -1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv", ["bfloat16", "int8"])
def test_a_heads_arithmetic_does_not_depend_on_how_many_heads_its_job_takes(kv):
    """A job takes every KV head of its chunk where the call has four chunks (of 256 keys) or more per thread,
    else one head: a long context over few threads puts a chunk's heads in one job, a short one or many threads
    one head in each. The rows' bits are the same whichever: a 2,100-key row (9 chunks) and a 40-key row on a
    table of its own (a second run), together and each alone, over 1, 2 and 8 threads. Together over 1 and 2
    threads both runs are in jobs of every head; the 40-key row alone, and every call over 8 threads, in jobs
    of one head."""
    q, k_cache, v_cache, tables, _ = make_case(9, 3, 64, 16, [2100, 40], dtype=torch.float32, seed=6)
    scales = (None, None)
    if kv == "bfloat16":
        k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    else:
        (k, ks), (v, vs) = (quantize_rows(c.flatten(0, 1)) for c in (k_cache, v_cache))
        k_cache, v_cache = k.view_as(k_cache), v.view_as(v_cache)
        scales = (ks.view(k_cache.shape[:3]), vs.view(k_cache.shape[:3]))
    rows_q = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(7))
    row_tables, lens = tables, torch.tensor([2100, 40])
    threads = torch.get_num_threads()
    outputs = []
    try:
        for count in (1, 2, 8):
            torch.set_num_threads(count)
            both = paged_attention_cpu.paged_decode(rows_q, k_cache, v_cache, row_tables, lens, 0.125, *scales)
            alone = [paged_attention_cpu.paged_decode(rows_q[r:r + 1], k_cache, v_cache, row_tables[r:r + 1],
                                                      lens[r:r + 1], 0.125, *scales) for r in range(2)]
            outputs.append(both)
            assert torch.equal(both, torch.cat(alone)), count
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])
    if kv == "bfloat16":
        qsl = torch.arange(3, dtype=torch.int32)
        expected = paged_attention_torch(rows_q, k_cache.float(), v_cache.float(), row_tables.int(), lens.int(), qsl,
                                         0.125)
        torch.testing.assert_close(outputs[0], expected.reshape(2, -1), atol=1e-5, rtol=1e-5)


_VARIANT_CHECK = """
import json, sys, torch
sys.path.insert(0, "tests/kernels")
from test_paged_attention_cpu import SHAPES, make_case
from corral import native
from corral.kernels import paged_attention_cpu
from corral.kernels.paged_attention import paged_attention_torch
worst = 0.0
for shape in SHAPES.values():
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, tables, lens = make_case(*shape, dtype=dtype)
        q = q.float()  # float32 queries over a float32 or bfloat16 cache
        got = paged_attention_cpu.paged_decode(q, k, v, tables, lens, shape[2] ** -0.5)
        qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
        expected = paged_attention_torch(q, k.float(), v.float(), tables.int(), lens.int(), qsl, shape[2] ** -0.5)
        worst = max(worst, float((got - expected.reshape(len(lens), -1)).abs().max()))
independent = True  # a run of rows on one table (a decode and its draft): each row's bits as alone
for dim in (64, 128):
    q, k, v, tables, _ = make_case(9, 3, dim, 16, [300], dtype=torch.bfloat16, seed=3)
    rows = torch.randn(9, 9, dim, generator=torch.Generator().manual_seed(5))
    run_tables, lens = tables.expand(9, -1).contiguous(), torch.arange(292, 301)
    together = paged_attention_cpu.paged_decode(rows, k, v, run_tables, lens, 0.125)
    independent &= all(torch.equal(together[r:r + 1], paged_attention_cpu.paged_decode(
        rows[r:r + 1], k, v, run_tables[r:r + 1], lens[r:r + 1], 0.125)) for r in range(9))
print(json.dumps({"isa": native.module().kernel_isa, "worst": worst, "independent": independent}))
"""


@pytest.mark.parametrize("variant", ["baseline"] + (["avx2"] if {"avx2", "fma", "f16c", "bmi2"} <= native.cpu_flags()
                                                    else []))
def test_every_variant_this_cpu_runs_agrees_with_the_twin(variant):
    """The other instruction sets' builds of the kernel (8 and 4 floats a vector, so other lane reductions)."""
    report = report_in_variant(_VARIANT_CHECK, CORRAL_NATIVE_BUILD=variant)
    assert report["isa"].startswith(variant) and report["worst"] < 1e-5 and report["independent"], report

"""Buffers on 2 MiB pages (corral/engine/hugepages.py): the same tensors as torch.zeros, in a mapping that asks the
kernel for huge pages where it can, alive as long as any view of it."""

import gc

import pytest
import torch

from corral.engine import hugepages
from corral.engine.attention import KVCache

BIG = (hugepages.MIN_BYTES // (16 * 3 * 64 * 2) + 5, 16, 3, 64)  # just past the threshold in bfloat16


def advised(tensor: torch.Tensor) -> bool:
    """Whether the mapping that holds ``tensor``'s first byte carries the huge-page advice (``hg`` in its
    VmFlags)."""
    address = tensor.data_ptr()
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    raise AssertionError("no mapping holds the tensor")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.uint8])
def test_zeros_are_torch_zeros_of_that_shape_and_dtype(dtype):
    for shape in (BIG, (7,), (3, 5)):
        out = hugepages.zeros(shape, dtype)
        assert out.shape == shape and out.dtype == dtype and out.is_contiguous()
        assert torch.equal(out, torch.zeros(shape, dtype=dtype))


@pytest.mark.skipif(not hugepages.AVAILABLE, reason="transparent huge pages are off or not Linux here")
def test_a_big_buffer_is_aligned_to_a_huge_page_and_advised():
    out = hugepages.zeros(BIG, torch.bfloat16)
    assert out.data_ptr() % hugepages.HUGE_PAGE == 0
    assert advised(out)
    small = hugepages.zeros((4, 16, 3, 64), torch.bfloat16)  # under the threshold: torch's own memory
    assert not advised(small) or small.data_ptr() % hugepages.HUGE_PAGE != 0


def test_when_off_it_is_torch_memory(monkeypatch):
    monkeypatch.setattr(hugepages, "AVAILABLE", False)
    out = hugepages.zeros(BIG, torch.bfloat16)
    assert torch.equal(out, torch.zeros(BIG, dtype=torch.bfloat16))
    assert not advised(out)


def test_a_view_keeps_the_mapping_alive():
    base = hugepages.zeros(BIG, torch.float32)
    last = base[-1]
    del base
    gc.collect()
    last.fill_(3.0)  # a freed mapping would fault here
    assert float(last.sum()) == 3.0 * last.numel()


def test_copy_is_equal_and_its_own_memory():
    source = torch.randn(BIG[0], 16, 3, 64)
    out = hugepages.copy(source)
    assert torch.equal(out, source)
    source.zero_()
    assert float(out.abs().sum()) > 0


def test_the_kv_cache_is_allocated_there():
    cache = KVCache.allocate(BIG[0], 16, 3, 64, torch.bfloat16)
    for tensor in (cache.k, cache.v):
        assert torch.equal(tensor, torch.zeros(BIG, dtype=torch.bfloat16))
        if hugepages.AVAILABLE:
            assert tensor.data_ptr() % hugepages.HUGE_PAGE == 0 and advised(tensor)

"""Buffers on huge pages (corral/engine/hugepages.py): the same tensors as torch.zeros, in a mapping that asks the
kernel for huge pages where it can, alive as long as any view of it, and used for the streamed weights and the KV
cache."""

import gc
import os
import pickle

import pytest
import torch

from corral.engine import hugepages
from corral.engine.attention import KVCache
from corral.engine.quant import Q8Tiles

needs_smaps = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="no /proc/self/smaps here")
needs_huge = pytest.mark.skipif(not hugepages.AVAILABLE, reason="transparent huge pages are off or not Linux here")


def big(dtype: torch.dtype) -> tuple[int, ...]:
    """A shape just past the threshold in ``dtype``."""
    return (hugepages.MIN_BYTES // (16 * 3 * 64 * dtype.itemsize) + 5, 16, 3, 64)


def mapping(tensor: torch.Tensor) -> tuple[set[str], int]:
    """The VmFlags and the resident kB of the mapping that holds ``tensor``'s first byte."""
    address = tensor.data_ptr()
    inside, rss = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Rss:":
                rss = int(line.split()[1])
            elif inside and head == "VmFlags:":
                return set(line.split()[1:]), rss
    raise AssertionError("no mapping holds the tensor")


def advised(tensor: torch.Tensor) -> bool:
    return "hg" in mapping(tensor)[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.uint8])
def test_zeros_are_torch_zeros_of_that_shape_and_dtype(dtype):
    for shape in (big(dtype), (7,), (3, 5)):
        out = hugepages.zeros(shape, dtype)
        assert out.shape == shape and out.dtype == dtype and out.is_contiguous()
        assert torch.equal(out, torch.zeros(shape, dtype=dtype))
        assert out.untyped_storage().nbytes() == out.numel() * dtype.itemsize  # no padding to copy or pickle


@needs_smaps
@needs_huge
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8])
def test_a_big_buffer_is_aligned_advised_and_committed(dtype):
    out = hugepages.zeros(big(dtype), dtype)
    assert out.data_ptr() % hugepages.HUGE_PAGE == 0
    flags, rss_kb = mapping(out)
    assert "hg" in flags
    assert rss_kb * 1024 >= out.numel() * dtype.itemsize  # every page faulted in at allocation


def test_when_off_it_is_torch_memory(monkeypatch):
    """Off, :func:`hugepages.zeros` maps nothing of its own: ``torch.zeros``, whose memory it never advises."""
    monkeypatch.setattr(hugepages, "AVAILABLE", False)

    def no_mapping(*args, **kwargs):
        raise AssertionError("hugepages.zeros mapped memory while off")

    monkeypatch.setattr(hugepages.mmap, "mmap", no_mapping)
    shape = big(torch.bfloat16)
    out = hugepages.zeros(shape, torch.bfloat16)
    assert torch.equal(out, torch.zeros(shape, dtype=torch.bfloat16))


_OFF_IN_A_FRESH_PROCESS = """
import json, sys
sys.path.insert(0, "tests/engine")
import torch
from corral.engine import hugepages
from test_hugepages import advised, big
hugepages.AVAILABLE = False
print(json.dumps({"advised": advised(hugepages.zeros(big(torch.bfloat16), torch.bfloat16))}))
"""


@needs_smaps
@pytest.mark.skipif(os.environ.get("THP_MEM_ALLOC_ENABLE") == "1", reason="torch's allocator advises huge pages")
def test_when_off_its_memory_is_not_advised():
    """In a fresh interpreter: in this one, numpy has advised huge pages over large arrays it freed (it does so for
    any array of 4 MiB and more), and once glibc serves such sizes from its heap (its mmap threshold rises as large
    blocks are freed) a later torch allocation can land in those advised pages. That is numpy's advice, not this
    module's."""
    from tests.kernels.variants import report_in_variant

    assert report_in_variant(_OFF_IN_A_FRESH_PROCESS) == {"advised": False}


def test_the_environment_turns_it_off(monkeypatch):
    monkeypatch.setenv("CORRAL_HUGE_PAGES", "0")
    assert not hugepages._available()


def test_a_view_keeps_the_mapping_alive():
    base = hugepages.zeros(big(torch.float32), torch.float32)
    last = base[-1]
    del base
    gc.collect()
    last.fill_(3.0)  # a freed mapping would fault here
    assert float(last.sum()) == 3.0 * last.numel()


def test_copy_is_equal_its_own_memory_and_pickles_as_a_plain_tensor():
    source = torch.randn(big(torch.float32))
    out = hugepages.copy(source)
    assert torch.equal(out, source)
    source.zero_()
    assert float(out.abs().sum()) > 0
    assert torch.equal(pickle.loads(pickle.dumps(out)), out)


@needs_smaps
@needs_huge
def test_the_kv_cache_and_the_q8_tiles_are_allocated_there():
    cache = KVCache.allocate(big(torch.bfloat16)[0], 16, 3, 64, torch.bfloat16)
    for tensor in (cache.k, cache.v):
        assert torch.equal(tensor, torch.zeros(big(torch.bfloat16), dtype=torch.bfloat16))
        assert tensor.data_ptr() % hugepages.HUGE_PAGE == 0 and advised(tensor)
    rows = hugepages.MIN_BYTES // 576 + 16  # Q8 tiles: 544 bytes per 16 rows x 32 columns, past the threshold
    head = Q8Tiles(torch.randn(rows, 576))
    assert head.tiles.data_ptr() % hugepages.HUGE_PAGE == 0 and advised(head.tiles)


def test_the_native_steps_layer_tiles_are_allocated_there(monkeypatch):
    from corral.engine import model as model_module

    made = []
    real = hugepages.zeros

    def recording(shape, dtype):
        made.append((tuple(shape), dtype))
        return real(shape, dtype)

    monkeypatch.setattr(model_module.hugepages, "zeros", recording)
    layers = [{name: type("Layer", (), {"tiles": torch.zeros(size, dtype=torch.uint8)})()
               for name, size in (("qkv", 3), ("o", 5), ("gate_up", 7), ("down", 11))} for _ in range(2)]
    fake = type("Model", (), {"layers": layers})()
    tiles = model_module.NativeStep._gather_tiles(fake)
    assert made == [((52,), torch.uint8)] and tiles.numel() == 52
    assert layers[1]["down"].tiles.data_ptr() == tiles.data_ptr() + 41  # the layers view the one buffer


def test_the_native_steps_logits_buffer_is_allocated_there(monkeypatch):
    from corral.engine import model as model_module

    made = []
    real = hugepages.zeros
    monkeypatch.setattr(model_module.hugepages, "zeros",
                        lambda shape, dtype: made.append((tuple(shape), dtype)) or real(shape, dtype))
    outputs = model_module._StepOutputs(576, 1000)
    hidden, logits, _, _ = outputs.rows(3)
    assert made == [((outputs.keep_rows, 1000), torch.float32)]  # made whole at the start, once
    assert logits.shape == (3, 1000) and hidden.shape == (3, 576)

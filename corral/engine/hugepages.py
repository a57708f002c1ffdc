"""Long-lived buffers on 2 MiB pages: the weights a decode step streams through, the KV cache it reads and the
native step's logits buffer it writes.

A decode step reads every weight byte once (66 MB for SmolLM2's layers in W4A8, 30 MB more for its LM head) and,
at a long context, every cached key and value of its sequences. In 4 KiB pages that is one page walk per 4 KiB
read, and the stream pushes every other translation out of the TLB. Where the kernel's transparent huge pages are
on for regions that ask (``/sys/kernel/mm/transparent_hugepage/enabled`` at ``madvise``, the default of many
distributions, or ``always``), :func:`zeros` maps the buffer itself, aligned to 2 MiB, and asks for huge pages
before any page is touched. Elsewhere (another OS, huge pages ``never`` or unreadable, a small buffer, or
``CORRAL_HUGE_PAGES=0`` in the environment) it is ``torch.zeros``. The tensor holds an export of its mapping (which
cannot be unmapped while it lives); its storage is the buffer alone, not resizable. Every byte is written once
here, so the memory is committed at load, as ``torch.zeros`` commits it, the last huge page whole (up to one huge
page more per buffer). Where memory is fragmented, the kernel may compact it while those pages fault in, at load;
``CORRAL_HUGE_PAGES=0`` is the way out. What it bought: the README's "Huge pages".
"""

import logging
import math
import mmap
import os
import sys

import torch

log = logging.getLogger(__name__)

_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
_SIZE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"


def _huge_page() -> int:
    """The size of a transparent huge page here (2 MiB on x86-64; larger where the base page is, as on some arm64
    kernels)."""
    try:
        with open(_SIZE) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


HUGE_PAGE = _huge_page()
MIN_BYTES = 4 * HUGE_PAGE  # smaller buffers gain little and would round up a larger share of their size


def _available() -> bool:
    """Whether anonymous memory that asks for huge pages gets them here (the setting reads ``[madvise]`` or
    ``[always]``), and the environment does not turn them off."""
    if os.environ.get("CORRAL_HUGE_PAGES", "1") == "0":
        return False
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_SETTING) as f:
            setting = f.read()
    except OSError:
        return False
    return "[madvise]" in setting or "[always]" in setting


AVAILABLE = _available()


def zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)``, in a mapping of its own on huge pages where :data:`AVAILABLE` and the
    buffer is at least :data:`MIN_BYTES`."""
    shape = tuple(shape)
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if not AVAILABLE or nbytes < MIN_BYTES:
        return torch.zeros(shape, dtype=dtype)
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE  # the first aligned byte
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, span)
    except OSError as error:  # a kernel without the advice: 4 KiB pages, as torch.zeros would have
        log.debug("huge pages refused (%s); %d bytes in 4 KiB pages", error, nbytes)
    # a memoryview is an export of the mapping, which then cannot be closed under the tensor; the storage is the
    # buffer's bytes alone (a pickle or a copy holds no padding)
    out = torch.frombuffer(memoryview(region), dtype=dtype, count=count, offset=start).view(shape)
    out.zero_()  # fault every page in now (the mapping reads as zeros already): committed at load, not mid-step
    return out


def copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``tensor`` made by :func:`zeros`."""
    out = zeros(tensor.shape, tensor.dtype)
    out.copy_(tensor)
    return out


def huge_bytes() -> int:
    """This process's anonymous memory in huge pages (``AnonHugePages`` over ``/proc/self/smaps_rollup``), in
    bytes; 0 where the file is missing."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0

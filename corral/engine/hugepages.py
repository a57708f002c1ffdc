"""Long-lived buffers on 2 MiB pages: the weights a decode step streams through and the KV cache it reads.

A decode step reads every weight byte once (66 MB for SmolLM2's layers in W4A8, 30 MB more for its LM head) and,
at a long context, every cached key and value of its sequences. In 4 KiB pages that is one page walk per 4 KiB
read, and the stream pushes every other translation out of the TLB. Where the kernel's transparent huge pages are
on for regions that ask (``/sys/kernel/mm/transparent_hugepage/enabled`` at ``madvise``, the default of many
distributions, or ``always``), :func:`zeros` maps the buffer itself, aligned to 2 MiB, and asks for huge pages
before any page is touched. Elsewhere (another OS, huge pages ``never``, a small buffer, or ``CORRAL_HUGE_PAGES=0``
in the environment) it is ``torch.zeros``. The tensor keeps its mapping alive, and every byte is written once here,
so the memory is committed at load as ``torch.zeros`` commits it. What it bought: the README's "Huge pages".
"""

import logging
import mmap
import os
import sys

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MIN_BYTES = 4 * HUGE_PAGE  # smaller buffers gain little and would round up a larger share of their size
_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


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
    """``torch.zeros(shape, dtype=dtype)``, in a mapping of its own on 2 MiB pages where :data:`AVAILABLE` and the
    buffer is at least :data:`MIN_BYTES`."""
    shape = tuple(shape)
    count = 1
    for size in shape:
        count *= size
    nbytes = count * dtype.itemsize
    if not AVAILABLE or nbytes < MIN_BYTES:
        return torch.zeros(shape, dtype=dtype)
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # the tensor holds the mapping (a buffer export)
    start = -raw.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, span)
    except OSError as error:  # a kernel without the advice: 4 KiB pages, as torch.zeros would have
        log.debug("huge pages refused (%s); %d bytes in 4 KiB pages", error, nbytes)
    out = raw[start: start + nbytes].view(dtype).view(shape)
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

"""Test-wide settings: offline model hub, and Triton's interpreter on machines without a GPU."""

import os
import shutil
import threading

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if shutil.which("nvidia-smi") is None:
    # Must be set before triton is first imported; kernels then run on CPU tensors (slowly), as tests need.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def released_gil():
    """``released_gil(call)``: runs ``call`` with the native test hook armed, while a Python thread waits to let it
    go; True when that thread could run (the GIL was released inside the native call) and released the hook."""
    from corral import native

    def run(call) -> bool:
        module = native.module()
        helper_saw_it = threading.Event()

        def helper():
            while not module._hook_waiting():  # runs only while the native call lets go of the GIL
                pass
            helper_saw_it.set()
            module._hook_release()

        module._hook_arm(10.0)
        thread = threading.Thread(target=helper)
        thread.start()
        call()
        thread.join(timeout=15)
        return helper_saw_it.is_set() and module._hook_outcome() == 1

    return run

"""Test-wide settings: offline model hub, and Triton's interpreter on machines without a GPU."""

import os
import shutil

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if shutil.which("nvidia-smi") is None:
    # Must be set before triton is first imported; kernels then run on CPU tensors (slowly), as tests need.
    os.environ.setdefault("TRITON_INTERPRET", "1")

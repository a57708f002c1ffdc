"""EngineConfig: the engine's frozen knobs, checked on construction. Derived sizes are computed, never stored."""

from dataclasses import dataclass

import torch

from corral.errors import InvalidRequestError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class EngineConfig:
    """``model``: a .gguf file or HF folder (None: the shipped default). The KV pool is ``num_kv_blocks`` blocks
    when given, else as many as ``kv_cache_bytes`` holds (default 1 GiB). ``max_model_len`` None: the model's
    context length."""

    model: str | None = None
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_bytes: int | None = None
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise InvalidRequestError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}", param="dtype")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be a positive integer", param=name)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise InvalidRequestError("max_num_batched_tokens must be >= max_num_seqs (one decode token each)",
                                      param="max_num_batched_tokens")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise InvalidRequestError("num_kv_blocks must be >= 1", param="num_kv_blocks")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

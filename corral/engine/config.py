"""EngineConfig: the engine's frozen knobs, checked on construction. Derived sizes are computed, never stored.

The number formats (``dtype``, ``quantization``, ``kv_cache_dtype``) may be ``"auto"``; :mod:`corral.engine.formats`
resolves them from the CPU's flags when the engine starts.
"""

from dataclasses import dataclass

import torch

from corral.engine.quant import GROUP_SIZES
from corral.errors import InvalidRequestError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "fp32": torch.float32}
DECODE_STEPS = ("auto", "native", "torch")
QUANTIZATIONS = ("auto", "none", "w8a16", "w4a16", "gguf", "w4a8")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "bf16", "int8")
MAX_DECODE_BURST = 16  # the native call takes up to 64; past a few tokens a burst gains nothing and delays arrivals


@dataclass(frozen=True)
class EngineConfig:
    """``model``: a .gguf file or HF folder (None: the shipped default). The KV pool is ``num_kv_blocks`` blocks
    when given, else as many as ``kv_cache_bytes`` holds (default 1 GiB). ``max_model_len`` None: the model's
    context length."""

    model: str | None = None
    dtype: str = "float32"
    quantization: str = "none"
    quant_group_size: int = 32
    awq: bool = False  # w4a16: activation-aware scales before rounding (corral/engine/awq.py), calibrated at load
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int | None = None
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    decode_step: str = "auto"  # auto: the native decode step where it serves the model; native: required; torch
    # the most tokens one native call decodes per sequence, where every sequence of a step decodes greedily or
    # samples with no draft, guide, bias or penalty and nothing waits (each token is the pick or draw the sampler
    # would make; a stop id, an arrival or a departure ends the burst early); 1: a call per token
    decode_burst: int = 8
    # every query's attention through the decode kernel over the cache, prompt chunks included, so a request's tokens
    # and logprobs do not depend on the prefix cache, chunking, preemption or its batch (see ModelRunner.prepare);
    # W4A8 only, whose products are the same bits at any row count. Long prompts take longer (bench/deterministic.py)
    deterministic: bool = False
    # drafts (corral/engine/speculation.py): the defaults of the per-request switches, and the lookup's bounds
    jump_forward: bool = True
    speculation: bool = True
    num_speculative_tokens: int = 8  # the most prompt-lookup tokens one sequence drafts per step
    # a draft row's cost as a share of a whole step at batch 1 (bench/speculation.py --row-cost measures it); it
    # prices drafts at every batch size (corral/engine/speculation.py), 0: rows are free, drafts always full length
    draft_row_cost: float = 0.25
    # drafts from a model (corral/engine/draft_model.py): ``draft_model`` a model with the same vocabulary (a
    # path or name, as ``model``), cut to its first ``draft_layers`` layers when given; ``draft_model`` None and
    # ``draft_layers`` given: the target's own first layers (self-speculation). ``draft_model_cost``: a draft
    # step's cost as a share of a target step (None: the ratio of their weight bytes)
    draft_model: str | None = None
    draft_layers: int | None = None
    draft_model_cost: float | None = None

    def __post_init__(self):
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise InvalidRequestError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}",
                                      param="dtype")
        if self.quantization not in QUANTIZATIONS:
            raise InvalidRequestError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}",
                                      param="quantization")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                                      f"{self.kv_cache_dtype!r}", param="kv_cache_dtype")
        if self.decode_step not in DECODE_STEPS:
            raise InvalidRequestError(f"decode_step must be one of {DECODE_STEPS}, got {self.decode_step!r}",
                                      param="decode_step")
        if isinstance(self.decode_burst, bool) or not isinstance(self.decode_burst, int) \
                or not 1 <= self.decode_burst <= MAX_DECODE_BURST:
            raise InvalidRequestError(f"decode_burst must be an integer from 1 to {MAX_DECODE_BURST}",
                                      param="decode_burst")
        if self.quant_group_size not in GROUP_SIZES:
            raise InvalidRequestError("quant_group_size must be 32, 64 or 128", param="quant_group_size")
        if not isinstance(self.awq, bool):
            raise InvalidRequestError("awq must be a boolean", param="awq")
        if self.awq and self.quantization != "w4a16":
            raise InvalidRequestError("awq scales weights before w4a16 quantization: it needs quantization w4a16",
                                      param="awq")
        for name in ("jump_forward", "speculation", "deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be a boolean", param=name)
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0:
            raise InvalidRequestError("num_speculative_tokens must be an integer >= 0", param="num_speculative_tokens")
        if not isinstance(self.draft_row_cost, (int, float)) or not 0 <= self.draft_row_cost < 1:
            raise InvalidRequestError("draft_row_cost must be in [0, 1)", param="draft_row_cost")
        if self.draft_model is not None and (not isinstance(self.draft_model, str) or not self.draft_model):
            raise InvalidRequestError("draft_model must be a model path or name", param="draft_model")
        if self.draft_layers is not None and (isinstance(self.draft_layers, bool) or
                                              not isinstance(self.draft_layers, int) or self.draft_layers < 1):
            raise InvalidRequestError("draft_layers must be a positive integer", param="draft_layers")
        if self.draft_model_cost is not None and (isinstance(self.draft_model_cost, bool) or not isinstance(
                self.draft_model_cost, (int, float)) or not 0 <= self.draft_model_cost <= 1):
            raise InvalidRequestError("draft_model_cost must be in [0, 1]", param="draft_model_cost")
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
        """The activation dtype; only once ``dtype`` is resolved (not ``auto``)."""
        return _DTYPES[self.dtype]


def kv_torch_dtype(name: str) -> torch.dtype:
    """The cache dtype of a resolved ``kv_cache_dtype``."""
    return torch.int8 if name == "int8" else _DTYPES[name]

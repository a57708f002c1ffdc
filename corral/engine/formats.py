"""The number formats an engine runs in, and the ``auto`` rule that picks them from the CPU's flags.

Three knobs of :class:`~corral.engine.config.EngineConfig`: ``dtype`` (activations and dense weights),
``quantization`` (the linears' and embedding's format) and ``kv_cache_dtype``. Each may be ``auto``. The rule
reads only the CPU's feature flags and the model file's kind, never a timing, so that one machine always runs
the same numerics (the format changes greedy outputs, which is why it is reported in ``system_fingerprint`` and
``/v1/models``):

- ``quantization``: a GGUF whose linears are quantized runs them as shipped. With the native module that is
  ``w4a8``: the Q2_K, Q3_K, Q4 (Q4_0, Q4_1, Q4_K), Q5 (Q5_0, Q5_1, Q5_K), Q6_K, IQ4 (IQ4_NL, IQ4_XS) and Q8_0 blocks,
  and a Q6_K or Q8_0 embedding/LM head (tied or not) through Corral's integer kernels (AVX-512 VNNI, AVX2 or scalar,
  chosen by the CPU), activations float32, quantized to int8 per block of 32 inside each product, as llama.cpp
  runs the same file. Without the native module a file with Q4 linears runs ``gguf`` (W4A16 through torch's int4
  kernel). Any other model runs ``none``.
- ``dtype``: float32 under ``w4a8`` (its activations); otherwise bfloat16 where the CPU has fast bf16 (AMX or
  AVX-512 bf16), else float32.
- ``kv_cache_dtype``: bfloat16 under ``w4a8`` (storage only: it is read by shifts, no bf16 arithmetic, and halves
  the KV bytes); otherwise the activation dtype. int8 halves the bytes again but adds error; it is a choice, not
  a default.

What this leaves out: a start-up timing probe (it could only choose among kernels with identical numerics,
and there is no such pair here), GPU formats.
"""

import dataclasses
import logging
from typing import NamedTuple

from corral import native
from corral.engine.config import EngineConfig
from corral.errors import InvalidRequestError

log = logging.getLogger(__name__)

FAST_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


class Formats(NamedTuple):
    dtype: str  # float32 | bfloat16
    quantization: str  # none | w8a16 | w4a16 | gguf | w4a8
    kv_cache_dtype: str  # float32 | bfloat16 | int8
    reason: str  # why, for the start-up log line

    @property
    def tag(self) -> str:
        """The short form in ``system_fingerprint``: e.g. ``bf16-gguf-kvbf16``."""
        short = {"float32": "fp32", "bfloat16": "bf16", "int8": "int8"}
        return f"{short[self.dtype]}-{self.quantization}-kv{short[self.kv_cache_dtype]}"


def has_fast_bf16(flags: frozenset[str]) -> bool:
    return bool(FAST_BF16_FLAGS & flags)


def resolve(config: EngineConfig, gguf_q4: bool, flags: frozenset[str] | None = None, gguf_q8: bool = False
            ) -> Formats:
    """The formats ``config`` runs in on a CPU with ``flags`` (default: this one's), for a model whose linears are
    (``gguf_q4``) or are not GGUF Q4_0/Q4_1/Q4_K blocks, and are (``gguf_q8``) or are not Q2_K, Q3_K, Q5, Q6_K, IQ4
    or Q8_0 blocks (which the native module runs as Q2, Q3, Q5, Q6, IQ4 or Q8 blocks)."""
    flags = native.cpu_flags() if flags is None else flags
    reasons = []
    quantization = config.quantization
    if quantization == "auto":
        quantization = "w4a8" if native.module() is not None and (gguf_q4 or gguf_q8) else \
            "gguf" if gguf_q4 else "none"
        reasons.append({"w4a8": "quantization w4a8: the GGUF's quantized linears (2 to 6 bits and IQ4 as "
                                "shipped, Q8_0 in Q8 blocks) and its embedding and head (Q6_K as shipped, else in Q8 "
                                "blocks), native kernels",
                        "gguf": "quantization gguf: the GGUF's Q4 linears as shipped (no native module: torch's "
                                "int4 kernel)",
                        "none": "quantization none: the model has no Q4 blocks"}[quantization])
    if quantization == "gguf" and not gguf_q4:
        raise InvalidRequestError("quantization 'gguf' needs a GGUF model whose linears are Q4_0, Q4_1 or Q4_K blocks; "
                                  "w4a16 quantizes any model", param="quantization")
    if quantization == "w4a8" and native.module() is None:
        raise InvalidRequestError("quantization 'w4a8' runs on the native module, which is not loaded here",
                                  param="quantization")
    dtype = {"bf16": "bfloat16", "fp32": "float32"}.get(config.dtype, config.dtype)
    if quantization == "w4a8" and dtype not in ("auto", "float32"):
        raise InvalidRequestError("quantization 'w4a8' runs float32 activations (dtype auto or float32)",
                                  param="dtype")
    if dtype == "auto" and quantization == "w4a8":
        dtype = "float32"
        reasons.append("dtype float32: w4a8's activations")
    elif dtype == "auto":
        fast = has_fast_bf16(flags)
        dtype = "bfloat16" if fast else "float32"
        reasons.append(f"dtype {dtype}: the CPU " + ("has " + "/".join(sorted(FAST_BF16_FLAGS & flags)) if fast
                                                      else "has neither amx_bf16 nor avx512_bf16"))
    kv = {"bf16": "bfloat16"}.get(config.kv_cache_dtype, config.kv_cache_dtype)
    if kv == "auto" and quantization == "w4a8":
        kv = "bfloat16"
        reasons.append("KV cache bfloat16: half the bytes of float32, read without bf16 arithmetic")
    elif kv == "auto":
        kv = dtype
        reasons.append(f"KV cache {kv}: the activation dtype")
    return Formats(dtype, quantization, kv, "; ".join(reasons) or "as configured")


def resolved_config(config: EngineConfig, formats: Formats) -> EngineConfig:
    return dataclasses.replace(config, dtype=formats.dtype, quantization=formats.quantization,
                               kv_cache_dtype=formats.kv_cache_dtype)

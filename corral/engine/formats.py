"""The number formats an engine runs in, and the ``auto`` rule that picks them from the CPU's flags.

Three knobs of :class:`~corral.engine.config.EngineConfig`: ``dtype`` (activations and dense weights),
``quantization`` (the linears' and embedding's format) and ``kv_cache_dtype``. Each may be ``auto``. The rule
reads only the CPU's feature flags and the model file's kind, never a timing, so that one machine always runs
the same numerics (the format changes greedy outputs, which is why it is reported in ``system_fingerprint`` and
``/v1/models``):

- ``dtype``: bfloat16 where the CPU has fast bf16 (AMX or AVX-512 bf16), else float32.
- ``quantization``: a GGUF whose linears are Q4_0/Q4_1 runs them as shipped (``gguf``, W4A16); any other model
  runs ``none``. torch's int4 CPU kernel is a per-row GEMV: it beats dense weights at 1-8 rows and loses from
  about 16 rows up (measured in ``bench/engine.py --formats``; the README has the table). Decode batches are
  mostly small on a CPU, prefill is slower. ``auto`` takes the shipped format, since it is also the only one with
  no quantization error of Corral's own.
- ``kv_cache_dtype``: the activation dtype (int8 halves the KV bytes but adds error; it is a choice, not a
  default).

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
    quantization: str  # none | w8a16 | w4a16 | gguf
    kv_cache_dtype: str  # float32 | bfloat16 | int8
    reason: str  # why, for the start-up log line

    @property
    def tag(self) -> str:
        """The short form in ``system_fingerprint``: e.g. ``bf16-gguf-kvbf16``."""
        short = {"float32": "fp32", "bfloat16": "bf16", "int8": "int8"}
        return f"{short[self.dtype]}-{self.quantization}-kv{short[self.kv_cache_dtype]}"


def has_fast_bf16(flags: frozenset[str]) -> bool:
    return bool(FAST_BF16_FLAGS & flags)


def resolve(config: EngineConfig, gguf_q4: bool, flags: frozenset[str] | None = None) -> Formats:
    """The formats ``config`` runs in on a CPU with ``flags`` (default: this one's), for a model whose linears are
    (``gguf_q4``) or are not GGUF Q4_0/Q4_1 blocks."""
    flags = native.cpu_flags() if flags is None else flags
    reasons = []
    dtype = {"bf16": "bfloat16", "fp32": "float32"}.get(config.dtype, config.dtype)
    if dtype == "auto":
        fast = has_fast_bf16(flags)
        dtype = "bfloat16" if fast else "float32"
        reasons.append(f"dtype {dtype}: the CPU " + ("has " + "/".join(sorted(FAST_BF16_FLAGS & flags)) if fast
                                                      else "has neither amx_bf16 nor avx512_bf16"))
    quantization = config.quantization
    if quantization == "auto":
        quantization = "gguf" if gguf_q4 else "none"
        reasons.append("quantization gguf: the GGUF's Q4 linears run as shipped" if gguf_q4
                       else "quantization none: the model has no Q4 blocks")
    if quantization == "gguf" and not gguf_q4:
        raise InvalidRequestError("quantization 'gguf' needs a GGUF model whose linears are Q4_0 or Q4_1 blocks; "
                                  "w4a16 quantizes any model", param="quantization")
    kv = {"bf16": "bfloat16"}.get(config.kv_cache_dtype, config.kv_cache_dtype)
    if kv == "auto":
        kv = dtype
        reasons.append(f"KV cache {kv}: the activation dtype")
    return Formats(dtype, quantization, kv, "; ".join(reasons) or "as configured")


def resolved_config(config: EngineConfig, formats: Formats) -> EngineConfig:
    return dataclasses.replace(config, dtype=formats.dtype, quantization=formats.quantization,
                               kv_cache_dtype=formats.kv_cache_dtype)

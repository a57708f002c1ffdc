"""Wire models of ``/v1/completions`` (the legacy text endpoint) and ``/v1/models``.

``prompt`` is a string, a list of token ids, or a batch of either; each prompt gets ``n`` choices, numbered
``prompt_index * n + i`` as OpenAI does. What it leaves out: ``suffix`` (no fill-in-the-middle) is refused.
"""

import time
from typing import Literal

from pydantic import Field, StrictInt

from corral.schemas.common import Open, ResponseFormat, SamplingFields, Usage

# token ids are strict: pydantic's lax mode would read true and false as 1 and 0
Prompt = str | list[StrictInt] | list[str] | list[list[StrictInt]]


class CompletionRequest(SamplingFields):
    model: str
    prompt: Prompt
    response_format: ResponseFormat | None = None
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None


class CompletionLogprobs(Open):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = []


class CompletionChoice(Open):
    index: int
    text: str
    finish_reason: Literal["stop", "length", "abort", "error"] | None
    logprobs: CompletionLogprobs | None = None
    # what ended it: the stop string or stop token id for "stop"; for "error", the limit or fault, by name
    stop_reason: int | str | None = None


class Completion(Open):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None  # the engine's number formats: they change greedy outputs
    warnings: list[str] | None = None  # Corral's: what the constraint's compiler ignored (unknown keywords, ...)


class ModelCard(Open):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "corral"
    max_model_len: int | None = None
    formats: dict[str, str] | None = None  # dtype, quantization, kv_cache_dtype, and why (Corral's)


class ModelList(Open):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class NativePaths(Open):
    """Which implementation runs (``corral.native.status()``): the ``CORRAL_NATIVE`` switch, whether the native
    module loaded and why not, the mask path (native or python) and the CPU kernels (native-<isa> or torch)."""
    mode: Literal["auto", "require", "off"]
    loaded: bool
    reason: str | None = None
    module: str | None = None
    mask_path: Literal["native", "python"]
    kernels: str
    qmatmul: str | None = None  # the W4A8/W8A8 products' variant: native-avx512-vnni(-pairs), native-avx2, native-scalar
    build: str | None = None


class Health(Open):
    status: Literal["ok"] = "ok"
    native: NativePaths | None = None
    decode_step: Literal["native", "torch"] | None = None  # what runs the steps (None: a toy engine)
    decode_burst: int | None = None  # the most greedy tokens one native call decodes per sequence (1: one a call)
    deterministic: bool | None = None  # prompts' queries through the decode kernel too (None: a toy engine)

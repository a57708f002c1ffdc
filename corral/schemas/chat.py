"""Wire models of ``/v1/chat/completions``: messages, tools, the request, the response and its stream chunks.

OpenAI's shapes, field for field, for what Corral implements. What it leaves out: audio, images, web search,
``prediction`` and the other output-changing options are not declared, so a request using them is a 400.
"""

import time
from typing import Any, Literal

from pydantic import Field

from corral.schemas.common import Open, ResponseFormat, SamplingFields, Strict, Usage


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    metadata: dict[str, str] | None = None
    store: bool | None = None


class TopLogprob(Open):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(Open):
    content: list[TokenLogprob] | None = None


class ResponseMessage(Open):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


class ChatChoice(Open):
    index: int
    message: ResponseMessage
    finish_reason: FinishReason | None
    logprobs: ChoiceLogprobs | None = None
    # what ended it: the stop string or stop token id for "stop"; for "error", the limit or fault, by name
    stop_reason: int | str | None = None


class ChatCompletion(Open):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    warnings: list[str] | None = None  # Corral's: what the constraint's compiler ignored (unknown keywords, ...)


class FunctionCallDelta(Open):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Open):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class DeltaMessage(Open):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(Open):
    index: int
    delta: DeltaMessage
    finish_reason: FinishReason | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(Open):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    warnings: list[str] | None = None  # on the first chunk only

"""``/v1/chat/completions``: one request in, a ``ChatCompletion`` or a stream of ``ChatCompletionChunk`` s out.

Tool-mode outputs are read back into ``tool_calls`` (whole, or as deltas while streaming) with
``finish_reason: "tool_calls"``. A stream ends with an optional usage chunk and ``data: [DONE]``; an error after
the stream started is sent as one ``data: {"error": ...}`` event before ``[DONE]``.
"""

import contextlib
import json
from collections.abc import AsyncIterator

from starlette.requests import Request

from corral.api.context import ServingContext, warnings_of
from corral.api.event_stream import EventStream
from corral.api.outputs import chat_logprobs, logprob_rows, select_choices, usage
from corral.errors import CorralError
from corral.schemas.chat import (ChatChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
                                 ChunkChoice, DeltaMessage, FunctionCall, FunctionCallDelta, ResponseMessage,
                                 ToolCall, ToolCallDelta)
from corral.schemas.prepare import PreparedRequest, prepare_chat
from corral.schemas.tool_stream import Delta, ToolCallStream, new_call_id
from corral.schemas.tools import split_tool_calls


def _finish_reason(engine_reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and engine_reason == "stop" else engine_reason


async def chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request):
    """A ``ChatCompletion``, or an :class:`EventStream` of SSE lines when ``req.stream``."""
    ctx.check_model(req.model)
    ticket = ctx.admit()
    try:
        prepared = await ctx.prepare(raw, prepare_chat, req)
        grammar = await ctx.compile(raw, prepared)
        if req.stream:
            request_id, outputs = await ctx.stream(raw, "chatcmpl", prepared, grammar)
            events = _stream(ctx, req, request_id, prepared, outputs, warnings_of(grammar))
            response, ticket = EventStream(events, outputs, ticket, ctx.config.send_timeout_s), None  # it releases
            return response
        run = await ctx.collect(raw, "chatcmpl", prepared, grammar)
        return _completion(ctx, req, prepared, *run, warnings_of(grammar))
    finally:
        if ticket is not None:
            ticket.release()


def _completion(ctx, req, prepared, request_id, latest, last, warnings) -> ChatCompletion:
    num_top = req.top_logprobs or 0
    choices = []
    for index, out in enumerate(select_choices(prepared.strategy, list(latest.values()), req.n)):
        content, calls = (split_tool_calls(out.text) if prepared.tool_mode != "none" else (out.text, []))
        tool_calls = [ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=args))
                      for name, args in calls] or None
        choices.append(ChatChoice(
            index=index, message=ResponseMessage(content=content, tool_calls=tool_calls),
            finish_reason=_finish_reason(out.finish_reason, bool(calls)), stop_reason=out.stop_reason,
            logprobs=chat_logprobs(ctx.vocabulary, logprob_rows(out), num_top) if req.logprobs else None))
    num_generated = sum(len(o.token_ids) for o in latest.values())
    return ChatCompletion(id=request_id, model=req.model, choices=choices,
                          usage=usage(len(prepared.prompt_token_ids), num_generated, last.num_cached_tokens,
                                      latest.values()),
                          system_fingerprint=ctx.config.system_fingerprint, warnings=warnings)


class _ChoiceState:
    def __init__(self, tool_mode: bool):
        self.num_tokens = 0
        self.tools = ToolCallStream() if tool_mode else None
        self.finish_reason = None


def _deltas(state: _ChoiceState, text: str, final: bool) -> list[Delta]:
    if state.tools is None:
        return [Delta(content=text)] if text else []
    return state.tools.feed(text) + (state.tools.finish() if final else [])


def _delta_message(delta: Delta) -> DeltaMessage:
    if delta.call_index is None:
        return DeltaMessage(content=delta.content)
    function = FunctionCallDelta(name=delta.name, arguments=delta.arguments)
    return DeltaMessage(tool_calls=[ToolCallDelta(index=delta.call_index, id=delta.call_id,
                                                  type="function" if delta.call_id else None, function=function)])


def _sse(payload) -> str:
    body = payload.model_dump_json(exclude_none=True) if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {body}\n\n"


async def _stream(ctx: ServingContext, req: ChatCompletionRequest, request_id: str, prepared: PreparedRequest,
                  outputs: AsyncIterator, warnings: list[str] | None) -> AsyncIterator[str]:
    def chunk(choices, usage_=None, warnings_=None):
        return _sse(ChatCompletionChunk(id=request_id, model=req.model, choices=choices, usage=usage_,
                                        system_fingerprint=ctx.config.system_fingerprint, warnings=warnings_))

    async with contextlib.aclosing(outputs):  # closed at once when the client goes: the engine request aborts
        states = [_ChoiceState(prepared.tool_mode != "none") for _ in range(req.n)]
        for index in range(req.n):  # the compiler's warnings ride on the first chunk
            yield chunk([ChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))],
                        warnings_=warnings if index == 0 else None)
        num_cached, latest = 0, {}
        try:
            async for output in outputs:
                num_cached = output.num_cached_tokens
                for out in output.outputs:
                    latest[out.index] = out
                    for line in _choice_chunks(ctx, req, states[out.index], out, chunk):
                        yield line
        except CorralError as err:
            yield _sse({"error": {"message": str(err), "type": getattr(err, "error_type", "server_error"),
                                  "param": None, "code": None}})
        if req.stream_options is not None and req.stream_options.include_usage:
            num_generated = sum(s.num_tokens for s in states)
            yield chunk([], usage(len(prepared.prompt_token_ids), num_generated, num_cached, latest.values()))
    yield "data: [DONE]\n\n"


def _choice_chunks(ctx, req, state: _ChoiceState, out, chunk) -> list[str]:
    if state.finish_reason is not None:
        return []
    final = out.finish_reason is not None
    text = out.text  # a delta output: what is new since the previous one
    logprobs = None
    if req.logprobs:
        rows = logprob_rows(out)
        logprobs = chat_logprobs(ctx.vocabulary, rows, req.top_logprobs or 0) if rows else None
    state.num_tokens += len(out.token_ids)
    choices = [ChunkChoice(index=out.index, delta=_delta_message(d)) for d in _deltas(state, text, final)]
    if logprobs is not None:  # this step's logprobs ride on its last delta
        choices = choices or [ChunkChoice(index=out.index, delta=DeltaMessage())]
        choices[-1].logprobs = logprobs
    if final:
        has_calls = state.tools is not None and state.tools.num_calls > 0
        state.finish_reason = _finish_reason(out.finish_reason, has_calls)
        choices.append(ChunkChoice(index=out.index, delta=DeltaMessage(), finish_reason=state.finish_reason))
    return [chunk([choice]) for choice in choices]

"""``/v1/completions``: the legacy text endpoint. A batch of prompts runs as that many engine requests at once;
prompt ``p`` gets choices ``p * n .. p * n + n - 1``."""

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from starlette.requests import Request

from corral.api.context import ServingContext, warnings_of
from corral.api.event_stream import EventStream
from corral.api.outputs import completion_logprobs, logprob_rows, select_choices, usage
from corral.errors import CorralError, InvalidRequestError
from corral.schemas.completions import Completion, CompletionChoice, CompletionRequest
from corral.schemas.prepare import prepare_completion


async def completion(ctx: ServingContext, req: CompletionRequest, raw: Request):
    """A ``Completion``, or an :class:`EventStream` of SSE lines when ``req.stream``."""
    ctx.check_model(req.model)
    ticket = ctx.admit()
    try:
        batch = await ctx.prepare(raw, prepare_completion, req)
        if req.stream and len(batch) != 1:
            raise InvalidRequestError("streaming takes one prompt", param="prompt")
        grammar = await ctx.compile(raw, batch[0])  # every prompt shares the one constraint: compiled once
        if req.stream:
            request_id, outputs = await ctx.stream(raw, "cmpl", batch[0], grammar)
            events = _stream(ctx, req, request_id, batch[0], outputs, warnings_of(grammar))
            response, ticket = EventStream(events, outputs, ticket, ctx.config.send_timeout_s), None  # it releases
            return response
        ticket.grow(len(batch) - 1)  # every prompt is one engine request
        async with asyncio.TaskGroup() as group:  # one prompt failing cancels the others
            tasks = [group.create_task(ctx.collect(raw, "cmpl", prepared, grammar)) for prepared in batch]
        return _completion(ctx, req, batch, [t.result() for t in tasks], warnings_of(grammar))
    except ExceptionGroup as group:
        raise group.exceptions[0] from None  # the first failure is the request's answer
    finally:
        if ticket is not None:
            ticket.release()


def _completion(ctx: ServingContext, req: CompletionRequest, batch, runs, warnings) -> Completion:
    choices, num_prompt, num_generated, num_cached, completions = [], 0, 0, 0, []
    for p, (prepared, (request_id, latest, last)) in enumerate(zip(batch, runs)):
        prefix = ctx.tokenizer.decode(prepared.prompt_token_ids) if req.echo else ""
        for i, out in enumerate(select_choices(prepared.strategy, list(latest.values()), req.n)):
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(ctx.vocabulary, logprob_rows(out), req.logprobs, len(prefix))
            choices.append(CompletionChoice(index=p * req.n + i, text=prefix + out.text,
                                            finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                                            logprobs=logprobs))
        num_prompt += len(prepared.prompt_token_ids)
        num_generated += sum(len(o.token_ids) for o in latest.values())
        num_cached += last.num_cached_tokens
        completions.extend(latest.values())
    return Completion(id=runs[0][0], model=req.model, choices=choices,
                      usage=usage(num_prompt, num_generated, num_cached, completions),
                      system_fingerprint=ctx.config.system_fingerprint, warnings=warnings)


async def _stream(ctx: ServingContext, req: CompletionRequest, request_id: str, prepared,
                  outputs: AsyncIterator, warnings: list[str] | None) -> AsyncIterator[str]:
    unsent = warnings

    def chunk(choices, usage_=None) -> str:
        nonlocal unsent  # the compiler's warnings ride on the first chunk
        body = Completion(id=request_id, model=req.model, choices=choices, usage=usage_,
                          system_fingerprint=ctx.config.system_fingerprint, warnings=unsent)
        unsent = None
        return f"data: {body.model_dump_json(exclude={'warnings'} if body.warnings is None else None)}\n\n"

    async with contextlib.aclosing(outputs):  # closed at once when the client goes: the engine request aborts
        sent_tokens, done = [0] * req.n, [False] * req.n
        num_cached, latest = 0, {}
        if req.echo:
            prompt_text = ctx.tokenizer.decode(prepared.prompt_token_ids)
            for index in range(req.n):
                yield chunk([CompletionChoice(index=index, text=prompt_text, finish_reason=None)])
        try:
            async for output in outputs:
                num_cached = output.num_cached_tokens
                for out in output.outputs:
                    if done[out.index]:
                        continue
                    latest[out.index] = out
                    text, rows = out.text, logprob_rows(out)  # a delta output: what is new since the previous one
                    sent_tokens[out.index] += len(out.token_ids)
                    done[out.index] = out.finish_reason is not None
                    logprobs = (completion_logprobs(ctx.vocabulary, rows, req.logprobs, 0)
                                if req.logprobs is not None else None)
                    if text or done[out.index]:
                        yield chunk([CompletionChoice(index=out.index, text=text, finish_reason=out.finish_reason,
                                                      logprobs=logprobs)])
        except CorralError as err:
            error = {"message": str(err), "type": getattr(err, "error_type", "server_error"), "param": None, "code": None}
            yield f"data: {json.dumps({'error': error})}\n\n"
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], usage(len(prepared.prompt_token_ids), sum(sent_tokens), num_cached, latest.values()))
    yield "data: [DONE]\n\n"

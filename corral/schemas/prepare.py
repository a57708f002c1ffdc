"""A validated wire request → what the engine runs: prompt token ids, SamplingParams, a constraint, a strategy.

This is the one place that decides what a request means. It never touches the engine or the compiler, so every
decision (which constraint, which budget, which decoding strategy) is a pure function that tests pin exactly.
"""

from dataclasses import dataclass
from typing import Literal

import jinja2

from corral.engine.sampling_params import SamplingParams
from corral.errors import InvalidRequestError
from corral.grammar.constraint import Constraint
from corral.models import Tokenizer
from corral.schemas.chat import ChatCompletionRequest
from corral.schemas.common import SamplingFields
from corral.schemas.completions import CompletionRequest
from corral.schemas.constraints import (constraint_param, disables_additional_properties, rejects_unknown_keywords,
                                        request_constraint)
from corral.schemas.limits import RequestLimits
from corral.schemas.sampling import output_budget, sampling_params
from corral.schemas.tools import check_tool_limits, template_messages, tool_choice_mode, tools_constraint

StrategyKind = Literal["sample", "best_of", "self_consistency", "beam_search"]


@dataclass(frozen=True)
class Strategy:
    """How the returned choices are chosen. ``width`` candidates are generated for ``sample`` (= n),
    ``best_of`` (the n with the highest cumulative logprob are returned), ``self_consistency`` (the most
    frequent answer is returned) and ``beam_search`` (the n best beams)."""

    kind: StrategyKind = "sample"
    width: int = 1
    length_penalty: float = 1.0
    pointer: str = ""  # self-consistency votes on the value at this JSON pointer ("" = the whole answer)


@dataclass(frozen=True, eq=False)
class PreparedRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    constraint: Constraint | None = None  # compiled with GrammarCompiler.compile (tool calls too)
    tool_mode: str = "none"
    strategy: Strategy = Strategy()
    constraint_param: str | None = None  # the field the constraint came from: what its compile errors name


def strategy_of(req: SamplingFields) -> Strategy:
    modes = [name for name, on in (("use_beam_search", req.use_beam_search),
                                   ("best_of", not req.use_beam_search and req.best_of not in (None, req.n)),
                                   ("self_consistency", req.self_consistency is not None)) if on]
    if len(modes) > 1:
        raise InvalidRequestError(f"'{modes[0]}' and '{modes[1]}' cannot be combined", param=modes[1])
    if modes and req.stream:
        raise InvalidRequestError(f"'{modes[0]}' cannot be streamed: its choices are known only at the end",
                                  param="stream")
    if req.use_beam_search:
        return Strategy("beam_search", max(req.best_of or req.n, req.n), req.length_penalty)
    if req.best_of is not None and req.best_of != req.n:
        if req.best_of < req.n:
            raise InvalidRequestError(f"best_of ({req.best_of}) must be >= n ({req.n})", param="best_of")
        return Strategy("best_of", req.best_of)
    if req.self_consistency is not None:
        if req.n != 1:
            raise InvalidRequestError("self_consistency returns one answer; n must be 1", param="n")
        return Strategy("self_consistency", req.self_consistency, pointer=req.self_consistency_pointer or "")
    return Strategy("sample", req.n)


def _check_pointer(strategy: Strategy, constraint: Constraint | None) -> None:
    from corral.engine.self_consistency import check_pointer, pointer_tokens

    if strategy.kind == "self_consistency" and strategy.pointer:
        try:
            pointer_tokens(strategy.pointer)  # raises for a malformed pointer
            if constraint is not None and constraint.kind == "json_schema":
                check_pointer(constraint.value, strategy.pointer)
        except InvalidRequestError as err:
            err.param = "self_consistency_pointer"  # its name in the request
            raise


def _num_logprobs(enabled: bool, top: int | None) -> int | None:
    if top is not None and not enabled:  # as OpenAI and vLLM refuse it, rather than drop it unsaid
        raise InvalidRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
    return (top or 0) if enabled else None


def _params(req: SamplingFields, num_prompt: int, num_logprobs: int | None, tokenizer: Tokenizer,
            max_model_len: int, default_max_tokens: int | None, strategy: Strategy,
            limits: RequestLimits) -> SamplingParams:
    budget = output_budget(req, num_prompt, max_model_len, default_max_tokens)
    return sampling_params(req, max_tokens=budget, num_logprobs=num_logprobs, vocab_size=tokenizer.vocab_size,
                           n=strategy.width, limits=limits)


def _check_sequences(strategy: Strategy, num_prompts: int, limits: RequestLimits) -> None:
    if strategy.width * num_prompts > limits.max_sequences:
        raise InvalidRequestError(f"this request would run {strategy.width * num_prompts} sequences at once "
                                  f"({num_prompts} prompts x {strategy.width} per prompt); the limit is "
                                  f"{limits.max_sequences}", param="n")


def chat_prompt(req: ChatCompletionRequest, tokenizer: Tokenizer) -> str:
    native = bool(tokenizer.chat_template and "tools" in tokenizer.chat_template)
    messages = template_messages(req.messages, req.tools, native)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if native and req.tools else None
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=req.add_generation_prompt)
    except jinja2.TemplateError as err:
        raise InvalidRequestError(f"the chat template refused these messages: {err}", param="messages") from None


def prepare_chat(req: ChatCompletionRequest, tokenizer: Tokenizer, *, max_model_len: int,
                 default_max_tokens: int | None = None, limits: RequestLimits = RequestLimits(),
                 reject_unknown_keywords: bool = False) -> PreparedRequest:
    """What the engine runs for a chat request. Renders the template and tokenizes: call it off the event loop.
    ``reject_unknown_keywords``: the server's default for schemas (a request may set its own)."""
    if len(req.messages) > limits.max_messages:
        raise InvalidRequestError(f"at most {limits.max_messages} messages are allowed, this request has "
                                  f"{len(req.messages)}", param="messages")
    check_tool_limits(req.tools, limits)
    strategy = strategy_of(req)
    _check_sequences(strategy, 1, limits)
    constraint = request_constraint(req, reject_unknown_keywords)
    _check_pointer(strategy, constraint)
    mode = tool_choice_mode(req.tools, req.tool_choice)
    constraint = tools_constraint(req.tools, req.tool_choice, parallel=req.parallel_tool_calls, answer=constraint,
                                  reject_unknown_keywords=rejects_unknown_keywords(req, reject_unknown_keywords),
                                  disable_additional_properties=disables_additional_properties(req))
    _make_key(constraint)
    prompt_ids = tokenizer.encode(chat_prompt(req, tokenizer))
    params = _params(req, len(prompt_ids), _num_logprobs(req.logprobs, req.top_logprobs), tokenizer,
                     max_model_len, default_max_tokens, strategy, limits)
    # the answer's own constraint names its field; else the tools (their schemas' errors name the tool already)
    param = constraint_param(req) or ("tools" if mode != "none" else None)
    return PreparedRequest(prompt_ids, params, constraint, mode, strategy, param)


def _make_key(constraint: Constraint | None) -> None:
    """Make the constraint's cache key here, off the event loop (a full serialization of the schema), so that a
    compile-cache hit is a dictionary lookup on the loop; a value that is not JSON is refused now."""
    if constraint is not None:
        constraint.cache_key()



def completion_prompts(req: CompletionRequest, tokenizer: Tokenizer,
                       limits: RequestLimits = RequestLimits()) -> list[list[int]]:
    prompt = req.prompt
    if isinstance(prompt, str):
        batch = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        batch = [prompt]
    else:
        batch = list(prompt)
    if not batch:
        raise InvalidRequestError("'prompt' is empty", param="prompt")
    if len(batch) > limits.max_prompts:
        raise InvalidRequestError(f"at most {limits.max_prompts} prompts are allowed in one request, this one has "
                                  f"{len(batch)}", param="prompt")
    out = []
    for item in batch:
        ids = tokenizer.encode(item) if isinstance(item, str) else list(item)
        if not ids:
            raise InvalidRequestError("a prompt must hold at least one token", param="prompt")
        if any(not 0 <= t < tokenizer.vocab_size for t in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {tokenizer.vocab_size})", param="prompt")
        out.append(ids)
    return out


def prepare_completion(req: CompletionRequest, tokenizer: Tokenizer, *, max_model_len: int,
                       default_max_tokens: int | None = None, limits: RequestLimits = RequestLimits(),
                       reject_unknown_keywords: bool = False) -> list[PreparedRequest]:
    """One engine request per prompt. Tokenizes: call it off the event loop."""
    if req.suffix:
        raise InvalidRequestError("'suffix' is not supported", param="suffix")
    strategy = strategy_of(req)
    constraint = request_constraint(req, reject_unknown_keywords)
    _check_pointer(strategy, constraint)
    prompts = completion_prompts(req, tokenizer, limits)
    _check_sequences(strategy, len(prompts), limits)
    _make_key(constraint)
    return [PreparedRequest(ids, _params(req, len(ids), req.logprobs, tokenizer, max_model_len,
                                         default_max_tokens, strategy, limits), constraint, "none", strategy,
                            constraint_param(req))
            for ids in prompts]

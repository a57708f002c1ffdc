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
from corral.grammar.regex_ast import Node
from corral.models import Tokenizer
from corral.schemas.chat import ChatCompletionRequest
from corral.schemas.common import SamplingFields
from corral.schemas.completions import CompletionRequest
from corral.schemas.constraints import constraint_node, request_constraint
from corral.schemas.sampling import output_budget, sampling_params
from corral.schemas.tools import template_messages, tool_choice_mode, tools_node

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
    constraint: Constraint | None = None  # compiled with GrammarCompiler.compile
    node: Node | None = None  # tools: compiled with GrammarCompiler.compile_node (wins over ``constraint``)
    tool_mode: str = "none"
    strategy: Strategy = Strategy()


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
        pointer_tokens(strategy.pointer)  # raises for a malformed pointer
        if constraint is not None and constraint.kind == "json_schema":
            check_pointer(constraint.value, strategy.pointer)


def _num_logprobs(enabled: bool, top: int | None) -> int | None:
    return (top or 0) if enabled else None


def _params(req: SamplingFields, num_prompt: int, num_logprobs: int | None, tokenizer: Tokenizer,
            max_model_len: int, default_max_tokens: int | None, strategy: Strategy) -> SamplingParams:
    budget = output_budget(req, num_prompt, max_model_len, default_max_tokens)
    return sampling_params(req, max_tokens=budget, num_logprobs=num_logprobs, vocab_size=tokenizer.vocab_size,
                           n=strategy.width)


def chat_prompt(req: ChatCompletionRequest, tokenizer: Tokenizer) -> str:
    native = bool(tokenizer.chat_template and "tools" in tokenizer.chat_template)
    messages = template_messages(req.messages, req.tools, native)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if native and req.tools else None
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=req.add_generation_prompt)
    except jinja2.TemplateError as err:
        raise InvalidRequestError(f"the chat template refused these messages: {err}", param="messages") from None


def prepare_chat(req: ChatCompletionRequest, tokenizer: Tokenizer, *, max_model_len: int,
                 default_max_tokens: int | None = None) -> PreparedRequest:
    strategy = strategy_of(req)
    constraint = request_constraint(req)
    _check_pointer(strategy, constraint)
    mode = tool_choice_mode(req.tools, req.tool_choice)
    node = None
    # With 'required' or a named tool the output is the call, so a response_format describes a later turn's
    # answer, not this one; with 'auto' it is the alternative to a call.
    if mode != "none":
        answer = constraint_node(constraint) if constraint is not None and mode == "auto" else None
        node = tools_node(req.tools, req.tool_choice, parallel=req.parallel_tool_calls, answer=answer)
    prompt_ids = tokenizer.encode(chat_prompt(req, tokenizer))
    params = _params(req, len(prompt_ids), _num_logprobs(req.logprobs, req.top_logprobs), tokenizer,
                     max_model_len, default_max_tokens, strategy)
    return PreparedRequest(prompt_ids, params, None if node is not None else constraint, node, mode, strategy)


def completion_prompts(req: CompletionRequest, tokenizer: Tokenizer) -> list[list[int]]:
    prompt = req.prompt
    if isinstance(prompt, str):
        batch = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        batch = [prompt]
    else:
        batch = list(prompt)
    if not batch:
        raise InvalidRequestError("'prompt' is empty", param="prompt")
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
                       default_max_tokens: int | None = None) -> list[PreparedRequest]:
    if req.suffix:
        raise InvalidRequestError("'suffix' is not supported", param="suffix")
    strategy = strategy_of(req)
    constraint = request_constraint(req)
    _check_pointer(strategy, constraint)
    return [PreparedRequest(ids, _params(req, len(ids), req.logprobs, tokenizer, max_model_len,
                                         default_max_tokens, strategy), constraint, None, "none", strategy)
            for ids in completion_prompts(req, tokenizer)]

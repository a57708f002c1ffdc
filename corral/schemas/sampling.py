"""From a request body's sampling fields to :class:`SamplingParams`, and the output budget check.

Defaults follow OpenAI where they differ from ``SamplingParams``: temperature 1, and ``max_tokens`` omitted means
"the rest of the context window" (as vLLM does), unless the server sets a smaller default.
"""

from corral.engine.sampling_params import SamplingParams, make_logit_bias
from corral.errors import InvalidRequestError, PromptTooLongError
from corral.schemas.common import SamplingFields
from corral.schemas.limits import RequestLimits


def output_budget(req: SamplingFields, num_prompt_tokens: int, max_model_len: int,
                  default_max_tokens: int | None) -> int:
    """How many tokens the request may generate. Raises :class:`PromptTooLongError` when the prompt plus the
    requested output cannot fit the context window (OpenAI's wording, so clients that parse it keep working)."""
    requested = getattr(req, "max_completion_tokens", None) or req.max_tokens
    room = max_model_len - num_prompt_tokens
    if requested is None:
        if room < 1:
            raise PromptTooLongError(
                f"This model's maximum context length is {max_model_len} tokens. However, your messages resulted "
                f"in {num_prompt_tokens} tokens. Please reduce the length of the messages.", param="messages")
        return room if default_max_tokens is None else min(room, default_max_tokens)
    if requested > room:
        raise PromptTooLongError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the messages, {requested} in the "
            f"completion). Please reduce the length of the messages or completion.", param="max_tokens")
    return requested


def _stop(req: SamplingFields, limits: RequestLimits) -> tuple[str, ...]:
    if req.stop is None:
        return ()
    stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    if len(stops) > limits.max_stop:
        raise InvalidRequestError(f"at most {limits.max_stop} stop sequences are allowed", param="stop")
    if any(len(s) > limits.max_stop_chars for s in stops):
        raise InvalidRequestError(f"a stop sequence may hold at most {limits.max_stop_chars} characters",
                                  param="stop")
    return tuple(s for s in stops if s)


def sampling_params(req: SamplingFields, *, max_tokens: int, num_logprobs: int | None, vocab_size: int,
                    n: int | None = None, limits: RequestLimits = RequestLimits()) -> SamplingParams:
    """The request's per-token knobs. ``n`` overrides the request's (Best-of-N and self-consistency draw more
    candidates than they return)."""
    if req.logit_bias is not None and len(req.logit_bias) > limits.max_logit_bias:
        raise InvalidRequestError(f"logit_bias may hold at most {limits.max_logit_bias} entries", param="logit_bias")
    if req.stop_token_ids is not None and len(req.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidRequestError(f"stop_token_ids may hold at most {limits.max_stop_token_ids} ids",
                                  param="stop_token_ids")
    requested = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if requested is not None and req.min_tokens > requested:  # (a default budget only caps min_tokens)
        raise InvalidRequestError(f"min_tokens ({req.min_tokens}) must be at most max_tokens ({requested})",
                                  param="min_tokens")
    bias = make_logit_bias(req.logit_bias)
    for token_id, _ in bias:
        if token_id >= vocab_size:
            raise InvalidRequestError(f"logit_bias names token id {token_id}, past the vocabulary of {vocab_size}",
                                      param="logit_bias")
    for token_id in req.stop_token_ids or ():
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(f"stop_token_ids holds {token_id}, outside the vocabulary of {vocab_size}",
                                      param="stop_token_ids")
    return SamplingParams(
        n=n or req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None or req.top_k < 0 else min(req.top_k, vocab_size),  # vLLM's "off" is -1
        min_p=req.min_p or 0.0,
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=min(req.min_tokens, max_tokens),
        stop=_stop(req, limits),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logit_bias=bias,
        repetition_penalty=req.repetition_penalty or 1.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        logprobs=num_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        jump_forward=req.jump_forward,
        speculation=req.speculation,
    )

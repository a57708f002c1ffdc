"""Engine outputs → wire pieces shared by both endpoints: logprobs, usage, finish reasons, choice selection.

Choice selection is where Best-of-N and self-consistency meet the server: both draw ``width`` candidates in one
engine request (the children share the prompt's KV blocks), then keep the ``n`` best by the engine's Best-of-N
scorer, or the one answer most candidates agree on (the engine's schema-aware vote, at a JSON pointer).
"""

import math
from collections import Counter
from collections.abc import Iterable
from typing import NamedTuple

from corral.engine.best_of_n import score_candidates
from corral.engine.self_consistency import majority_vote
from corral.schemas.chat import ChoiceLogprobs, TokenLogprob, TopLogprob
from corral.schemas.common import CompletionTokensDetails, PromptTokensDetails, SpeculationUsage, Usage
from corral.schemas.completions import CompletionLogprobs
from corral.schemas.prepare import Strategy


# JSON has no NaN or infinity: a logprob that is not finite (a NaN or +inf in the model's logits makes its row's
# normalizer one) is written as this floor, as OpenAI-compatible servers write -inf
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


class TokenLogprobRow(NamedTuple):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def logprob_rows(output) -> list[TokenLogprobRow]:
    """One row per generated token from ``CompletionOutput.logprobs``: entries are a float (the chosen token's
    logprob), a ``(logprob, [(token_id, logprob), ...])`` pair, or a vLLM-style ``{token_id: logprob}`` dict. A
    logprob that is not finite becomes ``LOGPROB_FLOOR`` (JSON cannot carry it)."""
    rows = []
    for token_id, entry in zip(output.token_ids, output.logprobs or ()):
        if isinstance(entry, dict):
            values = {int(k): _finite(float(getattr(v, "logprob", v))) for k, v in entry.items()}
            top = sorted(((k, v) for k, v in values.items()), key=lambda kv: -kv[1])
            rows.append(TokenLogprobRow(token_id, values.get(token_id, LOGPROB_FLOOR), top))
        elif isinstance(entry, (tuple, list)):
            rows.append(TokenLogprobRow(token_id, _finite(float(entry[0])),
                                        [(int(i), _finite(float(v))) for i, v in entry[1] or ()]))
        else:
            rows.append(TokenLogprobRow(token_id, _finite(float(entry)), []))
    return rows


def _piece(vocab, token_id: int) -> tuple[str, list[int]]:
    raw = vocab.token_bytes[token_id] if token_id < vocab.size else b""
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(vocab, rows: list[TokenLogprobRow], num_top: int) -> ChoiceLogprobs:
    content = []
    for row in rows:
        text, raw = _piece(vocab, row.token_id)
        top = [TopLogprob(token=_piece(vocab, i)[0], logprob=lp, bytes=_piece(vocab, i)[1])
               for i, lp in row.top[:num_top]]
        content.append(TokenLogprob(token=text, logprob=row.logprob, bytes=raw, top_logprobs=top))
    return ChoiceLogprobs(content=content)


def completion_logprobs(vocab, rows: list[TokenLogprobRow], num_top: int, offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs(top_logprobs=[] if num_top else None)
    for row in rows:
        text = _piece(vocab, row.token_id)[0]
        out.tokens.append(text)
        out.token_logprobs.append(row.logprob)
        out.text_offset.append(offset)
        offset += len(text)
        if num_top:
            out.top_logprobs.append({_piece(vocab, i)[0]: lp for i, lp in row.top[:num_top]})
    return out


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int,
          completions: Iterable = ()) -> Usage:
    """The usage block; ``completions`` (the engine's ``CompletionOutput``s) add how their tokens were drafted."""
    completions = list(completions)
    drafted = sum(c.num_draft_tokens for c in completions)
    accepted = sum(c.num_accepted_tokens for c in completions)
    speculation = SpeculationUsage(forward_passes=sum(c.num_forward_passes for c in completions),
                                   draft_tokens=drafted, accepted_tokens=accepted,
                                   forced_tokens=sum(c.num_forced_tokens for c in completions))
    return Usage(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                 total_tokens=num_prompt_tokens + num_completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens),
                 completion_tokens_details=CompletionTokensDetails(accepted_prediction_tokens=accepted,
                                                                   rejected_prediction_tokens=drafted - accepted),
                 speculation=speculation)


def _vote(outputs: list, pointer: str):
    """The first output holding the majority answer (``corral.engine.self_consistency``'s vote, at
    ``pointer``); outputs that are not JSON (regex, choice) vote by their stripped text."""
    result = majority_vote([o.text for o in outputs], pointer)
    if result.answer is not None:
        return outputs[result.answers.index(result.answer)]
    votes = Counter(o.text.strip() for o in outputs)
    return max(outputs, key=lambda o: votes[o.text.strip()])  # max keeps the first drawn among equals


def select_choices(strategy: Strategy, outputs: list, n: int) -> list:
    """The outputs to return, in order. ``sample`` returns all; ``beam_search`` the ``n`` best (its width may be
    ``best_of``, wider; beams come best first); ``best_of`` ranks by mean token logprob
    (``corral.engine.best_of_n``), a grammar error ranking last."""
    outputs = sorted(outputs, key=lambda o: o.index)
    if strategy.kind == "beam_search":
        return outputs[:n]
    if strategy.kind == "best_of":
        ranked = sorted(score_candidates(outputs), key=lambda c: -c.score)  # stable: ties keep draw order
        return [c.completion for c in ranked[:n]]
    if strategy.kind == "self_consistency":
        return [_vote([o for o in outputs if o.finish_reason == "stop"] or outputs, strategy.pointer)]
    return outputs

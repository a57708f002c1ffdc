"""Best-of-N: draw N samples of one prompt and keep the one a scorer ranks highest.

The N samples are one request with ``n = N``: the engine runs the prompt once and forks the samples from it,
sharing its KV blocks, each with its own copy of the guide. The default scorer is the mean token logprob
(the model's own confidence, length-neutral); any callable from a completion to a number, or a verifier that
returns a bool, may replace it. A sample that ended in a grammar error ranks below every other, whatever its
score, and so does one whose score is NaN. Ties go to the sample drawn first.
"""

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

from corral.engine.outputs import CompletionOutput
from corral.engine.sampling_params import SamplingParams
from corral.errors import InvalidRequestError
from corral.fsm.guide import Guide

Scorer = Callable[[CompletionOutput], float | bool]


class ScoredCandidate(NamedTuple):
    completion: CompletionOutput
    score: float


class BestOfNResult(NamedTuple):
    best: CompletionOutput
    score: float
    candidates: list[ScoredCandidate] | None  # every sample in draw order, when asked for


def mean_token_logprob(completion: CompletionOutput) -> float:
    """The default scorer: cumulative logprob over the number of output tokens (EOS included)."""
    return completion.cumulative_logprob / len(completion.token_ids) if completion.token_ids else -math.inf


def score_candidates(completions: Sequence[CompletionOutput], scorer: Scorer = mean_token_logprob
                     ) -> list[ScoredCandidate]:
    """Each completion with its score; errors and NaN scores become -inf."""
    scored = []
    for completion in completions:
        score = -math.inf if completion.finish_reason == "error" else float(scorer(completion))
        scored.append(ScoredCandidate(completion, -math.inf if math.isnan(score) else score))
    return scored


def select_best(candidates: Sequence[ScoredCandidate]) -> ScoredCandidate:
    """The highest score; the earliest drawn among equals."""
    assert candidates, "no candidates to select from"
    return max(candidates, key=lambda c: c.score)  # max keeps the first of equal keys


def best_of_n(engine, prompt: str | Sequence[int], params: SamplingParams, *, guide: Guide | None = None,
              scorer: Scorer = mean_token_logprob, return_candidates: bool = False) -> BestOfNResult:
    """Draw ``params.n`` samples of ``prompt`` on ``engine`` and return the best. ``params`` must ask for
    logprobs only if the scorer needs them: the cumulative logprob is always tracked."""
    if params.n < 2:
        raise InvalidRequestError(f"best-of-N needs n >= 2 samples, got n={params.n}", param="n")
    (output,) = engine.generate([prompt], params, [guide])
    candidates = score_candidates(output.outputs, scorer)
    best = select_best(candidates)
    return BestOfNResult(best.completion, best.score, candidates if return_candidates else None)

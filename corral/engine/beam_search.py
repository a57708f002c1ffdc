"""Beam search over any next-token model, with an optional grammar: each beam carries its own copy of the guide.

The algorithm is written against one small protocol, :data:`NextTokenLogprobs` (a batch of output prefixes in,
next-token logprobs out), so it runs the same over a toy model in tests and over the engine
(:class:`EngineLogprobs`). Every step:

1. ask the model for the next-token logprobs of every live beam;
2. mask each constrained beam's row by its guide (the grammar's tokens keep the model's own logprobs, not
   renormalised ones: the search finds the sequences most likely under the model among those the grammar allows);
3. take the best ``2 * beam_width`` extensions over all beams by cumulative logprob;
4. an extension by EOS, or one after which the guide is finished, becomes a finished hypothesis; the others
   become the next live beams, at most ``beam_width``, each with the guide advanced on its own copy.

A hypothesis's score is ``cumulative_logprob / length ** length_penalty``, with ``length`` its number of output
tokens (the EOS that ended it included). With ``early_stopping`` the search ends as soon as ``beam_width``
hypotheses are finished; without it, it ends once no live beam can still beat the ``beam_width``-th finished
score (logprobs are <= 0, so a bound is exact), or at ``max_tokens``. Live beams at ``max_tokens`` finish with
reason 'length'.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from corral.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from corral.errors import InvalidRequestError
from corral.fsm.guide import Guide
from corral.kernels.bitmask import apply_token_bitmask_

NextTokenLogprobs = Callable[[Sequence[tuple[int, ...]]], torch.Tensor]
"""Output prefixes (the prompt is the callee's business) -> float ``[len(prefixes), vocab]`` next-token logprobs;
-inf where a token is impossible or unknown."""


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0
    early_stopping: bool = False

    def __post_init__(self):
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise InvalidRequestError(f"beam_width must be an integer >= 1, got {self.beam_width!r}",
                                      param="beam_width")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
                                      param="max_tokens")
        if not isinstance(self.length_penalty, (int, float)) or not math.isfinite(self.length_penalty):
            raise InvalidRequestError(f"length_penalty must be a finite number, got {self.length_penalty!r}",
                                      param="length_penalty")


class BeamHypothesis(NamedTuple):
    token_ids: tuple[int, ...]
    cumulative_logprob: float
    score: float
    finish_reason: str  # 'stop' (EOS, or the grammar is complete) or 'length'


class _Beam(NamedTuple):
    token_ids: tuple[int, ...]
    cumulative_logprob: float
    guide: Guide | None


def length_normalized_score(cumulative_logprob: float, length: int, length_penalty: float) -> float:
    return cumulative_logprob / max(length, 1) ** length_penalty


def beam_search(next_token_logprobs: NextTokenLogprobs, params: BeamSearchParams, *,
                eos_token_ids: Sequence[int], guide: Guide | None = None) -> list[BeamHypothesis]:
    """The ``beam_width`` best hypotheses, best first. ``guide`` (left untouched) constrains every beam."""
    eos = frozenset(eos_token_ids)
    live = [_Beam((), 0.0, guide.copy() if guide is not None else None)]
    finished: list[BeamHypothesis] = []
    for step in range(params.max_tokens):
        logprobs = _masked(next_token_logprobs([beam.token_ids for beam in live]), live)
        live = _extend(live, logprobs, params, eos, finished)
        if not live or _can_stop(live, finished, params, step + 1):
            break
    for beam in live:  # only left at max_tokens, or when stopping early made them irrelevant
        finished.append(_hypothesis(beam.token_ids, beam.cumulative_logprob, params, "length"))
    return sorted(finished, key=lambda h: h.score, reverse=True)[: params.beam_width]


def _masked(logprobs: torch.Tensor, live: list[_Beam]) -> torch.Tensor:
    logprobs = logprobs.to(torch.float32, copy=True)
    constrained = [i for i, beam in enumerate(live) if beam.guide is not None]
    if constrained:
        bitmask = np.zeros((len(live), -(-logprobs.shape[1] // 32)), dtype=np.int32)
        for i in constrained:
            live[i].guide.fill_mask(bitmask[i])
        apply_token_bitmask_(logprobs, torch.from_numpy(bitmask), torch.tensor(constrained))
    return logprobs


def _extend(live: list[_Beam], logprobs: torch.Tensor, params: BeamSearchParams, eos: frozenset[int],
            finished: list[BeamHypothesis]) -> list[_Beam]:
    """One step: the next live beams; finished hypotheses are appended to ``finished``."""
    vocab_size = logprobs.shape[1]
    totals = torch.tensor([b.cumulative_logprob for b in live], dtype=torch.float64)[:, None] + logprobs.double()
    num_candidates = min(2 * params.beam_width, totals.numel())
    values, flat_ids = torch.topk(totals.flatten(), num_candidates)
    next_live: list[_Beam] = []
    for value, flat_id in zip(values.tolist(), flat_ids.tolist()):
        if value == -math.inf or len(next_live) == params.beam_width:
            break
        beam, token_id = live[flat_id // vocab_size], flat_id % vocab_size
        token_ids = beam.token_ids + (token_id,)
        if token_id in eos:
            finished.append(_hypothesis(token_ids, value, params, "stop"))
            continue
        guide = beam.guide.copy() if beam.guide is not None else None
        if guide is not None:
            assert guide.advance(token_id), "a masked token was chosen"
            if guide.is_finished():
                finished.append(_hypothesis(token_ids, value, params, "stop"))
                continue
        next_live.append(_Beam(token_ids, value, guide))
    return next_live


def _hypothesis(token_ids: tuple[int, ...], cumulative_logprob: float, params: BeamSearchParams,
                reason: str) -> BeamHypothesis:
    score = length_normalized_score(cumulative_logprob, len(token_ids), params.length_penalty)
    return BeamHypothesis(token_ids, cumulative_logprob, score, reason)


def _can_stop(live: list[_Beam], finished: list[BeamHypothesis], params: BeamSearchParams, length: int) -> bool:
    if len(finished) < params.beam_width:
        return False
    if params.early_stopping:
        return True
    kth_best = sorted((h.score for h in finished), reverse=True)[params.beam_width - 1]
    return all(_best_reachable(beam.cumulative_logprob, length, params) <= kth_best for beam in live)


def _best_reachable(cumulative_logprob: float, length: int, params: BeamSearchParams) -> float:
    """An upper bound on the score of any continuation: more tokens never raise a logprob sum (<= 0), and
    ``c / L ** a`` with c <= 0 is largest at the longest length when a >= 0, at the shortest when a < 0."""
    longest = params.max_tokens if params.length_penalty >= 0 else length + 1
    return length_normalized_score(cumulative_logprob, longest, params.length_penalty)


# --- over the engine ------------------------------------------------------------------------------------------

class EngineLogprobs:
    """:data:`NextTokenLogprobs` served by an ``LLMEngine`` through its public API.

    Each call adds one single-token greedy request per beam (prompt + the beam's output) and steps the engine
    until they finish. Beams share their prompt and common prefix through the engine's prefix cache (whole
    blocks; the last partial block is recomputed), not through explicit forks. A row holds the raw logprobs of
    the model's top ``MAX_LOGPROBS`` tokens plus that of the beam's best grammar-allowed token (the request
    carries a copy of the guide), -inf elsewhere. That is exact for ``2 * beam_width <= MAX_LOGPROBS`` without
    a grammar; with one, an allowed token ranked below the top ``MAX_LOGPROBS`` other than the best allowed one
    is not seen. The engine must not be serving other callers meanwhile (their outputs would be consumed here).
    """

    def __init__(self, engine, prompt_token_ids: Sequence[int], guide: Guide | None = None):
        self.engine, self.prompt_token_ids, self.guide = engine, list(prompt_token_ids), guide
        self._params = SamplingParams(temperature=0, max_tokens=1, logprobs=MAX_LOGPROBS)
        self._num_calls = 0

    def __call__(self, prefixes: Sequence[tuple[int, ...]]) -> torch.Tensor:
        request_ids = []
        for i, prefix in enumerate(prefixes):
            request_ids.append(f"beam-{id(self):x}-{self._num_calls}-{i}")
            self.engine.add_request(request_ids[-1], self.prompt_token_ids + list(prefix), self._params,
                                    guide=self._guide_after(prefix))
        self._num_calls += 1
        done = {}
        while len(done) < len(request_ids):
            done.update((o.request_id, o.outputs[0]) for o in self.engine.step() if o.finished)
        logprobs = torch.full((len(prefixes), self.engine.vocabulary.size), -math.inf)
        for i, request_id in enumerate(request_ids):
            completion = done[request_id]
            assert completion.finish_reason != "error", "the engine sampled a token its guide rejects"
            chosen_logprob, top = completion.logprobs[0]
            for token_id, value in top:
                logprobs[i, token_id] = value
            logprobs[i, completion.token_ids[0]] = chosen_logprob
        return logprobs

    def _guide_after(self, prefix: Sequence[int]) -> Guide | None:
        if self.guide is None:
            return None
        guide = self.guide.copy()
        for token_id in prefix:
            assert guide.advance(token_id), "a beam left the grammar"
        return guide


def beam_search_engine(engine, prompt: str | Sequence[int], params: BeamSearchParams,
                       guide: Guide | None = None) -> list[BeamHypothesis]:
    """Beam search on the engine's model; ``prompt`` is text (tokenized as is) or token ids."""
    prompt_token_ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    model = EngineLogprobs(engine, prompt_token_ids, guide)
    return beam_search(model, params, eos_token_ids=engine.vocabulary.eos_token_ids, guide=guide)

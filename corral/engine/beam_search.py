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

from corral.engine.outputs import CompletionOutput
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

    Each call adds one single-token greedy request per beam (prompt + the beam's output, ``logprobs=20``) and
    steps the engine until they finish. Beams share their prompt and common prefix through the engine's prefix
    cache (whole blocks; the last partial block is recomputed), not through explicit forks. A row holds the raw
    logprobs of the model's top ``MAX_LOGPROBS`` tokens, -inf elsewhere: exact for the beam's best
    ``2 * beam_width`` extensions when ``2 * beam_width <= MAX_LOGPROBS``.

    With a guide, the allowed tokens are often outside the raw top ``MAX_LOGPROBS``. Then more rounds follow,
    each a greedy request whose guide also excludes the allowed tokens found so far, so each round adds the
    next-best allowed token, until the row holds ``num_candidates`` allowed tokens or every allowed one.
    The engine must not be serving other callers meanwhile (their outputs would be consumed here).
    """

    def __init__(self, engine, prompt_token_ids: Sequence[int], guide: Guide | None = None, num_candidates: int = 8):
        self.engine, self.prompt_token_ids, self.guide = engine, list(prompt_token_ids), guide
        self.num_candidates = num_candidates
        self._params = SamplingParams(temperature=0, max_tokens=1, logprobs=MAX_LOGPROBS)
        self._num_requests = 0

    def __call__(self, prefixes: Sequence[tuple[int, ...]]) -> torch.Tensor:
        vocab_size = self.engine.vocabulary.size
        logprobs = torch.full((len(prefixes), vocab_size), -math.inf)
        guides = [self._guide_after(prefix) for prefix in prefixes]
        # row -> the guide its next request carries (a copy: the engine advances it)
        pending = {i: g.copy() if g is not None else None for i, g in enumerate(guides)}
        while pending:
            for i, completion in self._run({i: (prefixes[i], g) for i, g in pending.items()}).items():
                chosen_logprob, top = completion.logprobs[0]
                for token_id, value in top:
                    logprobs[i, token_id] = value
                logprobs[i, completion.token_ids[0]] = chosen_logprob
            pending = {i: _Excluding(guides[i], found) for i in pending
                       if (found := self._allowed_found(guides[i], logprobs[i])) is not None}
        return logprobs

    def _allowed_found(self, guide: Guide | None, row: torch.Tensor) -> np.ndarray | None:
        """The allowed tokens seen in ``row`` as a bitmask to exclude next round; None when the row is done."""
        if guide is None:
            return None
        allowed = np.zeros(-(-row.shape[0] // 32), dtype=np.int32)
        guide.fill_mask(allowed)
        seen = np.zeros(allowed.size * 32, dtype=bool)
        seen[: row.shape[0]] = torch.isfinite(row).numpy()
        found = allowed & np.packbits(seen, bitorder="little").view("<i4").astype(np.int32)
        num_found, num_allowed = _popcount(found), _popcount(allowed)
        return found if num_found < min(self.num_candidates, num_allowed) else None

    def _run(self, requests: dict[int, tuple[tuple[int, ...], Guide | None]]) -> dict[int, CompletionOutput]:
        ids = {}
        for i, (prefix, guide) in requests.items():
            request_id = f"beam-{id(self):x}-{self._num_requests}"
            self._num_requests += 1
            self.engine.add_request(request_id, self.prompt_token_ids + list(prefix), self._params, guide=guide)
            ids[request_id] = i
        done = {}
        while len(done) < len(ids):
            done.update((o.request_id, o.outputs[0]) for o in self.engine.step() if o.finished and o.request_id in ids)
        assert all(c.finish_reason != "error" for c in done.values()), "the engine sampled a token its guide rejects"
        return {ids[request_id]: completion for request_id, completion in done.items()}

    def _guide_after(self, prefix: Sequence[int]) -> Guide | None:
        if self.guide is None:
            return None
        guide = self.guide.copy()
        for token_id in prefix:
            assert guide.advance(token_id), "a beam left the grammar"
        return guide


def _popcount(words: np.ndarray) -> int:
    return int(np.unpackbits(words.view(np.uint8)).sum())


class _Excluding(Guide):
    """A throwaway copy of a guide whose mask also leaves out ``excluded`` (a bitmask row)."""

    def __init__(self, guide: Guide, excluded: np.ndarray):
        self.inner, self.excluded = guide.copy(), excluded

    def fill_mask(self, row: np.ndarray) -> None:
        self.inner.fill_mask(row)
        row &= ~self.excluded

    def advance(self, token_id: int) -> bool:
        return self.inner.advance(token_id)

    def is_accepting(self) -> bool:
        return self.inner.is_accepting()

    def is_finished(self) -> bool:
        return self.inner.is_finished()

    def is_error(self) -> bool:
        return self.inner.is_error()

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)

    def copy(self) -> "_Excluding":
        return _Excluding(self.inner, self.excluded)

    def forced_bytes(self) -> bytes:
        return self.inner.forced_bytes()


def beam_search_engine(engine, prompt: str | Sequence[int], params: BeamSearchParams,
                       guide: Guide | None = None) -> list[BeamHypothesis]:
    """Beam search on the engine's model; ``prompt`` is text (tokenized as is) or token ids."""
    prompt_token_ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    model = EngineLogprobs(engine, prompt_token_ids, guide, num_candidates=2 * params.beam_width)
    return beam_search(model, params, eos_token_ids=engine.vocabulary.eos_token_ids, guide=guide)

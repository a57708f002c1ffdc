"""Beam search with an optional grammar: each beam carries its own copy of the guide.

One step of the search is :func:`select_extensions`, and it has two drivers. :func:`beam_search` runs it over
any next-token model given as :data:`NextTokenLogprobs` (a batch of output prefixes in, logprobs out), which
is how the tests compare it with brute force on a toy model. :class:`BeamGroup` runs it inside the engine:
the beams are live ``Sequence`` s decoded in the same batches as every other request, and forked beams share
their KV blocks (see ``LLMEngine``). Every step:

1. take the next-token logprobs of every live beam: the model's full raw row;
2. mask each constrained beam's row by its guide (the grammar's tokens keep the model's own logprobs, not
   renormalised ones: the search finds the sequences most likely under the model among those the grammar allows);
3. take the best ``2 * beam_width`` extensions over all beams by cumulative logprob;
4. an extension by EOS, or one after which the guide is finished, becomes a finished hypothesis; the others
   become the next live beams, at most ``beam_width``, each with the guide advanced on its own copy.

A hypothesis's score is ``cumulative_logprob / length ** length_penalty``, with ``length`` its number of output
tokens (the EOS that ended it included). With ``early_stopping`` the search ends as soon as ``beam_width``
hypotheses are finished; without it, it ends once no live beam can still beat the ``beam_width``-th finished
score (logprobs are <= 0, so a bound is exact), or at ``max_tokens``. Live beams at ``max_tokens`` finish with
reason 'length'. Left out: stop strings, penalties, logit bias and temperature, which are sampling knobs.
"""

import itertools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from corral.engine.detokenizer import IncrementalDetokenizer
from corral.engine.outputs import CompletionOutput
from corral.engine.sampling_params import BeamSearchParams
from corral.fsm.guide import Guide
from corral.fsm.vocabulary import Vocabulary
from corral.kernels.bitmask import apply_token_bitmask_

if TYPE_CHECKING:
    from corral.engine.sequence import Sequence as EngineSequence

__all__ = ["BeamGroup", "BeamHypothesis", "BeamSearchParams", "Extension", "NextTokenLogprobs", "beam_search",
           "beam_search_engine", "length_normalized_score", "select_extensions"]

NextTokenLogprobs = Callable[[Sequence[tuple[int, ...]]], torch.Tensor]
"""Output prefixes (the prompt is the callee's business) -> float ``[len(prefixes), vocab]`` next-token logprobs;
-inf where a token is impossible or unknown."""


class BeamHypothesis(NamedTuple):
    token_ids: tuple[int, ...]
    cumulative_logprob: float
    score: float
    finish_reason: str  # 'stop' (EOS, or the grammar is complete), 'length', or 'error' (its grammar met a limit)
    stop_reason: str | None = None  # for 'error': the limit's message


class Extension(NamedTuple):
    beam: int  # the index of the beam it extends
    token_id: int
    cumulative_logprob: float
    guide: Guide | None  # a copy of the beam's guide, advanced by token_id
    is_finished: bool  # EOS, or the guide is finished: a hypothesis, no longer a beam
    error: str | None = None  # the limit its grammar met taking token_id: it ends there, with that error


def length_normalized_score(cumulative_logprob: float, length: int, length_penalty: float) -> float:
    return cumulative_logprob / max(length, 1) ** length_penalty


def select_extensions(cumulative_logprobs: Sequence[float], guides: Sequence[Guide | None], logprobs: torch.Tensor,
                      params: BeamSearchParams, eos: frozenset[int]) -> list[Extension]:
    """Steps 3-4 over the masked ``logprobs`` ``[beams, vocab]``: the chosen extensions, best first, holding at
    most ``beam_width`` that stay live (finished ones are interleaved where they ranked). A beam whose grammar
    meets a limit taking a token gives one extension with ``error`` (its first such token), which is neither live
    nor a result: callers keep it apart (:func:`with_errors`)."""
    vocab_size = logprobs.shape[1]
    totals = torch.tensor(cumulative_logprobs, dtype=torch.float64)[:, None] + logprobs.double()
    values, flat_ids = torch.topk(totals.flatten(), min(2 * params.beam_width, totals.numel()))
    chosen: list[Extension] = []
    num_live, errored = 0, set()
    for value, flat_id in zip(values.tolist(), flat_ids.tolist()):
        if value == -math.inf or num_live == params.beam_width:
            break
        beam, token_id = flat_id // vocab_size, flat_id % vocab_size
        if token_id in eos:
            chosen.append(Extension(beam, token_id, value, None, True))
            continue
        guide = guides[beam].copy() if guides[beam] is not None else None
        if guide is not None and not guide.advance(token_id):
            # its mask allowed the token, so taking it met a limit of the grammar (a row or a configuration past
            # its cap): this beam ends here with that error, and the others go on
            error = getattr(guide, "error", None) or "the grammar refused a token its mask allowed"
            if beam not in errored:
                errored.add(beam)
                chosen.append(Extension(beam, token_id, value, None, True, error))
            continue
        finished = guide is not None and guide.is_finished()
        chosen.append(Extension(beam, token_id, value, guide, finished))
        num_live += not finished
    return chosen


def limited_beams(guides: Sequence[Guide | None]) -> list[tuple[int, str]]:
    """The beams whose grammar met a limit filling their mask (the row then allows nothing), with its message:
    each ends as an error hypothesis rather than vanishing like a beam the grammar has no token for."""
    return [(i, guide.error) for i, guide in enumerate(guides) if guide is not None and getattr(guide, "error", None)]


def with_errors(finished: list[BeamHypothesis], errors: list[BeamHypothesis],
                params: BeamSearchParams) -> list[BeamHypothesis]:
    """The ``beam_width`` best results, best first: the hypotheses that finished, then, where they are fewer, the
    best of the beams that ended on a limit of their grammar (``finish_reason`` "error", the limit as
    ``stop_reason``), so a search cut short says why. Errors never rank among results nor end the search."""
    found = best(finished, params)
    return found + best(errors, params)[: params.beam_width - len(found)]


def mask_by_guides(logprobs: torch.Tensor, guides: Sequence[Guide | None]) -> torch.Tensor:
    """A float32 copy of ``logprobs`` with each constrained row masked by its guide."""
    logprobs = logprobs.to(torch.float32, copy=True)
    constrained = [i for i, guide in enumerate(guides) if guide is not None]
    if constrained:
        bitmask = np.zeros((len(guides), -(-logprobs.shape[1] // 32)), dtype=np.int32)
        for i in constrained:
            guides[i].fill_mask(bitmask[i])
        apply_token_bitmask_(logprobs, torch.from_numpy(bitmask), torch.tensor(constrained))
    return logprobs


# --- over any model ---------------------------------------------------------------------------------------------

class _Beam(NamedTuple):
    token_ids: tuple[int, ...]
    cumulative_logprob: float
    guide: Guide | None


def beam_search(next_token_logprobs: NextTokenLogprobs, params: BeamSearchParams, *,
                eos_token_ids: Sequence[int], guide: Guide | None = None) -> list[BeamHypothesis]:
    """The ``beam_width`` best hypotheses, best first. ``guide`` (left untouched) constrains every beam."""
    eos = frozenset(eos_token_ids)
    live = [_Beam((), 0.0, guide.copy() if guide is not None else None)]
    finished: list[BeamHypothesis] = []
    errors: list[BeamHypothesis] = []
    for step in range(params.max_tokens):
        guides = [beam.guide for beam in live]
        logprobs = mask_by_guides(next_token_logprobs([beam.token_ids for beam in live]), guides)
        errors.extend(_hypothesis(live[i].token_ids, live[i].cumulative_logprob, params, "error", error)
                      for i, error in limited_beams(guides))
        live = _extend(live, select_extensions([b.cumulative_logprob for b in live], guides, logprobs, params, eos),
                       params, finished, errors)
        if not live or _can_stop(live, finished, params, step + 1):
            break
    for beam in live:  # only left at max_tokens, or when stopping early made them irrelevant
        finished.append(_hypothesis(beam.token_ids, beam.cumulative_logprob, params, "length"))
    return with_errors(finished, errors, params)


def _extend(live: list[_Beam], extensions: list[Extension], params: BeamSearchParams,
            finished: list[BeamHypothesis], errors: list[BeamHypothesis]) -> list[_Beam]:
    next_live = []
    for ext in extensions:
        token_ids = live[ext.beam].token_ids + (ext.token_id,)
        if ext.error:
            errors.append(_hypothesis(token_ids, ext.cumulative_logprob, params, "error", ext.error))
        elif ext.is_finished:
            finished.append(_hypothesis(token_ids, ext.cumulative_logprob, params, "stop"))
        else:
            next_live.append(_Beam(token_ids, ext.cumulative_logprob, ext.guide))
    return next_live


def best(hypotheses: list[BeamHypothesis], params: BeamSearchParams) -> list[BeamHypothesis]:
    return sorted(hypotheses, key=lambda h: h.score, reverse=True)[: params.beam_width]


def _hypothesis(token_ids: tuple[int, ...], cumulative_logprob: float, params: BeamSearchParams,
                reason: str, stop_reason: str | None = None) -> BeamHypothesis:
    score = length_normalized_score(cumulative_logprob, len(token_ids), params.length_penalty)
    return BeamHypothesis(token_ids, cumulative_logprob, score, reason, stop_reason)


def _can_stop(live, finished: list[BeamHypothesis], params: BeamSearchParams, length: int) -> bool:
    """Whether no ``live`` beam (anything with a ``cumulative_logprob``) can still enter the top ``beam_width``."""
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


# --- inside the engine ------------------------------------------------------------------------------------------

class BeamGroup:
    """The search state of one beam-search request in the engine; the engine owns the sequences and blocks.

    ``beams`` are the live beams, engine ``Sequence`` s whose ``cumulative_logprob`` and ``guide`` are the
    beam's. After each forward the engine hands in the rows of the beams that computed their last token
    (:meth:`add_row`). A step of the search runs only once *every* live beam has its row and its K/V in the
    cache (:attr:`is_ready`): a beam that was preempted, or not scheduled, has none yet, so a partial batch never
    decides anything. A preempted beam's held row is dropped (:meth:`drop_row`); it is recomputed with the beam.
    """

    def __init__(self, params: BeamSearchParams, eos_token_ids: Sequence[int], root: "EngineSequence"):
        self.params, self.eos = params, frozenset(eos_token_ids)
        self.beams: list[EngineSequence] = [root]
        self.finished: list[BeamHypothesis] = []
        self.errors: list[BeamHypothesis] = []  # beams that ended on a limit of their grammar (see with_errors)
        self.rows: dict[int, torch.Tensor] = {}  # seq_id -> masked next-token logprobs
        self.num_steps = 0
        self.num_forks = 0  # beams made by forking, over the whole search (their sequence indices)
        self.is_done = False

    def add_row(self, beam: "EngineSequence", logprobs: torch.Tensor) -> None:
        self.rows[beam.seq_id] = logprobs

    def drop_row(self, beam: "EngineSequence") -> None:
        self.rows.pop(beam.seq_id, None)

    def has_row(self, beam: "EngineSequence") -> bool:
        return beam.seq_id in self.rows

    @property
    def is_ready(self) -> bool:
        return not self.is_done and all(beam.seq_id in self.rows and beam.block_table
                                        and beam.num_uncomputed_tokens == 0 for beam in self.beams)

    def decide(self) -> list[Extension]:
        """One step over every live beam's row: record the hypotheses that finish, and return the extensions
        that stay live (``.beam`` indexes :attr:`beams`), none once the search is done."""
        assert self.is_ready
        logprobs = torch.stack([self.rows.pop(beam.seq_id) for beam in self.beams])
        guides = [b.guide for b in self.beams]
        extensions = select_extensions([b.cumulative_logprob for b in self.beams], guides, logprobs, self.params,
                                       self.eos)
        self.num_steps += 1
        for i, error in limited_beams(guides):
            beam = self.beams[i]
            self.errors.append(_hypothesis(tuple(beam.output_token_ids), beam.cumulative_logprob, self.params,
                                           "error", error))
        live = []
        for ext in extensions:
            if ext.error:
                self.errors.append(self._hypothesis(ext, "error", ext.error))
            elif ext.is_finished:
                self.finished.append(self._hypothesis(ext, "stop"))
            else:
                live.append(ext)
        if not live or self.num_steps >= self.params.max_tokens or _can_stop(live, self.finished, self.params,
                                                                             self.num_steps):
            self.finished.extend(self._hypothesis(ext, "length") for ext in live)
            self.is_done = True
            return []
        return live

    def _hypothesis(self, ext: Extension, reason: str, stop_reason: str | None = None) -> BeamHypothesis:
        token_ids = tuple(self.beams[ext.beam].output_token_ids) + (ext.token_id,)
        return _hypothesis(token_ids, ext.cumulative_logprob, self.params, reason, stop_reason)

    def hypotheses(self) -> list[BeamHypothesis]:
        """The ``beam_width`` best finished hypotheses, best first (beams that ended on a limit fill what they
        leave: :func:`with_errors`)."""
        return with_errors(self.finished, self.errors, self.params)

    def completions(self, vocabulary: Vocabulary) -> list[CompletionOutput]:
        """:meth:`hypotheses` as the engine's outputs; the text leaves out special tokens (EOS)."""
        outputs = []
        for i, hypothesis in enumerate(self.hypotheses()):
            detokenizer = IncrementalDetokenizer(vocabulary)
            for token_id in hypothesis.token_ids:
                detokenizer.add_token(token_id)
            detokenizer.finish()
            outputs.append(CompletionOutput(i, list(hypothesis.token_ids), detokenizer.text, hypothesis.finish_reason,
                                            hypothesis.stop_reason, cumulative_logprob=hypothesis.cumulative_logprob))
        return outputs


def beam_search_engine(engine, prompt: str | Sequence[int], params: BeamSearchParams,
                       guide: Guide | None = None) -> list[BeamHypothesis]:
    """Beam search on the engine's model; ``prompt`` is text (tokenized as is) or token ids. It steps the engine
    until its request finishes and drops what other requests output meanwhile, so it suits code that owns the
    engine; a server submits ``add_request(request_id, prompt_ids, BeamSearchParams(...), guide)`` instead."""
    prompt_token_ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    request_id = f"beam-search-{next(_request_ids)}"
    engine.add_request(request_id, prompt_token_ids, params, guide=guide)
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return [BeamHypothesis(tuple(c.token_ids), c.cumulative_logprob,
                                       length_normalized_score(c.cumulative_logprob, len(c.token_ids),
                                                               params.length_penalty), c.finish_reason,
                                       c.stop_reason if c.finish_reason == "error" else None)
                        for c in output.outputs]


_request_ids = itertools.count()

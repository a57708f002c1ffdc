"""Sequence: one stream of tokens the engine advances, with what the scheduler and block manager track about it.

A request with ``n > 1`` owns ``n`` sequences; they share the prompt's KV blocks. A beam-search request's live
beams are sequences too, forked from one another as the search goes (:meth:`Sequence.fork`). ``num_computed_tokens`` is
how many of ``token_ids`` have K/V in the cache; the scheduler advances it by any k (a prefill chunk, one
decode token, a prefix-cache hit, a decode token and its draft), so prefill and decode are the same operation.
A draft is not part of ``token_ids``: the step computes its K/V past ``num_computed_tokens``, and only the
tokens the verification accepts join ``token_ids``.
"""

import enum
import itertools
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from corral.engine.detokenizer import IncrementalDetokenizer
    from corral.engine.sampling_params import SamplingParams
    from corral.fsm.guide import Guide


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


class TokenSpan(Seq):
    """``tokens[start:stop] + tail`` read in place: what a step hands the sampler, which reads a row's tokens only
    for its penalties, so that a step costs the same at the tenth output token as at the ten-thousandth (a copy of
    each row's tokens made it linear in the length). ``tail``: a draft row's draft tokens so far. Valid while the
    list keeps those items (a sequence's ``token_ids`` only grows)."""

    __slots__ = ("_tokens", "_start", "_stop", "_tail")

    def __init__(self, tokens: list[int], start: int, stop: int, tail: Seq[int] = ()):
        self._tokens, self._start, self._stop, self._tail = tokens, start, stop, tail

    def __len__(self) -> int:
        return self._stop - self._start + len(self._tail)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return list(self)[index]
        size, head = len(self), self._stop - self._start
        if not -size <= index < size:
            raise IndexError("token index out of range")
        index %= size
        return self._tokens[self._start + index] if index < head else self._tail[index - head]

    def __iter__(self):  # a copy of the span (islice would walk the prompt before an output span)
        return itertools.chain(self._tokens[self._start:self._stop], self._tail)

    def runs(self) -> tuple:
        """The span as the native sampler reads it, in place: ``((list, start, stop), (tail, 0, len(tail)))``."""
        tail = self._tail if isinstance(self._tail, (list, tuple)) else tuple(self._tail)
        return (self._tokens, self._start, self._stop), (tail, 0, len(tail))

    def __repr__(self) -> str:
        return f"TokenSpan({list(self)!r})"


class Sequence:
    """Mutable per-sequence state. ``block_table`` is owned by the BlockManager; the rest by the scheduler."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: "SamplingParams", *, index: int = 0,
                 guide: "Guide | None" = None, cache_salt: str | None = None, generator: "torch.Generator | None" = None,
                 detokenizer: "IncrementalDetokenizer | None" = None, arrival_time: float = 0.0):
        self.seq_id = next(_ids)
        self.request_id, self.index = request_id, index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params, self.guide, self.cache_salt, self.generator = params, guide, cache_salt, generator
        self.detokenizer = detokenizer
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at the first allocation
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chain hashes of this sequence's full blocks, in order
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.arrival_time, self.first_token_time, self.finished_time = arrival_time, None, None
        self.num_preemptions = 0
        self.num_forks_pending = 0  # n > 1: siblings forked from this one once its prompt is computed
        # this step's draft: tokens after token_ids that the step computes too and then verifies (speculation.py)
        self.draft: list[int] = []
        self.num_draft_forced = 0  # of the draft, how many are jump-forward tokens
        self.draft_by_model = False  # whether the draft came from a draft model (corral/engine/draft_model.py)
        self.draft_by_self = False  # whether the draft is a burst's own greedy tokens (each took a forward pass)
        # (a draft, len(token_ids)) where a drafter advanced a copy of the guide through every token of that draft
        # at that length: its grammar allows the draft and every prefix of it, so verification need not ask again
        self.allowed_draft: tuple[list[int], int] | None = None
        # (position, [(token, probe, index), ...]): the guide's probes that have taken the tokens now picked for
        # positions ``position``, ``position + 1``, ... (each as that probe's ``index``-th advance), so that
        # emitting them advances the guide without asking its grammar again (Guide.advance_as)
        self.ahead: tuple[int, list] | None = None
        self.spec = None  # a SpecState once the sequence first drafts
        self.is_beam = False  # a beam of a beam-search request (its rows skip the sampler)
        self.num_draft_tokens = self.num_accepted_tokens = self.num_forced_tokens = 0  # drafted, kept, jump-forward
        # what "delta" outputs have handed out: output tokens (and their logprobs), and characters of text
        self.num_sent_tokens = self.num_sent_chars = 0
        # the native tally of token_ids that its penalties read, made at its first sampled step (sampler.sampling_row)
        self.tally = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    def spans(self, draft: Seq[int] = ()) -> tuple[TokenSpan, TokenSpan]:
        """The prompt, and the output so far followed by ``draft``, without copying either."""
        tokens, split = self.token_ids, self.num_prompt_tokens
        return TokenSpan(tokens, 0, split), TokenSpan(tokens, split, len(tokens), draft)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_forward_passes(self) -> int:
        """Steps that produced this sequence's output: one token each, plus the draft tokens they accepted."""
        return self.num_output_tokens - self.num_accepted_tokens

    @property
    def num_scheduled_tokens(self) -> int:
        """What the next step computes for this sequence: its uncomputed tokens, and its draft."""
        return len(self.token_ids) - self.num_computed_tokens + len(self.draft)

    def input_token_ids(self, start: int, count: int) -> list[int]:
        """Tokens ``start .. start + count`` of ``token_ids`` followed by the draft."""
        if not self.draft:
            return self.token_ids[start: start + count]
        return (self.token_ids + self.draft)[start: start + count]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def fork(self, index: int) -> "Sequence":
        """A new sequence with this one's tokens (prompt and output) and cumulative logprob, nothing else: the
        caller gives it its guide, and its blocks through ``BlockManager.fork``."""
        child = Sequence(self.request_id, self.prompt_token_ids, self.params, index=index, cache_salt=self.cache_salt,
                         arrival_time=self.arrival_time)
        child.token_ids = list(self.token_ids)
        child.cumulative_logprob = self.cumulative_logprob
        child.is_beam = self.is_beam
        child.first_token_time = self.first_token_time
        return child

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id}#{self.index}, {self.status.value}, tokens={len(self)}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")

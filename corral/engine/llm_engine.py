"""LLMEngine: requests in, tokens out, one ``step()`` at a time (vLLM's shape).

A step is: propose drafts → schedule → fill the grammar masks (on a worker thread while the model runs, where a
core is free; else before the forward, and a plain greedy row's not at all unless its grammar refuses the model's
own token: see ``_deferred``) → forward → sample, or verify each draft and roll back what it rejected
(``corral.engine.speculation``) → advance guides, detokenize, check stops → finish. ``n > 1`` runs the prompt once: when it is computed the
siblings are forked from it, sharing its KV blocks, each with its own ``guide.copy()`` and generator.

A burst (``EngineConfig.decode_burst``): while at most 16 sequences run, each decoding greedily with no draft,
guide or penalty, and no request waits, the native step decodes up to that many tokens per sequence in one call,
each step's input the greedy token of the step before, so the loop's Python runs once for them all (after the
forward's weight stream it finds its data cold, about 100 us a step on a 2-core EPYC). The tokens are the
sampler's own greedy picks (one native pass, the same one), so they are emitted as they are; where that pass could
not decide a row or top logprobs are asked for, they are verified as a draft is. A stop among them drops the rest.
Where a burst may not run (more sequences, a request waits, or a sequence has a draft) but every sequence is a
plain greedy decode, the native step still makes the greedy pick of every logits row in its call, a draft's rows
included: the sampler's call is saved, and a draft is verified on those picks (kept while it is its row's pick).

A beam-search request (``BeamSearchParams``) is a :class:`BeamGroup` whose live beams are sequences in the same
batches as everything else. Its rows skip the sampler: each beam's full raw logprob row, masked by its own
guide, goes to the group, and once every live beam has its row the group picks the extensions. The first
extension of a beam continues that sequence, each further one forks it (``BlockManager.fork``: shared blocks,
the partial last block copied on its first write), and beams with no extension are freed. A beam that has its
row but waits for a sibling (preempted, or not yet readmitted) is left out of the batches until the group
decides. A group is preempted as a whole (see ``_schedule``).
"""

import dataclasses
import itertools
import logging
import operator
import os
import time
from collections.abc import Iterator, Sequence as Seq
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from corral.engine import draft_model, formats
from corral.engine.beam_search import BeamGroup, Extension
from corral.engine.block_manager import BlockManager
from corral.engine.config import EngineConfig
from corral.engine.detokenizer import IncrementalDetokenizer
from corral.engine.model_runner import ModelRunner
from corral.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from corral.engine.sampler import (DraftRows, Sampler, SampleResult, SamplingRow, Verified, draw_parameters,
                                   draw_uniforms, make_generator, sampling_row, verified_on_picks)
from corral.engine.speculation import Drafter, draft_batch
from corral.engine.sampling_params import BeamSearchParams, SamplingParams
from corral.engine.scheduler import ScheduledBatch, Scheduler
from corral.engine.sequence import Sequence, SequenceStatus
from corral.engine.weights import gguf_has_q4, gguf_has_q8
from corral.errors import InvalidRequestError, PromptTooLongError
from corral.fsm.guide import Guide
from corral.fsm.vocabulary import Vocabulary
from corral.kernels import cpu_ops
from corral.kernels.bitmask import apply_token_bitmask_
from corral.models import load_model_config, load_tokenizer, resolve_model

log = logging.getLogger(__name__)

# the stop reason of a sequence whose logits left no finite value to choose (a NaN or +inf from the model)
NO_FINITE_LOGIT = "the model's logits held no finite value to choose"


def _one_row_each(seqs: list[Sequence]) -> bool:
    """Whether each sequence samples one row of its own: no draft to verify, no beam, no sibling to fork."""
    for seq in seqs:
        if seq.draft or seq.is_beam or seq.num_forks_pending:
            return False
    return True


def _token_ids(tokens) -> list[int]:
    """A prompt's token ids as ints (numpy integers become ints; a bool, a float or a string is an error)."""
    ids = list(tokens)
    if all(type(t) is int for t in ids):  # the usual prompt, from the tokenizer
        return ids
    for i, t in enumerate(ids):
        try:
            if isinstance(t, bool):
                raise TypeError("a bool")
            ids[i] = operator.index(t)
        except TypeError:
            raise InvalidRequestError(f"prompt token {t!r} is not an integer token id", param="prompt") from None
    return ids


def _refused_at(guide: Guide, tokens: list[int]) -> int | None:
    """Where ``guide``'s grammar refuses the first of ``tokens`` (taken in turn, on a copy), or None."""
    probe = guide.probe()
    for j, token in enumerate(tokens):
        if not probe.advance(token):
            return j
    return None


def _probe_allows(guide: Guide, token: int) -> Guide | None:
    """A probe of ``guide`` that took ``token``, where its grammar allows it; else None."""
    probe = guide.probe()
    return probe if probe.advance(token) else None


def _take_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]``: a view where the rows are consecutive (the scheduler puts drafted decodes after the
    others, so a step's plain and drafted rows are two runs), else a copy (a few MB at 16 sequences)."""
    if rows[-1] - rows[0] == len(rows) - 1:  # increasing: consecutive
        return logits[rows[0]:rows[-1] + 1]
    return logits[torch.tensor(rows)]


def _completion(seq: Sequence) -> CompletionOutput:
    """What ``seq`` has produced so far (copies: the consumer reads it on another thread while this one goes on)."""
    return CompletionOutput(seq.index, seq.output_token_ids, seq.detokenizer.visible_text(seq.is_finished),
                            seq.finish_reason, seq.stop_reason,
                            list(seq.logprobs) if seq.logprobs is not None else None, seq.cumulative_logprob,
                            seq.num_draft_tokens, seq.num_accepted_tokens, seq.num_forced_tokens)


def _delta(seq: Sequence) -> CompletionOutput:
    """What ``seq`` has produced since its previous delta (copies of that alone), with its totals."""
    start, end = seq.num_prompt_tokens + seq.num_sent_tokens, len(seq.token_ids)
    text, seq.num_sent_chars = seq.detokenizer.visible_since(seq.num_sent_chars, seq.is_finished)
    logprobs = seq.logprobs[seq.num_sent_tokens:] if seq.logprobs is not None else None
    seq.num_sent_tokens = end - seq.num_prompt_tokens
    return CompletionOutput(seq.index, seq.token_ids[start:end], text, seq.finish_reason, seq.stop_reason, logprobs,
                            seq.cumulative_logprob, seq.num_draft_tokens, seq.num_accepted_tokens,
                            seq.num_forced_tokens, seq.num_sent_tokens)


# bursts pay where the loop's share of a step is large: over HTTP (bench/engine.py, one run, 2-core EPYC) +12-14% at
# 1, 4 and 16 streaming clients, but -12% at 64, where a step is ~30 ms and arrivals in a closed loop wait
_BURST_MAX_SEQS = 16


class BurstInterrupt:
    """A flag that another thread raises to end the engine's running burst after its current token: a request
    arrived or left, and should not wait for the rest of the burst. The native call reads it between its steps
    (with the GIL released, so the other thread runs meanwhile). Whoever feeds the engine from another thread lowers
    it as it takes the commands that raised it (:class:`corral.api.async_engine.AsyncEngine`)."""

    def __init__(self):
        self.flag = np.zeros(1, dtype=np.int64)

    def set(self) -> None:
        self.flag[0] = 1

    def clear(self) -> None:
        self.flag[0] = 0


class _Ready:
    """A result already computed, read as a future's."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class _Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], seqs: list[Sequence],
                 beam_group: BeamGroup | None = None):
        self.request_id, self.prompt_token_ids, self.seqs = request_id, prompt_token_ids, seqs
        self.beam_group = beam_group
        # an output after every step that advanced it, or the finished one alone (a beam group's: the latter)
        self.every_step = beam_group is None and seqs[0].params.output_kind != "final"
        self.delta = beam_group is None and seqs[0].params.output_kind == "delta"

    @property
    def is_finished(self) -> bool:
        if self.beam_group is not None:
            return self.beam_group.is_done
        for seq in self.seqs:  # read for every request a step touched: a loop, no generator
            if seq.status is not SequenceStatus.FINISHED or seq.num_forks_pending:
                return False
        return True

    @property
    def live_seqs(self) -> list[Sequence]:
        return self.beam_group.beams if self.beam_group is not None else self.seqs


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, runner=None, model_config=None,
                 vocabulary: Vocabulary | None = None, tokenizer=None):
        """Load ``config.model``. Or, given a ``runner`` (``num_blocks``, ``execute``, ``copy_blocks``), its
        ``model_config`` (``vocab_size``, ``max_position``) and ``vocabulary``, run over those: how the tests
        drive the engine over a toy model."""
        config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.formats = None  # a toy runner's
        self.model_drafter = None
        if runner is None:
            files = resolve_model(config.model)
            self.formats = formats.resolve(config, gguf_has_q4(files), gguf_q8=gguf_has_q8(files))
            config = formats.resolved_config(config, self.formats)
            log.info("formats: %s (%s)", self.formats.tag, self.formats.reason)
            model_config, tokenizer = load_model_config(files), load_tokenizer(files)
            vocabulary = Vocabulary.from_tokenizer(tokenizer)
            runner = ModelRunner(config, model_config, files)
            self.model_drafter = draft_model.build(config, runner, vocabulary)
        self.config = config
        self.model_config, self.tokenizer, self.vocabulary, self.runner = model_config, tokenizer, vocabulary, runner
        self.max_model_len = min(config.max_model_len or self.model_config.max_position, self.model_config.max_position)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler(vocab_size=self.vocabulary.size, eos_token_ids=self.vocabulary.eos_token_ids)
        self._mask_words = -(-self.vocabulary.size // 32)
        self._mask_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="corral-masks")
        self._cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        # whether a plain greedy guided row's mask waits for its token (see _deferred); None: where masks would be
        # filled on the engine's own thread, not beside the forward
        self.defer_masks: bool | None = None
        self._requests: dict[str, _Request] = {}
        self.burst_interrupt = BurstInterrupt()
        self._counters = {"steps": 0, "generated": 0, "computed": 0, "drafted": 0, "accepted": 0, "forced": 0,
                          "model_drafted": 0, "model_accepted": 0, "burst_steps": 0, "burst_tokens": 0,
                          "burst_accepted": 0}
        # drafts need a runner that computes a draft's rows (a toy runner may not)
        encode = self.tokenizer.encode if self.tokenizer is not None else None
        self.drafter = Drafter(vocabulary, encode) if getattr(self.runner, "supports_drafts", False) else None
        # whether the runner can make every row's greedy pick inside its forward (a toy runner may not)
        self._runner_picks = hasattr(self.runner, "execute_picking")
        self._auto_ids = itertools.count()

    # -- requests -------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | BeamSearchParams,
                    guide: Guide | None = None, cache_salt: str | None = None) -> None:
        """Queue a request: sampling, or beam search. Raises PromptTooLongError when it can never fit,
        InvalidRequestError for bad input. A beam-search request finishes with one output per hypothesis, best
        first (EOS included in ``token_ids``, as for sampled outputs); it streams nothing before."""
        prompt_token_ids = _token_ids(prompt_token_ids)
        self._check_request(request_id, prompt_token_ids, params)
        if isinstance(params, BeamSearchParams):
            return self._add_beam_request(request_id, prompt_token_ids, params, guide, cache_salt)
        seq = Sequence(request_id, list(prompt_token_ids), params, guide=guide, cache_salt=cache_salt,
                       generator=make_generator(params.seed), arrival_time=time.monotonic(),
                       detokenizer=IncrementalDetokenizer(self.vocabulary, params.stop, params.skip_special_tokens))
        seq.num_forks_pending = params.n - 1
        self._requests[request_id] = _Request(request_id, list(prompt_token_ids), [seq])
        self.scheduler.add(seq)

    def _add_beam_request(self, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams,
                          guide: Guide | None, cache_salt: str | None) -> None:
        max_tokens = min(params.max_tokens, self.max_model_len - len(prompt_token_ids))
        if max_tokens != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        # The beams' own SamplingParams: what a Sequence reads; beam rows never reach the sampler.
        root = Sequence(request_id, list(prompt_token_ids), SamplingParams(temperature=0, max_tokens=max_tokens),
                        guide=guide.copy() if guide is not None else None, cache_salt=cache_salt,
                        arrival_time=time.monotonic())
        root.num_forks_pending = params.beam_width - 1  # reserves the beams' places at admission
        root.is_beam = True
        group = BeamGroup(params, self.vocabulary.eos_token_ids, root)
        self._requests[request_id] = _Request(request_id, list(prompt_token_ids), [root], group)
        self.scheduler.add(root)

    def _check_request(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams | BeamSearchParams) -> None:
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running", param="request_id")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary", param="prompt")
        beams = isinstance(params, BeamSearchParams)
        width, name = (params.beam_width, "beam_width") if beams else (params.n, "n")
        if width > self.config.max_num_seqs:
            raise InvalidRequestError(f"{name}={width} exceeds max_num_seqs={self.config.max_num_seqs}", param=name)
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {len(prompt_token_ids)} tokens; the model's context is "
                                     f"{self.max_model_len}, which leaves no room for output", param="prompt")
        longest = min(len(prompt_token_ids) + params.max_tokens, self.max_model_len)
        capacity = self.runner.num_blocks * self.config.block_size
        if self.block_manager.num_blocks_for(longest) > self.runner.num_blocks:
            raise PromptTooLongError(f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                                     f"exceeds the KV cache's {capacity} tokens", param="max_tokens")
        # subtle: beams share blocks only while they run together; after preemption each recomputes alone (sharing
        # just the prefix cache's full blocks), and a group decides only with all its beams resident. So the pool
        # must hold every beam unshared, or the group could wait forever.
        if beams and width * self.block_manager.num_blocks_for(longest) > self.runner.num_blocks:
            raise PromptTooLongError(f"beam_width ({width}) x (prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                                     f"({params.max_tokens})) exceeds the KV cache's {capacity} tokens",
                                     param="max_tokens")

    def abort(self, request_id: str) -> None:
        """Finish every sequence of the request at once and free all its blocks. Unknown ids are ignored."""
        request = self._requests.pop(request_id, None)
        for seq in request.live_seqs if request else ():
            if not seq.is_finished:
                self._finish(seq, "abort")
            seq.num_forks_pending = 0

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # -- the loop -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Advance every scheduled sequence once; return the outputs of the requests that advanced."""
        self._propose_drafts()                                              # jump-forward and lookup drafts
        batch = self._schedule()                                            # who advances, by how many tokens
        if not batch:
            return []
        batch, burst = self._plan_burst(batch)                              # greedy tokens picked in the call
        copies = self.block_manager.take_pending_copies()
        if copies:  # a step after a forward finds the interpreter's data cold: skip what would do nothing
            self.runner.copy_blocks(copies)                                 # copy-on-write of forked blocks
        guided = [s for s in batch.seqs if s.guide is not None]
        deferred = None
        if guided:  # of those, the ones that sample this step, less those whose masks wait for their tokens
            guided = [s for s in self._sampling_seqs(batch) if s.guide is not None]
            deferred = self._deferred(guided)
            if deferred:
                guided = [s for s in guided if s.seq_id not in deferred]
        masks = self._start_masks(guided) if guided else None               # may overlap the forward
        row_picks = first_rows = None  # the native call's greedy pick of every logits row, where it made them
        if burst:
            ends = self._end_ids(batch.seqs) if burst > 1 else None  # a stop among them ends the burst there
            draws = self._burst_draws(batch.seqs, burst)  # None: every row greedy
            seqs, logits, picks, logprobs, decided = self.runner.execute_burst(
                batch, burst, self.sampler.vocab_size or 0, ends, self.burst_interrupt.flag if burst > 1 else None,
                draws and draws[0])
            done = len(picks[0]) if picks else burst
            if draws is not None and (done < burst or not decided):  # the uniforms of the steps not kept go back
                self._rewind_draws(draws[1], done if decided else 0)
            if draws is not None and not decided:  # a draw it could not decide (a NaN or +inf, at any step, of a
                done = 1  # greedy or sampled row): the burst counts for its first step alone, which the sampler takes
            if done < burst:  # it ended early
                batch, logits = self._cut_burst(batch, logits, burst, done)
                burst = done
            if burst > 1:  # each sequence's tokens but its last are its draft
                for seq, tokens in zip(seqs, picks):
                    seq.draft, seq.draft_by_self = tokens[:-1], True
                self._counters["burst_steps"] += 1
        elif self._picks_in_call(batch.seqs, deferred or ()):  # every row's pick is its unmasked argmax
            seqs, logits, row_picks = self.runner.execute_picking(batch, self.sampler.vocab_size or 0)
            first_rows = self._first_rows(seqs) if row_picks is not None else None
        else:
            seqs, logits = self.runner.execute(batch)                       # forward
        self._commit(batch)                                                 # their K/V is in the cache now
        if burst and decided and not any(seq.params.logprobs for seq in seqs):
            return self._outputs(self._settle_burst(seqs, picks, logprobs))  # the sampler's own greedy tokens
        if masks is None and _one_row_each(seqs):  # the usual decode step: nothing below would change a thing
            drafted, beams, rows, row_logits, stuck, masks = None, None, [(s, s) for s in seqs], logits, [], {}
        elif row_picks is not None:  # plain greedy rows, drafts among them: the picks decide every row, so no
            # logits row is split or masked; a deferred row whose pick its grammar refuses is read where it lies
            rows = [(s, s) for s in seqs if not s.draft]
            drafted = ([(s, first_rows[s.seq_id]) for s in seqs if s.draft], logits)
            beams, row_logits, stuck, masks = None, logits, [], {}
        else:
            (seqs, logits), drafted = self._split_drafts(seqs, logits)      # drafted rows are verified
            (seqs, logits), beams = self._split_beams(seqs, logits)         # beam rows skip the sampler
            masks = masks.result() if masks is not None else {}  # no guide: no thread hand-off
            rows, row_logits = self._fork_siblings(seqs, logits)            # n > 1: siblings share the row
            rows, row_logits, stuck = self._drop_dead_ends(rows, row_logits, masks)  # a mask with no token: error
        touched: dict[str, _Request] = {}
        if rows or stuck:
            at = None  # each row's place in row_logits where the picks decided (else its place in the list)
            if row_picks is not None and not stuck and not masks:  # no forks, no mask: each row's own pick
                at = [first_rows[seq.seq_id] for seq, _ in rows]
                result = SampleResult([row_picks[0][i] for i in at], [row_picks[1][i] for i in at], None)
            else:
                result = self.sampler(row_logits, self._sampling_rows(rows), *self._bitmask(masks, rows))
            if deferred:  # a token its grammar refuses: that row's mask now, and its pick again
                rows, result = self._repick_refused(rows, row_logits, result, deferred, stuck, at)
            self._process(rows, result, stuck, touched)                     # guides, stops
        if drafted:
            self._verify_drafts(*drafted, masks, touched, deferred,         # accept, then roll back the rest
                                (row_picks, first_rows) if row_picks is not None else None)
        outputs = self._outputs(touched)
        return outputs + self._advance_beams(*beams, masks) if beams and beams[0] else outputs

    def _schedule(self) -> ScheduledBatch:
        """The scheduler's batch, less the beams that hold their row while a sibling catches up (nothing to
        compute). Beam groups are preempted whole: a preempted beam takes its group's resident beams along, so a
        group never pins blocks while it waits for a beam it cannot get back. When nothing can run because held
        beams pin the pool the front of the queue needs, the groups holding them go to the back of the queue."""
        while True:
            batch = self.scheduler.schedule()
            for group in {id(g): g for s in batch.preempted if (g := self._beam_group(s)) is not None}.values():
                self._preempt_group(group)
            kept = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
                    if n > 0 and s.status is SequenceStatus.RUNNING]
            if len(kept) < len(batch.seqs):
                batch = ScheduledBatch([batch.seqs[i] for i in kept], [batch.num_new_tokens[i] for i in kept],
                                       batch.preempted)
            if batch or not self._requeue_blocking_groups():
                return batch

    def _plan_burst(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, int]:
        """``batch`` as it runs, and how many tokens each sequence decodes in it with its greedy pick or sampled
        draw made inside the native call (the same pass as the sampler's with the uniform the sampler would draw,
        so the same token): 0 (none: the sampler picks), 1 where every sequence decodes one token, greedily or
        sampled, with no draft, guide, beam, fork, bias, penalty or top logprobs (the sampler's call and its rows
        are saved), or a burst of up to ``decode_burst`` where, on top of that (top logprobs allowed where every
        row is greedy: they are verified), at most ``_BURST_MAX_SEQS`` sequences run, nothing waits (a burst would
        hold an arrival back), each has room for the tokens under its limits, and the pool has the blocks. A
        burst's tokens are emitted as the sampler's own (see :meth:`_settle_burst`), so a burst never changes an
        output, and a stop among them drops the rest. Its extra blocks are taken here."""
        most = getattr(self.runner, "max_burst_rows", 0)
        if not most:
            return batch, 0
        sampled = False
        steps = min(self.config.decode_burst, most // len(batch.seqs))
        if self.scheduler.waiting or len(batch.seqs) > _BURST_MAX_SEQS:
            steps = 1
        asked = False
        for seq, count in zip(batch.seqs, batch.num_new_tokens):
            params = seq.params
            if count != 1 or seq.num_uncomputed_tokens != 1 or seq.draft or seq.guide is not None or seq.is_beam \
                    or seq.num_forks_pending or not params.unshaped or seq.num_output_tokens < params.min_tokens:
                return batch, 0
            asked = asked or bool(params.logprobs)
            sampled = sampled or not params.is_greedy
            if asked and sampled:  # top logprobs verify a burst's rows, and a sampled row's verification draws anew
                return batch, 0
            if steps > 1:
                steps = min(steps, params.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq))
        if steps <= 1:  # top logprobs come from the sampler: a pick made in the call would be thrown away
            return batch, 0 if asked else 1
        bm = self.block_manager
        if sum(bm.num_blocks_to_append(seq, steps) for seq in batch.seqs) > bm.num_free_blocks:
            return batch, 0 if asked else 1
        for seq in batch.seqs:
            bm.append(seq, steps)
        return ScheduledBatch(batch.seqs, [steps] * len(batch.seqs), batch.preempted), steps

    def _picks_in_call(self, seqs: list[Sequence], deferred: set[int]) -> bool:
        """Whether every row of a step of ``seqs`` takes its unmasked greedy argmax first, so that the native call
        may pick them all where it computes the logits (:meth:`ModelRunner.execute_picking`) instead of a sampler
        pass after it: each sequence is ``deferred`` (guided: its grammar then rules on that pick, drafts
        included), or unguided, plain greedy past ``min_tokens``, with no beam or sibling to fork (a draft's rows
        are then verified on those picks: see :meth:`_verify_picked`)."""
        if not self._runner_picks:
            return False
        for seq in seqs:
            if seq.seq_id in deferred:
                continue
            params = seq.params
            if seq.guide is not None or seq.is_beam or seq.num_forks_pending or not params.plain_greedy \
                    or seq.num_output_tokens < params.min_tokens:
                return False
        return True

    @staticmethod
    def _first_rows(seqs: list[Sequence]) -> dict[int, int]:
        """Each sequence's first logits row in a step of ``seqs`` (in order, ``1 + len(draft)`` rows each)."""
        first, at = {}, 0
        for seq in seqs:
            first[seq.seq_id] = at
            at += 1 + len(seq.draft)
        return first

    def _burst_draws(self, seqs: list[Sequence], steps: int):
        """The native call's draws for ``steps`` steps of ``seqs`` where one of them samples (None where every one
        is greedy): each row's parameters and, step by step, the uniforms the sampler would draw for it (each
        step's as :func:`corral.engine.sampler.draw_uniforms` draws them, in turn), and the random states before
        them, to give back the uniforms of the steps a burst does not make."""
        drawn = [s for s in seqs if not s.params.is_greedy]
        if not drawn:
            return None
        generators = [s.generator for s in drawn]
        states = (torch.get_rng_state(), [(g, g.get_state()) for g in generators if g is not None], generators)
        at = {s.seq_id: j for j, s in enumerate(drawn)}
        uniforms = []
        for _ in range(steps):
            step = draw_uniforms(generators)
            uniforms.extend([step[at[s.seq_id]] if s.seq_id in at else 0.0 for s in seqs])
        width = self.sampler.vocab_size or 2 ** 31 - 1
        return (*draw_parameters([s.params for s in seqs], width), uniforms), states

    @staticmethod
    def _rewind_draws(states, kept: int) -> None:
        """Put the random states back as they were before a burst's draws, then draw again the uniforms of the
        ``kept`` steps it made: the states are then those of ``kept`` single steps."""
        global_state, seeded, generators = states
        torch.set_rng_state(global_state)
        for generator, state in seeded:
            generator.set_state(state)
        for _ in range(kept):
            draw_uniforms(generators)

    def _end_ids(self, seqs: list[Sequence]) -> list[int] | None:
        """The token ids that end one of ``seqs`` (EOS unless ignored, and its stop ids): a burst stops after
        the step that picks one, for every sequence (a shorter burst is always safe)."""
        ends = set()
        for seq in seqs:
            params = seq.params
            if not params.ignore_eos:
                ends.update(self.vocabulary.eos_token_ids)
            ends.update(params.stop_token_ids)
        return list(ends) or None

    def _cut_burst(self, batch: ScheduledBatch, logits: torch.Tensor, planned: int, done: int):
        """A burst that ended after ``done`` of its ``planned`` steps: the batch as it ran, its logits with each
        sequence's rows together again, and the blocks taken for the steps not made given back."""
        for seq in batch.seqs:
            self.block_manager.truncate(seq, seq.num_computed_tokens + done)
        n = len(batch.seqs)
        logits = logits[:done] if n == 1 else logits.view(n, planned, -1)[:, :done].reshape(n * done, -1)
        return ScheduledBatch(batch.seqs, [done] * n, batch.preempted), logits

    def _preempt_group(self, group: BeamGroup, to_back: bool = False) -> None:
        for beam in group.beams:
            group.drop_row(beam)
            if beam.status is SequenceStatus.RUNNING:
                self.scheduler.preempt(beam)
        if to_back:
            waiting = self.scheduler.waiting
            for beam in group.beams:
                waiting.remove(beam)
                waiting.append(beam)

    def _requeue_blocking_groups(self) -> bool:
        """Requeue, at the back, every group with held beams except the one at the front of the queue (or that
        one, when it alone holds). False when nothing is held or nothing waits: there is no stall to break."""
        running, waiting = self.scheduler.running, self.scheduler.waiting
        holders = {id(g): g for s in running if s.num_uncomputed_tokens == 0 and (g := self._beam_group(s))}
        if not holders or not waiting:
            return False
        front = self._beam_group(waiting[0])
        blocking = [g for g in holders.values() if g is not front] or list(holders.values())
        for group in blocking:
            self._preempt_group(group, to_back=True)
        return True

    def _beam_group(self, seq: Sequence) -> BeamGroup | None:
        if not seq.is_beam:
            return None
        request = self._requests.get(seq.request_id)
        return request.beam_group if request is not None else None

    def _sampling_seqs(self, batch: ScheduledBatch) -> list[Sequence]:
        return [s for s, n in zip(batch.seqs, batch.num_new_tokens)
                if s.num_computed_tokens + n == len(s) + len(s.draft)]

    def _start_masks(self, guided: list[Sequence]):
        """The guided rows' masks (a future's ``result()``): filled on a worker while the forward runs where the
        forward leaves a core free, else here, before it. On a CPU whose every core runs the forward the worker
        only took cores from it, and the hand-off cost more than it hid (2-core EPYC, 200-token JSON-schema requests
        alternating in one process, 6-8 each: filled here, 1.9-3.2% more tok/s at 1 and 8 sequences, drafts on
        and off; a schema of patterns, integer ranges and an enum array: the same)."""
        if torch.get_num_threads() < self._cores:
            return self._mask_worker.submit(self._fill_masks, guided)
        return _Ready(self._fill_masks(guided))

    def _deferred(self, guided: list[Sequence]) -> set[int] | None:
        """The ids of the guided sequences whose masks wait for their tokens: where masks would be filled on this
        thread (no core beside the forward), a plain greedy row (no top logprobs, bias or penalty, ``min_tokens``
        reached; no beam, no sibling to fork) takes the argmax of its unmasked logits, drafted rows included, and
        its grammar is asked whether it allows that token (one advance of a copy of its guide). Where it does, the
        token is the masked argmax too, and the mask was never needed; where it does not, that row's mask is filled
        then and the row picked again (:meth:`_repick_refused`, :meth:`_walk_deferred`), as is a row whose
        unmasked logits leave nothing finite to choose (a NaN or +inf the mask may rule out). So the tokens are
        those of a mask filled for every row, and a mask costs only where the model's own token breaks the
        grammar. What differs: a mask never filled never meets its limits (its fuel), so a sequence goes on past a
        state whose mask would have ended it with an error; and where a state inside a draft allows no token at
        all (a vocabulary that cannot spell what the grammar needs next) and the model rejects the draft before
        it, the draft counts one more tested token than masks would. None or empty: every mask is filled before
        the forward."""
        defer = self.defer_masks if self.defer_masks is not None else torch.get_num_threads() >= self._cores
        if not defer:
            return None
        return {seq.seq_id for seq in guided if seq.params.plain_greedy and not seq.is_beam
                and not seq.num_forks_pending and seq.num_output_tokens >= seq.params.min_tokens
                and not seq.guide.is_error()}  # an error met already (a limit): its mask ends it, as before

    def _masked_pick(self, guide: Guide, logits: torch.Tensor, at: int, seq: Sequence,
                     draft: list[int] = ()) -> SampleResult | None:
        """The pick of ``logits[at]``, a row of deferred ``seq`` (after ``draft``), under ``guide``'s mask, filled
        now; None where the mask allows nothing (a limit the guide meets filling it is its error, as before the
        forward). A deferred row is plain greedy, so the sampler would make the native greedy pick of the masked
        row: it is made here on a view of that row, with no torch slice, and the sampler decides only where that
        pick cannot (a NaN or +inf)."""
        mask = np.zeros((1, self._mask_words), dtype=np.int32)
        guide.fill_mask(mask[0])
        if not np.count_nonzero(mask):
            return None
        picked = cpu_ops.greedy_pick_row(logits, at, self.sampler.vocab_size or logits.shape[1], mask)
        if picked is not None:
            return SampleResult([picked[0]], [picked[1]], None)
        return self.sampler(logits[at:at + 1], [sampling_row(seq, draft)], mask, [0])

    def _repick_refused(self, rows, logits: torch.Tensor, result: SampleResult, deferred: set[int],
                        stuck: list[Sequence], at: list[int] | None = None) -> tuple[list, SampleResult]:
        """The rows of deferred sequences whose unmasked argmax their grammar refuses, picked again with their
        masks (row i at ``logits[at[i]]``; no ``at``: ``logits[i]``); a row whose mask allows nothing leaves the
        batch for ``stuck``, as :meth:`_drop_dead_ends` does."""
        tokens, logprobs, dropped = result.token_ids, result.logprobs, []
        for i, (seq, _) in enumerate(rows):
            if seq.seq_id not in deferred:
                continue
            if tokens[i] >= 0:  # (no token: a NaN or +inf the mask may rule out)
                probe = _probe_allows(seq.guide, tokens[i])
                if probe is not None:  # its emit takes the probe's step (Guide.advance_as)
                    seq.ahead = (len(seq.token_ids), [(tokens[i], probe, 0)])
                    continue
            picked = self._masked_pick(seq.guide, logits, i if at is None else at[i], seq)  # its own guide's mask
            if picked is None:
                dropped.append(i)
                stuck.append(seq)
                continue
            if tokens is result.token_ids:  # the first change: copies
                tokens, logprobs = list(tokens), list(logprobs)
            tokens[i], logprobs[i] = picked.token_ids[0], picked.logprobs[0]
        top = result.top_logprobs
        if dropped:
            kept = [i for i in range(len(rows)) if i not in dropped]
            rows, tokens, logprobs = [rows[i] for i in kept], [tokens[i] for i in kept], [logprobs[i] for i in kept]
            top = [top[i] for i in kept] if top is not None else None
        return rows, SampleResult(tokens, logprobs, top) if tokens is not result.token_ids or dropped else result

    def _verify_deferred(self, drafted: list[tuple[Sequence, int]], logits: torch.Tensor, picks=None
                         ) -> dict[int, tuple[DraftRows, Verified]]:
        """Verify the drafts of deferred sequences as their masks would have: per sequence, its draft and what it
        verified, by sequence id; each sequence walks its rows with a copy of its guide (see
        :meth:`_walk_deferred`) from their unmasked argmax. ``picks``: (the native call's picks of the step's
        logits rows, each sequence's first row there), which are those argmax, and ``logits`` the step's own (a
        row is read only where its grammar refuses its pick). Without them ``drafted`` holds each sequence with its
        rows, and only those, in ``logits``, in order, and their argmax come from one sampler call: the caller takes
        the rows out only where other sequences' rows are among them (right after the forward, a torch call costs
        tens of microseconds)."""
        if picks is not None:
            (tokens, logprobs), first_rows = picks
            starts = [first_rows[seq.seq_id] for seq, _ in drafted]
        else:
            rows = []
            for seq, _ in drafted:
                draft = seq.draft
                rows.extend([sampling_row(seq, draft[:j]) for j in range(len(draft) + 1)])
            picked = self.sampler(logits, rows)
            tokens, logprobs = picked.token_ids, picked.logprobs
            starts = list(itertools.accumulate([len(seq.draft) + 1 for seq, _ in drafted], initial=0))
        out = {}
        for (seq, _), start in zip(drafted, starts):
            end = start + len(seq.draft) + 1
            out[seq.seq_id] = self._walk_deferred(seq, logits, start, tokens[start:end], logprobs[start:end])
        return out

    def _walk_deferred(self, seq: Sequence, logits: torch.Tensor, start: int, argmax: list[int],
                       logprobs: list[float]) -> tuple[DraftRows, Verified]:
        """One deferred sequence's draft, verified on its rows ``logits[start:]`` from their unmasked argmax (and
        its logprob) as :meth:`Sampler.verify` verifies a greedy draft on masked rows, with the same result: the
        draft tested ends after the first draft token its grammar refuses (the masks after it would allow
        nothing), and a row whose argmax the grammar refuses has its mask filled and is picked again; where that
        mask allows nothing, the tokens before it are the ones tested and none is drawn after them (a state inside
        the draft that allows nothing, met only where the walk reaches it: see :meth:`_deferred`)."""
        draft, allowed = seq.draft, seq.allowed_draft
        # a drafter that took the draft on a copy of the guide has asked already (no token since; the scheduler may
        # have cut the draft, and a prefix of an allowed draft is allowed)
        known = allowed is not None and allowed[1] == len(seq.token_ids) and allowed[0][:len(draft)] == draft
        refused = None if known else _refused_at(seq.guide, draft)
        tested = len(draft) if refused is None else refused + 1
        final = refused is None
        probe, tokens, chosen_logprobs, accepted = seq.guide.probe(), [], [], 0
        ahead = []  # the probes that took the tokens kept, for their emits (Guide.advance_as)
        for j in range(tested + int(final)):
            token, logprob = argmax[j], logprobs[j]
            if j < tested and token == draft[j]:  # walked above
                allowed = refused is None or j < refused
            else:  # (no token, -1: a NaN or +inf the mask may rule out)
                took = _probe_allows(probe, token) if token >= 0 else None
                allowed = took is not None
                if allowed:
                    ahead.append((token, took, 0))
            if not allowed:  # the masked row's pick, as filling its mask first would have made it
                picked = self._masked_pick(probe, logits, start + j, seq, draft[:j])
                if picked is None:
                    tested, final = j, False
                    break
                token, logprob = picked.token_ids[0], picked.logprobs[0]  # -1: nothing finite; it ends the walk
            tokens.append(token)
            chosen_logprobs.append(logprob)
            if j < tested and token == draft[j]:
                accepted += 1
                probe.advance(token)
                ahead.append((token, probe, j))
            else:
                break
        seq.ahead = (len(seq.token_ids), ahead) if ahead else None
        rows = list(range(start, start + len(tokens)))
        return (DraftRows(0, draft[:tested], final, [False] * tested),
                Verified(tokens, accepted, rows, chosen_logprobs, None))

    def _fill_masks(self, seqs: list[Sequence]) -> dict[int, np.ndarray]:
        """Each guided sequence's mask; a drafted one's ``[1 + len(draft), words]``: here, and after each draft
        token, computed on a copy of its guide (a limit reached on a draft the model rejects must not stay)."""
        masks = {}
        for seq in seqs:
            if seq.guide is None:
                continue
            if not seq.draft:
                row = np.zeros(self._mask_words, dtype=np.int32)
                seq.guide.fill_mask(row)
                masks[seq.seq_id] = row
                continue
            rows = np.zeros((1 + len(seq.draft), self._mask_words), dtype=np.int32)
            probe = seq.guide.probe()
            probe.fill_mask(rows[0])
            for j, token in enumerate(seq.draft):
                if not probe.advance(token):
                    break  # the rows after stay empty: verification stops before them
                probe.fill_mask(rows[j + 1])
            masks[seq.seq_id] = rows
        return masks

    def _commit(self, batch: ScheduledBatch) -> None:
        """Count what the step computed. A drafted sequence commits its last token only: its draft tokens join
        ``token_ids`` (and the computed prefix) once verification accepts them."""
        for seq, count in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += count - len(seq.draft)
            self.block_manager.cache_full_blocks(seq)
        self._counters["steps"] += 1
        self._counters["computed"] += batch.num_tokens

    # -- drafts ---------------------------------------------------------------------------------------------
    def _propose_drafts(self) -> None:
        """Give each decoding sequence its draft for this step (see :mod:`corral.engine.speculation`)."""
        if self.drafter is None:
            return
        decoding = [s for s in self.scheduler.running if s.status is SequenceStatus.RUNNING
                    and s.num_uncomputed_tokens == 1 and not s.num_forks_pending and not s.is_beam]
        model = self.model_drafter
        wanted = self.drafter.propose_all(decoding, self.config, self.max_model_len,
                                          model.cost if model is not None else None)
        if model is not None:
            model.propose(wanted, self.scheduler.running)

    def _settle_burst(self, seqs: list[Sequence], picks: list[list[int]], logprobs: list[list[float]]) -> dict:
        """Emit a burst's tokens as the plain path would have emitted them one step each: every token is the
        native pass's greedy pick or draw of its row, as the sampler makes it for a row with no mask, bias, penalty
        or top logprobs, so there is nothing to verify (the rows were ruled on where that pass could not decide, or
        top logprobs are asked for). A stop among them ends the sequence there, and the blocks past what was
        computed go back. Returns the requests touched."""
        touched: dict[str, _Request] = {}
        now = time.monotonic()
        counters, block_manager = self._counters, self.block_manager
        for seq, tokens, token_logprobs in zip(seqs, picks, logprobs):
            touched[seq.request_id] = self._requests[seq.request_id]
            drafted = len(tokens) - 1  # each took a forward pass of its own: none is a draft's gain
            if drafted:
                counters["burst_tokens"] += drafted
                counters["burst_accepted"] += drafted
                seq.draft, seq.num_draft_forced, seq.draft_by_model, seq.draft_by_self = [], 0, False, False
            if self._emit_run(seq, tokens, token_logprobs, now) or not drafted:
                continue
            seq.num_computed_tokens += drafted  # their K/V, computed in the burst
            block_manager.truncate(seq, seq.num_computed_tokens)
            block_manager.cache_full_blocks(seq)
        return touched

    def _emit_run(self, seq: Sequence, tokens: list[int], logprobs: list[float], now: float) -> bool:
        """:meth:`_emit` for each of ``tokens`` (with no top logprobs) until one ends ``seq``, with the same stop
        checks in the same order, made once for the run where they can be: the first EOS or stop id (for a guided
        sequence, also the first token its grammar refuses or after which it is finished; each token advances its
        guide in turn), the text of the tokens the detokenizer would have seen in one call, and the length limit.
        A guided sequence with stop strings goes a token at a time: a stop string may end it before a token its
        guide would otherwise have taken. True when ``seq`` ended."""
        params, length, guide = seq.params, len(seq.token_ids), seq.guide
        if guide is not None and params.stop:
            return any(self._emit(seq, token, logprob, [], now) for token, logprob in zip(tokens, logprobs))
        # a token is emitted before its limit is checked, so at least one is (a burst is planned within them)
        room = max(1, min(params.max_tokens - length + seq.num_prompt_tokens, self.max_model_len - length))
        run = tokens[:room] if room < len(tokens) else tokens
        count, reason, stop_reason = len(run), "length" if len(run) == room else None, None
        eos = () if params.ignore_eos else self.vocabulary.eos_token_ids
        if guide is None:
            for i, token in enumerate(run):
                if token in eos or token in params.stop_token_ids:
                    count, reason, stop_reason = i + 1, "stop", None if token in eos else token
                    break
            added, stop = seq.detokenizer.add_tokens(run[:count - 1] if reason == "stop" else run)
            if stop is not None:  # a stop string, completed before any stop id
                count, reason, stop_reason = added, "stop", stop
            seq.token_ids.extend(run[:count] if count < len(run) else run)
        else:
            token_ids, seen = seq.token_ids, len(run)  # seen: the tokens whose text the detokenizer gets
            for i, token in enumerate(run):
                token_ids.append(token)  # before its advance, which reads where the sequence stands
                if not self._advance_guide(seq, token):
                    count, reason, stop_reason, seen = i + 1, "error", getattr(guide, "error", None), i
                    break
                if token in eos or token in params.stop_token_ids:
                    count, reason, stop_reason, seen = i + 1, "stop", None if token in eos else token, i
                    break
                if guide.is_finished():  # after its text, as a token at a time
                    count, reason, seen = i + 1, "stop", i + 1
                    break
            seq.detokenizer.add_tokens(run[:seen] if seen < len(run) else run)  # (no stop string to find)
        self._counters["generated"] += count
        if seq.first_token_time is None:
            seq.first_token_time = now
        cumulative = seq.cumulative_logprob
        for logprob in logprobs[:count]:  # one at a time: the sum of a run of single steps, bit for bit
            cumulative += logprob
        seq.cumulative_logprob = cumulative
        if seq.logprobs is not None:
            seq.logprobs.extend([(logprob, []) for logprob in logprobs[:count]])
        if reason is None:
            return False
        if stop_reason is not None:
            seq.stop_reason = stop_reason
        self._finish(seq, reason)
        return True

    def _split_drafts(self, seqs: list[Sequence], logits: torch.Tensor):
        """((sequences without a draft, their rows: None when there are none), (drafted sequences with their first
        row, their rows))."""
        if not any(seq.draft for seq in seqs):
            return (seqs, logits), None
        plain, plain_rows, drafted, draft_rows = [], [], [], []
        at = 0
        for seq in seqs:
            if seq.draft:
                drafted.append((seq, len(draft_rows)))
                draft_rows.extend(range(at, at + 1 + len(seq.draft)))
            else:
                plain.append(seq)
                plain_rows.append(at)
            at += 1 + len(seq.draft)
        if not plain:  # every row is a draft's: no copy, and no rows left to sample (nothing reads them)
            return ([], None), (drafted, logits)
        return (plain, _take_rows(logits, plain_rows)), (drafted, _take_rows(logits, draft_rows))

    def _verify_drafts(self, drafted: list[tuple[Sequence, int]], logits: torch.Tensor,
                       masks: dict[int, np.ndarray], touched: dict, deferred: set[int] | None = None,
                       picks=None) -> None:
        """Verify every draft against its rows, emit what it accepted and the token after, and roll the rest
        back. Guides, hashes and detokenizers only ever see emitted tokens. A ``deferred`` sequence's rows have
        no mask: they are verified by :meth:`_verify_deferred` (with ``picks``, the native call's)."""
        order = [seq for seq, _ in drafted]
        walked = {}
        if deferred and any(seq.seq_id in deferred for seq in order):
            mine = [d for d in drafted if d[0].seq_id in deferred]
            theirs = logits  # with picks, the step's logits; else the drafted rows, of which these take theirs
            if picks is None and len(mine) < len(drafted):
                theirs = _take_rows(logits, [first + j for seq, first in mine for j in range(len(seq.draft) + 1)])
            walked = self._verify_deferred(mine, theirs, picks)
            drafted = [d for d in drafted if d[0].seq_id not in deferred]
        if drafted and picks is not None:  # every row's argmax is known, and each of these is unguided
            walked.update(self._verify_picked(drafted, picks))
            drafted = []
        if drafted:
            batch = draft_batch(drafted, masks)
            live = [d for d in batch.drafts if d is not None]
            rows = batch.logits_rows
            if rows != list(range(len(logits))):  # some sequence's rows end early (its grammar allows no more)
                logits = logits[torch.tensor(rows, dtype=torch.long)]
            results = iter(self.sampler.verify(logits, batch.rows, live, batch.bitmask, batch.masked_rows)
                           if live else [])
            for seq, draft in zip(batch.seqs, batch.drafts):
                walked[seq.seq_id] = (draft, next(results) if draft is not None else None)
        now = time.monotonic()
        for seq in order:  # in batch order
            touched[seq.request_id] = self._requests[seq.request_id]
            self._settle(seq, *walked[seq.seq_id], now)

    @staticmethod
    def _verify_picked(drafted: list[tuple[Sequence, int]], picks) -> dict[int, tuple[DraftRows, Verified]]:
        """Verify unguided plain greedy drafts on the native call's picks (``picks``: as :meth:`_verify_deferred`
        takes them) as :meth:`Sampler.verify` verifies a greedy row with no mask: each draft token is kept while it
        is its row's argmax, then the argmax after it is taken. Those picks come from the sampler's own greedy
        pass, so the tokens and their logprobs are the ones its verification would give."""
        (tokens, logprobs), first_rows = picks
        out = {}
        for seq, _ in drafted:
            draft = DraftRows(first_rows[seq.seq_id], seq.draft, True, [False] * len(seq.draft))
            out[seq.seq_id] = (draft, verified_on_picks(draft, tokens, logprobs))
        return out

    def _settle(self, seq: Sequence, draft: DraftRows | None, result: Verified | None, now: float) -> None:
        """Count the draft, emit the verified tokens, and give back what the rejected positions took: their
        blocks (their K/V, past ``num_computed_tokens``, is never read). ``draft`` None or without a ``final``
        row: the grammar allows no token after the tokens tested, and the sequence ends there with 'error'."""
        tested = draft.tokens if draft is not None else []
        accepted = result.num_accepted if result is not None else 0
        if seq.draft_by_self:  # a burst's tokens: each took a forward pass of its own, so none is a draft's gain
            self._counters["burst_tokens"] += len(tested)
            self._counters["burst_accepted"] += accepted
        else:
            forced = min(accepted, seq.num_draft_forced)
            seq.num_draft_tokens += len(tested)
            seq.num_accepted_tokens += accepted
            seq.num_forced_tokens += forced
            seq.spec.record(len(tested), min(len(tested), seq.num_draft_forced), accepted, seq.draft_by_model)
            for key, value in (("drafted", len(tested)), ("accepted", accepted), ("forced", forced)):
                self._counters[key] += value
            if seq.draft_by_model:
                self._counters["model_drafted"] += len(tested)
                self._counters["model_accepted"] += accepted
        seq.draft, seq.num_draft_forced, seq.draft_by_model, seq.draft_by_self = [], 0, False, False
        if result is not None and result.top_logprobs is None and result.token_ids and min(result.token_ids) >= 0:
            if self._emit_run(seq, result.token_ids, result.logprobs, now):  # one stop check for the run
                return
        else:
            for j, token in enumerate(result.token_ids if result is not None else ()):
                if token < 0:  # its logits left nothing finite to choose: it ends alone, the tokens before it kept
                    seq.stop_reason = NO_FINITE_LOGIT
                    self._finish(seq, "error")
                    return
                top = result.top_logprobs[j] if result.top_logprobs is not None else []
                if self._emit(seq, token, result.logprobs[j], top, now):
                    return
        seq.num_computed_tokens += accepted  # the accepted draft tokens' K/V, computed this step
        if draft is None or (not draft.final and accepted == len(tested)):
            # end as the plain path would at its next step, with the limit the guide reached there (if one did)
            seq.guide.fill_mask(np.zeros(self._mask_words, dtype=np.int32))
            seq.stop_reason = getattr(seq.guide, "error", None)
            self._finish(seq, "error")
            return
        self.block_manager.truncate(seq, seq.num_computed_tokens)  # what a run without drafts holds
        self.block_manager.cache_full_blocks(seq)

    def _split_beams(self, seqs: list[Sequence], logits: torch.Tensor):
        """((sampled sequences, their logits), (beams, their logits)), in batch order."""
        is_beam = [seq.is_beam for seq in seqs]
        if not any(is_beam):
            return (seqs, logits), ([], None)
        sampled = [i for i, b in enumerate(is_beam) if not b]
        beams = [i for i, b in enumerate(is_beam) if b]
        return (([seqs[i] for i in sampled], logits[sampled]), ([seqs[i] for i in beams], logits[beams]))

    def _fork_siblings(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[tuple[Sequence, Sequence]], torch.Tensor]:
        """(sequence, the sequence whose logits row it samples from) per row, and the logits row for row."""
        rows, index = [], []
        for i, seq in enumerate(seqs):
            rows.append((seq, seq))
            index.append(i)
            while seq.num_forks_pending:
                child = self._fork(seq)
                rows.append((child, seq))
                index.append(i)
        if len(index) == len(seqs):
            return rows, logits
        return rows, logits[torch.tensor(index)]

    def _fork(self, parent: Sequence) -> Sequence:
        request = self._requests[parent.request_id]
        index = len(request.seqs)
        seed = None if parent.params.seed is None else parent.params.seed + index  # siblings draw differently
        child = Sequence(parent.request_id, parent.prompt_token_ids, parent.params, index=index,
                         guide=parent.guide.copy() if parent.guide is not None else None, cache_salt=parent.cache_salt,
                         generator=make_generator(seed), arrival_time=parent.arrival_time,
                         detokenizer=IncrementalDetokenizer(self.vocabulary, parent.params.stop,
                                                            parent.params.skip_special_tokens))
        self.block_manager.fork(parent, child)
        child.status = parent.status
        self.scheduler.running.append(child)
        request.seqs.append(child)
        parent.num_forks_pending -= 1
        return child

    def _sampling_rows(self, rows) -> list[SamplingRow]:
        return [sampling_row(seq) for seq, _ in rows]

    def _bitmask(self, filled: dict[int, np.ndarray], rows) -> tuple[np.ndarray | None, list[int] | None]:
        """The sampler's bitmask and masked rows, as a numpy array and a list (no torch call: see Sampler)."""
        if not filled:
            return None, None
        masked = [i for i, (seq, source) in enumerate(rows) if source.seq_id in filled]
        bitmask = np.zeros((len(rows), self._mask_words), dtype=np.int32)
        for i in masked:
            bitmask[i] = filled[rows[i][1].seq_id]  # a fresh sibling's guide is a copy: same state, same mask
        return bitmask, masked

    def _drop_dead_ends(self, rows, logits: torch.Tensor, filled: dict[int, np.ndarray]):
        """Rows whose guide allows no token at all (a grammar that needs bytes no token spells) leave the batch:
        their sequences finish with reason 'error' instead of failing the whole step in the sampler."""
        stuck = [i for i, (_, source) in enumerate(rows)
                 if source.seq_id in filled and not np.count_nonzero(filled[source.seq_id])]
        if not stuck:
            return rows, logits, []
        dead = set(stuck)
        kept = [i for i in range(len(rows)) if i not in dead]
        return [rows[i] for i in kept], logits[kept], [rows[i][0] for i in stuck]

    def _process(self, rows, result: SampleResult, stuck: list[Sequence], touched: dict) -> None:
        now = time.monotonic()
        for seq in stuck:
            seq.stop_reason = getattr(seq.guide, "error", None)  # a limit the grammar reached, by name
            self._finish(seq, "error")
            touched[seq.request_id] = self._requests[seq.request_id]
        for i, (seq, _) in enumerate(rows):
            touched[seq.request_id] = self._requests[seq.request_id]
            if result.token_ids[i] < 0:  # its logits left nothing finite to choose: it ends alone
                seq.stop_reason = NO_FINITE_LOGIT
                self._finish(seq, "error")
                continue
            top = result.top_logprobs[i] if result.top_logprobs is not None else []
            self._emit(seq, result.token_ids[i], result.logprobs[i], top, now)

    def _emit(self, seq: Sequence, token: int, logprob: float, top: list, now: float) -> bool:
        """Append one output token and check whether it ends ``seq``; True when it did."""
        seq.append_token(token)
        self._counters["generated"] += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.cumulative_logprob += logprob
        if seq.logprobs is not None:
            seq.logprobs.append((logprob, top))
        reason = self._check_stop(seq, token)
        if reason is not None:
            self._finish(seq, reason)
        return reason is not None

    def _outputs(self, touched: dict) -> list[RequestOutput]:
        outputs = []
        for request in touched.values():
            finished = request.is_finished
            if finished:
                del self._requests[request.request_id]
            if finished or request.every_step:
                outputs.append(self._output(request))
        return outputs

    def _check_stop(self, seq: Sequence, token: int) -> str | None:
        """Set ``seq.stop_reason`` and return the finish reason when ``token`` ends the sequence."""
        params = seq.params
        if seq.guide is not None and not self._advance_guide(seq, token):
            seq.stop_reason = getattr(seq.guide, "error", None)
            return "error"
        if token in self.vocabulary.eos_token_ids and not params.ignore_eos:
            return "stop"
        if token in params.stop_token_ids:
            seq.stop_reason = token
            return "stop"
        stop = seq.detokenizer.add_token(token)
        if stop is not None:
            seq.stop_reason = stop
            return "stop"
        if seq.guide is not None and seq.guide.is_finished():
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _advance_guide(seq: Sequence, token: int) -> bool:
        """``seq.guide.advance(token)`` for the token just appended, by the step of the probe that took it where
        this step walked one there (``seq.ahead``)."""
        ahead = seq.ahead
        if ahead is not None:
            k = len(seq.token_ids) - 1 - ahead[0]
            if 0 <= k < len(ahead[1]) and ahead[1][k][0] == token:
                if k == len(ahead[1]) - 1:
                    seq.ahead = None  # the last: the probes may go
                _, probe, index = ahead[1][k]
                return seq.guide.advance_as(token, probe, index)
            seq.ahead = None
        return seq.guide.advance(token)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.finished_time = time.monotonic()
        if seq.detokenizer is not None:  # beams have none: their text is built once, per hypothesis
            seq.detokenizer.finish()
        self.scheduler.finish(seq)
        if self.model_drafter is not None:
            self.model_drafter.finished(seq.seq_id)

    # -- beam search ----------------------------------------------------------------------------------------
    def _advance_beams(self, beams: list[Sequence], logits: torch.Tensor | None,
                       masks: dict[int, np.ndarray]) -> list[RequestOutput]:
        """Hand each beam its full raw logprob row, masked by its own guide; step every group that now has all
        its rows; return the outputs of the groups that finished."""
        if not beams:
            return []
        logprobs = torch.log_softmax(logits[:, : self.vocabulary.size].float(), dim=-1)
        masked = [i for i, seq in enumerate(beams) if seq.seq_id in masks]
        if masked:
            bitmask = np.zeros((len(beams), self._mask_words), dtype=np.int32)
            for i in masked:
                bitmask[i] = masks[beams[i].seq_id]
            apply_token_bitmask_(logprobs, torch.from_numpy(bitmask), torch.tensor(masked))
        # a NaN or +inf in a beam's logits makes its row NaN: no extension comes from it (a dead end's row, all
        # -inf, is the same), where a NaN taken for a score would extend it by a token the mask refused
        logprobs.masked_fill_(torch.isnan(logprobs), float("-inf"))
        requests = {}
        for seq, row in zip(beams, logprobs):
            request = self._requests[seq.request_id]
            request.beam_group.add_row(seq, row)
            requests[request.request_id] = request
        self._counters["generated"] += len(beams)
        outputs, now = [], time.monotonic()
        for request in requests.values():
            group = request.beam_group
            if not group.is_ready:
                continue
            request.seqs[0].first_token_time = request.seqs[0].first_token_time or now
            self._apply_extensions(group, group.decide())
            if group.is_done:
                outputs.append(self._finish_beam_request(request))
        return outputs

    def _apply_extensions(self, group: BeamGroup, extensions: list[Extension]) -> None:
        """The next live beams: a beam's first extension continues it, each further one forks it (all forks
        before any token is appended, so a fork copies its parent as it was); beams left without one are freed."""
        parents, continued, beams = group.beams, set(), []
        group.beams[0].num_forks_pending = 0  # the root's reservation is spent at the first fork
        for ext in extensions:
            parent = parents[ext.beam]
            beams.append(parent if ext.beam not in continued else self._fork_beam(parent))
            continued.add(ext.beam)
        for beam, ext in zip(beams, extensions):
            beam.append_token(ext.token_id)
            beam.cumulative_logprob, beam.guide = ext.cumulative_logprob, ext.guide
        for i, parent in enumerate(parents):
            if i not in continued:
                self._finish(parent, "stop")
        group.beams = beams

    def _fork_beam(self, parent: Sequence) -> Sequence:
        group = self._requests[parent.request_id].beam_group
        group.num_forks += 1
        child = parent.fork(index=group.num_forks)
        self.block_manager.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        self.scheduler.running.append(child)
        return child

    def _finish_beam_request(self, request: _Request) -> RequestOutput:
        group = request.beam_group
        for beam in group.beams:
            self._finish(beam, "length")
        del self._requests[request.request_id]
        root = request.seqs[0]
        metrics = RequestMetrics(root.arrival_time, root.first_token_time, time.monotonic())
        return RequestOutput(request.request_id, request.prompt_token_ids, group.completions(self.vocabulary), True,
                             root.num_cached_tokens, metrics)

    def _output(self, request: _Request) -> RequestOutput:
        completion = _delta if request.delta else _completion
        if len(request.seqs) == 1 and request.beam_group is None:  # the usual request: no sort, no scan
            s = request.seqs[0]
            finished = s.is_finished and not s.num_forks_pending  # request.is_finished, for one sequence
            metrics = RequestMetrics(s.arrival_time, s.first_token_time, s.finished_time if finished else None)
            return RequestOutput(request.request_id, request.prompt_token_ids, [completion(s)], finished,
                                 s.num_cached_tokens, metrics, request.delta)
        seqs = sorted(request.seqs, key=lambda s: s.index)
        outputs = [completion(s) for s in seqs]
        first = min((s.first_token_time for s in seqs if s.first_token_time is not None), default=None)
        done = [s.finished_time for s in seqs if s.finished_time is not None]
        metrics = RequestMetrics(seqs[0].arrival_time, first, max(done) if request.is_finished and done else None)
        return RequestOutput(request.request_id, request.prompt_token_ids, outputs, request.is_finished,
                             seqs[0].num_cached_tokens, metrics, request.delta)

    # -- conveniences ---------------------------------------------------------------------------------------
    def stream(self) -> Iterator[RequestOutput]:
        """Step until every queued request has finished, yielding each output as it is produced."""
        while self.has_unfinished_requests():
            yield from self.step()

    def generate(self, prompts: list[str | list[int]],
                 params: SamplingParams | BeamSearchParams | Seq[SamplingParams | BeamSearchParams],
                 guides: Seq[Guide | None] | None = None) -> list[RequestOutput]:
        """Run ``prompts`` to completion together (sampled or beam-searched); the final outputs in prompt order
        (the engine builds no output before a request finishes)."""
        single = isinstance(params, (SamplingParams, BeamSearchParams))
        params_list = [params] * len(prompts) if single else list(params)
        guides = list(guides) if guides is not None else [None] * len(prompts)
        assert len(params_list) == len(prompts) == len(guides), "one params and guide per prompt"
        ids = []
        for prompt, p, guide in zip(prompts, params_list, guides):
            request_id = f"generate-{next(self._auto_ids)}"
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            if isinstance(p, SamplingParams):
                p = dataclasses.replace(p, output_kind="final")
            self.add_request(request_id, token_ids, p, guide=guide)
            ids.append(request_id)
        final = {output.request_id: output for output in self.stream() if output.finished}
        return [final[request_id] for request_id in ids]

    def stats(self) -> EngineStats:
        bm, sched, counters = self.block_manager, self.scheduler, self._counters
        return EngineStats(len(sched.running), len(sched.waiting), bm.num_used_blocks, bm.num_blocks,
                           bm.num_cached_free_blocks, bm.num_queried_tokens, bm.num_hit_tokens, sched.num_preemptions,
                           counters["steps"], counters["generated"], counters["computed"], counters["drafted"],
                           counters["accepted"], counters["forced"], counters["model_drafted"],
                           counters["model_accepted"],
                           self.model_drafter.num_forwards if self.model_drafter is not None else 0,
                           counters["burst_steps"], counters["burst_tokens"], counters["burst_accepted"])

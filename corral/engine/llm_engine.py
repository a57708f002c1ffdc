"""LLMEngine: requests in, tokens out, one ``step()`` at a time (vLLM's shape).

A step is: schedule → fill the grammar masks (on a worker thread, while the model runs) → forward → sample →
advance guides, detokenize, check stops → finish. ``n > 1`` runs the prompt once: when it is computed the
siblings are forked from it, sharing its KV blocks, each with its own ``guide.copy()`` and generator.
"""

import itertools
import logging
import time
from collections.abc import Iterator, Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from corral.engine.block_manager import BlockManager
from corral.engine.config import EngineConfig
from corral.engine.detokenizer import IncrementalDetokenizer
from corral.engine.model_runner import ModelRunner
from corral.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from corral.engine.sampler import Sampler, SampleResult, SamplingRow, make_generator
from corral.engine.sampling_params import SamplingParams
from corral.engine.scheduler import ScheduledBatch, Scheduler
from corral.engine.sequence import Sequence
from corral.errors import InvalidRequestError, PromptTooLongError
from corral.fsm.guide import Guide
from corral.fsm.vocabulary import Vocabulary
from corral.models import load_model_config, load_tokenizer, resolve_model

log = logging.getLogger(__name__)


class _Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], seqs: list[Sequence]):
        self.request_id, self.prompt_token_ids, self.seqs = request_id, prompt_token_ids, seqs

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished and not seq.num_forks_pending for seq in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        files = resolve_model(config.model)
        self.model_config = load_model_config(files)
        self.tokenizer = load_tokenizer(files)
        self.vocabulary = Vocabulary.from_tokenizer(self.tokenizer)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position, self.model_config.max_position)
        self.runner = ModelRunner(config, self.model_config, files)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler(vocab_size=self.vocabulary.size, eos_token_ids=self.vocabulary.eos_token_ids)
        self._mask_words = -(-self.vocabulary.size // 32)
        self._mask_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="corral-masks")
        self._requests: dict[str, _Request] = {}
        self._counters = {"steps": 0, "generated": 0, "computed": 0}
        self._auto_ids = itertools.count()

    # -- requests -------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    guide: Guide | None = None, cache_salt: str | None = None) -> None:
        """Queue a request. Raises PromptTooLongError when it can never fit, InvalidRequestError for bad input."""
        self._check_request(request_id, prompt_token_ids, params)
        seq = Sequence(request_id, list(prompt_token_ids), params, guide=guide, cache_salt=cache_salt,
                       generator=make_generator(params.seed), arrival_time=time.monotonic(),
                       detokenizer=IncrementalDetokenizer(self.vocabulary, params.stop, params.skip_special_tokens))
        seq.num_forks_pending = params.n - 1
        self._requests[request_id] = _Request(request_id, list(prompt_token_ids), [seq])
        self.scheduler.add(seq)

    def _check_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running", param="request_id")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary", param="prompt")
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}", param="n")
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {len(prompt_token_ids)} tokens; the model's context is "
                                     f"{self.max_model_len}, which leaves no room for output", param="prompt")
        longest = min(len(prompt_token_ids) + params.max_tokens, self.max_model_len)
        capacity = self.runner.num_blocks * self.config.block_size
        if self.block_manager.num_blocks_for(longest) > self.runner.num_blocks:
            raise PromptTooLongError(f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                                     f"exceeds the KV cache's {capacity} tokens", param="max_tokens")

    def abort(self, request_id: str) -> None:
        """Finish every sequence of the request at once and free all its blocks. Unknown ids are ignored."""
        request = self._requests.pop(request_id, None)
        for seq in request.seqs if request else ():
            if not seq.is_finished:
                self._finish(seq, "abort")
            seq.num_forks_pending = 0

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # -- the loop -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Advance every scheduled sequence once; return the outputs of the requests that advanced."""
        batch = self.scheduler.schedule()                                   # who advances, by how many tokens
        if not batch:
            return []
        self.runner.copy_blocks(self.block_manager.take_pending_copies())   # copy-on-write of forked blocks
        masks = self._mask_worker.submit(self._fill_masks, self._sampling_seqs(batch))  # overlaps the forward
        seqs, logits = self.runner.execute(batch)                           # forward
        self._commit(batch)                                                 # their K/V is in the cache now
        rows, row_logits = self._fork_siblings(seqs, logits)                # n > 1: siblings share the row
        result = self.sampler(row_logits, self._sampling_rows(rows), *self._bitmask(masks, seqs, rows))
        return self._process(rows, result)                                  # advance guides, stop, finish

    def _sampling_seqs(self, batch: ScheduledBatch) -> list[Sequence]:
        return [s for s, n in zip(batch.seqs, batch.num_new_tokens) if s.num_computed_tokens + n == len(s)]

    def _fill_masks(self, seqs: list[Sequence]) -> dict[int, np.ndarray]:
        masks = {}
        for seq in seqs:
            if seq.guide is not None:
                row = np.zeros(self._mask_words, dtype=np.int32)
                seq.guide.fill_mask(row)
                masks[seq.seq_id] = row
        return masks

    def _commit(self, batch: ScheduledBatch) -> None:
        for seq, count in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += count
            self.block_manager.cache_full_blocks(seq)
        self._counters["steps"] += 1
        self._counters["computed"] += batch.num_tokens

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
        return [SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.generator) for seq, _ in rows]

    def _bitmask(self, masks: Future, seqs: list[Sequence], rows) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        filled = masks.result()
        if not filled:
            return None, None
        masked = [i for i, (seq, source) in enumerate(rows) if source.seq_id in filled]
        bitmask = np.zeros((len(rows), self._mask_words), dtype=np.int32)
        for i in masked:
            bitmask[i] = filled[rows[i][1].seq_id]  # a fresh sibling's guide is a copy: same state, same mask
        return torch.from_numpy(bitmask), torch.tensor(masked, dtype=torch.long)

    def _process(self, rows, result: SampleResult) -> list[RequestOutput]:
        now, touched = time.monotonic(), {}
        for i, (seq, _) in enumerate(rows):
            token = result.token_ids[i]
            seq.append_token(token)
            self._counters["generated"] += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.cumulative_logprob += result.logprobs[i]
            if seq.logprobs is not None:
                top = result.top_logprobs[i] if result.top_logprobs is not None else []
                seq.logprobs.append((result.logprobs[i], top))
            reason = self._check_stop(seq, token)
            if reason is not None:
                self._finish(seq, reason)
            touched[seq.request_id] = self._requests[seq.request_id]
        outputs = [self._output(request) for request in touched.values()]
        for request in touched.values():
            if request.is_finished:
                del self._requests[request.request_id]
        return outputs

    def _check_stop(self, seq: Sequence, token: int) -> str | None:
        """Set ``seq.stop_reason`` and return the finish reason when ``token`` ends the sequence."""
        params = seq.params
        if seq.guide is not None and not seq.guide.advance(token):
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

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.finished_time = time.monotonic()
        seq.detokenizer.finish()
        self.scheduler.finish(seq)

    def _output(self, request: _Request) -> RequestOutput:
        seqs = sorted(request.seqs, key=lambda s: s.index)
        outputs = [CompletionOutput(s.index, s.output_token_ids, s.detokenizer.visible_text(s.is_finished),
                                    s.finish_reason, s.stop_reason,
                                    list(s.logprobs) if s.logprobs is not None else None, s.cumulative_logprob)
                   for s in seqs]
        first = min((s.first_token_time for s in seqs if s.first_token_time is not None), default=None)
        done = [s.finished_time for s in seqs if s.finished_time is not None]
        metrics = RequestMetrics(seqs[0].arrival_time, first, max(done) if request.is_finished and done else None)
        return RequestOutput(request.request_id, request.prompt_token_ids, outputs, request.is_finished,
                             seqs[0].num_cached_tokens, metrics)

    # -- conveniences ---------------------------------------------------------------------------------------
    def stream(self) -> Iterator[RequestOutput]:
        """Step until every queued request has finished, yielding each output as it is produced."""
        while self.has_unfinished_requests():
            yield from self.step()

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | Seq[SamplingParams],
                 guides: Seq[Guide | None] | None = None) -> list[RequestOutput]:
        """Run ``prompts`` to completion together; the final outputs in prompt order."""
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        guides = list(guides) if guides is not None else [None] * len(prompts)
        assert len(params_list) == len(prompts) == len(guides), "one SamplingParams and guide per prompt"
        ids = []
        for prompt, p, guide in zip(prompts, params_list, guides):
            request_id = f"generate-{next(self._auto_ids)}"
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self.add_request(request_id, token_ids, p, guide=guide)
            ids.append(request_id)
        final = {output.request_id: output for output in self.stream() if output.finished}
        return [final[request_id] for request_id in ids]

    def stats(self) -> EngineStats:
        bm, sched, counters = self.block_manager, self.scheduler, self._counters
        return EngineStats(len(sched.running), len(sched.waiting), bm.num_used_blocks, bm.num_blocks,
                           bm.num_cached_free_blocks, bm.num_queried_tokens, bm.num_hit_tokens, sched.num_preemptions,
                           counters["steps"], counters["generated"], counters["computed"])

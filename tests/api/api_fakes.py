"""A scripted stand-in for ``LLMEngine``: same interface, no model. Each request emits the tokens of a text chosen
by ``script(prompt_token_ids, params)``, one token per step, as cumulative outputs (the finished one alone when
the params ask for ``final``). With a guide, a scripted token the guide refuses is replaced by the lowest allowed
one, and the output ends ('stop') once the script is spent and the guide accepts, so every output is in the
constraint's language, as with the real engine."""

from dataclasses import dataclass, field

import numpy as np
import torch

from corral.engine.outputs import CompletionOutput, RequestMetrics
from corral.engine.sampler import Sampler, SamplingRow, make_generator
from corral.engine.sampling_params import BeamSearchParams, SamplingParams


FakeCompletionOutput = CompletionOutput  # the engine's own: plain data


@dataclass
class FakeRequestOutput:
    request_id: str
    prompt_token_ids: list
    outputs: list
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))  # no first-token time: as sent
    delta: bool = False


@dataclass
class FakeStats:
    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_used: int = 0
    num_kv_blocks_total: int = 100
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


@dataclass
class _Seq:
    index: int
    target: list
    guide: object
    emitted: list = field(default_factory=list)
    finish: str | None = None
    sent_tokens: int = 0  # what "delta" outputs have handed out
    sent_chars: int = 0


class FakeEngine:
    def __init__(self, tokenizer, script, *, vocabulary=None, max_model_len: int = 2048, blocks_per_request: int = 3,
                 sample: bool = False):
        """``sample``: choose each token with the real Sampler over random logits (the request's own params,
        seed, penalties, bias and the guide's mask) instead of following the script."""
        self.tokenizer, self.script, self.max_model_len = tokenizer, script, max_model_len
        self.vocabulary = vocabulary
        self.sampler = Sampler(tokenizer.vocab_size, tokenizer.eos_token_ids) if sample else None
        self.blocks_per_request = blocks_per_request
        self.requests: dict[str, tuple] = {}
        self.aborted: list[str] = []
        self.added: list[tuple] = []

    def add_request(self, request_id, prompt_token_ids, params, guide=None, cache_salt=None):
        self.added.append((request_id, list(prompt_token_ids), params, guide))
        if isinstance(params, BeamSearchParams):  # no model to search: the beams are width greedy outputs
            params = SamplingParams(n=params.beam_width, temperature=0, max_tokens=params.max_tokens)
        texts = self.script(list(prompt_token_ids), params)
        texts = texts if isinstance(texts, list) else [texts] * params.n
        seqs = [_Seq(i, self.tokenizer.encode(t), None if guide is None else (guide if i == 0 else guide.copy()))
                for i, t in enumerate(texts)]
        for s in seqs:
            s.generator = make_generator(params.seed)
        self.requests[request_id] = (list(prompt_token_ids), params, seqs)

    def abort(self, request_id):
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def stats(self):
        return FakeStats(num_running=len(self.requests), num_kv_blocks_used=self.blocks_per_request * len(self.requests))

    def step(self):
        outs = []
        for request_id, (prompt, params, seqs) in list(self.requests.items()):
            live = [s for s in seqs if s.finish is None]
            if self.sampler is not None:
                for s in live:
                    if s.guide is not None and s.guide.is_finished():  # as the engine does: only EOS can follow
                        s.finish = "stop"
                live = [s for s in live if s.finish is None]
                drawn = self._sampled(live, params, prompt) if live else []
            for i, s in enumerate(live):
                if s.finish is None:  # a guide with no allowed token has already ended its sequence
                    self._advance(s, params, drawn[i] if self.sampler is not None else None)
            delta = params.output_kind == "delta"
            completions = [self._completion(s, params, delta) for s in seqs]
            finished = all(s.finish is not None for s in seqs)
            if finished or params.output_kind != "final":  # as the engine does
                outs.append(FakeRequestOutput(request_id, prompt, completions, finished, delta=delta))
            if finished:
                del self.requests[request_id]
        return outs

    def _completion(self, s, params, delta: bool):
        """All ``s`` has emitted, or (delta) what is new since its previous output, as the engine hands them."""
        text, start = self.tokenizer.decode(s.emitted), s.sent_tokens if delta else 0
        tokens, shown = s.emitted[start:], text[s.sent_chars if delta else 0:]
        if delta:
            s.sent_tokens, s.sent_chars = len(s.emitted), len(text)
        return FakeCompletionOutput(
            s.index, list(tokens), shown, s.finish,
            logprobs=[(-0.5, [(t, -0.5)]) for t in tokens] if params.logprobs is not None else None,
            cumulative_logprob=-0.5 * len(s.emitted) - s.index, num_tokens=len(s.emitted) if delta else None)

    def _sampled(self, seqs, params, prompt) -> list[int | None]:
        """One real Sampler call over random logits for the request's live sequences (None: EOS)."""
        words = (self.tokenizer.vocab_size + 31) // 32
        logits = torch.randn(len(seqs), self.tokenizer.vocab_size)
        bitmask = torch.full((len(seqs), words), -1, dtype=torch.int32)
        for i, s in enumerate(seqs):
            if s.guide is not None:
                s.guide.fill_mask(bitmask[i].numpy())
        for i, s in enumerate(seqs):
            if s.guide is not None and not bitmask[i].any():  # as the engine does: no token fits, an error
                s.finish = "error"
        keep = [i for i, s in enumerate(seqs) if s.finish is None]
        rows = [SamplingRow(params, prompt, seqs[i].emitted, seqs[i].generator) for i in keep]
        tokens = self.sampler(logits[keep], rows, bitmask[keep]).token_ids if keep else []
        eos = set(self.tokenizer.eos_token_ids) if not params.ignore_eos else set()
        drawn = [None] * len(seqs)
        for i, token in zip(keep, tokens):
            drawn[i] = None if token in eos else token
        return drawn

    def _advance(self, s, params, drawn):
        if self.sampler is not None:
            token = drawn
            if token is not None and s.guide is not None and not s.guide.advance(token):
                s.finish = "error"
                return
        else:
            token = s.target[len(s.emitted)] if len(s.emitted) < len(s.target) else None
        if s.guide is not None and self.sampler is None:
            row = np.zeros((self.tokenizer.vocab_size + 31) // 32, dtype=np.int32)
            s.guide.fill_mask(row)
            bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:self.tokenizer.vocab_size]
            allowed = [t for t in np.flatnonzero(bits).tolist() if t not in self.tokenizer.eos_token_ids]
            if (token is None and s.guide.is_accepting()) or not allowed:
                s.finish = "stop"
                return
            if token not in allowed:
                token = allowed[0]
            assert s.guide.advance(token)
        if token is None:
            s.finish = "stop"
            return
        s.emitted.append(token)
        if s.guide is not None and s.guide.is_finished():
            s.finish = "stop"
        elif len(s.emitted) >= params.max_tokens:
            s.finish = "length"


class FakeCompiled:
    def __init__(self, guide_factory):
        self.new_guide = guide_factory
        self.warnings = ()


class FakeCompiler:
    """Records what it was asked to compile; guides are None-like (accept everything)."""

    def __init__(self):
        self.compiled = []

    def new_budget(self):
        from corral.budget import Budget

        return Budget()

    def lookup(self, constraint):
        return None

    def compile(self, constraint, budget=None):
        self.compiled.append(constraint)
        return FakeCompiled(lambda: None)

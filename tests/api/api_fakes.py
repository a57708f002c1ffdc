"""A scripted stand-in for ``LLMEngine``: same interface, no model. Each request emits the tokens of a text chosen
by ``script(prompt_token_ids)``, one token per step, as cumulative outputs; a guide, when given, must accept
every token (the fake checks that the script respects the constraint) or the choice ends with 'error'."""

from dataclasses import dataclass, field

import numpy as np


@dataclass
class FakeCompletionOutput:
    index: int
    token_ids: list
    text: str
    finish_reason: str | None = None
    stop_reason: object = None
    logprobs: list | None = None
    cumulative_logprob: float = 0.0


@dataclass
class FakeRequestOutput:
    request_id: str
    prompt_token_ids: list
    outputs: list
    finished: bool
    num_cached_tokens: int = 0
    metrics: object = None


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


class FakeEngine:
    def __init__(self, tokenizer, script, *, max_model_len: int = 2048, blocks_per_request: int = 3):
        self.tokenizer, self.script, self.max_model_len = tokenizer, script, max_model_len
        self.blocks_per_request = blocks_per_request
        self.requests: dict[str, tuple] = {}
        self.aborted: list[str] = []
        self.added: list[tuple] = []

    def add_request(self, request_id, prompt_token_ids, params, guide=None, cache_salt=None):
        self.added.append((request_id, list(prompt_token_ids), params, guide))
        texts = self.script(list(prompt_token_ids), params)
        texts = texts if isinstance(texts, list) else [texts] * params.n
        seqs = [_Seq(i, self.tokenizer.encode(t)[:params.max_tokens],
                     None if guide is None else (guide if i == 0 else guide.copy())) for i, t in enumerate(texts)]
        for s, t in zip(seqs, texts):
            s.full = len(self.tokenizer.encode(t)) <= params.max_tokens
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
            for s in seqs:
                if s.finish is None:
                    self._advance(s)
            completions = [FakeCompletionOutput(s.index, list(s.emitted), self.tokenizer.decode(s.emitted), s.finish,
                                                logprobs=[-0.5] * len(s.emitted) if params.logprobs is not None else None,
                                                cumulative_logprob=-0.5 * len(s.emitted) - s.index)
                           for s in seqs]
            finished = all(s.finish is not None for s in seqs)
            outs.append(FakeRequestOutput(request_id, prompt, completions, finished))
            if finished:
                del self.requests[request_id]
        return outs

    def _advance(self, s):
        token = s.target[len(s.emitted)]
        if s.guide is not None:
            row = np.zeros((self.tokenizer.vocab_size + 31) // 32, dtype=np.int32)
            s.guide.fill_mask(row)
            if not s.guide.advance(token):
                s.finish = "error"
                return
        s.emitted.append(token)
        if len(s.emitted) == len(s.target):
            s.finish = "stop" if s.full else "length"


class FakeCompiled:
    def __init__(self, guide_factory):
        self.new_guide = guide_factory


class FakeCompiler:
    """Records what it was asked to compile; guides are None-like (accept everything)."""

    def __init__(self):
        self.compiled = []

    def compile(self, constraint):
        self.compiled.append(constraint)
        return FakeCompiled(lambda: None)

    def compile_node(self, node):
        self.compiled.append(node)
        return FakeCompiled(lambda: None)

"""What the engine hands back: per-sequence completions, per-request outputs, and engine statistics."""

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort' | 'error'
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list | None = None  # per token: (logprob, [(token id, logprob), ...] most likely first)
    cumulative_logprob: float = 0.0
    num_draft_tokens: int = 0  # tokens drafted (jump-forward and prompt lookup) and checked by the model
    num_accepted_tokens: int = 0  # of those, kept: output tokens that took no forward pass of their own
    num_forced_tokens: int = 0  # of those kept, jump-forward tokens
    # every token produced so far, where token_ids holds only the new ones (a "delta" output); None: len(token_ids)
    num_tokens: int | None = None

    @property
    def num_forward_passes(self) -> int:
        """Forward passes that produced the sequence so far: one per token, less the accepted draft tokens."""
        return (len(self.token_ids) if self.num_tokens is None else self.num_tokens) - self.num_accepted_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    delta: bool = False  # each completion holds only what is new since this request's previous output


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_kv_blocks_cached_free: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found
    num_preemptions: int
    num_steps: int
    num_generated_tokens: int
    num_tokens_computed: int  # every token the model ran: prefill chunks, recomputes, decodes and drafts
    num_draft_tokens: int = 0  # draft tokens checked by the model
    num_accepted_tokens: int = 0  # of those, kept
    num_forced_tokens: int = 0  # of those kept, jump-forward tokens
    num_model_draft_tokens: int = 0  # draft tokens that came from a draft model (corral/engine/draft_model.py)
    num_model_accepted_tokens: int = 0  # of those, kept
    num_draft_model_forwards: int = 0  # the draft model's forward passes
    num_burst_steps: int = 0  # steps that decoded several tokens per sequence in one native call (decode_burst)
    num_burst_tokens: int = 0  # the tokens those steps decoded past each sequence's first, verified as drafts
    num_burst_accepted_tokens: int = 0  # of those, kept (the rest came after a stop, or after a tie or NaN)

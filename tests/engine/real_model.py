"""Helpers for the engine tests that run the real model (fp32, the shipped SmolLM2 GGUF)."""

import torch

from corral.engine import EngineConfig, LLMEngine, SamplingParams
from corral.engine.attention import AttentionMetadata, KVCache, PrefillSpan

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors, one per line.",
    "Explain gravity to a child in two sentences.",
    "Translate 'good morning' into Spanish and German.",
    "Write a Python function that returns the square of a number.",
    "What is 17 times 23? Show your work.",
    "Give me a JSON object with keys name and age for a fictional person.",
]


def chat(engine: LLMEngine, question: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


def top_two_gap(engine: LLMEngine, token_ids: list[int]) -> float:
    """The gap between the two largest next-token logits after ``token_ids`` (a logprob gap is the logit gap)."""
    out = engine.generate([token_ids], greedy(1, logprobs=2))[0].outputs[0]
    (_, first), (_, second) = out.logprobs[0][1][:2]
    return first - second


def assert_same_or_near_tie(engine: LLMEngine, prompt: list[int], expected: list[int], got: list[int],
                            tie: float = 1e-4) -> bool:
    """Token-identical, or the first difference is a near-tie (top two logits within ``tie``) shown here.
    Returns True when the outputs are identical."""
    if expected == got:
        return True
    k = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    assert k < min(len(expected), len(got)), f"one output is a prefix of the other: {expected} vs {got}"
    gap = top_two_gap(engine, prompt + expected[:k])
    assert gap < tie, f"outputs differ at token {k} ({expected[k]} vs {got[k]}) where the top-two gap is {gap:.3g}"
    return False




def prefill_logits(model, token_ids: list[int]) -> torch.Tensor:
    """float32 logits at every prompt position from ``model`` (a LlamaModel), one prefill into a scratch cache."""
    cfg, n = model.config, len(token_ids)
    caches = [KVCache.allocate(-(-n // 16), 16, cfg.num_kv_heads, cfg.head_dim, model.dtype)
              for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(torch.arange(n), (), (PrefillSpan(0, n, None, n),))
    with torch.inference_mode():
        return model.compute_logits(model.forward(torch.tensor(token_ids), torch.arange(n), meta, caches))

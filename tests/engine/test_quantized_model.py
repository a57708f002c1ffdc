"""The shipped model run as shipped (W4A16 from its Q4_1 blocks) against the dequantized forward of the same
weights, with the same bfloat16 rounding of scale and zero.

Tolerance, and why: in bfloat16 every linear's output is rounded to 8 significant bits, so any change in the
order of a float32 sum flips some roundings, and 30 layers carry the flips to the logits. The test measures that
noise floor instead of guessing it: the same reference linears computed in float32 (one valid summation order)
against float64. The int4 kernel must sit within twice that floor of the float64 reference, mean and max, and
agree with it on the top token almost everywhere.
"""

import pytest
import torch

from corral.engine.attention import AttentionMetadata, KVCache, PrefillSpan
from corral.engine.model import LlamaModel
from corral.engine.weights import load_weights
from corral.models import load_model_config, load_tokenizer, resolve_model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           '{"name": "Alice", "age":', "List three colors:", "SELECT * FROM users WHERE"]


class Reference:
    """``x @ W.T`` over explicitly dequantized weights, in a chosen accumulation dtype, rounded to x's dtype."""

    def __init__(self, weight: torch.Tensor, accumulate: torch.dtype):
        self.weight, self.accumulate = weight.to(accumulate), accumulate

    def __call__(self, x):
        return (x.to(self.accumulate) @ self.weight.T).to(x.dtype)


@pytest.fixture(scope="module")
def shipped():
    files = resolve_model(None)
    config = load_model_config(files)
    return config, load_tokenizer(files), load_weights(files, config, torch.float32, keep_q4=True)


def reference_model(config, weights, accumulate):
    model = LlamaModel(config, weights, torch.bfloat16, "gguf")
    deq = lambda *names: torch.cat([weights[n].dequantize(torch.bfloat16) for n in names])  # noqa: E731
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        layer["qkv"] = Reference(deq(*(p + f"self_attn.{x}_proj.weight" for x in "qkv")), accumulate)
        layer["o"] = Reference(deq(p + "self_attn.o_proj.weight"), accumulate)
        layer["gate_up"] = Reference(deq(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), accumulate)
        layer["down"] = Reference(deq(p + "mlp.down_proj.weight"), accumulate)
    head = model.lm_head
    model.lm_head = Reference(head.codes.float() * head.scale.float()[:, None], accumulate)
    return model


def logits(model, config, ids):
    n = len(ids)
    caches = [KVCache.allocate(-(-n // 16), 16, config.num_kv_heads, config.head_dim, torch.bfloat16)
              for _ in range(config.num_layers)]
    meta = AttentionMetadata(torch.arange(n), (), (PrefillSpan(0, n, None, n),))
    with torch.inference_mode():
        return model.compute_logits(model.forward(torch.tensor(ids), torch.arange(n), meta, caches))


def test_w4a16_forward_is_the_dequantized_forward_within_float_rounding(shipped):
    config, tokenizer, weights = shipped
    kernel = LlamaModel(config, weights, torch.bfloat16, "gguf")
    assert {layer["qkv"].kind for layer in kernel.layers} == {"w4a16"}
    exact, float32 = reference_model(config, weights, torch.float64), reference_model(config, weights, torch.float32)
    diffs, floors, agree, total = [], [], 0, 0
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        got, ref, floor = logits(kernel, config, ids), logits(exact, config, ids), logits(float32, config, ids)
        diffs.append((got - ref).abs())
        floors.append((floor - ref).abs())
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ids)
    diff, floor = torch.cat(diffs), torch.cat(floors)
    assert float(diff.mean()) <= 2 * float(floor.mean()), (float(diff.mean()), float(floor.mean()))
    assert float(diff.max()) <= 2 * float(floor.max()), (float(diff.max()), float(floor.max()))
    assert agree >= 0.95 * total, (agree, total)


def test_a_float32_model_runs_its_int4_linears_in_bfloat16(shipped):
    """What auto picks on a CPU without fast bf16: float32 activations and residuals, the int4 kernels fed bf16."""
    config, tokenizer, weights = shipped
    mixed = LlamaModel(config, weights, torch.float32, "gguf")
    assert {layer["gate_up"].kind for layer in mixed.layers} == {"w4a16"} and mixed.embed.kind == "w8a16"
    exact = reference_model(config, weights, torch.float64)
    ids = tokenizer.encode(PROMPTS[0])
    got, ref = logits(mixed, config, ids), logits(exact, config, ids)
    assert got.dtype == torch.float32
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.8

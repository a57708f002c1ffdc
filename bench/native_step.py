"""The native decode step against the torch path of the same numerics (W4A8, float32 activations, bf16 KV), on
the real model: the logits of every step over 16 prompts decoded together, and the greedy outputs of 50 prompts
(in batches of 16, so decode batches of many sizes and context lengths).

Both engines run the same requests in the same order, so they take the same steps; each step's logits are
recorded (``compute_logits``) and compared. The native step runs the torch path's kernels in its order, so the
claim is equality, and the tolerance printed is the largest difference seen.

    .venv/bin/python bench/native_step.py --check
"""

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from corral.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from servers import cpu_summary  # noqa: E402

TOPICS = ["the sea", "a dragon", "tax law", "the moon", "bread", "a violin", "winter", "chess", "a lighthouse",
          "volcanoes", "the Roman empire", "bees", "a train journey", "origami", "jazz", "deserts", "glaciers"]


def prompts(engine: LLMEngine, count: int) -> list[list[int]]:
    out = []
    for i in range(count):
        topic = TOPICS[i % len(TOPICS)]
        ask = ["Write two sentences about", "List facts about", "Explain to a child:", "Give a title for a story "
               "about"][i % 4]
        messages = [{"role": "user", "content": f"{ask} {topic} ({i})."}]
        out.append(engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages)))
    return out


def recorded(engine: LLMEngine) -> list[torch.Tensor]:
    steps: list[torch.Tensor] = []
    model = engine.runner.model
    inner = model.compute_logits

    def compute_logits(hidden):
        logits = inner(hidden)
        steps.append(logits.clone())
        return logits
    model.compute_logits = compute_logits
    return steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 unless every logit and token is equal")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(2)
    print(f"# {cpu_summary()}; torch {torch.__version__}")
    engines = {step: LLMEngine(EngineConfig(quantization="w4a8", dtype="auto", kv_cache_dtype="auto",
                                            decode_step=step, num_kv_blocks=2048, enable_prefix_caching=False))
               for step in ("native", "torch")}
    print({step: (e.formats.tag, e.runner.decode_path) for step, e in engines.items()})
    logs = {step: recorded(e) for step, e in engines.items()}
    sixteen = prompts(engines["native"], 16)
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for e in engines.values():
        e.generate(sixteen, greedy)
    pairs = list(zip(logs["native"], logs["torch"]))
    worst = max(float((a - b).abs().max()) for a, b in pairs)
    scale = max(float(b.abs().max()) for _, b in pairs)
    print(f"logits, 16 prompts decoded together: {len(pairs)} steps, largest |native - torch| {worst:.3g} "
          f"(largest |logit| {scale:.3g})")
    fifty = prompts(engines["native"], 50)
    outputs = {step: [o.outputs[0].token_ids for i in range(0, 50, 16)
                      for o in e.generate(fifty[i: i + 16], SamplingParams(temperature=0, max_tokens=args.tokens))]
               for step, e in engines.items()}
    same = sum(a == b for a, b in zip(outputs["native"], outputs["torch"]))
    print(f"greedy, 50 prompts in batches of 16, up to {args.tokens} tokens: {same}/50 token-identical")
    ok = worst == 0.0 and same == 50
    print("OK" if ok else "DIFFERENT")
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())

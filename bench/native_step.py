"""The native decode step against the torch path of the same numerics (W4A8, float32 activations, bf16 KV), on
the real model: the logits of every step over 16 prompts decoded together, and the greedy outputs of 50 prompts
(in batches of 16, so decode batches of many sizes and context lengths).

``--prompt-steps``: the steps that carry prompts (fresh prompts of 16 to 2,048 tokens, tails over cached
context, decodes with a prompt beside them), each batch run by the torch forward and by the native step in
turns, in one process: their hidden states compared bit for bit, and the median time of each with the ratio.
``--kv int8`` for the int8 cache.

Both engines run the same requests in the same order, one token per sequence and step (no burst, no draft), so
they take the same steps; each step's logits, as the runner returns them, are recorded and compared row by row.
The native step runs the torch path's kernels in its order, so the claim is equality, and the tolerance printed is
the largest difference seen.

    .venv/bin/python bench/native_step.py --check
    .venv/bin/python bench/native_step.py --prompt-steps [--kv int8]
"""

import argparse
import itertools
import os
import statistics
import sys
import time

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
    """Every step's logits as the runner returns them, one row per sequence in request order (the two paths may
    order a step's rows differently; the native step's logits are a view of a buffer the next step overwrites, so
    they are copied). The native step computes its LM head inside its call, so the runner's methods are wrapped,
    not ``compute_logits``."""
    steps: list[torch.Tensor] = []
    runner = engine.runner

    def wrap(method):
        def recording(*args, **kwargs):
            out = method(*args, **kwargs)
            seqs, logits = out[0], out[1]
            order = sorted(range(len(seqs)), key=lambda i: seqs[i].request_id)
            steps.append(logits[order].clone())
            return out
        return recording
    for name in ("execute", "execute_picking", "execute_burst"):
        setattr(runner, name, wrap(getattr(runner, name)))
    return steps


# (decodes' context lengths, prompt spans' new tokens, tokens each prompt finds cached)
PROMPT_STEPS = {"prompt 16": ([], [16], 0), "prompt 48": ([], [48], 0), "prompt 128": ([], [128], 0),
                "prompt 512": ([], [512], 0), "prompt 2048": ([], [2048], 0), "4 prompts of 48": ([], [48] * 4, 0),
                "tail 40 over 400 cached": ([], [40], 400), "16 tails of 40 over 200": ([], [40] * 16, 200),
                "4 decodes + prompt 48": ([200] * 4, [48], 0), "16 decodes + prompt 128": ([200] * 16, [128], 0),
                "64 decodes + prompt 48": ([200] * 64, [48], 0), "1 decode + chunk 512 over 1024": ([300], [512], 1024)}


def prompt_steps(kv_cache_dtype: str) -> bool:
    """Times each of PROMPT_STEPS through both paths; whether every hidden state was equal."""
    from corral.engine.model_runner import _NO_LENS, _NO_TABLES
    from corral.engine.sequence import Sequence

    engine = LLMEngine(EngineConfig(quantization="w4a8", dtype="auto", kv_cache_dtype=kv_cache_dtype,
                                    num_kv_blocks=4096))
    runner = engine.runner
    print(f"KV cache {kv_cache_dtype}; decode path {runner.decode_path}; times are medians of 7 turns each")
    blocks = itertools.count(1)  # each sequence its own blocks
    generator = torch.Generator().manual_seed(0)

    def sequence(tokens: int, computed: int) -> Sequence:
        seq = Sequence("bench", torch.randint(100, 40000, (tokens,), generator=generator).tolist(),
                       SamplingParams(max_tokens=1))
        seq.block_table = [next(blocks) for _ in range(-(-(tokens + 1) // runner.block_size))]
        seq.num_computed_tokens = computed
        return seq

    def torch_path(ids, positions, meta):
        return runner.model.forward(ids, positions, meta, runner.kv_caches)

    def native_path(ids, positions, meta):
        decodes = meta.decodes[0] if meta.decodes else None
        tables, lens = (decodes.block_tables, decodes.context_lens) if decodes else (_NO_TABLES, _NO_LENS)
        return runner.native_step(ids, positions, meta.slot_mapping, tables, lens, *runner.whole_kv,
                                  spans=meta.prefills)

    all_equal = True
    with torch.inference_mode():
        for name, (decodes, prompts, cached) in PROMPT_STEPS.items():
            seqs = [sequence(n, n - 1) for n in decodes] + [sequence(n + cached, cached) for n in prompts]
            ids, positions, meta = runner.prepare(seqs, [1] * len(decodes) + prompts)
            equal = torch.equal(torch_path(ids, positions, meta), native_path(ids, positions, meta))
            all_equal = all_equal and equal
            times: dict = {torch_path: [], native_path: []}
            for turn in range(7):
                for path in (torch_path, native_path) if turn % 2 else (native_path, torch_path):
                    start = time.perf_counter()
                    path(ids, positions, meta)
                    times[path].append(time.perf_counter() - start)
            slow, fast = (statistics.median(times[path]) * 1e3 for path in (torch_path, native_path))
            print(f"{name:32s} {len(ids):5d} rows: torch {slow:8.2f} ms, native {fast:8.2f} ms, native/torch "
                  f"{fast / slow:.3f}, {'equal' if equal else 'DIFFERENT'}", flush=True)
    return all_equal


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 unless every logit and token is equal")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-steps", action="store_true", help="time prompt-bearing steps through both paths")
    ap.add_argument("--kv", default="auto", choices=("auto", "int8"), help="the KV cache for --prompt-steps")
    args = ap.parse_args()
    torch.set_num_threads(2)
    print(f"# {cpu_summary()}; torch {torch.__version__}")
    if args.prompt_steps:
        ok = prompt_steps(args.kv)
        return 0 if ok or not args.check else 1
    # one token per sequence and step in both (no burst, no draft), so both take the same steps
    engines = {step: LLMEngine(EngineConfig(quantization="w4a8", dtype="auto", kv_cache_dtype="auto",
                                            decode_step=step, num_kv_blocks=2048, enable_prefix_caching=False,
                                            decode_burst=1, speculation=False, jump_forward=False))
               for step in ("native", "torch")}
    print({step: (e.formats.tag, e.runner.decode_path) for step, e in engines.items()})
    logs = {step: recorded(e) for step, e in engines.items()}
    sixteen = prompts(engines["native"], 16)
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for e in engines.values():
        e.generate(sixteen, greedy)
    assert len(logs["native"]) == len(logs["torch"]) == args.tokens, (len(logs["native"]), len(logs["torch"]))
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

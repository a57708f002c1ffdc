"""What 2 MiB pages buy the decode step: two engines in one process, the same formats, one with its streamed weights,
KV cache and logits buffer on huge pages (corral/engine/hugepages.py) and one in 4 KiB pages, taking turns.

Each round, each engine decodes ``--tokens`` greedy tokens (EOS ignored, drafts off, bursts as a server runs them)
for a batch of fresh prompts; at ``--context N`` the prompts are N tokens, computed into the prefix cache before the
clock starts, so the timed part is the decode at that context. The order of the two engines flips every round
(ABBA), so neither always runs second on a warmer machine. Prints each round's tok/s, the median, and the ratio
per round; the outputs of the two engines must be the same tokens (the pages change no arithmetic).

    .venv/bin/python bench/huge_pages.py --batches 1,4,16 --rounds 6
    .venv/bin/python bench/huge_pages.py --context 2000 --batches 1 --rounds 8
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from corral.engine import EngineConfig, LLMEngine, hugepages  # noqa: E402
from corral.engine.sampling_params import SamplingParams  # noqa: E402
from servers import cpu_summary  # noqa: E402
from step_profile import long_prompt  # noqa: E402


def build(huge: bool, args, most: int) -> LLMEngine:
    dtype, quantization, kv = args.format.split("/")
    hugepages.AVAILABLE = huge and hugepages._available()
    blocks = max(2048, most * -(-(args.context + args.tokens + 32) // 16) + 64)
    return LLMEngine(EngineConfig(dtype=dtype, quantization=quantization, kv_cache_dtype=kv, num_kv_blocks=blocks,
                                  max_num_seqs=64, jump_forward=False, speculation=False,
                                  decode_burst=args.decode_burst,
                                  max_model_len=args.context + args.tokens + 64 if args.context else None))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="float32/w4a8/bfloat16", help="dtype/quantization/kv")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--context", type=int, default=0, help="prompts of this many tokens (0: short)")
    ap.add_argument("--decode-burst", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not hugepages.AVAILABLE:
        raise SystemExit("huge pages are not available here (not Linux, transparent huge pages 'never', or "
                         "CORRAL_HUGE_PAGES=0): nothing to compare")
    with open(hugepages._SETTING) as f:
        if "[madvise]" not in f.read():  # at 'always' the baseline's torch.zeros would get huge pages too
            raise SystemExit("transparent huge pages are not at 'madvise' here: the 4 KiB baseline would not be one")
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"# {cpu_summary()}; torch {torch.__version__}, {args.threads} threads; {args.format}, "
          f"context {args.context or 'short'}, {args.tokens} tokens, decode burst {args.decode_burst}")
    start = hugepages.huge_bytes()
    engines = {"4 KiB": build(False, args, max(batches))}
    before = hugepages.huge_bytes()
    engines["2 MiB"] = build(True, args, max(batches))
    print(f"# on huge pages: the 4 KiB engine's buffers {(before - start) / 2**20:.0f} MiB, the 2 MiB engine's "
          f"{(hugepages.huge_bytes() - before) / 2**20:.0f} MiB")
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for batch in batches:
        rates = {name: [] for name in engines}
        for r in range(args.rounds):
            outputs = {}
            order = list(engines.items()) if r % 2 == 0 else list(engines.items())[::-1]
            for name, engine in order:
                hugepages.AVAILABLE = name == "2 MiB"  # buffers that grow during a run (the logits) follow it
                tokenizer = engine.tokenizer
                prompts = [long_prompt(tokenizer, 1000 * r + i, args.context) if args.context else
                           tokenizer.encode(f"Tale {r}.{i}: in a land far away") for i in range(batch)]
                if args.context:
                    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
                start = time.perf_counter()
                outs = engine.generate(prompts, params)
                rates[name].append(batch * args.tokens / (time.perf_counter() - start))
                outputs[name] = [out.outputs[0].token_ids for out in outs]
            if outputs["4 KiB"] != outputs["2 MiB"]:
                raise SystemExit(f"batch {batch}, round {r}: the two engines' tokens differ")
        line = " | ".join(f"{name} median {statistics.median(v):.1f} tok/s ({', '.join(f'{x:.0f}' for x in v)})"
                          for name, v in rates.items())
        ratios = [b / a for a, b in zip(rates["4 KiB"], rates["2 MiB"])]
        print(f"batch {batch}: {line}\n  2 MiB / 4 KiB per round: {', '.join(f'{x:.3f}' for x in ratios)}; "
              f"median {statistics.median(ratios):.3f}, {sum(x > 1 for x in ratios)} of {len(ratios)} rounds faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())

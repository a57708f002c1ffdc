"""Bitmask apply: Corral's kernel against XGrammar's ``apply_token_bitmask_inplace`` on the same data, one run.

On CPU that is Corral's torch twin against XGrammar's C++ CPU kernel; with CUDA, Corral's Triton kernel against
XGrammar's Triton kernel over batches 1-512 at a 128k vocabulary. Several mask shapes, because the kernels'
costs depend on them: ``random`` (half the bits, no structure), ``sparse`` (~1% of tokens allowed), ``open``
(all allowed but one word in 37), and at SmolLM2's 49,152 tokens ``json``: the real masks of Corral's FSM at
each token of a JSON document under its schema (rows cycle through them). Prints the median time of each and the
ratio xgrammar / corral (> 1: Corral is faster).

    python bench/kernels.py [--threads N] [--repeats R]
"""

import argparse
import functools
import json
import statistics
import time

import numpy as np
import torch
import xgrammar

from corral.kernels.bitmask import apply_token_bitmask_

CPU_SHAPES = [(b, v) for v in (49152, 128256, 151936) for b in (1, 8, 64)]
GPU_SHAPES = [(b, 128256) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)]


@functools.cache
def grammar_masks() -> torch.Tensor:
    """Real masks: the SmolLM2 vocabulary's bitmask at every token of a JSON document, under its schema."""
    from corral.fsm.compiler import GrammarCompiler
    from corral.fsm.vocabulary import Vocabulary
    from corral.grammar.constraint import Constraint
    from corral.models import load_tokenizer
    tokenizer = load_tokenizer()
    vocab = Vocabulary.from_tokenizer(tokenizer)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "age", "tags"], "additionalProperties": False}
    document = json.dumps({"name": "Ada Lovelace, countess", "age": 36, "tags": ["math", "engines", "notes"]},
                          separators=(",", ":"))
    guide = GrammarCompiler(vocab).compile(Constraint("json_schema", schema)).new_guide()
    masks = []
    for token_id in tokenizer.encode(document):
        masks.append(np.zeros(-(-vocab.size // 32), dtype=np.int32))
        guide.fill_mask(masks[-1])
        assert guide.advance(token_id), "the document must match its schema"
    return torch.from_numpy(np.stack(masks))


def make_bitmask(kind: str, rows: int, words: int, device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    if kind == "json":
        masks = grammar_masks()
        return masks[torch.arange(rows) % len(masks)].to(device)
    if kind == "random":
        bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=generator)
    elif kind == "sparse":
        allowed = torch.rand(rows, words * 32, generator=generator) < 0.01
        bits = (allowed.view(rows, words, 32).long() << torch.arange(32)).sum(-1)
        bitmask = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    else:
        bitmask = torch.full((rows, words), -1, dtype=torch.int32)
        bitmask[:, ::37] = 0x10001
    return bitmask.to(device)


def median_us(fn, logits: torch.Tensor, repeats: int) -> float:
    """Median over ``repeats`` calls, each on a fresh copy (copy time excluded)."""
    times = []
    for _ in range(repeats):
        work = logits.clone()
        if work.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(work)
        if work.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def run(shapes, device: str, repeats: int, dtype: torch.dtype) -> list[float]:
    ratios = []
    print(f"{'batch':>5} {'vocab':>7} {'mask':>7} {'corral us':>10} {'xgrammar us':>12} {'ratio':>6}")
    for batch, vocab in shapes:
        logits = torch.randn(batch, vocab, dtype=dtype).to(device)
        kinds = ("random", "sparse", "open") + (("json",) if vocab == 49152 else ())
        for kind in kinds:
            bitmask = make_bitmask(kind, batch, (vocab + 31) // 32, device)
            ours, theirs = logits.clone(), logits.clone()
            apply_token_bitmask_(ours, bitmask)
            xgrammar.apply_token_bitmask_inplace(theirs, bitmask)
            assert torch.equal(ours, theirs), "the kernels disagree"
            # Interleave the two so that load on a shared machine hits both alike.
            corral_us, xgrammar_us = [], []
            for _ in range(3):
                corral_us.append(median_us(lambda x: apply_token_bitmask_(x, bitmask), logits, repeats))
                xgrammar_us.append(median_us(lambda x: xgrammar.apply_token_bitmask_inplace(x, bitmask),
                                             logits, repeats))
            c, x = min(corral_us), min(xgrammar_us)
            ratios.append(x / c)
            print(f"{batch:>5} {vocab:>7} {kind:>7} {c:>10.1f} {x:>12.1f} {x / c:>6.2f}", flush=True)
    return ratios


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if torch.cuda.is_available():
        print(f"CUDA ({torch.cuda.get_device_name()}): Triton kernel vs xgrammar, bf16 logits")
        ratios = run(GPU_SHAPES, "cuda", args.repeats, torch.bfloat16)
    else:
        print(f"CPU, {torch.get_num_threads()} torch threads: torch twin vs xgrammar's CPU kernel, fp32 logits")
        ratios = run(CPU_SHAPES, "cpu", args.repeats, torch.float32)
    print(f"ratio xgrammar/corral: min {min(ratios):.2f}, geometric mean "
          f"{statistics.geometric_mean(ratios):.2f} over {len(ratios)} cases")


if __name__ == "__main__":
    main()

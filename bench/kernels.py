"""Bitmask apply: Corral's kernel against XGrammar's ``apply_token_bitmask_inplace`` on the same data, one run.

On CPU that is Corral's CPU path (what ``apply_token_bitmask_`` dispatches to for CPU tensors) against XGrammar's
C++ CPU kernel, fp32 logits; with CUDA, Corral's Triton kernel against XGrammar's Triton kernel over batches 1-512
at a 128k vocabulary. Several mask shapes, because the kernels' costs depend on them: ``random`` (half the bits,
no structure), ``sparse`` (~1% of tokens allowed), ``open`` (everything allowed except in one word in 37, which
allows 2 of its 32 tokens), and at SmolLM2's 49,152 tokens ``json``: the real masks of Corral's FSM at each
token of a JSON document under its schema (rows cycle through them).

Both kernels get the same logits and bitmask (and must produce the same result), a warm-up, then three rounds in
alternating order of ``--repeats`` calls each on freshly restored logits; a kernel's time is its best round's
median. Prints each time, the ratio xgrammar / corral (> 1: Corral is faster), and a table of the ratios.
Neither CPU kernel uses torch's thread pool; ``--threads`` pins it for the rest of the process.

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


def median_us(fn, logits: torch.Tensor, work: torch.Tensor, repeats: int) -> float:
    """Median over ``repeats`` calls, each on ``work`` restored from ``logits`` (the restore is not timed). On CPU
    the restore is a numpy copy: a torch copy would wake torch's thread pool, whose threads keep spinning after
    it and steal the core from whichever kernel is timed next."""
    times = []
    for _ in range(repeats):
        if work.is_cuda:
            work.copy_(logits)
            torch.cuda.synchronize()
        else:
            np.copyto(work.numpy(), logits.numpy())
        start = time.perf_counter()
        fn(work)
        if work.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def time_pair(corral, peer, logits: torch.Tensor, repeats: int, rounds: int = 3) -> tuple[float, float]:
    """Each kernel's best median over ``rounds``, alternating which goes first, so that load on a shared machine
    hits both alike. Both work on the same logits and the same bitmask."""
    work = logits.clone()
    for fn in (corral, peer):  # warm-up: first-call costs (imports, lazy tables, buffers) are not the kernel's
        median_us(fn, logits, work, 3)
    times = {corral: [], peer: []}
    for i in range(rounds):
        for fn in ((corral, peer) if i % 2 == 0 else (peer, corral)):
            times[fn].append(median_us(fn, logits, work, repeats))
    return min(times[corral]), min(times[peer])


def run(shapes, device: str, repeats: int, dtype: torch.dtype) -> dict[tuple[int, int, str], float]:
    ratios = {}
    print(f"{'batch':>5} {'vocab':>7} {'mask':>7} {'corral us':>10} {'xgrammar us':>12} {'ratio':>6}")
    for batch, vocab in shapes:
        logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch), dtype=dtype).to(device)
        kinds = ("random", "sparse", "open") + (("json",) if vocab == 49152 else ())
        for kind in kinds:
            bitmask = make_bitmask(kind, batch, (vocab + 31) // 32, device)
            ours, theirs = logits.clone(), logits.clone()
            apply_token_bitmask_(ours, bitmask)
            xgrammar.apply_token_bitmask_inplace(theirs, bitmask)
            assert torch.equal(ours, theirs), "the kernels disagree"
            c, x = time_pair(lambda t: apply_token_bitmask_(t, bitmask),
                             lambda t: xgrammar.apply_token_bitmask_inplace(t, bitmask), logits, repeats)
            ratios[batch, vocab, kind] = x / c
            print(f"{batch:>5} {vocab:>7} {kind:>7} {c:>10.1f} {x:>12.1f} {x / c:>6.2f}", flush=True)
    return ratios


def print_ratio_table(ratios: dict[tuple[int, int, str], float]) -> None:
    kinds = list(dict.fromkeys(kind for _, _, kind in ratios))
    print("\nratio xgrammar / corral (> 1: Corral is faster)\n")
    print("| batch | vocab | " + " | ".join(kinds) + " |")
    print("|---:|---:|" + "---:|" * len(kinds))
    for batch, vocab in dict.fromkeys((b, v) for b, v, _ in ratios):
        cells = [f"{ratios[batch, vocab, k]:.2f}" if (batch, vocab, k) in ratios else "" for k in kinds]
        print(f"| {batch} | {vocab} | " + " | ".join(cells) + " |")
    values = list(ratios.values())
    print(f"\nmin {min(values):.2f}, geometric mean {statistics.geometric_mean(values):.2f} over {len(values)} cases")


def describe_json_masks() -> str:
    masks = grammar_masks().numpy()
    open_words = (masks == -1).mean()
    closed_words = (masks == 0).mean()
    return (f"json: {len(masks)} masks of Corral's FSM, one per token of the document; words all-allowed "
            f"{open_words:.0%}, all-masked {closed_words:.0%}, mixed {1 - open_words - closed_words:.0%}")


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
        print(f"CPU, {torch.get_num_threads()} torch threads: Corral's CPU path vs xgrammar's CPU kernel, fp32 logits")
        print(describe_json_masks())
        ratios = run(CPU_SHAPES, "cpu", args.repeats, torch.float32)
    print_ratio_table(ratios)


if __name__ == "__main__":
    main()

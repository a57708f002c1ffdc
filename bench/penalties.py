"""What repetition, frequency and presence penalties cost the sampler per decode step as the context grows.

One 49,152-column logits row (SmolLM2's vocabulary), a prompt of real text (this repository's README and engine
sources through the shipped tokenizer, so that tokens repeat as they do in text) of 1,000 to 32,000 tokens, and a
decode of ``--steps`` tokens after it, each step one native draw (``cpu_ops.sample_pick``, temperature 0.7, top_p
0.9) of a row shaped like a model's (normal logits, a few tokens far above them) three ways, each first in turn:

- ``unshaped``: no penalty (the floor);
- ``runs``: the penalties read the prompt and output as token runs, every token at every step (what a row without
  a tally gets);
- ``tally``: they read the sequence's native tally, caught up on the one new token and holding each distinct
  token once (what the engine does).

Each cell prints the median microseconds per step of each, and the distinct tokens the tally holds. The two
shaped ways must draw the same token at every step (checked). Prints the CPU line first: a result from one
machine says nothing about another.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/penalties.py [--contexts 1000,8000,32000] [--steps 200]
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from corral import native  # noqa: E402
from corral.engine.sampler import Sampler, SamplingRow  # noqa: E402
from corral.engine.sampling_params import SamplingParams  # noqa: E402
from corral.engine.sequence import Sequence  # noqa: E402
from corral.kernels import cpu_ops  # noqa: E402
from corral.models import load_tokenizer  # noqa: E402
from servers import cpu_summary  # noqa: E402


WAYS = ["unshaped", "runs", "tally"]


def real_tokens(count: int) -> list[int]:
    """``count`` token ids of this repository's README and engine sources, repeated as needed."""
    paths = [os.path.join(ROOT, "README.md")] + sorted(
        os.path.join(ROOT, "corral", "engine", name) for name in os.listdir(os.path.join(ROOT, "corral", "engine"))
        if name.endswith(".py"))
    text = "".join(open(path, encoding="utf-8").read() for path in paths)
    ids = load_tokenizer().encode(text)
    return (ids * (count // len(ids) + 1))[:count]


def run(context: int, steps: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    tokens = real_tokens(context + steps)
    vocab = 49152
    params = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1, frequency_penalty=0.5,
                            presence_penalty=0.3, max_tokens=steps + 1)
    plain = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=steps + 1)
    seq = Sequence("bench", tokens[:context], params)
    seq.tally = cpu_ops.token_tally()
    sampler = Sampler(vocab_size=vocab)
    times = {way: [] for way in WAYS}
    for step in range(steps):
        values = rng.standard_normal(vocab).astype(np.float32) * 2  # a model's row: a few likely tokens
        values[rng.integers(0, vocab, 8)] += 14
        logits = torch.from_numpy(values[None])
        u = float(rng.random())
        picked = {}
        for way in WAYS[step % 3:] + WAYS[:step % 3]:  # each way first in turn (the row is warmest then)
            start = time.perf_counter()
            if way == "unshaped":
                shaping = None
            else:
                row = SamplingRow(params, *seq.spans(), None, seq.tally if way == "tally" else None)
                shaping = [sampler.shaping(row)]
            picked[way] = cpu_ops.sample_pick(logits, vocab, None, None, [plain.temperature], [0], [plain.top_p],
                                              [0.0], [u], [0], shaping)
            times[way].append(time.perf_counter() - start)
        assert picked["runs"] == picked["tally"], f"step {step}: the tally drew otherwise"
        seq.append_token(tokens[context + step])  # the text's next token, so that the output repeats as text does
    out = {way: statistics.median(t) * 1e6 for way, t in times.items()}
    out["distinct"] = seq.tally.num_seen
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="1000,8000,32000")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if native.module() is None:
        sys.exit("the native module is missing: the native draw (and the tally) are what this bench times")
    torch.set_num_threads(1)
    print(f"CPU: {cpu_summary()}; kernels {native.module().kernel_isa}; one thread")
    print("| context tokens | distinct | unshaped us/step | runs us/step | tally us/step | runs / tally |")
    print("|---|---|---|---|---|---|")
    for context in (int(c) for c in args.contexts.split(",")):
        r = run(context, args.steps, args.seed)
        print(f"| {context:,} | {r['distinct']:,} | {r['unshaped']:.1f} | {r['runs']:.1f} | {r['tally']:.1f} | "
              f"{r['runs'] / r['tally']:.2f} |", flush=True)


if __name__ == "__main__":
    main()

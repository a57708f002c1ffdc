"""Do masks overlap the forward? Decode-step time with constrained rows against the same batch unconstrained.

The engine fills a step's masks on a worker thread while the model's forward runs. The two overlap only where the
mask computation lets go of the GIL. This bench runs ``--batch`` requests of ``--tokens`` exact tokens (greedy),
first with no constraint, then each with a different JSON Schema from the MaskBench dev set, compiled just before
and with an empty compile cache so that its masks are met for the first time (a constrained row ends where its
document does, so later steps hold fewer rows). It prints the mean step time of each. The comparison that counts is
between checkouts: the same guides give the same tokens and steps in both. Drafts (jump-forward and prompt lookup)
are off on both sides, so every step computes one row per sequence. With ``--baseline DIR`` the same
measurement runs, in the same run, for the checkout in DIR (an earlier commit); the checkouts alternate per repeat,
and the table gives each one's median.

    .venv/bin/python bench/mask_overlap.py --batch 1,16 --baseline ../corral-before
"""

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "..", "shared", "data", "maskbench-dev.jsonl.gz")


def _schemas(count: int) -> list[dict]:
    """``count`` schemas from the dev set's Github_easy split that Corral compiles, for realistic first masks."""
    with gzip.open(DATA, "rt") as f:
        entries = [json.loads(line) for line in f]
    return [e["schema"] for e in entries if e["id"].startswith("Github_easy")][: 4 * count]


def measure(src: str, batches: list[int], tokens: int) -> dict:
    """In this process: step times for each batch size, unconstrained and constrained (seconds per step)."""
    sys.path.insert(0, src)
    from corral.engine import EngineConfig, LLMEngine, SamplingParams
    from corral.errors import UserInputError
    from corral.fsm.compiler import GrammarCompiler
    from corral.grammar.constraint import Constraint

    # no drafts: a drafted step computes several rows per sequence, which is not what this compares (a checkout
    # from before drafts has no such switch)
    fields = EngineConfig.__dataclass_fields__
    no_drafts = {name: False for name in ("jump_forward", "speculation") if name in fields}
    engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=2048, **no_drafts))
    compiler = GrammarCompiler(engine.vocabulary)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompt = engine.tokenizer.encode("Describe a small red bicycle in JSON.")
    pool = _schemas(max(batches))
    engine.generate([prompt], params)  # warm-up
    try:  # a checkout from before the native module's switch has no status to give
        from corral import native
        out = {"paths": native.status()}
    except ImportError:
        out = {"paths": None}
    for batch in batches:
        prompts = [prompt + [i + 1] for i in range(batch)]  # distinct prompts, no prefix sharing between rows
        steps0 = engine.stats().num_steps
        start = time.perf_counter()
        engine.generate(prompts, params)
        free = (time.perf_counter() - start) / (engine.stats().num_steps - steps0)
        compiler.clear()
        guides = []
        for schema in pool:
            if len(guides) == batch:
                break
            try:
                guides.append(compiler.compile(Constraint("json_schema", schema)).new_guide())
            except UserInputError:
                continue
        steps0 = engine.stats().num_steps
        start = time.perf_counter()
        # a row ends where its document does: the same rows and steps in every checkout whose masks agree (greedy)
        engine.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0), guides=guides)
        constrained = (time.perf_counter() - start) / (engine.stats().num_steps - steps0)
        out[str(batch)] = {"free_s": free, "constrained_s": constrained}
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", default=None, help="another checkout of Corral, measured in the same run")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # a child: the checkout to import
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    if args.measure:
        print(json.dumps(measure(args.measure, batches, args.tokens)))
        return
    sys.path.insert(0, HERE)
    from servers import cpu_summary

    checkouts = {"this": os.path.join(HERE, "..")}
    if args.baseline:
        checkouts["baseline"] = args.baseline
    runs = {name: [] for name in checkouts}
    for _ in range(args.repeats):
        for name, src in checkouts.items():
            child = subprocess.run([sys.executable, __file__, "--measure", os.path.abspath(src), "--batch", args.batch,
                                    "--tokens", str(args.tokens)], capture_output=True, text=True,
                                   env={**os.environ, "PYTHONPATH": os.path.abspath(src)})
            if child.returncode:
                raise SystemExit(f"{name}: {child.stderr[-2000:]}")
            runs[name].append(json.loads(child.stdout.strip().splitlines()[-1]))
    print(f"CPU: {cpu_summary()}; {time.strftime('%Y-%m-%d %H:%M')}; {args.tokens} tokens a row, "
          f"median of {args.repeats}\n")
    print("| checkout | batch | step, unconstrained (ms) | step, constrained (ms) | extra per step (ms) |")
    print("|---|---|---|---|---|")
    for name, results in runs.items():
        for batch in batches:
            free = statistics.median(r[str(batch)]["free_s"] for r in results) * 1e3
            constrained = statistics.median(r[str(batch)]["constrained_s"] for r in results) * 1e3
            print(f"| {name} | {batch} | {free:.1f} | {constrained:.1f} | {constrained - free:+.1f} |")
    print(f"\npaths: {runs['this'][0]['paths']}")


if __name__ == "__main__":
    main()

"""The engine loop of this checkout against an earlier commit's, in one process, taking turns round by round.

The loop (a run's time outside the runner's forward calls, per step: the steps and the requests' adding) moves
by a few percent with a change, while separate runs on a shared machine move by 20-50%. So this builds one engine
and, each round, runs the same requests twice: once with the functions a change touched as ``--base`` had them,
once as this checkout has them (which goes first alternates: old-new, new-old, ...). The old functions are the base commit's source of the same module, loaded
beside this checkout's (``git show BASE:PATH``): methods of ``LLMEngine`` (``--methods``) or the whole drafter
(``--drafter``: ``corral.engine.speculation``'s ``Drafter`` of the base commit, whose sequences keep the base's
own speculation state). The swapped code must fit the rest of this checkout; a change to what they share (a
signature, a class's fields) cannot be measured this way. The outputs (every request's tokens) must be identical,
or the run exits 1.

Printed per side: the median tokens per second, the loop per step in every round and its median, the time inside
``--timed`` methods (a subset of the swapped ones) per step, and in how many rounds the new side was the faster.
Greedy requests of ``--tokens`` tokens (``--schema``: each constrained to that JSON Schema, ending where its JSON
does), the defaults as a server runs them (drafts on, bursts of 8), 2 threads. For example:

    .venv/bin/python bench/loop_ab.py --base c2b4f88 --drafter --batch 16 --rounds 4
    .venv/bin/python bench/loop_ab.py --base 702465c --methods step,_repick_refused,_verify_deferred,_verify_drafts \\
        --schema bench/data/story_schema.json --batch 16 --rounds 6
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from servers import clocked, cpu_summary, frozen_heap  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def base_module(commit: str, path: str, name: str):
    """The module at ``path`` as ``commit`` had it, imported under ``name`` beside this checkout's."""
    source = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as out:
        out.write(source)
    spec = importlib.util.spec_from_file_location(name, out.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses look their module up while the classes are made)
    spec.loader.exec_module(module)
    os.unlink(out.name)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit whose functions are the old side")
    parser.add_argument("--methods", default="", help="LLMEngine methods to swap, comma-separated")
    parser.add_argument("--drafter", action="store_true", help="swap the drafter (corral.engine.speculation)")
    parser.add_argument("--timed", default="", help="swapped methods whose own time is reported")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--schema", default=None, help="a JSON Schema file constraining every request")
    args = parser.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    timed = set(m for m in args.timed.split(",") if m)
    if not methods and not args.drafter:
        parser.error("nothing to swap: give --methods or --drafter")
    if not timed <= set(methods):
        parser.error("--timed names methods that --methods swaps")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from corral.engine import EngineConfig, LLMEngine
    from corral.engine.sampling_params import SamplingParams
    torch.set_num_threads(2)
    engine = LLMEngine(EngineConfig(dtype="float32", quantization="w4a8", kv_cache_dtype="bfloat16",
                                    num_kv_blocks=2048, max_num_seqs=64))
    sides = {"new": {m: getattr(LLMEngine, m) for m in methods}, "old": {}}
    if methods:
        old_engine = base_module(args.base, "corral/engine/llm_engine.py", "base_llm_engine")
        sides["old"] = {m: getattr(old_engine.LLMEngine, m) for m in methods}
    drafters = {"new": engine.drafter}
    if args.drafter:
        old_speculation = base_module(args.base, "corral/engine/speculation.py", "base_speculation")
        drafters["old"] = old_speculation.Drafter(engine.drafter.vocab, engine.drafter.encode)
    else:
        drafters["old"] = engine.drafter
    forward, inside = [0.0], [0.0]
    for name in ("execute", "execute_picking", "execute_burst"):
        setattr(engine.runner, name, clocked(getattr(engine.runner, name), forward))

    def install(side: str) -> None:
        for name, function in sides[side].items():
            bound = function.__get__(engine)
            setattr(engine, name, clocked(bound, inside) if name in timed else bound)
        engine.drafter = drafters[side]

    guide_of = None
    if args.schema:
        from corral.fsm.compiler import GrammarCompiler
        from corral.grammar.constraint import Constraint
        with open(args.schema) as f:
            grammar = GrammarCompiler(engine.vocabulary).compile(Constraint("json_schema", json.load(f)))
        guide_of = grammar.new_guide
        prompts = [engine.tokenizer.encode(f"Give person {i} as JSON:") for i in range(args.batch)]
        params = SamplingParams(temperature=0, max_tokens=args.tokens)
    else:
        prompts = [engine.tokenizer.encode(f"Tale {i}: in a land far away there lived a king. The king had three "
                                           "sons. The king") for i in range(args.batch)]
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    count = [0]

    def run() -> list[list[int]]:
        ids = []
        for prompt in prompts:
            count[0] += 1
            ids.append(f"r{count[0]}")
            engine.add_request(ids[-1], prompt, params, guide=guide_of() if guide_of else None)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        return [done[i] for i in ids]

    swapped = ", ".join(methods + ["drafter"] * args.drafter)
    schema = f", schema {args.schema}" if args.schema else ""
    print(f"# bench/loop_ab.py: base {args.base}; swapped: {swapped}; batch {args.batch}, {args.rounds} rounds, "
          f"{args.tokens} tokens{schema}")
    print(f"# {cpu_summary()}")
    results: dict[str, list[tuple[float, float, float]]] = {"old": [], "new": []}
    outputs = {}
    with frozen_heap():
        install("new")
        run()  # warm-up: the first request's compile, the kernels' first calls
        for r in range(args.rounds):
            for side in ("old", "new") if r % 2 == 0 else ("new", "old"):
                install(side)
                engine.block_manager.reset_prefix_cache()
                forward[0] = inside[0] = 0.0
                steps, generated = engine._counters["steps"], engine._counters["generated"]
                start = time.perf_counter()
                got = run()
                elapsed = time.perf_counter() - start
                steps = engine._counters["steps"] - steps
                generated = engine._counters["generated"] - generated
                outputs.setdefault(side, got)
                results[side].append((generated / elapsed, (elapsed - forward[0]) / steps * 1e6,
                                      inside[0] / steps * 1e6))
    for side in ("old", "new"):
        rows = results[side]
        loops = [round(x[1]) for x in rows]
        line = (f"{side}: {statistics.median(x[0] for x in rows):.1f} tok/s (median); loop per step {loops} us, "
                f"median {statistics.median(x[1] for x in rows):.0f}")
        if timed:
            line += f"; --timed per step median {statistics.median(x[2] for x in rows):.0f} us"
        print(line)
    pairs = list(zip(results["new"], results["old"]))
    print(f"new faster: loop in {sum(a[1] < b[1] for a, b in pairs)} of {args.rounds} rounds, tok/s in "
          f"{sum(a[0] > b[0] for a, b in pairs)}" +
          (f", --timed in {sum(a[2] < b[2] for a, b in pairs)}" if timed else ""))
    if outputs["old"] != outputs["new"]:
        print("the two sides' outputs differ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

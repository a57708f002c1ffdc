"""Where a decode step's time goes, in process: timers around each part of the engine step.

One engine in the given formats decodes ``--tokens`` tokens for each batch size; every linear layer, the LM head,
the C++ attention and fused elementwise kernels (with their Python wrappers), the KV write, the embedding, the
batch preparation (the torch path's tensors, or the native step's lists) and the sampler are wrapped with a wall-clock timer (each timer adds well under a microsecond).
Prints, per batch size, the step time and each part's share; "other torch in forward" is the forward's time not
inside a timed part (views, splits, casts), and "engine loop" is the step's time outside the forward and the
sampler (scheduling, guides, drafts, outputs), also given per step (median and p90; inside ``engine.step``, so
without ``generate``'s own work). Drafts are on as a server runs them (``--drafts off``: one row per sequence per
step; the "Tale" prompts make prompt lookup draft often). Where the native decode step runs (``w4a8``), it times its own parts
("native: ..."; steps with prompts run in it too), and greedy steps with no draft may decode
up to ``--decode-burst`` tokens per sequence in one native call (8, as a server runs; 1: a call per token): the
shares are then per step, and the engine loop is also given per generated token. A plain greedy step makes its
pick inside that call, so its time is in "native: LM head" and the sampler's row is near 0. No HTTP: compare with
``bench/engine.py`` for what the server adds. ``--stub-forward`` (greedy, drafts off) makes every decode step
return at once with a fixed token, so the engine loop runs with warm caches: its own cost, without what the
forward's weight stream costs it; ``--evict-mb 96`` has each stubbed step first read 96 MB, as a step of the
shipped model streams its weights, so the loop meets the caches a forward leaves (the cold cost alone). The
engine loop's line also gives the median time of a Python call that does
nothing, made as the first code after each forward: what resuming the interpreter costs there on this machine
(a floor under any loop written in Python), before any of the loop's own work. ``--schema FILE`` constrains every
timed request to that JSON Schema (compact whitespace, as a server compiles it by default): the guided step, whose
masks, guide advances and jump-forward drafts the loop then carries; such a request ends where its JSON does, so
the per-token figures count the tokens made. ``--context N`` gives every timed request a prompt of N tokens
(a passage repeated, headed by its own number), computed into the prefix cache before the clock starts, so the
timed steps decode at a context of N and up: attention's share at a long context. ``--model`` profiles another
GGUF (a K-quant file's Q5 and Q8 linears among its Q4 ones).

    .venv/bin/python bench/step_profile.py --formats float32/w4a8/bfloat16 --batches 1,16
    .venv/bin/python bench/step_profile.py --formats bfloat16/gguf/auto --batches 1,16
    .venv/bin/python bench/step_profile.py --formats float32/w4a8/bfloat16 --temperature 0.7 --top-p 0.9 --seed 1
    .venv/bin/python bench/step_profile.py --formats float32/w4a8/bfloat16 --tokens 512 --drafts off \\
        --decode-burst 1 --stub-forward [--evict-mb 96]
    .venv/bin/python bench/step_profile.py --formats float32/w4a8/bfloat16 --temperature 0.7 --frequency-penalty 0.5 \\
        --repetition-penalty 1.1 --logit-bias 20
    .venv/bin/python bench/step_profile.py --formats float32/w4a8/bfloat16 --schema bench/data/story_schema.json
    .venv/bin/python bench/step_profile.py --formats float32/w4a8/bfloat16 --batches 1,16 --context 2048 --drafts off
    .venv/bin/python bench/step_profile.py --formats float32/w4a8/bfloat16 --model smollm2-q4km.gguf   # K-quant file
"""

import argparse
import collections
import dataclasses
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import corral.engine.attention as attention  # noqa: E402
import corral.engine.model as model_module  # noqa: E402
from corral.engine import EngineConfig, LLMEngine  # noqa: E402
from corral.engine.sampling_params import SamplingParams  # noqa: E402
from corral.fsm.compiler import GrammarCompiler  # noqa: E402
from corral.grammar.constraint import Constraint  # noqa: E402
from corral.kernels import cpu_ops  # noqa: E402
from servers import cpu_summary, frozen_heap  # noqa: E402

PARTS = ("linears", "LM head", "attention", "fused ops", "KV write", "embedding", "batch preparation")


class _TimedSampler:
    """The engine's sampler with its calls (sampling, and verifying drafts) timed as "sampler"."""

    def __init__(self, sampler, timed):
        self._sampler, self._call, self.verify = sampler, timed("sampler", sampler), timed("sampler", sampler.verify)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sampler, name)


def _no_op() -> None:
    """The resume probe: a Python call that does nothing, timed as the first code after each forward."""


def instrument(engine: LLMEngine, spent: dict, resumes: list | None = None) -> None:
    """Wrap the timed parts; with ``resumes``, the forward's timer, right after it has read the clock at the
    forward's return, times one call of :func:`_no_op` and appends its seconds there (outside "forward", so
    inside the engine loop): what the interpreter's first call costs after the forward, before any other work."""
    def timed(name, fn, probe=None):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.perf_counter()
                if probe is not None:
                    _no_op()
                    probe.append(time.perf_counter() - end)
                spent[name] += end - start
        return wrapper

    model, runner = engine.runner.model, engine.runner
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            layer[name] = timed("linears", layer[name])
    model.lm_head, model.embed = timed("LM head", model.lm_head), timed("embedding", model.embed)
    attention.paged_decode = timed("attention", attention.paged_decode)
    model_module.write_kv = timed("KV write", model_module.write_kv)
    for name in ("add_rms_norm", "rope_", "silu_mul"):
        setattr(cpu_ops, name, timed("fused ops", getattr(cpu_ops, name)))
    engine.sampler = _TimedSampler(engine.sampler, timed)
    runner.execute = timed("forward", runner.execute, resumes)
    runner.prepare = timed("batch preparation", runner.prepare)
    runner.execute_burst = timed("forward", runner.execute_burst, resumes)  # a burst's steps, each with its LM head
    runner.execute_picking = timed("forward", runner.execute_picking, resumes)  # a step with its picks made inside
    runner.prepare_decode = timed("batch preparation", runner.prepare_decode)  # the native step's lists
    if runner.native_step is not None:  # the native step times its own parts (every step it runs)
        runner.native_step.profile = torch.zeros(len(runner.native_step.PARTS), dtype=torch.float64)


PASSAGE = ("The river ran past the mill, the mill stood by the bridge, and the bridge carried the road to a town "
           "where every house had a garden and every garden had a wall. ")


def long_prompt(tokenizer, number: int, tokens: int) -> list[int]:
    """A prompt of exactly ``tokens`` tokens: its number, then the passage again and again."""
    head = tokenizer.encode(f"Tale {number}: ")
    body = tokenizer.encode(PASSAGE * (tokens // 20 + 1))
    return (head + body)[:tokens]


def stub_decode_steps(engine: LLMEngine, token: int = 42, evict_mb: int = 0) -> None:
    """Decode steps that return at once (``--stub-forward``): every sequence's tokens are ``token``, its logits a
    zero buffer, and the pass decided them, as a native greedy call reports it; prefills still run. With
    ``evict_mb``, each first reads that many MB of memory (``--evict-mb``: the caches left as a forward's weight
    stream leaves them, with no weights)."""
    runner = engine.runner
    if not runner.max_burst_rows:
        raise SystemExit("--stub-forward needs the native decode step (--formats float32/w4a8/bfloat16)")
    logits = torch.zeros(runner.max_burst_rows, engine.sampler.vocab_size or engine.vocabulary.size)

    stream = torch.ones(evict_mb << 18) if evict_mb else None  # float32: 4 bytes each

    def stub(batch, steps, *args, **kwargs):  # timed as "forward" by instrument()
        if stream is not None:
            stream.sum()
        rows = len(batch.seqs)
        return (list(batch.seqs), logits[:rows * steps], [[token] * steps for _ in range(rows)],
                [[0.0] * steps for _ in range(rows)], True)

    runner.execute_burst = stub


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="bfloat16/gguf/auto", help="dtype/quantization/kv, comma separated")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-burst", type=int, default=8,
                    help="the most tokens a native call decodes per sequence, as a server runs it (1: a call per "
                         "token)")
    ap.add_argument("--drafts", choices=("on", "off"), default="on",
                    help="jump-forward and prompt lookup, as a server runs them (on) or off")
    ap.add_argument("--temperature", type=float, default=0.0, help="the timed requests' sampling (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--logprobs", type=int, default=None, help="top logprobs per token (None: none)")
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--frequency-penalty", type=float, default=0.0)
    ap.add_argument("--presence-penalty", type=float, default=0.0)
    ap.add_argument("--logit-bias", type=int, default=0,
                    help="bias this many token ids (every 97th from id 0; +1.0 and -1.0 alternating)")
    ap.add_argument("--min-tokens", type=int, default=0)
    ap.add_argument("--stub-forward", action="store_true",
                    help="decode steps return at once with a fixed token and no forward, so the engine loop runs "
                         "with warm caches: its own cost, apart from the weight stream's (greedy, the native step)")
    ap.add_argument("--evict-mb", type=int, default=0,
                    help="with --stub-forward: each step first reads this many MB (96: what a step of the shipped "
                         "model streams), so the loop meets the caches a real forward leaves")
    ap.add_argument("--schema", default=None, help="a JSON Schema file: every timed request is constrained to it")
    ap.add_argument("--context", type=int, default=0,
                    help="prompts of this many tokens, prefilled into the prefix cache before the clock (0: short)")
    ap.add_argument("--model", default=None, help="a GGUF file or HF folder instead of the shipped model")
    args = ap.parse_args()
    if args.evict_mb and not args.stub_forward:
        ap.error("--evict-mb reads memory in place of a stubbed forward: it needs --stub-forward")
    if args.stub_forward and (args.drafts == "on" or args.temperature > 0 or args.schema):
        ap.error("--stub-forward takes unconstrained greedy steps with --drafts off (drafted steps would run the "
                 "real forward, and a fixed token would break a schema)")
    schema = None
    if args.schema:
        with open(args.schema) as f:
            schema = json.load(f)
    measured = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                           logprobs=args.logprobs, max_tokens=args.tokens, ignore_eos=True,
                           repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                           presence_penalty=args.presence_penalty, min_tokens=args.min_tokens,
                           logit_bias={97 * i: (1.0 if i % 2 else -1.0) for i in range(args.logit_bias)})
    torch.set_num_threads(args.threads)
    print(f"# {cpu_summary()}; torch {torch.__version__}, {args.threads} threads; model: {args.model or 'shipped'}; "
          f"the timed requests: {measured}")
    for spec in args.formats.split(","):
        dtype, quantization, kv = spec.split("/")
        drafts = args.drafts == "on"
        most = max(int(b) for b in args.batches.split(","))
        blocks = max(2048, most * -(-(args.context + args.tokens + 32) // 16) + 64)  # a long context's blocks
        engine = LLMEngine(EngineConfig(model=args.model, dtype=dtype, quantization=quantization, kv_cache_dtype=kv,
                                        num_kv_blocks=blocks, max_num_seqs=64, jump_forward=drafts,
                                        speculation=drafts, decode_burst=args.decode_burst,
                                        max_model_len=args.context + args.tokens + 64 if args.context else None))
        spent = collections.defaultdict(float)
        if args.stub_forward:
            stub_decode_steps(engine, evict_mb=args.evict_mb)
        resumes = []  # per forward: the no-op call right after it
        instrument(engine, spent, resumes)
        grammar = GrammarCompiler(engine.vocabulary).compile(Constraint("json_schema", schema)) if schema else None
        loops = []  # per step: its time outside the forward and the sampler
        step_fn = engine.step

        def step():
            start, inside = time.perf_counter(), spent["forward"] + spent["sampler"]
            try:
                return step_fn()
            finally:
                loops.append(time.perf_counter() - start - (spent["forward"] + spent["sampler"] - inside))

        engine.step = step
        for batch in (int(b) for b in args.batches.split(",")):
            warm = [engine.tokenizer.encode(f"Warm-up {i}: once upon a time") for i in range(batch)]
            engine.generate(warm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            spent.clear()
            loops.clear()
            resumes.clear()
            native_step = engine.runner.native_step
            if native_step is not None:
                native_step.profile.zero_()
            prompts = [engine.tokenizer.encode(f"Tale {i}: in a land far away") for i in range(batch)]
            if args.context:  # long prompts, their K/V computed (and cached) before the clock starts
                prompts = [long_prompt(engine.tokenizer, i, args.context) for i in range(batch)]
                engine.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
                spent.clear()
                loops.clear()
                resumes.clear()
                if native_step is not None:
                    native_step.profile.zero_()
            steps, bursts_before = engine.stats().num_steps, engine.stats().num_burst_steps
            seeded = [measured if args.seed is None else dataclasses.replace(measured, seed=args.seed + i)
                      for i in range(batch)]  # a seed each: the rows' draws independent
            guides = [grammar.new_guide() for _ in prompts] if grammar is not None else None
            with frozen_heap():  # no full collection inside, as in the server
                start = time.perf_counter()
                outs = engine.generate(prompts, seeded, guides)
                wall = time.perf_counter() - start
            made = sum(len(c.token_ids) for out in outs for c in out.outputs)
            steps = engine.stats().num_steps - steps
            if native_step is not None:
                spent.update({f"native: {name}": float(seconds)
                              for name, seconds in zip(native_step.PARTS, native_step.profile)})
            per = {name: seconds / steps * 1e3 for name, seconds in spent.items()}
            step = wall / steps * 1e3
            native_parts = [f"native: {name}" for name in native_step.PARTS] if native_step is not None else []
            per["other torch in forward"] = per["forward"] - sum(per.get(p, 0.0) for p in (*PARTS, *native_parts))
            per["engine loop"] = step - per["forward"] - per["sampler"]
            print(f"\n{engine.formats.tag}, batch {batch}: {steps} steps, {step:.2f} ms per step, "
                  f"{made} tokens, {made / wall:.1f} tok/s\n\n| part | ms per step | share |\n|---|---|---|")
            for name in (*native_parts, *PARTS, "other torch in forward", "sampler", "engine loop"):
                print(f"| {name} | {per.get(name, 0.0):.3f} | {per.get(name, 0.0) / step:.1%} |")
            bursts = engine.stats().num_burst_steps - bursts_before
            print(f"\nengine loop per step (inside engine.step): median {statistics.median(loops) * 1e6:.0f} us, "
                  f"p90 {sorted(loops)[int(len(loops) * 0.9)] * 1e6:.0f} us over {len(loops)} steps ({bursts} "
                  f"bursts); per generated token {sum(loops) / made * 1e6:.0f} us; of it, a "
                  f"no-op Python call right after the forward: median {statistics.median(resumes) * 1e6:.1f} us")
        del engine
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Deterministic mode (``--deterministic``, ``EngineConfig.deterministic``): what it fixes, and what it costs.

Two engines in one process, ``make serve``'s formats (W4A8, bfloat16 KV cache, prefix cache on), one with the mode
and one without:

- **Same request, same bits?** Each of ``--prompts`` chat prompts (greedy, with logprobs, and a seeded sampled
  request beside each) runs three ways: alone with nothing cached (a cache salt of its own), again under the same
  salt (its prompt's full blocks now from the prefix cache), and four copies at once in a pool of 16 blocks with a
  64-token batch budget (chunked prompts, recompute after preemption). Counts the requests whose tokens, and
  those whose logprobs, differ from the first run.
- **Prompt cost**: requests with one output token each (``--prompt-lengths``, and 64 prompts of about 48 tokens at
  once), nothing cached from an earlier batch (a fresh salt each round and engine), the two engines taking turns;
  milliseconds per request batch and the ratio. Decode-only steps run the same kernels either way; ``--decode``
  also times 128 greedy tokens at 1 and 16 sequences (their short prompts included) to show it.
- ``--fuzz N``: N random trials instead, the mode on (``--fuzz-off``: off) in both engines: each trial 1-20
  requests (greedy or seeded sampling with random top-k/top-p/min-p, penalties, logit bias, stop strings and ids,
  ``min_tokens``, logprobs, ``n`` = 2, a JSON Schema for a quarter of them, repetitive prompts that prompt lookup
  drafts from) arriving in random waves at an engine as a server runs it (the native step, bursts of 8, drafts, the
  prefix cache) in a pool of 32 blocks with an int8 cache and a 64-token batch budget (preemption and chunked
  prompts), against an engine with none of that (the torch path, no draft, no burst, no cache, 4,000 blocks) given
  the requests in other batches. Prints every request whose tokens, finish reason or stop reason differ.

    .venv/bin/python bench/deterministic.py
    .venv/bin/python bench/deterministic.py --prompts 16 --prompt-lengths 128,512,1800 --rounds 4 --decode
    .venv/bin/python bench/deterministic.py --fuzz 150
"""

import argparse
import os
import random
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from corral.engine import EngineConfig, LLMEngine  # noqa: E402
from corral.engine.sampling_params import SamplingParams  # noqa: E402
from corral.fsm.compiler import GrammarCompiler  # noqa: E402
from corral.grammar.constraint import Constraint  # noqa: E402
from servers import cpu_summary  # noqa: E402

TOPICS = ["the sea", "a mountain village", "an old clock", "a lost dog", "the first snow", "a night train",
          "a lighthouse keeper", "a market at dawn", "two rival bakers", "a robot gardener", "a desert well",
          "a library after closing", "a storm at sea", "a kite festival", "a forgotten letter", "a river ferry"]


def engine(det: bool, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"quantization": "w4a8", "dtype": "auto", "kv_cache_dtype": "bfloat16",
                                     "deterministic": det, "num_threads": torch.get_num_threads(), **overrides}))


def chat(e: LLMEngine, text: str) -> list[int]:
    return e.tokenizer.encode(e.tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def bits(outs) -> list:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def same_request(det: bool, prompts: list[list[int]]) -> str:
    params = [SamplingParams(temperature=0, max_tokens=48, logprobs=1, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=48, logprobs=0, ignore_eos=True)]
    big = engine(det, num_kv_blocks=1024)
    small = engine(det, num_kv_blocks=16, max_num_batched_tokens=64)
    counts = {"cache hit": [0, 0], "chunked and preempted": [0, 0]}
    for i, prompt in enumerate(prompts):
        for j, p in enumerate(params):
            salt = f"{det}-{i}-{j}"  # a salt of its own: the first run finds nothing cached, the second its blocks
            first, again = (salted(big, prompt, p, salt) for _ in range(2))
            assert first[2] == 0 and again[2] >= 16, (first[2], again[2])  # a miss, then a hit
            crowded = bits(small.generate([prompt] * 4, p))  # four copies in 16 blocks: preempted
            for name, outs in (("cache hit", [again[:2]]), ("chunked and preempted", crowded)):
                counts[name][0] += sum(tokens != first[0] for tokens, _ in outs)
                counts[name][1] += sum(logprobs != first[1] for _, logprobs in outs)
    total = {"cache hit": 2 * len(prompts), "chunked and preempted": 8 * len(prompts)}
    return "; ".join(f"{name}: tokens differ in {tokens}/{total[name]}, logprobs in {logprobs}/{total[name]}"
                     for name, (tokens, logprobs) in counts.items()) + \
        f" (preemptions in the small pool: {small.stats().num_preemptions})"


def salted(e: LLMEngine, prompt: list[int], params: SamplingParams, salt: str) -> tuple:
    """(tokens, logprobs, prompt tokens found in the prefix cache) of one request under ``salt``."""
    e.add_request(f"{salt}-{e.stats().num_steps}", prompt, params, cache_salt=salt)
    (out,) = [o for o in e.stream() if o.finished]
    return out.outputs[0].token_ids, out.outputs[0].logprobs, out.num_cached_tokens


def timed(e: LLMEngine, prompts: list[list[int]], params: SamplingParams, salt: str) -> float:
    for i, prompt in enumerate(prompts):
        e.add_request(f"{salt}-{i}", prompt, params, cache_salt=salt)
    start = time.perf_counter()
    while e.has_unfinished_requests():
        e.step()
    return time.perf_counter() - start


WORDS = ("the river ran past mill bridge road town house garden wall once upon a time there was king queen castle "
         "dragon").split()
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {
        "type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"}}}},
]


def random_params(rng: random.Random, e: LLMEngine) -> SamplingParams:
    kw = {"max_tokens": rng.randint(1, 48), "seed": rng.randint(0, 10**6)}
    if rng.random() < 0.5:
        kw["temperature"] = 0.0
    else:
        kw["temperature"] = rng.choice([0.5, 0.8, 1.0, 1.3])
        if rng.random() < 0.4:
            kw["top_k"] = rng.choice([1, 5, 40])
        if rng.random() < 0.4:
            kw["top_p"] = rng.choice([0.5, 0.9, 0.99])
        if rng.random() < 0.2:
            kw["min_p"] = rng.choice([0.05, 0.2])
    vocab = e.vocabulary.size
    for name, chance, values in (("repetition_penalty", 0.15, [1.1, 1.3]), ("frequency_penalty", 0.15, [0.5, -0.5]),
                                 ("presence_penalty", 0.1, [0.7])):
        if rng.random() < chance:
            kw[name] = rng.choice(values)
    if rng.random() < 0.1:
        kw["logit_bias"] = tuple((rng.randrange(vocab), rng.choice([5.0, -100.0, 2.0])) for _ in range(3))
    if rng.random() < 0.15:
        kw["stop"] = (rng.choice(WORDS), " the")
    if rng.random() < 0.1:
        kw["stop_token_ids"] = (rng.randrange(vocab), e.tokenizer.encode(" the")[0])
    if rng.random() < 0.1:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if rng.random() < 0.1:
        kw["logprobs"] = rng.choice([0, 2])
    kw["ignore_eos"] = rng.random() < 0.5
    if rng.random() < 0.05:
        kw["n"] = 2
    return SamplingParams(**kw)


def run_waves(e: LLMEngine, requests: list, rng: random.Random, waves: set[int]) -> dict:
    """Each request's (tokens, finish reason, stop reason) per completion, the requests added in random batches:
    at the steps in ``waves`` and whenever the engine is idle."""
    outs, pending, step = {}, list(requests), 0
    while pending or e.has_unfinished_requests():
        if pending and (not e.has_unfinished_requests() or step in waves):
            count = rng.randint(1, len(pending))
            for request_id, prompt, params, grammar in pending[:count]:
                e.add_request(request_id, prompt, params, grammar.new_guide() if grammar is not None else None)
            pending = pending[count:]
        for out in e.step():
            if out.finished:
                outs[out.request_id] = [(c.token_ids, c.finish_reason, c.stop_reason) for c in out.outputs]
        step += 1
    return outs


def fuzz(trials: int, det: bool) -> int:
    served = engine(det, kv_cache_dtype="int8", num_kv_blocks=32, max_num_batched_tokens=64, decode_burst=8)
    oracle = engine(det, kv_cache_dtype="int8", num_kv_blocks=4000, decode_step="torch", decode_burst=1,
                    jump_forward=False, speculation=False, enable_prefix_caching=False)
    compiler = GrammarCompiler(served.vocabulary)
    grammars = [compiler.compile(Constraint("json_schema", schema)) for schema in SCHEMAS]
    differ = total = 0
    for trial in range(trials):
        rng = random.Random(trial)
        requests = []
        for i in range(rng.randint(1, 20)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(1, 30))]
            if rng.random() < 0.3:
                words *= rng.randint(2, 5)  # repeats: prompt lookup drafts
            prompt = served.tokenizer.encode(f"Story {trial}-{i}: " + " ".join(words))
            grammar = rng.choice(grammars) if rng.random() < 0.25 else None
            requests.append((f"{trial}-{i}", prompt, random_params(rng, served), grammar))
        waves = set(rng.sample(range(60), 8))
        got = run_waves(served, requests, rng, waves)
        expected = run_waves(oracle, requests, random.Random(-trial - 1), set())
        for request_id, _, params, grammar in requests:
            total += 1
            if got[request_id] != expected[request_id]:
                differ += 1
                print(f"- request {request_id} ({'guided, ' if grammar else ''}{params}): served "
                      f"{got[request_id]}, oracle {expected[request_id]}", flush=True)
    print(f"\n{differ} of {total} requests differ ({trials} trials, deterministic {'on' if det else 'off'}; "
          f"preemptions in the served engine: {served.stats().num_preemptions})")
    return differ


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-lengths", default="128,512,1800")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--decode", action="store_true", help="also 128 greedy tokens at 1 and 16 sequences")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fuzz", type=int, default=0, help="random trials instead (see above)")
    ap.add_argument("--fuzz-off", action="store_true", help="the fuzz with the mode off in both engines")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {cpu_summary()}; torch {torch.__version__}, {args.threads} threads")
    if args.fuzz:
        fuzz(args.fuzz, not args.fuzz_off)
        return 0
    probe = engine(False, num_kv_blocks=64)
    prompts = [chat(probe, f"Tell a short story about {TOPICS[i % len(TOPICS)]} (number {i}).")
               for i in range(args.prompts)]
    print("\n## The same request, three ways (each compared with its first run)\n")
    for det in (False, True):
        print(f"- deterministic {'on' if det else 'off'}: {same_request(det, prompts)}")
    engines = {det: engine(det, num_kv_blocks=2048) for det in (False, True)}
    base = probe.tokenizer.encode(" ".join(f"The river passed mill {i}, and the road crossed it there."
                                           for i in range(200)))
    cases = [(f"1 prompt of {n} tokens", [base[:n]]) for n in map(int, args.prompt_lengths.split(","))]
    cases.append(("64 prompts of about 48 tokens", [chat(probe, f"Story {i}: " + " ".join(TOPICS[:6]))
                                                      for i in range(64)]))
    one = SamplingParams(temperature=0, max_tokens=1)
    print("\n## Prompt cost: nothing cached, one output token each (ms per batch, median of the rounds)\n\n"
          "| requests | off | on | on / off |\n|---|---|---|---|")
    for name, batch in cases:
        times = {False: [], True: []}
        for r in range(args.rounds):
            for det in ((False, True) if r % 2 else (True, False)):
                times[det].append(timed(engines[det], batch, one, f"p{r}-{det}-{name}"))
        off, on = (statistics.median(times[d]) * 1e3 for d in (False, True))
        print(f"| {name} | {off:.1f} | {on:.1f} | {on / off:.2f} |")
    if args.decode:
        print("\n## Decode: 128 greedy tokens per sequence after a short prompt (tok/s over the whole request, its "
              "prompt included; median of the rounds)\n\n"
              "| sequences | off | on | on / off |\n|---|---|---|---|")
        params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        for count in (1, 16):
            rates = {False: [], True: []}
            for r in range(args.rounds):
                for det in ((False, True) if r % 2 else (True, False)):
                    batch = [chat(probe, f"Decode {r} {i}: {TOPICS[i % 16]}") for i in range(count)]
                    rates[det].append(128 * count / timed(engines[det], batch, params, f"d{r}-{det}-{count}"))
            off, on = (statistics.median(rates[d]) for d in (False, True))
            print(f"| {count} | {off:.1f} | {on:.1f} | {on / off:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

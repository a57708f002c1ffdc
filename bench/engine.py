"""Engine throughput and latency: Corral against HF ``generate`` (static batches, bf16) and llama-cpp-python (the
same GGUF, 2 threads), in one run, on the same workload.

Workload: 64 chat requests with prompts of 50-500 tokens and outputs of 32-256 tokens (seeded). Every engine
must produce exactly each request's output length (EOS is suppressed), so tokens per second compare like for
like. Arrivals: all at once, and as a Poisson stream (Corral and llama.cpp; a static batch has no notion of
arrival). A second workload: 32 requests sharing a 1,000-token system prompt, Corral with the prefix cache on
and off. Printed per engine: output tok/s, TTFT p50/p99, TPOT p50/p99, and the ratios.

HF runs in two forms, both bf16 (see ``load_hf``): as transformers loads the GGUF (quantized tensors kept packed)
and as a plain dense model of the same dequantized weights; the ratio is against the fastest HF run.

    .venv/bin/python bench/engine.py                       # everything (about 25 minutes on 2 cores)
    .venv/bin/python bench/engine.py --engines corral --skip-poisson

HF's TTFT in a static batch is the batch's first decoding step (prefill included) minus the request's
arrival; its TPOT is the mean step time after that. llama.cpp serves one request at a time, as its Python
binding does; under a Poisson stream a request waits for the one before it.
"""

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from corral.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from corral.models import load_tokenizer, resolve_model  # noqa: E402

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river mountain engine garden music letter window city "
         "history science money story market water energy language system question answer light night").split()


@dataclass
class Request:
    prompt_token_ids: list[int]
    num_output_tokens: int
    arrival: float = 0.0  # seconds after the run starts


@dataclass
class Timing:
    arrival: float
    first_token: float
    finished: float
    num_tokens: int

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        return (self.finished - self.first_token) / max(1, self.num_tokens - 1)


@dataclass
class Result:
    engine: str
    scenario: str
    wall: float
    timings: list[Timing] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return sum(t.num_tokens for t in self.timings) / self.wall


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def make_workload(tokenizer, num_requests: int, seed: int, system: str | None = None,
                  prompt_range=(50, 500), output_range=(32, 256)) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        target = rng.randint(*prompt_range) if system is None else 0
        words = " ".join(rng.choice(WORDS) for _ in range(max(target, 12)))
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": f"Request {i}. Summarise these words as a story: {words}"}]
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
        if system is None:
            # trim the user text so the whole chat prompt has the target length; the chat frame stays
            head, tail = ids[: target - 5], ids[-5:]
            ids = head + tail
        requests.append(Request(ids, rng.randint(*output_range)))
    return requests


def poisson_arrivals(requests: list[Request], rate: float, seed: int) -> list[Request]:
    rng, now, out = random.Random(seed), 0.0, []
    for r in requests:
        now += rng.expovariate(rate)
        out.append(Request(r.prompt_token_ids, r.num_output_tokens, now))
    return out


# -- Corral ---------------------------------------------------------------------------------------------------
def run_corral(engine: LLMEngine, requests: list[Request], scenario: str) -> Result:
    pending = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    timings: dict[int, Timing] = {}
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and requests[pending[0]].arrival <= now:
            i = pending.pop(0)
            r = requests[i]
            params = SamplingParams(temperature=0, max_tokens=r.num_output_tokens, ignore_eos=True)
            engine.add_request(f"bench-{i}", r.prompt_token_ids, params)
            timings[i] = Timing(r.arrival, 0.0, 0.0, 0)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, requests[pending[0]].arrival - now))
            continue
        for out in engine.step():
            t = timings[int(out.request_id.split("-")[1])]
            stamp = time.perf_counter() - start
            if not t.first_token:
                t.first_token = stamp
            if out.finished:
                t.finished, t.num_tokens = stamp, len(out.outputs[0].token_ids)
    return Result("corral", scenario, time.perf_counter() - start, [timings[i] for i in sorted(timings)])


# -- HF transformers ------------------------------------------------------------------------------------------
def load_hf(weights: str):
    """HF's Llama in bf16. ``gguf``: loaded from the GGUF file as transformers does it (its loader warns that it
    keeps the quantized tensors packed and casts each bf16 matmul's input and output);
    ``dense``: the same weights dequantized to plain bf16 tensors (Corral's own conversion, HF names and layout)
    in an ordinary ``nn.Linear`` model. Both run, and the ratio is taken against the faster."""
    from transformers import AutoConfig, AutoModelForCausalLM

    files = resolve_model(None)
    folder, name = os.path.dirname(files.path), os.path.basename(files.path)
    if weights == "gguf":
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16).eval()
    from corral.engine.weights import load_weights
    from corral.models import load_model_config

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, gguf_file=name), dtype=torch.bfloat16)
    state = load_weights(files, load_model_config(files), torch.bfloat16)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # a tied head is not stored
    model.tie_weights()
    return model.eval()


def run_hf(model, requests: list[Request], batch_size: int, pad_id: int, weights: str) -> Result:
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        def __init__(self):
            self.stamps = []

        def __call__(self, input_ids, scores):
            self.stamps.append(time.perf_counter())
            return scores

    timings, start = [], time.perf_counter()
    for b in range(0, len(requests), batch_size):
        batch = requests[b: b + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.tensor([[pad_id] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch])
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(r.prompt_token_ids) for r in batch])[:, None])
        new = max(r.num_output_tokens for r in batch)
        clock = StepClock()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad_id, logits_processor=LogitsProcessorList([clock]))
        stamps = [s - start for s in clock.stamps]
        for r in batch:
            timings.append(Timing(r.arrival, stamps[0], stamps[r.num_output_tokens - 1], r.num_output_tokens))
    return Result(f"hf-{weights}-b{batch_size}", "all at once", time.perf_counter() - start, timings)


# -- llama.cpp ------------------------------------------------------------------------------------------------
def load_llama_cpp():
    from llama_cpp import Llama

    return Llama(model_path=resolve_model(None).path, n_threads=2, n_threads_batch=2, n_ctx=2048, n_batch=512,
                 verbose=False)


def run_llama_cpp(llm, requests: list[Request], eos: int, scenario: str) -> Result:
    timings, start = [], time.perf_counter()
    for r in sorted(requests, key=lambda r: r.arrival):
        wait = r.arrival - (time.perf_counter() - start)
        if wait > 0:
            time.sleep(wait)
        llm.reset()
        first, count = None, 0
        for _ in llm.create_completion(r.prompt_token_ids, max_tokens=r.num_output_tokens, temperature=0.0,
                                       logit_bias={eos: -1e9}, stream=True):
            count += 1
            if first is None:
                first = time.perf_counter() - start
        timings.append(Timing(r.arrival, first, time.perf_counter() - start, count))
    return Result("llama.cpp", scenario, time.perf_counter() - start, timings)


# -- report ---------------------------------------------------------------------------------------------------
def report(results: list[Result]) -> None:
    print(f"\n{'engine':<18} {'scenario':<22} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
          f"{'TPOT p99':>9}  (seconds)")
    for r in results:
        ttft, tpot = [t.ttft for t in r.timings], [t.tpot for t in r.timings]
        print(f"{r.engine:<18} {r.scenario:<22} {r.tok_s:>9.1f} {percentile(ttft, 50):>9.3f} {percentile(ttft, 99):>9.3f}"
              f" {percentile(tpot, 50):>9.4f} {percentile(tpot, 99):>9.4f}")
    corral = next((r for r in results if r.engine == "corral" and r.scenario == "all at once"), None)
    hf = [r for r in results if r.engine.startswith("hf")]
    llama = next((r for r in results if r.engine == "llama.cpp" and r.scenario == "all at once"), None)
    if corral and hf:
        best = max(hf, key=lambda r: r.tok_s)
        print(f"corral / HF best batch ({best.engine}) output tok/s: {corral.tok_s / best.tok_s:.2f}x (target >= 2x)")
    if corral and llama:
        print(f"corral / llama.cpp output tok/s: {corral.tok_s / llama.tok_s:.2f}x (target >= 3x)")
    on = next((r for r in results if r.scenario == "shared prefix, cache on"), None)
    off = next((r for r in results if r.scenario == "shared prefix, cache off"), None)
    if on and off:
        ratio = percentile([t.ttft for t in off.timings], 50) / percentile([t.ttft for t in on.timings], 50)
        print(f"shared 1,000-token system prompt: TTFT p50 without / with prefix cache: {ratio:.1f}x (target >= 5x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="corral,hf,llama.cpp")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--hf-batch-sizes", default="16,32")
    parser.add_argument("--hf-weights", default="dense,gguf", help="HF model variants (see load_hf), all bf16")
    parser.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--skip-poisson", action="store_true")
    parser.add_argument("--skip-prefix", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    engines = set(args.engines.split(","))
    torch.set_num_threads(2)
    tokenizer = load_tokenizer()
    workload = make_workload(tokenizer, args.num_requests, args.seed)
    stream = poisson_arrivals(workload, args.rate, args.seed)
    print(f"{len(workload)} requests, prompt tokens {sum(len(r.prompt_token_ids) for r in workload)}, "
          f"output tokens {sum(r.num_output_tokens for r in workload)}; torch threads {torch.get_num_threads()}; "
          f"load average at the start (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    results = []
    if "corral" in engines:
        engine = LLMEngine(EngineConfig(dtype=args.dtype))
        run_corral(engine, workload[:4], "warm-up")
        results.append(run_corral(engine, workload, "all at once"))
        engine.block_manager.reset_prefix_cache()
        if not args.skip_poisson:
            results.append(run_corral(engine, stream, f"poisson {args.rate:g}/s"))
        if not args.skip_prefix:
            system = " ".join(f"Rule {i}: answer politely, briefly and truthfully." for i in range(75))
            shared = make_workload(tokenizer, 32, args.seed + 1, system=system, output_range=(32, 32))
            print(f"shared-prefix workload: {len(shared[0].prompt_token_ids)} prompt tokens per request")
            engine.block_manager.reset_prefix_cache()
            results.append(run_corral(engine, shared, "shared prefix, cache on"))
            uncached = LLMEngine(EngineConfig(dtype=args.dtype, enable_prefix_caching=False))
            results.append(run_corral(uncached, shared, "shared prefix, cache off"))
        report(results)
    if "hf" in engines:
        pad = tokenizer.eos_token_ids[0]
        for weights in args.hf_weights.split(","):
            model = load_hf(weights)
            for size in map(int, args.hf_batch_sizes.split(",")):
                results.append(run_hf(model, workload, size, pad, weights))
                report(results[-1:])
            del model
    if "llama.cpp" in engines:
        llm = load_llama_cpp()
        eos = tokenizer.eos_token_ids[0]
        results.append(run_llama_cpp(llm, workload, eos, "all at once"))
        report(results[-1:])
        if not args.skip_poisson:
            results.append(run_llama_cpp(llm, stream, eos, f"poisson {args.rate:g}/s"))
    report(results)
    print(f"load average at the end (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()

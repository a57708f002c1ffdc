"""Engine throughput and latency: Corral's server against llama.cpp's ``llama-server`` (and HF ``generate``, and
llama-cpp-python for one stream), in one run, cell by cell, on the same requests.

Every server is driven through its OpenAI-compatible ``/v1/chat/completions`` by the same client (streaming, so
TTFT is the first content chunk). Free-text requests ask for an exact output length (``max_tokens`` with
``ignore_eos``); a response whose ``usage.completion_tokens`` differs is counted as a failure, not as tokens.
Constrained requests (real JSON Schemas from the MaskBench dev set, ``response_format``, flexible whitespace on
both sides: Corral's ``disable_any_whitespace: false`` and llama.cpp's own JSON grammar, which allows
whitespace) end where the model ends them: tokens per second are over the tokens produced, and requests/s.

Cells: short prompts at 1, 4, 16 and 64 concurrent clients (128 output tokens each), prompts of 50-500 tokens
at 16 clients (32-256 output tokens), prompts of about 1,750-1,830 tokens at 1 and 4 clients (128 output tokens: a long
context, within llama-server's 2,048 tokens per slot), JSON schemas at 1, 4, 16 and 64 clients (8, 16, 64 and 64
schemas, no schema in two cells; up to 192 tokens), and 32 requests that share a 1,000-token system prompt at 16
clients. Each cell has a fixed request count; the engines take turns
cell by cell, so a slow minute on this shared machine hits both. A cell's requests are all distinct from the
warm-up's and from every other cell's (no accidental prefix-cache hits); both engines keep their prompt cache
on, as they ship.

- Corral runs as ``make serve`` runs it (``--dtype auto --quantization auto``: on the shipped GGUF, its Q4 linears
  as shipped, in bf16 where the CPU has fast bf16), and in dense fp32, the reference numerics.
- llama-server runs with 1, 4, 16 and 64 parallel slots (those up to the cell's concurrency), each with a
  2,048-token context, continuous batching on, 2 threads; the best is reported, and the ratio is against it.

Each row notes a machine check taken just before it (fixed pure-Python work, and a sum over 256 MB): this is a
shared machine. ``OMP_WAIT_POLICY`` is removed from this process's environment before anything loads OpenMP:
``PASSIVE`` makes ggml's threads sleep at the barrier after every operation, and llama.cpp (server or in
process) then decodes 4-5 times slower on two cores. Every engine runs with its default.
- HF ``generate`` (static batches of 1, 16 and 64, the same dense weights) runs the short-prompt and the long
  cells, in fp32 (bf16 too where it is fast); its TTFT counts the wait for earlier batches.
- llama-cpp-python (in process, the same prompt token ids) runs the single-client cell.

With ``--formats``, Corral runs once per number format instead (fp32, bf16, W8A16, W4A16 from the GGUF's Q4_1
blocks, each with its activation-dtype KV cache and with an int8 one, and ``auto``: what ``make serve`` picks), on
the short-prompt cells at 1, 16 and 64 clients by default, beside llama-server at its best slot count. W8A16 and
W4A16 take bf16 activations in their matmuls whatever the model dtype (torch's int8/int4 CPU kernels are many
times slower in fp32); their model dtype is ``auto``'s.

    .venv/bin/python bench/engine.py                     # everything, about 35-40 minutes on 2 cores
    .venv/bin/python bench/engine.py --cells short-1,json-16 --no-hf
    .venv/bin/python bench/engine.py --formats --no-hf --slots 1,16,64   # about 25 minutes
    .venv/bin/python bench/engine.py --cells short-1,short-4,short-16 --no-hf --no-fp32 --decode-bursts 1
    .venv/bin/python bench/engine.py --cells short-1,short-4 --no-hf --no-fp32 --temperature 0.8 --top-p 0.95 \
        --top-k 40 --min-p 0.05                          # sampled, the same parameters sent to every server
    .venv/bin/python bench/engine.py --model smollm2-q4km.gguf --cells short-1,short-16 --no-hf --no-fp32

``--no-drafts`` runs Corral without prompt lookup and jump-forward (for ``bench/decode_scale.py``'s random models).
``--model FILE`` runs every engine (Corral, llama-server, llama-cpp-python) on that GGUF instead of the shipped one
(HF rows are off: they run the shipped model's dense weights); a K-quant file is made from the shipped one with
llama.cpp's own ``llama-quantize --allow-requantize SHIPPED.gguf OUT.gguf Q4_K_M``.
"""

import argparse
import asyncio
import collections
import gzip
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.pop("OMP_WAIT_POLICY", None)  # each engine's own default (see above); before torch or llama_cpp load
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import httpx  # noqa: E402

from servers import (LLAMA_SERVER, Server, closed_loop, corral_server, cpu_summary, dropped_kind,  # noqa: E402
                     has_fast_bf16, llama_server, llama_server_version)

LLAMA_CTX_PER_SLOT = 2048  # servers.llama_server's default
# --formats: name -> corral serve's format flags
FORMATS_ARGS = {"fp32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"},
                "w8a16": {"dtype": "auto", "quantization": "w8a16"}, "w4a16": {"dtype": "auto", "quantization": "gguf"},
                "w4a8": {"dtype": "auto", "quantization": "w4a8"}, "auto": {"dtype": "auto", "quantization": "auto"}}
FORMATS = ("fp32", "bf16", "w8a16", "w4a16", "w4a8")

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river mountain engine garden music letter window city "
         "history science money story market water energy language system question answer light night").split()
DATA = os.path.join(ROOT, "..", "shared", "data", "maskbench-dev.jsonl.gz")
MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Request:
    messages: list[dict]
    max_tokens: int
    exact: bool = True  # free text: exactly max_tokens (EOS ignored); constrained: the model ends it
    schema: dict | None = None


@dataclass
class Cell:
    name: str
    concurrency: int
    requests: list[Request]
    hf_batch: int | None = None  # HF static batch size, None: HF does not run this cell


@dataclass
class Timing:
    start: float
    first: float | None = None
    end: float = 0.0
    num_tokens: int = 0
    error: str | None = None
    dropped: str | None = None  # the connection failed before any response: see servers.closed_loop

    @property
    def ttft(self) -> float:
        return (self.first if self.first is not None else self.end) - self.start

    @property
    def tpot(self) -> float:
        return (self.end - (self.first or self.end)) / max(1, self.num_tokens - 1)


@dataclass
class Result:
    engine: str
    cell: str
    wall: float
    timings: list[Timing] = field(default_factory=list)
    note: str = ""

    @property
    def ok(self) -> list[Timing]:
        return [t for t in self.timings if t.error is None]

    @property
    def tok_s(self) -> float:
        return sum(t.num_tokens for t in self.ok) / self.wall

    @property
    def req_s(self) -> float:
        return len(self.ok) / self.wall


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


# ---- workloads ------------------------------------------------------------------------------------------------
def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def free_text(tag: str, num: int, seed: int, prompt_words=(8, 8), outputs=(128, 128),
              system: str | None = None) -> list[Request]:
    """Distinct requests (each names its cell and index first, so no two share more than the chat frame)."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        user = f"{tag} request {i}. Tell a story about: {words(rng, rng.randint(*prompt_words))}"
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        out.append(Request(messages, rng.randint(*outputs)))
    return out


def json_requests(num: int, offset: int = 0) -> list[Request]:
    """``num`` dev schemas spread over the file (it is grouped by source), each with its description as prompt.
    Each pick is at an index that is ``offset`` (0-3) modulo 4, so cells with different offsets share no schema."""
    with gzip.open(DATA, "rt") as f:
        entries = [json.loads(line) for line in f]
    step = max(4, len(entries) // num)
    out = []
    for entry in [entries[(k * step // 4) * 4 + offset] for k in range(num)]:
        schema = entry["schema"]
        described = schema.get("description") if isinstance(schema, dict) else None
        prompt = (described.strip()[:400] if isinstance(described, str) and described.strip()
                  else "Produce one JSON value of the expected structure.")
        out.append(Request([{"role": "user", "content": f"{prompt}\nAnswer with JSON."}], 192, False, schema))
    return out


def make_cells(seed: int) -> list[Cell]:
    system = " ".join(f"Rule {i}: answer politely, briefly and truthfully." for i in range(75))  # ~1,000 tokens
    return [
        Cell("short-1", 1, free_text("short-1", 4, seed), hf_batch=1),
        Cell("short-4", 4, free_text("short-4", 8, seed + 1)),
        Cell("short-16", 16, free_text("short-16", 32, seed + 2), hf_batch=16),
        Cell("short-64", 64, free_text("short-64", 64, seed + 3), hf_batch=64),
        Cell("long-16", 16, free_text("long-16", 32, seed + 4, prompt_words=(40, 450), outputs=(32, 256)),
             hf_batch=16),
        Cell("context-1", 1, free_text("context-1", 4, seed + 6, prompt_words=(1700, 1800))),
        Cell("context-4", 4, free_text("context-4", 8, seed + 7, prompt_words=(1700, 1800))),
        Cell("json-1", 1, json_requests(8, offset=1)),
        Cell("json-4", 4, json_requests(16, offset=2)),
        Cell("json-16", 16, json_requests(64)),
        Cell("json-64", 64, json_requests(64, offset=3)),
        Cell("prefix-16", 16, free_text("prefix-16", 32, seed + 5, prompt_words=(4, 4), outputs=(32, 32),
                                        system=system)),
    ]


# ---- the HTTP client, the same for every server ---------------------------------------------------------------
SAMPLING = {"temperature": 0}  # every request's sampling parameters (main sets them from the command line)


def body_of(request: Request, engine: str) -> dict:
    body = {"model": MODEL, "messages": request.messages, "max_tokens": request.max_tokens, **SAMPLING,
            "stream": True, "stream_options": {"include_usage": True}}
    if request.exact:
        body["ignore_eos"] = True  # both servers take it: exactly max_tokens tokens
    if request.schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "out", "schema": request.schema}}
        if engine.startswith("corral"):
            body["structured_outputs"] = {"disable_any_whitespace": False}  # flexible, as llama.cpp's grammar
    return body


async def one(client: httpx.AsyncClient, url: str, request: Request, engine: str, t0: float) -> Timing:
    timing = Timing(time.perf_counter() - t0)
    usage = None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body_of(request, engine)) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {(await response.aread())[:120]!r}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        timing.error = str(chunk["error"])[:120]
                    usage = chunk.get("usage") or usage
                    if timing.first is None and any((c.get("delta") or {}).get("content")
                                                    for c in chunk.get("choices") or ()):
                        timing.first = time.perf_counter() - t0
    except httpx.HTTPError as err:
        timing.error = f"{type(err).__name__}: {err}"[:120]
        timing.dropped = dropped_kind(err) if timing.first is None and usage is None else None
    timing.end = time.perf_counter() - t0
    timing.num_tokens = (usage or {}).get("completion_tokens", 0)
    if timing.error is None and usage is None:
        timing.error = "no usage in the stream"
    elif timing.error is None and request.exact and timing.num_tokens != request.max_tokens:
        timing.error = f"{timing.num_tokens} tokens, asked for exactly {request.max_tokens}"
    return timing


async def drive(url: str, requests: list[Request], concurrency: int, engine: str,
                server: Server | None = None) -> tuple[float, list[Timing], int]:
    """The requests through ``concurrency`` closed-loop clients (``servers.closed_loop``: a dropped connection
    is retried, a dead server restarted off the clock). Returns the wall time, the timings and the restarts."""
    t0 = time.perf_counter()

    async def send(client, request):
        timing = await one(client, url, request, engine, t0)
        return timing, timing.dropped

    def crashed(timing: Timing) -> Timing:
        timing.error = f"crashed: the server died ({timing.error})"[:120]
        return timing

    timings, wall, restarts = await closed_loop(server, requests, concurrency, send, crashed)
    return wall, timings, restarts


def run_server(engine: str, url: str, cell: Cell, note: str = "", server: Server | None = None) -> Result:
    check = machine_check()
    wall, timings, restarts = asyncio.run(drive(url, cell.requests, cell.concurrency, engine, server))
    notes = [note] if note else []
    notes += [f"{restarts} server restart(s) after crashes, not timed"] if restarts else []
    return Result(engine, cell.name, wall, timings, "; ".join(notes + [check]))


_BIG = None


def machine_check() -> str:
    """Two fixed pieces of work, timed before each run so that a slow stretch of this shared machine (other
    tenants) shows beside the numbers it slowed: pure Python (CPU-bound) and a sum over 256 MB (memory-bound; a
    decode step that streams its weights is slowed by the same things)."""
    global _BIG
    import numpy as np

    if _BIG is None:
        _BIG = np.ones(64 << 20, dtype=np.float32)
    start = time.perf_counter()
    total = 0
    for i in range(1_000_000):
        total += i * i
    middle = time.perf_counter()
    float(_BIG.sum())
    end = time.perf_counter()
    return f"check: python {(middle - start) * 1e3:.0f} ms, memory {(end - middle) * 1e3:.0f} ms"


def warm_up(engine: str, url: str) -> None:
    """Two requests unlike any measured one (loads kernels and caches the chat frame, as a running server has)."""
    cell = Cell("warm-up", 2, free_text("warm-up", 2, 99, outputs=(16, 16)))
    run_server(engine, url, cell)


# ---- HF generate (static batches) and llama-cpp-python (one stream), in this process ---------------------------
def chat_ids(tokenizer, request: Request) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(request.messages))


def load_hf(dtype: str):
    """HF's Llama with the same weights dequantized (Corral's conversion, HF names), a plain dense model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from corral.engine.weights import load_weights
    from corral.models import load_model_config, resolve_model

    files = resolve_model(None)
    folder, name = os.path.dirname(files.path), os.path.basename(files.path)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, gguf_file=name), dtype=torch_dtype)
    missing, unexpected = model.load_state_dict(load_weights(files, load_model_config(files), torch_dtype),
                                                strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def run_hf(model, tokenizer, cell: Cell, label: str) -> Result:
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        def __init__(self):
            self.stamps = []

        def __call__(self, input_ids, scores):
            self.stamps.append(time.perf_counter())
            return scores

    pad = tokenizer.eos_token_ids[0]
    check = machine_check()
    timings, start = [], time.perf_counter()
    for b in range(0, len(cell.requests), cell.hf_batch):
        batch = cell.requests[b: b + cell.hf_batch]
        prompts = [chat_ids(tokenizer, r) for r in batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        new = max(r.max_tokens for r in batch)
        clock = StepClock()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad, logits_processor=LogitsProcessorList([clock]))
        stamps = [s - start for s in clock.stamps]
        timings += [Timing(0.0, stamps[0], stamps[r.max_tokens - 1], r.max_tokens) for r in batch]
    return Result(label, cell.name, time.perf_counter() - start, timings, check)


def run_llama_cpp_python(tokenizer, cell: Cell, model: str | None = None) -> Result:
    from llama_cpp import Llama

    from corral.models import resolve_model

    llm = Llama(model_path=resolve_model(model).path, n_threads=2, n_threads_batch=2, n_ctx=2048, verbose=False)
    eos = tokenizer.eos_token_ids[0]
    check = machine_check()
    timings, start = [], time.perf_counter()
    for request in cell.requests:
        llm.reset()  # a fresh context per request, as each HTTP request here is distinct
        timing = Timing(time.perf_counter() - start)
        for chunk in llm.create_completion(chat_ids(tokenizer, request), max_tokens=request.max_tokens,
                                           temperature=SAMPLING["temperature"], top_p=SAMPLING.get("top_p", 1.0),
                                           top_k=SAMPLING.get("top_k", 0), min_p=SAMPLING.get("min_p", 0.0),
                                           logit_bias={eos: -1e9}, stream=True):
            if chunk["choices"][0]["finish_reason"] is not None:
                continue  # the closing chunk carries no token
            timing.num_tokens += 1
            if timing.first is None:
                timing.first = time.perf_counter() - start
        timing.end = time.perf_counter() - start
        if timing.num_tokens != request.max_tokens:
            timing.error = f"{timing.num_tokens} tokens, asked for exactly {request.max_tokens}"
        timings.append(timing)
    return Result("llama-cpp-python", cell.name, time.perf_counter() - start, timings, f"in process; {check}")


# ---- report ---------------------------------------------------------------------------------------------------
def row(r: Result) -> str:
    ttft, tpot = [t.ttft for t in r.ok], [t.tpot for t in r.ok]
    failed = len(r.timings) - len(r.ok)
    return (f"| {r.engine} | {r.cell} | {r.tok_s:.1f} | {r.req_s:.2f} | {percentile(ttft, 50):.3f} / "
            f"{percentile(ttft, 99):.3f} | {percentile(tpot, 50) * 1e3:.1f} / {percentile(tpot, 99) * 1e3:.1f} | "
            f"{failed}/{len(r.timings)} | {r.note} |")


def header() -> str:
    return ("| engine | cell | output tok/s | req/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | failed | note |\n"
            "|---|---|---|---|---|---|---|---|")


def summary(results: list[Result]) -> None:
    print("\n## Summary: Corral as make serve runs it (corral-auto; else its best run) against the best llama-server "
          "slot count\n")
    print("| cell | Corral | tok/s | llama-server | tok/s | Corral / llama-server | HF best | Corral / HF |")
    print("|---|---|---|---|---|---|---|---|")
    for cell in dict.fromkeys(r.cell for r in results):
        here = [r for r in results if r.cell == cell]
        ours = next((r for r in here if r.engine == "corral-auto"), None) or max(
            (r for r in here if r.engine.startswith("corral")), key=lambda r: r.tok_s, default=None)
        peer = max((r for r in here if r.engine.startswith("llama-server")), key=lambda r: r.tok_s, default=None)
        hf = max((r for r in here if r.engine.startswith("hf")), key=lambda r: r.tok_s, default=None)
        if ours is None:
            continue
        cells = [cell, ours.engine, f"{ours.tok_s:.1f}"]
        cells += [peer.engine, f"{peer.tok_s:.1f}", ratio(ours.tok_s, peer.tok_s, bold=True)] if peer else ["-"] * 3
        cells += [f"{hf.engine} {hf.tok_s:.1f}", ratio(ours.tok_s, hf.tok_s)] if hf else ["-", "-"]
        print("| " + " | ".join(cells) + " |")


def format_summary(results: list[Result]) -> None:
    """--formats: every Corral format against the best llama-server slot count, cell by cell."""
    print("\n## Formats: output tok/s of each Corral format, and its ratio to the best llama-server slot count\n")
    cells = list(dict.fromkeys(r.cell for r in results))
    print("| format | " + " | ".join(cells) + " |")
    print("|---|" + "---|" * len(cells))
    best = {c: max((r for r in results if r.cell == c and r.engine.startswith("llama-server")),
                   key=lambda r: r.tok_s, default=None) for c in cells}
    for engine in dict.fromkeys(r.engine for r in results if r.engine.startswith("corral")):
        line = []
        for c in cells:
            r = next((r for r in results if r.engine == engine and r.cell == c), None)
            peer = best[c]
            line.append("-" if r is None else f"{r.tok_s:.1f}" + (f" ({ratio(r.tok_s, peer.tok_s)})" if peer else ""))
        print(f"| {engine} | " + " | ".join(line) + " |")
    print("| llama-server (best -np) | " + " | ".join(
        f"{best[c].tok_s:.1f} ({best[c].engine.split()[-1]})" if best[c] else "-" for c in cells) + " |")


def ratio(ours: float, theirs: float, bold: bool = False) -> str:
    """``ours / theirs``; a peer that produced nothing (every request failed) has no ratio, and says so."""
    if theirs <= 0:
        return "peer produced nothing"
    text = f"{ours / theirs:.2f}x"
    return f"**{text}**" if bold else text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", default=None, help="comma-separated cell names (default: all)")
    parser.add_argument("--slots", default="1,4,16,64", help="llama-server slot counts to try")
    parser.add_argument("--kv-unified", action="store_true", help="llama-server with one KV buffer for all slots")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--no-fp32", action="store_true", help="no dense float32 Corral (the reference numerics)")
    parser.add_argument("--no-llama", action="store_true")
    parser.add_argument("--no-drafts", action="store_true",
                        help="Corral without prompt lookup and jump-forward (a model of random weights repeats "
                             "itself, which drafts would turn into speed no real model's text gives)")
    parser.add_argument("--llama-server", default=LLAMA_SERVER,
                        help="the llama-server binary (default: make bench-extras' build for this CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="a GGUF file every engine runs instead of the shipped model "
                                                      "(implies --no-hf)")
    parser.add_argument("--out", default=None, help="write every timing as JSON")
    parser.add_argument("--decode-bursts", default="", help="also Corral (make serve's formats) with each of these "
                        "--decode-burst values, as corral-auto-burstN (comma separated; corral-auto runs the default)")
    parser.add_argument("--formats", nargs="?", const=",".join(FORMATS), default=None,
                        help=f"Corral in each number format (default list: {','.join(FORMATS)}; each also with an "
                             "int8 KV cache)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="every request's temperature (0: greedy); above 0 the HF rows are off (--no-hf)")
    parser.add_argument("--top-p", type=float, default=None, help="with --temperature (default 1: off)")
    parser.add_argument("--top-k", type=int, default=None, help="with --temperature (default 0: off)")
    parser.add_argument("--min-p", type=float, default=None, help="with --temperature (default 0: off)")
    args = parser.parse_args()
    if args.temperature > 0 and not args.no_hf:
        parser.error("sampled requests (--temperature > 0) run without the HF rows: add --no-hf")
    if args.temperature > 0:  # all four, sent to every server: llama-server's own defaults filter (top_k 40, ...)
        SAMPLING.update(temperature=args.temperature, top_p=1.0 if args.top_p is None else args.top_p,
                        top_k=0 if args.top_k is None else args.top_k, min_p=0.0 if args.min_p is None else args.min_p)
    from corral.models import load_tokenizer

    started = time.time()
    fast_bf16 = has_fast_bf16()
    dtypes = ["float32", "bfloat16"] if fast_bf16 else ["float32"]
    print(f"# bench/engine.py, {time.strftime('%Y-%m-%d %H:%M')}\n\nCPU: {cpu_summary()}; fast bf16: {fast_bf16}; "
          f"HF dtypes: {', '.join(dtypes)}; load average {os.getloadavg()[0]:.2f}\nsampling: {SAMPLING}")
    cells = make_cells(args.seed)
    if args.cells or args.formats:
        wanted = (args.cells or "short-1,short-16,short-64").split(",")
        cells = [c for c in cells if c.name in wanted]
    global MODEL
    from corral.models import resolve_model

    files = resolve_model(args.model)
    if args.model:
        args.no_hf, MODEL = True, files.name  # the name Corral serves it under (llama-server takes any)
        print(f"model: {files.path}")
    tokenizer = load_tokenizer(files)
    model_args = ("--model", files.path) if args.model else ()
    if args.no_drafts:  # every Corral server without prompt lookup and jump-forward
        model_args = (*model_args, "--jump-forward", "off", "--speculation", "off")
    if not args.no_llama and not os.path.exists(args.llama_server):
        print(f"WARNING: {args.llama_server} is missing (make bench-extras): no llama-server rows", file=sys.stderr)
    elif not args.no_llama:
        print(f"llama-server: {args.llama_server}: {llama_server_version(args.llama_server)}, "
              f"{LLAMA_CTX_PER_SLOT}-token context per slot")
    from corral.engine.config import EngineConfig
    from corral.engine.formats import resolve
    from corral.engine.weights import gguf_has_q4, gguf_has_q8

    auto = resolve(EngineConfig(dtype="auto", quantization="auto"), gguf_q4=gguf_has_q4(files),
                   gguf_q8=gguf_has_q8(files))
    print(f"auto (make serve) picks here: {auto.tag} ({auto.reason})")
    if args.formats:
        corrals = {}
        for name in args.formats.split(","):
            for kv in ("auto", "int8"):
                label = f"corral-{name}" + ("-kvint8" if kv == "int8" else "")
                corrals[label] = corral_server(**FORMATS_ARGS[name], kv_cache_dtype=kv, label=label,
                                               extra=model_args).start()
    else:
        corrals = {"corral-auto": corral_server("auto", quantization="auto", label="corral-auto",
                                                extra=model_args).start()}
        for burst in (int(b) for b in args.decode_bursts.split(",") if b):
            label = f"corral-auto-burst{burst}"
            corrals[label] = corral_server("auto", quantization="auto", label=label,
                                           extra=("--decode-burst", str(burst), *model_args)).start()
        if not args.no_fp32:
            corrals["corral-float32"] = corral_server("float32", extra=model_args).start()
    for label, server in corrals.items():
        warm_up(label, server.url)
        native = httpx.get(server.url + "/health", timeout=30).json().get("native") or {}
        print(f"{label}: kernels {native.get('kernels')}, products {native.get('qmatmul')}, module "
              f"{native.get('module')}")
    hf_models = {} if args.no_hf else {dtype: load_hf(dtype) for dtype in dtypes}
    results: list[Result] = []
    print(header())
    try:
        for cell in cells:
            for label, server in corrals.items():
                results.append(run_server(label, server.url, cell, server=server))
                print(row(results[-1]), flush=True)
            if not args.no_llama and os.path.exists(args.llama_server):
                for slots in (int(s) for s in args.slots.split(",")):
                    if slots > max(cell.concurrency, 1):
                        continue
                    with llama_server(slots, binary=args.llama_server, kv_unified=args.kv_unified,
                                      model=files.path) as peer:
                        warm_up("llama-server", peer.url)
                        results.append(run_server(f"llama-server -np {slots}", peer.url, cell, server=peer))
                    print(row(results[-1]), flush=True)
            for dtype, model in hf_models.items():
                if cell.hf_batch:
                    results.append(run_hf(model, tokenizer, cell, f"hf-{dtype}-b{cell.hf_batch}"))
                    print(row(results[-1]), flush=True)
            if cell.name == "short-1" and not args.no_llama and args.llama_server != LLAMA_SERVER:
                print("llama-cpp-python skipped: it is built like the default llama-server, not like "
                      f"{args.llama_server}", file=sys.stderr)
            elif cell.name == "short-1" and not args.no_llama:
                try:
                    results.append(run_llama_cpp_python(tokenizer, cell, args.model))
                    print(row(results[-1]), flush=True)
                except ImportError:
                    print("llama-cpp-python is not installed (make bench-extras): skipped", file=sys.stderr)
    finally:
        for server in corrals.values():
            server.stop()
    if args.out:
        with open(args.out, "w") as f:
            json.dump([{"engine": r.engine, "cell": r.cell, "wall": r.wall, "note": r.note,
                        "timings": [vars(t) for t in r.timings]} for r in results], f)
    summary(results)
    if args.formats:
        format_summary(results)
    print(f"\nwhole run {(time.time() - started) / 60:.1f} min; load average at the end {os.getloadavg()[0]:.2f}")
    failures = [(r.engine, r.cell, t.error) for r in results for t in r.timings if t.error]
    if failures:
        print(f"failed requests (first 10 of {len(failures)}): {failures[:10]}")
        for engine in dict.fromkeys(e for e, _, _ in failures):  # every engine's kinds of failure, counted
            kinds = collections.Counter(error[:60] for e, _, error in failures if e == engine)
            print(f"  {engine}: {dict(kinds.most_common(5))}")


if __name__ == "__main__":
    main()

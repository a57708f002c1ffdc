"""What each number format costs in quality, against the float32 reference (the shipped Q4_1 weights dequantized
to float32, float32 activations and KV cache), in one run on the same inputs.

Per format (``dtype/quantization/kv``):

- **Perplexity** on ``bench/data/kjv-genesis.txt`` (Genesis 1-28 of the King James Version, public domain;
  taken from Debian's ``bible-kjv-text`` package, verse numbers removed, verses joined per chapter): 25,062
  tokens in 1,024-token windows, each fed as four 256-token chunks so that later chunks attend through the KV
  cache (an int8 cache is read as it is in decode). Reported: perplexity over every window, over the last 256
  positions of each window, and over 4,096-token windows' last 1,024 positions (the longest contexts); then the
  per-window increase over the reference, mean and worst decile (the mean of the worst 10% of windows).
- **Greedy agreement** over 50 prompts, 64 tokens each: the first position where the output leaves the
  reference's (64 when it never does), mean and worst decile (the mean of the 5 earliest divergences), and
  the share that never diverge.
- **JSON tasks**: 100 MaskBench dev schemas (spread over the file), greedy under the schema, up to 256 tokens:
  the share of outputs that are complete and valid (``jsonschema``), and the share identical to the
  reference's output. Every schema counts: one that fails to compile counts as invalid in every format.

A quantization ``w4a16-g64`` is W4A16 at group 64; ``w4a16-g64-awq`` the same with activation-aware scales and
clipping (``--awq``).

    .venv/bin/python bench/quality.py                          # every format, about 30 minutes on 2 cores
    .venv/bin/python bench/quality.py --formats bfloat16/gguf/auto --json-tasks 20
"""

import argparse
import gzip
import json
import math
import os
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jsonschema  # noqa: E402
import torch  # noqa: E402

from corral.engine import EngineConfig, LLMEngine  # noqa: E402
from corral.engine.attention import AttentionMetadata, KVCache, PrefillSpan  # noqa: E402
from corral.engine.config import kv_torch_dtype  # noqa: E402
from corral.engine.sampling_params import SamplingParams  # noqa: E402
from servers import cpu_summary  # noqa: E402

TEXT = os.path.join(ROOT, "bench", "data", "kjv-genesis.txt")
DATA = os.path.join(ROOT, "..", "shared", "data", "maskbench-dev.jsonl.gz")
REFERENCE = "float32/none/float32"
FORMATS = [REFERENCE, "float32/none/int8", "bfloat16/none/bfloat16", "bfloat16/w8a16/bfloat16",
           "bfloat16/w4a16/bfloat16", "bfloat16/w4a16-g64/bfloat16", "bfloat16/w4a16-g64-awq/bfloat16",
           "bfloat16/gguf/bfloat16", "bfloat16/gguf/int8",
           "float32/gguf/float32"]
WORDS = ("river mountain engine garden music letter window city history science money story market water energy "
         "language system question answer light night king road winter ship doctor school friend").split()


def engine_for(spec: str) -> LLMEngine:
    dtype, quant, kv = spec.split("/")
    group, awq = 32, quant.endswith("-awq")
    quant = quant.removesuffix("-awq")
    if "-g" in quant:
        quant, group = quant.split("-g")[0], int(quant.split("-g")[1])
    return LLMEngine(EngineConfig(dtype=dtype, quantization=quant, quant_group_size=int(group), awq=awq,
                                  kv_cache_dtype=kv, num_kv_blocks=512, max_num_seqs=64))


@torch.inference_mode()
def token_nlls(engine: LLMEngine, ids: list[int], chunk: int) -> torch.Tensor:
    """Negative log-likelihood of ids[1:], the window fed in chunks through a fresh KV cache."""
    model, cfg = engine.runner.model, engine.model_config
    kv = kv_torch_dtype(engine.config.kv_cache_dtype)
    blocks = -(-len(ids) // 16)
    caches = [KVCache.allocate(blocks, 16, cfg.num_kv_heads, cfg.head_dim, kv) for _ in range(cfg.num_layers)]
    table = torch.arange(blocks)
    logits = []
    for start in range(0, len(ids), chunk):
        end = min(start + chunk, len(ids))
        context = None if start == 0 else table[: -(-end // 16)]
        meta = AttentionMetadata(torch.arange(start, end), (), (PrefillSpan(0, end - start, context, end),))
        hidden = model.forward(torch.tensor(ids[start:end]), torch.arange(start, end), meta, caches)
        logits.append(model.compute_logits(hidden))
    logprobs = torch.log_softmax(torch.cat(logits)[:-1], dim=-1)
    return -logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def perplexity(engine: LLMEngine, tokens: list[int]) -> dict:
    windows = [token_nlls(engine, tokens[i: i + 1024], 256) for i in range(0, len(tokens) - 1024 + 1, 1024)]
    longest = [token_nlls(engine, tokens[i: i + 4096], 1024) for i in range(0, len(tokens) - 4096 + 1, 4096)]
    return {"all": torch.cat(windows), "tail": torch.cat([w[-256:] for w in windows]),
            "long": torch.cat([w[-1024:] for w in longest]),
            "per_window": torch.stack([w.mean() for w in windows])}


def greedy_prompts(num: int) -> list[str]:
    rng = random.Random(7)
    return [f"Write a short paragraph about the {rng.choice(WORDS)} and the {rng.choice(WORDS)} of "
            f"{rng.choice(WORDS)}." for _ in range(num)]


def chat_ids(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def json_tasks(num: int) -> list[dict]:
    with gzip.open(DATA, "rt") as f:
        entries = [json.loads(line) for line in f]
    return [entry["schema"] for entry in entries[:: max(1, len(entries) // num)][:num]]


def compile_all(engine: LLMEngine, schemas: list) -> list:
    from corral.fsm.compiler import GrammarCompiler
    from corral.grammar.constraint import Constraint

    compiler = GrammarCompiler(engine.vocabulary)
    grammars = []
    for schema in schemas:
        try:
            grammars.append(compiler.compile(Constraint("json_schema", schema, lenient=True)))
        except Exception:  # noqa: BLE001 - counted as invalid in every format
            grammars.append(None)
    return grammars


def run_json(engine: LLMEngine, schemas: list, grammars: list) -> list[str | None]:
    todo = [i for i, g in enumerate(grammars) if g is not None]
    prompts = [chat_ids(engine, (s.get("description", "") if isinstance(s, dict) else "")[:300] +
                        "\nAnswer with one JSON value.") for s in (schemas[i] for i in todo)]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=256),
                           guides=[grammars[i].new_guide() for i in todo])
    texts: list[str | None] = [None] * len(schemas)
    for i, out in zip(todo, outs):
        texts[i] = out.outputs[0].text if out.outputs[0].finish_reason == "stop" else None
    return texts


def is_valid(text: str | None, schema) -> bool:
    if text is None:
        return False
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError, RecursionError):
        return False


def worst_decile(values: list[float], largest: bool) -> float:
    ordered = sorted(values, reverse=largest)
    k = max(1, len(ordered) // 10)
    return sum(ordered[:k]) / k


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=",".join(FORMATS), help="dtype/quantization/kv, comma separated")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--json-tasks", type=int, default=100)
    ap.add_argument("--text-tokens", type=int, default=None, help="use only the text's first N tokens (a dry run)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    formats = [REFERENCE] + [f for f in args.formats.split(",") if f != REFERENCE]
    print(f"# {cpu_summary()}; torch {torch.__version__}, {args.threads} threads", flush=True)
    text = open(TEXT).read()
    schemas = json_tasks(args.json_tasks)
    ref, rows, grammars = None, [], None
    for spec in formats:
        started = time.time()
        engine = engine_for(spec)
        tokens = engine.tokenizer.encode(text)[: args.text_tokens]
        if grammars is None:
            grammars = compile_all(engine, schemas)
        ppl = perplexity(engine, tokens)
        prompts = [chat_ids(engine, p) for p in greedy_prompts(args.prompts)]
        greedy = [o.outputs[0].token_ids for o in
                  engine.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))]
        texts = run_json(engine, schemas, grammars)
        result = {"spec": spec, "tag": engine.formats.tag, "ppl": ppl, "greedy": greedy, "json": texts}
        ref = ref or result
        rows.append(result)
        print(f"# {spec} ({engine.formats.tag}) done in {time.time() - started:.0f} s", flush=True)
        print_row(result, ref, schemas)
        del engine
    print(f"\n{len(tokens)} tokens of text; {args.prompts} greedy prompts; {len(schemas)} JSON tasks "
          f"({sum(g is not None for g in grammars)} compile)\n")
    print(HEADER)
    for r in rows:
        print_row(r, ref, schemas)
    return 0


HEADER = ("| format | ppl | ppl, window tail | ppl, 4k context | Δppl/window mean | worst decile | first divergence "
          "mean | worst decile | identical | JSON valid | JSON = fp32 |\n|---|---|---|---|---|---|---|---|---|---|---|")


def print_row(r: dict, ref: dict, schemas: list) -> None:
    if r is ref:
        print(HEADER)
    p, ref_windows = r["ppl"], ref["ppl"]["per_window"]
    increase = [math.exp(a) - math.exp(b) for a, b in zip(p["per_window"].tolist(), ref_windows.tolist())]
    diverge = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
               for a, b in zip(r["greedy"], ref["greedy"])]
    valid = sum(is_valid(t, s) for t, s in zip(r["json"], schemas))
    same = sum(t is not None and t == u for t, u in zip(r["json"], ref["json"]))
    print(f"| {r['spec']} | {math.exp(p['all'].mean()):.3f} | {math.exp(p['tail'].mean()):.3f} | "
          f"{math.exp(p['long'].mean()):.3f} | {sum(increase) / len(increase):+.3f} | "
          f"{worst_decile(increase, True):+.3f} | {sum(diverge) / len(diverge):.1f} | "
          f"{worst_decile(diverge, False):.1f} | {sum(d == 64 for d in diverge)}/{len(diverge)} | "
          f"{valid}/{len(schemas)} | {same}/{len(schemas)} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())

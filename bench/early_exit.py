"""How often the model's first k layers (then the final norm and the LM head) choose the token the whole model
chooses: the acceptance rate that self-speculation (drafts from the model's own first layers) or a layer-truncated
copy of the model as a draft model could reach, before paying for the draft passes.

Teacher-forced over two kinds of text, with the default model in the format ``--format`` names: free text (the
first ``--tokens`` tokens of ``bench/data/kjv-genesis.txt``) and JSON (a valid instance of every 200th MaskBench dev
schema after a chat prompt that asks for it; the positions of the instance are counted). Prints, per k, the share
of positions where the early exit's argmax equals the whole model's.

    .venv/bin/python bench/early_exit.py
"""

import argparse
import gzip
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from corral.engine.attention import AttentionMetadata, KVCache, PrefillSpan  # noqa: E402
from corral.engine.config import kv_torch_dtype  # noqa: E402
from quality import engine_for  # noqa: E402
from servers import cpu_summary  # noqa: E402

DATA = os.path.join(HERE, "..", "..", "shared", "data", "maskbench-dev.jsonl.gz")


@torch.inference_mode()
def argmaxes(engine, ids: list[int], num_layers: int) -> torch.Tensor:
    """The argmax after each position of ``ids`` through the first ``num_layers`` layers (a fresh KV cache)."""
    model, cfg = engine.runner.model, engine.model_config
    blocks = -(-len(ids) // 16)
    kv = kv_torch_dtype(engine.config.kv_cache_dtype)
    caches = [KVCache.allocate(blocks, 16, cfg.num_kv_heads, cfg.head_dim, kv) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(torch.arange(len(ids)), (), (PrefillSpan(0, len(ids), None, len(ids)),))
    hidden = model.forward(torch.tensor(ids), torch.arange(len(ids)), meta, caches, num_layers=num_layers)
    return model.compute_logits(hidden).argmax(dim=-1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", default="float32/w4a8/bfloat16", help="dtype/quantization/kv, as quality.py")
    parser.add_argument("--layers", default="4,8,12,16,20,24,27", help="the k to try")
    parser.add_argument("--tokens", type=int, default=800)
    args = parser.parse_args()
    print(cpu_summary())
    engine = engine_for(args.format)
    tok, total = engine.tokenizer, engine.model_config.num_layers
    ks = [int(k) for k in args.layers.split(",")]
    texts = []  # (ids, first position counted)
    with open(os.path.join(HERE, "data", "kjv-genesis.txt")) as f:
        texts.append(("free text", tok.encode(f.read()[: 8 * args.tokens])[: args.tokens], 1))
    with gzip.open(DATA, "rt") as f:
        entries = [json.loads(line) for line in f][::200]
    for entry in entries:
        docs = [t["data"] for t in entry.get("tests", []) if t.get("valid")]
        if docs:
            prompt = tok.apply_chat_template([{"role": "user", "content": "Write JSON for this schema: "
                                               + json.dumps(entry["schema"])[:1500]}])
            start = len(tok.encode(prompt))
            texts.append(("JSON", tok.encode(prompt) + tok.encode(json.dumps(docs[0]))[:120], start))
    print(f"{engine.model_config.num_layers} layers; format {args.format}")
    for kind in ("free text", "JSON"):
        agree, counted = {k: 0 for k in ks}, 0
        for _, ids, start in [t for t in texts if t[0] == kind]:
            whole = argmaxes(engine, ids, total)[start - 1: -1]
            counted += len(whole)
            for k in ks:
                agree[k] += int((argmaxes(engine, ids, k)[start - 1: -1] == whole).sum())
        print(f"{kind} ({counted} positions): " + ", ".join(f"k={k}: {agree[k] / counted:.3f}" for k in ks))
    return 0


if __name__ == "__main__":
    sys.exit(main())

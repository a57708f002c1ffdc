"""Two builds of the native module in one process: this checkout's and another's, taking turns.

Separate processes on a shared machine move by 20-50% from one minute to the next, more than most kernel changes,
so this loads the other build's ``_native`` module file beside this checkout's and interleaves them:

- ``--products`` (the default): SmolLM2's 30 layers of Q4 products and its Q8 LM head, random weights of the real
  shapes, one build's calls then the other's, ``--rounds`` times per row count (which goes first alternates); the
  products must be the same bits (it exits 1 where they are not). Each figure includes each call's Python binding
  (120 calls for the layers), as ``bench/linears.py``'s do.
- ``--engine``: the whole engine (``make serve``'s formats, drafts off, greedy ``--tokens`` per sequence), the
  module object the engine calls swapped between runs; the outputs (tokens and logprobs) must be identical.
- ``--attention``: the decode attention kernel alone, SmolLM2's heads (9 query heads, 3 KV heads of 64) over a
  bfloat16 cache, ``--batches`` sequences at each of ``--contexts`` keys, once with one layer's cache (warm after
  the first round) and once cycling through 60 layers' caches (each read from memory, as in a decode step); every
  layer's output must be the same bits. Each figure includes the call's Python binding (a few microseconds).
- ``--prefill``: the float32 prefill attention alone, SmolLM2's heads, a fresh prompt of each of ``--contexts``
  tokens (the causal kernel over its own K and V), then the same prompt's last 64 tokens over the rest of it in a
  bfloat16 paged cache (the kernel of a prefix-cache hit). Each build's largest error against float64 attention
  (of the same float32 inputs, the cache's keys as bfloat16 holds them) is printed, and this build's must stay
  within twice the other's or 1e-5; the same bits are reported, not required (a kernel that orders its sums anew
  moves the last bits).

``CORRAL_QMATMUL_ISA`` picks the product variant for both builds (each chooses it as it loads). The other build
is any checkout built in place, for example:

    git worktree add /tmp/before <commit> && (cd /tmp/before && .venv/bin/python setup.py build_ext --inplace)
    .venv/bin/python bench/native_ab.py /tmp/before/corral/_native.cpython-311-x86_64-linux-gnu.so
    .venv/bin/python bench/native_ab.py OTHER.so --engine --batches 1,4,16 --decode-burst 1
    .venv/bin/python bench/native_ab.py OTHER.so --attention --contexts 128,512,2048 --batches 1,4,16
    .venv/bin/python bench/native_ab.py OTHER.so --prefill --contexts 128,455,1000,1800
"""

import argparse
import importlib.util
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import corral.native as native  # noqa: E402
from corral.kernels.cpu_ops import buffer  # noqa: E402
from servers import cpu_summary, frozen_heap  # noqa: E402

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # fused QKV, output, gate/up, down
HEAD = (49152, 576)


def load_other(path: str):
    """The module file at ``path`` as a second native module (its classes register again: nanobind warns)."""
    spec = importlib.util.spec_from_file_location("_native", path)
    if spec is None:
        raise SystemExit(f"not a module file: {path}")
    other = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec.loader.exec_module(other)
    return other


def ratio(before: list[float], after: list[float]) -> str:
    b, a = statistics.median(before), statistics.median(after)
    return f"{b:.3f} -> {a:.3f} ({a / b - 1:+.0%})"


def products(this, other, rows_list: list[int], rounds: int) -> bool:
    from corral.engine.quant import Q4Tiles, Q8Tiles, quantize_int4

    torch.manual_seed(0)
    layers = [[Q4Tiles(quantize_int4(torch.randn(n, k) * 0.02, 32), None) for n, k in LAYER_SHAPES]
              for _ in range(30)]
    head = Q8Tiles(torch.randn(*HEAD) * 0.02)
    same = True
    print("| rows | 30 layers, ms: other -> this | LM head, ms: other -> this | same bits |\n|---|---|---|---|")
    for rows in rows_list:
        x = {k: torch.randn(rows, k) for k in (576, 1536)}
        parts = {"layers": [("q4_matmul", buffer(x[k]), buffer(layer.tiles), n)
                            for per_layer in layers for (n, k), layer in zip(LAYER_SHAPES, per_layer)],
                 "head": [("q8_matmul", buffer(x[576]), buffer(head.tiles), HEAD[0])]}
        cells = []
        for calls in parts.values():
            times = {"other": [], "this": []}
            outs = {name: [torch.empty(rows, c[3]) for c in calls] for name in times}
            targets = {name: [buffer(o) for o in outs[name]] for name in times}
            for r in range(rounds):
                for name, module in (("other", other), ("this", this))[:: 1 if r % 2 else -1]:
                    start = time.perf_counter()
                    for (fn, xb, tiles, n), out in zip(calls, targets[name]):
                        getattr(module, fn)(xb, tiles, n, out, torch.get_num_threads())
                    times[name].append((time.perf_counter() - start) * 1e3)
            same = same and all(torch.equal(a, b) for a, b in zip(outs["other"], outs["this"]))
            cells.append(ratio(times["other"], times["this"]))
        print(f"| {rows} | {cells[0]} | {cells[1]} | {same} |")
    return same


def attention_calls(this, other, contexts: list[int], batches: list[int], rounds: int) -> bool:
    same = True
    print("| keys | sequences | layers' caches | us per layer: other -> this | same bits |\n|---|---|---|---|---|")
    for context in contexts:
        for seqs in batches:
            for layers in (1, 60):
                blocks = -(-context // 16)
                gen = torch.Generator().manual_seed(0)
                caches = [tuple(torch.randn(blocks * seqs, 16, 3, 64, generator=gen).bfloat16() for _ in range(2))
                          for _ in range(layers)]
                q = torch.randn(seqs, 9, 64, generator=gen)
                tables = torch.arange(blocks * seqs).view(seqs, blocks)
                lens = torch.full((seqs,), context)
                outs = {name: [torch.empty(seqs, 9 * 64) for _ in caches] for name in ("other", "this")}
                targets = {name: [buffer(o) for o in outs[name]] for name in outs}  # a layer's output each
                args = [(buffer(k), buffer(v)) for k, v in caches]
                qb, tb, lb = buffer(q), buffer(tables), buffer(lens)
                times = {"other": [], "this": []}
                for r in range(rounds):
                    for name, module in (("other", other), ("this", this))[:: 1 if r % 2 else -1]:
                        start = time.perf_counter()
                        for (kb, vb), out in zip(args, targets[name]):
                            module.paged_decode(qb, kb, vb, tb, lb, out, 0.125, torch.get_num_threads(), None, None)
                        times[name].append((time.perf_counter() - start) / layers * 1e6)
                equal = all(torch.equal(a, b) for a, b in zip(outs["other"], outs["this"]))
                same = same and equal
                print(f"| {context} | {seqs} | {layers} | {ratio(times['other'], times['this'])} | {equal} |")
    return same


def exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int) -> torch.Tensor:
    """Causal attention of q [n, heads, D] over k/v [n, kv_heads, D] in float64, [n, heads * D]."""
    dim = q.shape[-1]
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.double().transpose(0, 1).unsqueeze(0) for t in (q, k, v)), is_causal=True, enable_gqa=True,
        scale=dim ** -0.5)
    return out[0].transpose(0, 1).reshape(n, -1)


def prefill_calls(this, other, contexts: list[int], rounds: int) -> bool:
    """The causal prefill and the paged prefill (its last 64 tokens over the rest, bfloat16 blocks of 16) of one
    layer, per prompt length."""
    heads, kv_heads, dim, size = 9, 3, 64, 16
    ok = True
    print("| tokens | kernel | ms per call: other -> this | same bits | error vs float64: other, this |\n"
          "|---|---|---|---|---|")
    for n in contexts:
        gen = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(n, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
        blocks = -(-n // size)
        table = torch.randperm(blocks, generator=gen)
        k_cache, v_cache = (torch.zeros(blocks, size, kv_heads, dim, dtype=torch.bfloat16) for _ in range(2))
        slots = table.repeat_interleave(size)[:n] * size + torch.arange(n) % size
        k_cache.view(-1, kv_heads, dim)[slots], v_cache.view(-1, kv_heads, dim)[slots] = k.bfloat16(), v.bfloat16()
        tail = min(64, n)
        kb, vb = k.bfloat16().float(), v.bfloat16().float()  # what the paged kernel reads
        reference = {"causal": exact(q, k, v, n), "paged": exact(q, kb, vb, n)[n - tail:]}
        calls = {
            "causal": lambda m, out: m.causal_prefill(buffer(q), buffer(k), buffer(v), buffer(out), dim ** -0.5,
                                                     torch.get_num_threads()),
            "paged": lambda m, out: m.prefill_paged(buffer(q[n - tail:]), buffer(k_cache), buffer(v_cache),
                                                    buffer(table), n, buffer(out), dim ** -0.5,
                                                    torch.get_num_threads(), None, None)}
        for kernel, call in calls.items():
            rows = n if kernel == "causal" else tail
            times, outputs = {"other": [], "this": []}, {}
            for r in range(rounds):
                for name, module in (("other", other), ("this", this))[:: 1 if r % 2 else -1]:
                    out = torch.empty(rows, heads * dim)
                    start = time.perf_counter()
                    call(module, out)
                    times[name].append((time.perf_counter() - start) * 1e3)
                    outputs.setdefault(name, out)
            errors = {name: float((out.double() - reference[kernel]).abs().max()) for name, out in outputs.items()}
            ok = ok and errors["this"] <= max(2 * errors["other"], 1e-5)
            print(f"| {n} | {kernel} | {ratio(times['other'], times['this'])} | "
                  f"{torch.equal(outputs['other'], outputs['this'])} | {errors['other']:.1e}, {errors['this']:.1e} |")
    return ok


def engine_runs(this, other, batches: list[int], rounds: int, tokens: int, burst: int) -> bool:
    from corral.engine import EngineConfig, LLMEngine
    from corral.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(dtype="float32", quantization="w4a8", kv_cache_dtype="bfloat16",
                                    num_kv_blocks=2048, max_num_seqs=64, jump_forward=False, speculation=False,
                                    decode_burst=burst))
    engine.generate([engine.tokenizer.encode("Warm-up: once upon a time")], SamplingParams(temperature=0,
                                                                                         max_tokens=8))
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    loaded = native._loaded  # [module, reason]: what native.module() hands every caller
    same = True
    print("| sequences | tok/s: other -> this | same outputs |\n|---|---|---|")
    try:
        for batch in batches:
            prompts = [engine.tokenizer.encode(f"Tale {i}: in a land far away") for i in range(batch)]
            rates, outputs = {"other": [], "this": []}, {}
            for r in range(rounds):
                for name, module in (("other", other), ("this", this))[:: 1 if r % 2 else -1]:
                    loaded[0] = module
                    engine.block_manager.reset_prefix_cache()
                    with frozen_heap():
                        start = time.perf_counter()
                        outs = engine.generate(prompts, params)
                        wall = time.perf_counter() - start
                    rates[name].append(batch * tokens / wall)
                    got = [(c.token_ids, c.logprobs, c.cumulative_logprob) for o in outs for c in o.outputs]
                    same = same and outputs.setdefault(name, got) == got
            same = same and outputs["other"] == outputs["this"]
            print(f"| {batch} | {ratio(rates['other'], rates['this'])} | {same} |")
    finally:
        loaded[0] = this
    return same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("other", help="the other build's _native module file")
    ap.add_argument("--engine", action="store_true", help="the whole engine instead of the products")
    ap.add_argument("--attention", action="store_true", help="the decode attention kernel instead of the products")
    ap.add_argument("--prefill", action="store_true", help="the prefill attention kernels instead of the products")
    ap.add_argument("--contexts", default="128,512,2048", help="attention: keys per sequence")
    ap.add_argument("--rows", default="1,2,4,8,16,64", help="product row counts")
    ap.add_argument("--batches", default="1,4,16", help="engine batch sizes; attention: sequences per call")
    ap.add_argument("--rounds", type=int, default=None,
                    help="turns per build (40 products, 6 engine runs, 16 attention calls)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--decode-burst", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    this = native.module()
    if this is None:
        raise SystemExit("this checkout's native module is not built")
    other = load_other(args.other)
    print(f"# {cpu_summary()}; {args.threads} threads; products: this {this.qmatmul_isa}, other "
          f"{other.qmatmul_isa}; other: {args.other}")
    if args.prefill:
        ok = prefill_calls(this, other, [int(c) for c in args.contexts.split(",")], args.rounds or 10)
    elif args.attention:
        ok = attention_calls(this, other, [int(c) for c in args.contexts.split(",")],
                             [int(b) for b in args.batches.split(",")], args.rounds or 16)
    elif args.engine:
        ok = engine_runs(this, other, [int(b) for b in args.batches.split(",")], args.rounds or 6, args.tokens,
                         args.decode_burst)
    else:
        ok = products(this, other, [int(r) for r in args.rows.split(",")], args.rounds or 40)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

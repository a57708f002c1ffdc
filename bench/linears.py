"""The model's linear layers in each weight format, timed at a range of row counts, in one run.

Per row count, the sum over SmolLM2-135M's 30 layers (fused QKV 960x576, gate/up 3072x576, down 576x1536, output
576x576) and, separately, its LM head (49,152x576), for: dense fp32, dense bf16, W8A16 (``_weight_int8pack_mm``,
bf16 and fp32 activations) and W4A16 (``_weight_int4pack_mm_for_cpu`` at group 32 and 64, bf16 and fp32
activations; the fp32-activation kernels only up to 4 rows, past which one call takes seconds), and Corral's
native W4A8 (Q4 tiles; on the LM head row, W8A8 Q8 tiles: what ``w4a8`` runs), fp32 activations quantized
inside; for the layers also W5A8 (Q5 tiles: a K-quant file's Q5_0/Q5_1 linears), W6A8 (Q6 tiles: its Q6_K
ones), W8A8 (Q8 tiles: its Q8_0 ones) and IQ4 tiles (an IQ4_NL/IQ4_XS file's).
Random weights of the real shapes; each figure is the median of ``--repeats`` calls after a warm-up. This is what
the ``auto`` format rule and the README's kernel figures rest on.

Timed alone, a layer's tiles stay in the cache: those figures are arithmetic. ``--streamed`` times instead, per
row count, one pass over 30 distinct copies of each layer shape in each native format (W4A8, W5A8, W6A8, W8A8, IQ4,
or those ``--kinds`` names), as a decode step streams its weights from memory, the formats taking turns for
``--repeats`` rounds (the median). ``--shape llama-1b`` streams Llama 3.2 1B's 16 layers instead (fused QKV
3072x2048, gate/up 16384x2048, down 2048x8192, output 2048x2048: 0.97 billion weights a pass), whose K are whole
super-blocks of 256, as tiles in super-blocks need (``q4k``, ``q5k``, ``q3``, ``q2``, ``iq4xs``: a Q4_K, Q5_K,
Q3_K, Q2_K or IQ4_XS file's linears as shipped); SmolLM2's 576 are not.

    .venv/bin/python bench/linears.py [--rows 1,4,16,32,64,256] [--threads 2]
    .venv/bin/python bench/linears.py --streamed --rows 1,4,16 --repeats 9
    .venv/bin/python bench/linears.py --streamed --shape llama-1b --kinds q4,q4k,q5,q5k --rows 1,4,16 --repeats 9
    .venv/bin/python bench/linears.py --streamed --shape llama-1b --kinds q4k,q3,q2 --rows 1,4,16,64 --repeats 9
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from servers import cpu_summary  # noqa: E402

from corral import native  # noqa: E402
from corral.engine.quant import (IQ4Blocks, IQ4Tiles, IQ4XSBlocks, IQ4XSTiles, Q2Blocks, Q2Tiles,  # noqa: E402
                                 Q3Blocks, Q3Tiles, Q4KBlocks, Q4KTiles, Q4Tiles, Q5Blocks, Q5KBlocks, Q5KTiles,
                                 Q5Tiles, Q6Blocks, Q6Tiles, Q8Blocks, Q8Linear, Q8Tiles, quantize_int4,
                                 quantize_q8_blocks)

LAYERS = [(960, 576), (3072, 576), (576, 1536), (576, 576)]
HEAD = (49152, 576)
NUM_LAYERS = 30
# --streamed --shape: the layer shapes (N, K) and how many layers of them
SHAPES = {"smollm2": (LAYERS, NUM_LAYERS), "llama-1b": ([(3072, 2048), (16384, 2048), (2048, 8192), (2048, 2048)], 16)}


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def kernels(n: int, k: int, rows: int) -> dict:
    """name -> a call computing ``x @ W.T`` for random W [n, k] and x [rows, k] in that format."""
    w, x = torch.randn(n, k), torch.randn(rows, k)
    wb, xb = w.bfloat16(), x.bfloat16()
    codes8, scale8 = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n)
    packed = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
    out = {"fp32": lambda: torch.nn.functional.linear(x, w), "bf16": lambda: torch.nn.functional.linear(xb, wb)}
    for act, xa in (("bf16", xb), ("fp32", x)) if rows <= 4 else (("bf16", xb),):
        s8 = scale8.to(xa.dtype)
        out[f"w8 {act}"] = lambda xa=xa, s8=s8: torch._weight_int8pack_mm(xa, codes8, s8)
        for group in (32, 64):
            sz = torch.rand(k // group, n, 2).to(xa.dtype)
            out[f"w4g{group} {act}"] = lambda xa=xa, sz=sz, g=group: torch._weight_int4pack_mm_for_cpu(xa, packed,
                                                                                                      g, sz)
    if native.module() is not None:
        native_layer = (Q8Tiles(w) if (n, k) == HEAD else Q4Tiles(quantize_int4(w, 32), None))
        out["w4a8 native"] = lambda: native_layer(x)
        if (n, k) != HEAD:  # a K-quant file's 5-, 6- and 8-bit linears (Q5_0/Q5_1; Q6_K; Q8_0), IQ4
            five, six, grid = random_native("q5", n, k), random_native("q6", n, k), random_native("iq4", n, k)
            eight = Q8Linear(Q8Blocks(*quantize_q8_blocks(w)), None)
            out["w5a8 native"], out["w6a8 native"] = (lambda: five(x)), (lambda: six(x))
            out["w8a8 native"], out["iq4 native"] = (lambda: eight(x)), (lambda: grid(x))
    return out


def random_native(kind: str, n: int, k: int):
    """A random layer [n, k] in native ``kind`` (q2, q3, q4, q4k, q5, q5k, q6, q8, iq4, iq4xs)."""
    if kind == "q4":
        return Q4Tiles(quantize_int4(torch.randn(n, k), 32), None)
    if kind in ("q4k", "q5k"):
        bits = int(kind[1])
        blocks = (Q4KBlocks if bits == 4 else Q5KBlocks)(torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8),
                                                         (torch.rand(n, k // 256) * 1e-3).half().float(),
                                                         (torch.rand(n, k // 256) * 1e-3).half().float(),
                                                         torch.randint(0, 64, (n, k // 32), dtype=torch.uint8),
                                                         torch.randint(0, 64, (n, k // 32), dtype=torch.uint8))
        return (Q4KTiles if bits == 4 else Q5KTiles)(blocks, None)
    if kind == "q5":
        return Q5Tiles(Q5Blocks(torch.randint(0, 32, (n, k), dtype=torch.uint8), torch.rand(n, k // 32) * 0.01,
                                torch.randn(n, k // 32) * 0.01), None)
    if kind == "q6":
        return Q6Tiles(Q6Blocks(torch.randint(0, 64, (n, k), dtype=torch.uint8),
                                (torch.rand(n, k // 32) * 1e-3).half().float(),
                                torch.randint(-128, 128, (n, k // 16), dtype=torch.int8)), None)
    # Q2 and Q3 blocks: a d (and dmin) per super-block of 256, repeated over its blocks of 32
    per_super = lambda: (torch.rand(n, k // 256) * 1e-3).half().float().repeat_interleave(8, dim=1)  # noqa: E731
    if kind == "q2":
        return Q2Tiles(Q2Blocks(torch.randint(0, 4, (n, k), dtype=torch.uint8), per_super(), per_super(),
                                torch.randint(0, 16, (n, k // 16), dtype=torch.uint8),
                                torch.randint(0, 16, (n, k // 16), dtype=torch.uint8)), None)
    if kind == "q3":
        return Q3Tiles(Q3Blocks(torch.randint(0, 8, (n, k), dtype=torch.uint8), per_super(),
                                torch.randint(-32, 32, (n, k // 16), dtype=torch.int8)), None)
    if kind == "iq4":
        return IQ4Tiles(IQ4Blocks(torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.rand(n, k // 32) * 1e-3),
                        None)
    if kind == "iq4xs":
        return IQ4XSTiles(IQ4XSBlocks(torch.randint(0, 16, (n, k), dtype=torch.uint8),
                                      (torch.rand(n, k // 256) * 1e-3).half().float(),
                                      torch.randint(-32, 32, (n, k // 32), dtype=torch.int8)), None)
    if kind == "q8":
        return Q8Linear(Q8Blocks(*quantize_q8_blocks(torch.randn(n, k))), None)
    raise ValueError(f"no native kind {kind!r}")


def streamed(rows_list: list[int], repeats: int, kinds: tuple[str, ...], shape: str) -> None:
    """Per row count: ms for one pass over the model's distinct copies of every layer shape, per native format."""
    shapes, count = SHAPES[shape]
    layers = {kind: [random_native(kind, n, k) for _ in range(count) for n, k in shapes] for kind in kinds}
    print("| rows | " + " | ".join(f"{kind} ({sum(l.nbytes for l in layers[kind]) / 1e6:.1f} MB)" for kind in kinds) +
          " |\n|---|" + "---|" * len(kinds))
    for rows in rows_list:
        xs = {k: torch.randn(rows, k) for _, k in shapes}
        times = {kind: [] for kind in kinds}
        for r in range(repeats + 1):
            for kind in kinds[:: 1 if r % 2 else -1]:
                start = time.perf_counter()
                for layer in layers[kind]:
                    layer(xs[layer.in_features])
                if r:  # the first round warms up
                    times[kind].append((time.perf_counter() - start) * 1e3)
        print(f"| {rows} | " + " | ".join(f"{statistics.median(times[kind]):.2f}" for kind in kinds) + " |",
              flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,32,64,256")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--streamed", action="store_true",
                    help="the native formats over 30 distinct copies of each layer (weights from memory)")
    ap.add_argument("--kinds", default="q4,q5,q6,q8,iq4",
                    help="--streamed: the native formats (q2, q3, q4, q4k, q5, q5k, q6, q8, iq4, iq4xs)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2", help="--streamed: whose layers")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    isa = native.module().qmatmul_isa if native.module() is not None else "no native module"
    print(f"# {cpu_summary()}; torch {torch.__version__} (kernels: {torch.backends.cpu.get_cpu_capability()}), "
          f"{args.threads} threads; native products: {isa}; ms, median of {args.repeats}\n")
    if args.streamed:
        kinds = tuple(args.kinds.split(","))
        if {"q4k", "q5k", "q3", "q2", "iq4xs"} & set(kinds) and args.shape == "smollm2":
            ap.error("q4k, q5k, q3, q2 and iq4xs tiles take K in whole super-blocks of 256: --shape llama-1b")
        streamed([int(r) for r in args.rows.split(",")], args.repeats, kinds, args.shape)
        return 0
    names = list(kernels(16, 64, 1))
    print("| rows | part | " + " | ".join(names) + " |\n|---|---|" + "---|" * len(names))
    for rows in (int(r) for r in args.rows.split(",")):
        layers = {}
        for n, k in LAYERS:
            for name, fn in kernels(n, k, rows).items():
                layers[name] = layers.get(name, 0.0) + NUM_LAYERS * timed(fn, args.repeats)
        head = {name: timed(fn, args.repeats) for name, fn in kernels(*HEAD, rows).items()}
        for part, row in (("30 layers", layers), ("LM head", head)):
            print(f"| {rows} | {part} | " + " | ".join(f"{row[n]:.2f}" if n in row and row[n] else "-"
                                                     for n in names) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

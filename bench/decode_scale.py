"""Single-stream decode on a model the size users run, not only the bundled one: Corral against llama.cpp
(llama-cpp-python, in process), in one run, on the same GGUF files and the same prompt token ids.

The bundled model is SmolLM2-135M (hidden 576), where a token's fixed costs weigh as much as its products. This
bench writes a Llama of a larger shape with random weights (by default Llama 3.2 1B's: hidden 2,048, 16 layers, 32
query heads over 8 KV heads of 64, an MLP of 8,192), in float16, with the bundled model's tokenizer and chat
template (49,152 tokens, where Llama 3.2 has 128,256), so that ``bench/engine.py --model FILE --no-drafts`` serves
the same files to both servers; and it has llama.cpp's own ``llama-quantize`` make each of ``--types`` from it (Q4_K_M,
Q3_K_M and Q2_K by default: at hidden 2,048 every row is whole super-blocks of 256, so these are the K-quant files
users carry, which SmolLM2's 576 columns cannot give). For each file, each engine decodes ``--tokens`` greedy tokens
after the same ``--prompt-tokens`` random prompt ids, one sequence, taking turns for ``--rounds`` rounds:

- Corral's ``LLMEngine`` as ``make serve`` configures it (dtype, quantization and KV cache ``auto``: w4a8, the
  native step, bursts of 8), with prompt lookup and jump-forward off: a random model repeats itself, which would
  let drafts inflate Corral's figure;
- llama-cpp-python with 2 threads (``generate``, top-k 1), as the single-stream peer.

Reported per file and engine: the decode rate (tokens after the first over the time after the first, the median
over rounds, and the range) and Corral's over llama.cpp's; the prompt's time is left out of both. Each round loads
each engine afresh (outside the timed window): on a shared 2-core machine one load's rate differs from the next's
by up to half, for both engines, so only many rounds taken in turns compare. Random weights make the outputs
meaningless; the arithmetic and the bytes streamed are a real model's of that shape. Needs ``make bench-extras``
(llama.cpp's tools and llama-cpp-python). The files are kept in ``--dir`` (2 GB of float16 and about 1.6 GB of
quantized files at the default shape) and reused by the next run.

    .venv/bin/python bench/decode_scale.py --dir DIR      # 2-core EPYC: 7 minutes the first time, 5 after
    .venv/bin/python bench/decode_scale.py --dir DIR --types Q4_K_M --rounds 9
    .venv/bin/python bench/engine.py --model DIR/random-2048-16-32-8-8192-49152-Q4_K_M.gguf --no-drafts \
        --cells short-1,short-4,short-16 --no-hf --no-fp32        # the same file behind both servers
"""

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.pop("OMP_WAIT_POLICY", None)  # each engine's own default (bench/engine.py says why)

from servers import cpu_summary  # noqa: E402

QUANTIZE = os.path.join(ROOT, ".venv", "llama.cpp", "build", "bin", "llama-quantize")


def write_source(path: str, tokenizer: str, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int) -> None:
    """A Llama GGUF of that shape, float16 matrices of a fixed seed (scaled as an initialization is), float32
    norms, and the tokenizer (and chat template) of the GGUF ``tokenizer``. Written once: kept where it is."""
    from tests.models.kquant_fixture import layer_weights, write_llama_gguf

    vocab = vocabulary_size(tokenizer)
    rng = np.random.default_rng(20261207)
    head_dim = hidden // heads

    def dense(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float16)

    def norm() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)

    weights = {"model.embed_tokens.weight": dense(vocab, hidden), "model.norm.weight": norm()}
    for i in range(layers):
        weights.update(layer_weights(i, dense, norm, hidden=hidden, heads=heads, kv_heads=kv_heads,
                                     head_dim=head_dim, ffn=ffn))
    write_llama_gguf(path, weights, layers=layers, hidden=hidden, ffn=ffn, heads=heads, kv_heads=kv_heads,
                     vocab=vocab, context=4096, eos=0, name="corral-scale-random", tokenizer_from=tokenizer)


def vocabulary_size(path: str) -> int:
    import gguf

    return len(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].contents())


def corral_rate(path: str, prompt: list[int], tokens: int) -> tuple[float, tuple[str, str]]:
    """Corral's decode rate on ``path`` and what it ran (its quantization, and whether the native step served)."""
    from corral.engine import EngineConfig, LLMEngine
    from corral.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=path, dtype="auto", quantization="auto", kv_cache_dtype="auto",
                                    jump_forward=False, speculation=False, max_model_len=len(prompt) + tokens + 64))
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.generate([prompt[:8]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm-up
    (out,) = engine.generate([prompt], params)
    assert len(out.outputs[0].token_ids) == tokens, len(out.outputs[0].token_ids)
    metrics = out.metrics
    rate = (tokens - 1) / (metrics.finished_time - metrics.first_token_time)
    model = engine.runner.model
    formats = model.quantization, "native step" if model.native_step is not None else "torch path"
    del engine
    gc.collect()
    return rate, formats


def llama_rate(path: str, prompt: list[int], tokens: int) -> float:
    """llama-cpp-python's decode rate on ``path`` (2 threads, greedy)."""
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_threads=2, n_threads_batch=2, n_ctx=len(prompt) + tokens + 64, verbose=False)
    for i, _ in enumerate(llm.generate(prompt[:8], top_k=1, top_p=1.0, temp=0.0)):  # warm-up
        if i == 7:
            break
    llm.reset()
    first = last = None
    for i, _ in enumerate(llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0)):
        last = time.perf_counter()
        first = first or last
        if i + 1 == tokens:
            break
    del llm
    gc.collect()
    return (tokens - 1) / (last - first)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="where the float16 source and the quantized files are kept")
    ap.add_argument("--shape", default="2048,16,32,8,8192", help="hidden, layers, heads, KV heads, MLP width")
    ap.add_argument("--types", default="Q4_K_M,Q3_K_M,Q2_K", help="llama-quantize's types, one file each")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from corral.models import resolve_model

    hidden, layers, heads, kv_heads, ffn = (int(v) for v in args.shape.split(","))
    tokenizer = resolve_model(None).path  # the bundled model's GGUF
    vocab = vocabulary_size(tokenizer)
    os.makedirs(args.dir, exist_ok=True)
    tag = "-".join(str(v) for v in (hidden, layers, heads, kv_heads, ffn, vocab))
    source = os.path.join(args.dir, f"random-{tag}-f16.gguf")
    if not os.path.exists(source):
        write_source(source + ".part", tokenizer, hidden, layers, heads, kv_heads, ffn)
        os.replace(source + ".part", source)
    files = {}
    for kind in args.types.split(","):
        files[kind] = os.path.join(args.dir, f"random-{tag}-{kind}.gguf")
        if not os.path.exists(files[kind]):
            env = {**os.environ, "LD_LIBRARY_PATH": os.path.dirname(QUANTIZE)}
            subprocess.run([QUANTIZE, source, files[kind] + ".part", kind, "2"], check=True, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            os.replace(files[kind] + ".part", files[kind])
    prompt = [int(t) for t in np.random.default_rng(7).integers(300, vocab, args.prompt_tokens)]
    print(f"# {cpu_summary()}; shape {args.shape},{vocab} (hidden, layers, heads, KV heads, MLP, vocabulary), random "
          f"weights; {args.prompt_tokens}-token prompt, {args.tokens} greedy tokens, one sequence; decode tok/s, "
          f"median of {args.rounds} rounds taking turns\n")
    print("| file | MB | Corral tok/s (range) | llama.cpp tok/s (range) | Corral / llama.cpp | Corral runs |\n"
          "|---|---|---|---|---|---|")
    for kind, path in files.items():
        ours, theirs, formats = [], [], None
        for r in range(args.rounds):
            for engine in ("corral", "llama") if r % 2 == 0 else ("llama", "corral"):
                if engine == "corral":
                    rate, formats = corral_rate(path, prompt, args.tokens)
                    ours.append(rate)
                else:
                    theirs.append(llama_rate(path, prompt, args.tokens))
        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"| {kind} | {os.path.getsize(path) / 1e6:.0f} | {a:.1f} ({min(ours):.1f}-{max(ours):.1f}) | {b:.1f} "
              f"({min(theirs):.1f}-{max(theirs):.1f}) | **{a / b:.2f}x** | {formats[0]}, {formats[1]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

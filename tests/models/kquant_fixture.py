"""A tiny Llama in GGUF, float32 from a fixed seed, and its K-quant copies made by llama.cpp's own
``llama-quantize``: the fixtures of ``tests/models/test_kquants.py``.

The float32 weights are a function of the seed alone (:func:`weights`), so the test rebuilds them instead of
keeping the float32 file. The quantized files under ``tests/models/data`` were made by running this module with
the ``llama-quantize`` that ``bench/build_llama.sh`` builds from the pinned llama.cpp sources:

    .venv/bin/python tests/models/kquant_fixture.py .venv/llama.cpp/build/bin/llama-quantize [FILE ...]

(naming files makes only those.)

Shapes: hidden 256 (a K-quant super-block is 256 weights along a row), 4 heads of 64 with 2 KV heads, an MLP of
512, one layer, a vocabulary of 256 single-byte tokens, an untied LM head (tied in ``tiny-kquants-tied.gguf``).
"""

import os
import subprocess
import sys
import tempfile

import numpy as np

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
SEED = 20261204
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 256, 4, 2, 64, 512, 256, 1
# file -> (llama-quantize's base type, per-tensor overrides, tied): Q4_K, Q5_K and Q6_K (the K-quants users' GGUFs
# carry), with a Q4_0, a Q5_0 (llama.cpp's fallback for a K-quant whose rows are not whole super-blocks: most
# tensors of a small model's Q4_K_M file) and a Q8_0 tensor beside them; and the same weights with a tied head (no
# output tensor) in Q4_K_M, which gives the token embedding Q6_K, as llama.cpp does the output tensor it serves as;
# and in IQ4_XS, with IQ4_NL tensors beside (llama.cpp's non-linear 4-bit grid) and the value projection in Q5_K,
# as llama-quantize makes it in an IQ4_XS file of a model with 4 or more query heads per KV head; and in Q3_K_M,
# where llama-quantize makes the query, key, gate and up projections and the embedding Q3_K, the value projection
# Q5_K, the output and down projections Q4_K and the LM head Q6_K; and in Q2_K, where it makes the query, key, gate
# and up projections and the embedding Q2_K, the value, output and down projections Q3_K and the LM head Q6_K
FIXTURES = {"tiny-kquants.gguf": ("Q4_K_S", ["attn_v=q6_k", "ffn_down=q5_k", "attn_output=q4_0",
                                             "ffn_gate=q8_0", "attn_k=q5_0"], False),
            "tiny-kquants-tied.gguf": ("Q4_K_M", [], True),
            "tiny-iq4.gguf": ("IQ4_XS", ["attn_k=iq4_nl", "ffn_up=iq4_nl", "attn_v=q5_k", "ffn_down=iq4_xs"],
                              False),
            "tiny-q3k.gguf": ("Q3_K_M", [], False),
            "tiny-q2k.gguf": ("Q2_K", [], False)}


def layer_weights(i: int, dense, norm, *, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int) -> dict:
    """Layer ``i``'s HF-named weights: ``norm()`` for each RMSNorm weight and ``dense(rows, cols)`` for each
    projection, called in this order (the two norms, then q, k, v, o, gate, up, down), so that a seeded source gives
    the same weights wherever this builds them."""
    p = f"model.layers.{i}."
    return {p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": dense(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": dense(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": dense(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": dense(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": dense(ffn, hidden), p + "mlp.up_proj.weight": dense(ffn, hidden),
            p + "mlp.down_proj.weight": dense(hidden, ffn)}


def weights() -> dict[str, np.ndarray]:
    """HF-named float32 weights ([out, in], rotary rows in HF order), from :data:`SEED`."""
    rng = np.random.default_rng(SEED)

    def dense(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)

    out = {"model.embed_tokens.weight": dense(VOCAB, HIDDEN), "lm_head.weight": dense(VOCAB, HIDDEN),
           "model.norm.weight": norm()}
    for i in range(LAYERS):
        out.update(layer_weights(i, dense, norm, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                 ffn=FFN))
    return out


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert script's rotary row order (each head's halves interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path: str, weights: dict, *, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int,
                     vocab: int, context: int, eos: int, eps: float = 1e-5, name: str | None = None,
                     extra: dict | None = None, arch: str = "llama", theta: float = 10000.0,
                     pre: str | None = None, merges: tuple[str, ...] = (), pieces: tuple[str, ...] = (),
                     tokenizer_from: str | None = None) -> None:
    """HF-named float32 ``weights`` (numpy) as a Llama GGUF laid out as llama.cpp's converter writes one (Q and K
    rows, and their biases, in its rotary order), with a byte-per-token vocabulary, and the ``extra`` tensors (GGUF
    names) as they are. ``arch`` "qwen2": a Qwen2 GGUF, its keys so named and its Q and K rows as HF has them (the
    converter leaves a Qwen2's alone, and no rotary dimension count, as Qwen2 files have none); ``pre`` and ``merges``:
    the BPE pre-tokenizer's name and merges (pairs of pieces, ``"a b"``; each adds the merged piece to the
    vocabulary after the bytes), ``pieces``: more vocabulary entries after those, with no merge that makes them.
    ``tokenizer_from``: a GGUF whose tokenizer (every ``tokenizer.*`` key, its chat template included) this one takes
    instead, ``vocab`` its vocabulary's size; ``eos`` is then its own."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    if name:
        writer.add_name(name)
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if arch == "llama":  # a Qwen2 file has none: hidden // heads
        writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(eps)
    writer.add_rope_freq_base(theta)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if tokenizer_from is not None:
        _copy_tokenizer(writer, tokenizer_from, vocab)
    else:
        _byte_tokenizer(writer, vocab, eos, pre, merges, pieces)
    _write_tensors(writer, weights, arch, heads, kv_heads, extra)


def _copy_tokenizer(writer, path: str, vocab: int) -> None:
    import gguf

    reader = gguf.GGUFReader(path)
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), kind)
    tokens = len(reader.fields["tokenizer.ggml.tokens"].contents())
    if tokens != vocab:
        raise ValueError(f"{path} has {tokens} tokens, not the {vocab} the embedding has")


def _byte_tokenizer(writer, vocab: int, eos: int, pre: str | None, merges: tuple[str, ...],
                    pieces: tuple[str, ...]) -> None:
    import gguf

    writer.add_tokenizer_model("gpt2")
    bytes_as = [bytes([b]).hex() for b in range(256)]  # pieces of no tokenizer: the models take token ids
    if pre is not None:  # a byte-level BPE's: each byte as GPT-2's printable character for it
        writer.add_tokenizer_pre(pre)
        printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
        extra_chars = iter(range(256, 512))
        bytes_as = [chr(b) if b in printable else chr(next(extra_chars)) for b in range(256)]
    added = [m.replace(" ", "") for m in merges] + list(pieces)
    writer.add_token_list(bytes_as[: vocab - len(added)] + added)
    writer.add_token_types([gguf.TokenType.NORMAL] * vocab)
    writer.add_token_merges(list(merges))
    writer.add_eos_token_id(eos)


def _write_tensors(writer, weights: dict, arch: str, heads: int, kv_heads: int, extra: dict | None) -> None:
    names = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
             "model.norm.weight": "output_norm.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                 "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                 "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
                 "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                 "mlp.down_proj.weight": "ffn_down.weight", "self_attn.q_proj.bias": "attn_q.bias",
                 "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias"}
    for hf_name, value in weights.items():
        if hf_name.startswith("model.layers."):
            layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{per_layer[rest]}"
        else:
            gname = names[hf_name]
        if ".self_attn.q_proj." in hf_name and arch == "llama":
            value = _permute(value, heads)
        elif ".self_attn.k_proj." in hf_name and arch == "llama":
            value = _permute(value, kv_heads)
        writer.add_tensor(gname, np.ascontiguousarray(value))
    for gname, value in (extra or {}).items():
        writer.add_tensor(gname, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_f32(path: str, tied: bool = False) -> None:
    """The float32 file; ``tied``: without the LM head (the embedding serves as one)."""
    tensors = {name: w for name, w in weights().items() if not (tied and name == "lm_head.weight")}
    write_llama_gguf(path, tensors, layers=LAYERS, hidden=HIDDEN, ffn=FFN, heads=HEADS, kv_heads=KV_HEADS,
                     vocab=VOCAB, context=256, eos=0, name="corral-tiny-kquant")


def main(quantize: str, only: list[str]) -> None:
    os.makedirs(DATA, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for file, (base, overrides, tied) in FIXTURES.items():
            if only and file not in only:
                continue
            source = os.path.join(tmp, "tiny-f32-tied.gguf" if tied else "tiny-f32.gguf")
            write_f32(source, tied)
            args = [quantize]
            for override in overrides:
                args += ["--tensor-type", override]
            subprocess.run(args + [source, os.path.join(DATA, file), base], check=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

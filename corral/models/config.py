"""ModelConfig: the shape of a Llama-family model, read from GGUF metadata or an HF ``config.json``."""

import json
import os
from dataclasses import dataclass, field

import numpy as np

from corral.errors import ModelNotFoundError
from corral.models.files import ModelFiles, resolve_model
from corral.models.gguf_file import gguf_metadata, gguf_tensors

SUPPORTED_ARCHITECTURES = ("llama", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# GGUF architectures read here: their keys are named for them ("qwen2.block_count"), and llama.cpp's converter
# permutes a Llama's Q and K rows for its rotary layout, not a Qwen2's (llama.cpp runs those rotate-half, as HF)
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "Qwen2ForCausalLM"}


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and constants of a decoder-only Llama-family transformer."""

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None = None
    rope_scaling: dict | None = field(default=None, compare=False, hash=False)
    attention_bias: bool = False

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ModelNotFoundError(f"{self.num_heads} query heads do not divide into {self.num_kv_heads} KV heads")
        if not self.eos_token_ids:
            raise ModelNotFoundError("the model declares no end-of-sequence token")

    def kv_bytes_per_token(self, dtype_bytes: int, scale_bytes: int = 0) -> int:
        """The seed's KV bill: 2 (K and V) × layers × KV heads × (head dim × bytes + a quantized head's scale)."""
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * dtype_bytes + scale_bytes)


def _from_gguf(path: str) -> ModelConfig:
    meta = gguf_metadata(path)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelNotFoundError(f"{path}: architecture {arch!r} is not supported (GGUF: "
                                 f"{', '.join(GGUF_ARCHITECTURES)})")
    num_heads = meta[f"{arch}.attention.head_count"]
    hidden = meta[f"{arch}.embedding_length"]
    tokens = meta["tokenizer.ggml.tokens"]
    head_dim = meta.get(f"{arch}.rope.dimension_count", hidden // num_heads)
    reader_names = _gguf_tensor_names(path)
    scaling = _gguf_rope_scaling(path, meta, head_dim, arch)
    biases = {f"blk.0.attn_{x}.bias" for x in "qkv"} & reader_names
    if biases and len(biases) < 3:
        raise ModelNotFoundError(f"{path}: {', '.join(sorted(biases))} without the other Q/K/V biases")
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        num_layers=meta[f"{arch}.block_count"],
        hidden_size=hidden,
        intermediate_size=meta[f"{arch}.feed_forward_length"],
        num_heads=num_heads,
        num_kv_heads=meta.get(f"{arch}.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        vocab_size=meta.get(f"{arch}.vocab_size", len(tokens)),
        max_position=meta.get(f"{arch}.context_length", 2048),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in reader_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=gguf_end_ids(meta),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        rope_scaling=scaling,
        attention_bias=bool(biases),
    )


def gguf_end_ids(meta: dict) -> tuple[int, ...]:
    """The token ids that end a GGUF model's turn: its EOS, then the end-of-turn and end-of-message tokens its
    metadata names (llama.cpp also ends at those; it further takes tokens by their text, such as
    ``<|endoftext|>``, which this does not). An id outside the vocabulary is refused."""
    ids, size = [], len(meta.get("tokenizer.ggml.tokens", ()))
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = meta.get(key)
        if value is None or value in ids:
            continue
        if not 0 <= int(value) < size:
            raise ModelNotFoundError(f"{key} {value} is outside the vocabulary of {size} tokens")
        ids.append(int(value))
    return tuple(ids)


def _gguf_rope_scaling(path: str, meta: dict, head_dim: int, arch: str = "llama") -> dict | None:
    """A GGUF's RoPE scaling: ``<arch>.rope.scaling.type`` (linear, or one that loading refuses), and the per-pair
    frequency divisors of ``rope_freqs.weight``, where llama.cpp's converter puts Llama 3.1's ``llama3`` scaling
    (no metadata key says it): each pair's angle is divided by its factor, as in llama.cpp's RoPE."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    scaling = {} if kind in (None, "none") else {"type": kind,
                                                 "factor": meta.get(f"{arch}.rope.scaling.factor", 1.0)}
    factors = [t for t in gguf_tensors(path) if t.name == "rope_freqs.weight"]
    if factors:
        values = np.asarray(factors[0].data, dtype=np.float64).ravel()
        if values.shape != (head_dim // 2,):
            raise ModelNotFoundError(f"{path}: rope_freqs.weight holds {values.shape[0]} factors where the "
                                     f"{head_dim // 2} rotary pairs need one each")
        if not np.all(np.isfinite(values) & (values > 0)):
            raise ModelNotFoundError(f"{path}: rope_freqs.weight holds a factor that is not a positive number")
        scaling["freq_factors"] = tuple(float(v) for v in values)
    return scaling or None


def _gguf_tensor_names(path: str) -> frozenset[str]:
    return frozenset(t.name for t in gguf_tensors(path))


def _from_hf(folder: str) -> ModelConfig:
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    arch = (cfg.get("architectures") or [cfg.get("model_type", "?")])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelNotFoundError(f"{folder}: architecture {arch!r} is not supported (Llama family only)")
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    num_heads = cfg["num_attention_heads"]
    # transformers 5 writes RoPE settings as one "rope_parameters" dict (rope_theta and rope_type inside it);
    # earlier versions write "rope_theta" and "rope_scaling" at the top level.
    rope = dict(cfg.get("rope_parameters") or {})
    rope_theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    return ModelConfig(
        architecture=arch,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads", num_heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        vocab_size=cfg["vocab_size"],
        max_position=cfg.get("max_position_embeddings", 2048),
        rope_theta=float(rope_theta),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=cfg.get("pad_token_id"),
        rope_scaling=scaling,
        attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
    )


def load_model_config(model: ModelFiles | str | None = None) -> ModelConfig:
    files = model if isinstance(model, ModelFiles) else resolve_model(model)
    return _from_gguf(files.path) if files.kind == "gguf" else _from_hf(files.path)

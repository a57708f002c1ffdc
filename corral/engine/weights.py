"""Weight loading: a GGUF file or a local HF folder (safetensors) → a flat dict of torch tensors in HF naming.

GGUF tensors are dequantized with the ``gguf`` package's numpy dequantizer (Q4_1, Q8_0, F16, ...), and the Q/K
projections are un-permuted: llama.cpp's converter interleaves each head's rotary halves, HF's layout (which
:mod:`corral.engine.model` uses, ``rotate_half`` RoPE) keeps them as two halves.

Converting the shipped GGUF takes a few seconds, so the converted tensors are cached as one safetensors file
per (source file, size, mtime, dtype) under ``$CORRAL_CACHE_DIR`` (default ``~/.cache/corral``). What this
leaves out: quantized execution (weights are dequantized to the run dtype), sharded ``.bin`` checkpoints.
"""

import glob
import hashlib
import logging
import os

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from corral.cache import cache_dir
from corral.errors import ModelNotFoundError
from corral.models import ModelConfig, ModelFiles

log = logging.getLogger(__name__)

# GGUF tensor name (after "blk.{i}.") → HF name (after "model.layers.{i}.").
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleave of the rotary halves (rows of a Q or K projection, or its bias)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _gguf_name(name: str) -> str | None:
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    if name.startswith("blk."):
        _, layer, rest = name.split(".", 2)
        if rest in _GGUF_LAYER_NAMES:
            return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[rest]}"
    return None  # e.g. rope_freqs: derived from the config instead


def _read_gguf(path: str, config: ModelConfig) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    from corral.models.gguf_file import open_gguf

    tensors = {}
    for tensor in open_gguf(path).tensors:
        name = _gguf_name(tensor.name)
        if name is None:
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists dims innermost first
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            values = unpermute_rotary(values, config.num_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            values = unpermute_rotary(values, config.num_kv_heads)
        tensors[name] = torch.from_numpy(np.array(values, copy=True))  # writable: torch warns on read-only
    return tensors


def _read_hf(folder: str) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ModelNotFoundError(f"{folder} has no *.safetensors weights")
    tensors = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors


def _cache_path(files: ModelFiles, dtype: torch.dtype) -> str:
    stat = os.stat(files.path if files.kind == "gguf" else os.path.join(files.path, "config.json"))
    key = f"{files.path}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}|v1"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), "weights", f"{files.name}-{str(dtype).removeprefix('torch.')}-{digest}.safetensors")


def load_weights(files: ModelFiles, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-named tensors of ``files`` in ``dtype``. GGUF conversions are cached on disk; HF folders are read directly."""
    if files.kind == "hf":
        return {name: t.to(dtype) for name, t in _read_hf(files.path).items()}
    path = _cache_path(files, dtype)
    if os.path.isfile(path):
        try:
            return load_file(path)
        except Exception as exc:  # a truncated cache file is rebuilt, never trusted
            log.warning("ignoring unreadable weight cache %s: %s", path, exc)
    tensors = {name: t.to(dtype).contiguous() for name, t in _read_gguf(files.path, config).items()}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    save_file(tensors, tmp)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the whole file or none
    return tensors

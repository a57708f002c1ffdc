"""Weight loading: a GGUF file or a local HF folder (safetensors) → a flat dict of torch tensors in HF naming.

GGUF tensors are dequantized with the ``gguf`` package's numpy dequantizer (Q4_1, Q8_0, F16, K-quants, ...),
except that with ``keep_q4`` the Q4_1 and Q4_0 blocks of linear layers stay as int4 codes with their scale and
zero (:class:`~corral.engine.quant.Q4Blocks`), which the int4 kernel runs as shipped. The Q/K projections are
un-permuted: llama.cpp's converter interleaves each head's rotary halves, HF's layout (which
:mod:`corral.engine.model` uses, ``rotate_half`` RoPE) keeps them as two halves.

Converting the shipped GGUF takes a few seconds, so the converted tensors are cached as one safetensors file
per (source file, size, mtime, dtype, blocks kept) under ``$CORRAL_CACHE_DIR`` (default ``~/.cache/corral``).
What this leaves out: sharded ``.bin`` checkpoints.
"""

import glob
import hashlib
import logging
import os

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from corral.cache import cache_dir
from corral.engine.quant import Q4Blocks
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


_Q4_KINDS = ("Q4_0", "Q4_1")


def q4_blocks(raw: np.ndarray, kind: str, rows: int, cols: int) -> Q4Blocks:
    """The codes, scale and zero of GGUF Q4_1 (``w = d q + m``) or Q4_0 (``w = d (q - 8)``) rows ``raw`` (bytes
    [rows, blocks * block_bytes]), as ``w = (q - 8) scale + zero``: scale = d, zero = m + 8 d (Q4_1) or 0 (Q4_0).
    A block is its float16 d (and m), then 16 bytes: the low nibbles are weights 0-15, the high ones 16-31."""
    head = 4 if kind == "Q4_1" else 2
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // 32, head + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., head:]
    codes = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1).reshape(rows, cols)
    zero = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) + 8 * d if kind == "Q4_1" \
        else np.zeros_like(d)
    return Q4Blocks(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zero), 32)


def gguf_has_q4(files: ModelFiles) -> bool:
    """Whether ``files`` is a GGUF whose layers' linear weights are Q4_0 or Q4_1 blocks (the int4 kernel's)."""
    if files.kind != "gguf":
        return False
    from corral.models.gguf_file import gguf_tensors

    return any(t.tensor_type.name in _Q4_KINDS and (_gguf_name(t.name) or "").endswith("_proj.weight")
               for t in gguf_tensors(files.path))


def _log_dequantized(path: str) -> None:
    """With Q4 blocks kept: say which GGUF types have no kernel here and were dequantized (on every load)."""
    from corral.models.gguf_file import gguf_tensors

    kinds = sorted({t.tensor_type.name for t in gguf_tensors(path) if _gguf_name(t.name)} -
                   {*_Q4_KINDS, "F32", "F16", "BF16"})
    if kinds:
        log.info("GGUF blocks with no kernel here were dequantized at load: %s (Q4_0 and Q4_1 linears run as "
                 "shipped; an embedding or LM head is then requantized to int8 rows)", ", ".join(kinds))


def _read_gguf(path: str, config: ModelConfig, keep_q4: bool = False) -> dict[str, torch.Tensor | Q4Blocks]:
    from gguf.quants import dequantize

    from corral.models.gguf_file import gguf_tensors

    tensors = {}
    for tensor in gguf_tensors(path):
        name = _gguf_name(tensor.name)
        if name is None:
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists dims innermost first
        kind = tensor.tensor_type.name
        heads = config.num_heads if ".q_proj." in name else config.num_kv_heads if ".k_proj." in name else None
        if keep_q4 and kind in _Q4_KINDS and name.startswith("model.layers."):
            blocks = q4_blocks(tensor.data, kind, *shape)
            if heads:
                blocks = Q4Blocks(*(torch.from_numpy(unpermute_rotary(f.numpy(), heads)) for f in blocks[:3]), 32)
            tensors[name] = blocks
            continue
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        if heads:
            values = unpermute_rotary(values, heads)
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


def _cache_path(files: ModelFiles, dtype: torch.dtype, keep_q4: bool) -> str:
    stat = os.stat(files.path if files.kind == "gguf" else os.path.join(files.path, "config.json"))
    key = f"{files.path}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}|{'q4' if keep_q4 else ''}|v2"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    tag = str(dtype).removeprefix("torch.") + ("-q4" if keep_q4 else "")
    return os.path.join(cache_dir(), "weights", f"{files.name}-{tag}-{digest}.safetensors")


_Q4_FIELDS = ("codes", "scale", "zero")


def _flatten(tensors: dict) -> dict[str, torch.Tensor]:
    """One safetensors dict: Q4 blocks as three tensors ``<name>.q4_codes`` / ``.q4_scale`` / ``.q4_zero``."""
    flat = {}
    for name, value in tensors.items():
        if isinstance(value, Q4Blocks):
            flat.update({f"{name}.q4_{field}": getattr(value, field).contiguous() for field in _Q4_FIELDS})
        else:
            flat[name] = value
    return flat


def _unflatten(flat: dict[str, torch.Tensor]) -> dict:
    tensors = {name: value for name, value in flat.items() if ".q4_" not in name}
    for name in {n.rsplit(".q4_", 1)[0] for n in flat if ".q4_" in n}:
        tensors[name] = Q4Blocks(*(flat[f"{name}.q4_{field}"] for field in _Q4_FIELDS), 32)
    return tensors


def load_weights(files: ModelFiles, config: ModelConfig, dtype: torch.dtype,
                 keep_q4: bool = False) -> dict[str, torch.Tensor | Q4Blocks]:
    """HF-named tensors of ``files`` in ``dtype`` (with ``keep_q4``, GGUF Q4 linears as :class:`Q4Blocks`).
    GGUF conversions are cached on disk; HF folders are read directly."""
    if files.kind == "hf":
        return {name: t.to(dtype) for name, t in _read_hf(files.path).items()}
    if keep_q4:
        _log_dequantized(files.path)
    path = _cache_path(files, dtype, keep_q4)
    if os.path.isfile(path):
        try:
            return _unflatten(load_file(path))
        except Exception as exc:  # a truncated cache file is rebuilt, never trusted
            log.warning("ignoring unreadable weight cache %s: %s", path, exc)
    tensors = {name: t if isinstance(t, Q4Blocks) else t.to(dtype).contiguous()
               for name, t in _read_gguf(files.path, config, keep_q4).items()}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    save_file(_flatten(tensors), tmp)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the whole file or none
    return tensors

"""The Llama-family transformer in plain torch: RMSNorm, RoPE, grouped-query attention over a paged KV cache,
SwiGLU MLP, tied or untied LM head.

The forward pass takes one flat batch of tokens (every scheduled sequence's new tokens, decodes first) and an
:class:`~corral.engine.attention.AttentionMetadata` that says where each token's K/V goes and what each query
may see. No HF modeling code runs here; HF transformers is only the test oracle. Q/K and gate/up projections
are fused into one matmul each at load time, because on a 2-core CPU the number of ops per layer matters as
much as their size. What this leaves out: sliding-window attention, MoE, biases other than Q/K/V.
"""

import math

import torch
import torch.nn.functional as F

from corral.engine.attention import AttentionMetadata, paged_attention_forward, write_kv
from corral.errors import ModelNotFoundError
from corral.kernels import cpu_ops
from corral.models import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies with the config's theta, and its ``linear`` or ``llama3`` scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = dict(config.rope_scaling or {})
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor, low, high = float(scaling["factor"]), scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    raise ModelNotFoundError(f"RoPE scaling {kind!r} is not supported (default, linear and llama3 are)")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # subtle: computed in float32 and cast back before the weight, exactly as HF's LlamaRMSNorm does
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [T, heads, D] rotated by per-row ``cos``/``sin`` [T, 1, D]."""
    return x * cos + rotate_half(x) * sin


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class LlamaModel:
    """Weights plus ``forward``. Plain tensors rather than ``nn.Module``: nothing here trains."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype):
        self.config, self.dtype = config, dtype
        get = lambda name: weights[name].to(dtype).contiguous()  # noqa: E731
        self.embed = get("model.embed_tokens.weight")
        self.final_norm = get("model.norm.weight")
        self.lm_head = self.embed if config.tie_word_embeddings else get("lm_head.weight")
        self.layers = [self._layer(weights, i, get) for i in range(config.num_layers)]
        freqs = torch.outer(torch.arange(config.max_position, dtype=torch.float32), rope_inv_freq(config))
        angles = torch.cat((freqs, freqs), dim=-1)
        # computed in float32 as HF does, then cast once: [max_position, head_dim] in the run dtype
        self.cos, self.sin = angles.cos().to(dtype), angles.sin().to(dtype)
        self.fused = cpu_ops.available(dtype) and self.embed.device.type == "cpu"

    def _layer(self, weights, i, get) -> dict[str, torch.Tensor | None]:
        p = f"model.layers.{i}."
        qkv = torch.cat([get(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
        has_bias = p + "self_attn.q_proj.bias" in weights
        qkv_bias = torch.cat([get(p + f"self_attn.{x}_proj.bias") for x in "qkv"]) if has_bias else None
        return {"attn_norm": get(p + "input_layernorm.weight"), "qkv": qkv, "qkv_bias": qkv_bias,
                "o": get(p + "self_attn.o_proj.weight"), "mlp_norm": get(p + "post_attention_layernorm.weight"),
                "gate_up": torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
                "down": get(p + "mlp.down_proj.weight")}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for the flat batch ``input_ids`` [T]."""
        cfg = self.config
        num_tokens, q_size, kv_size = len(input_ids), cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        h = F.embedding(input_ids, self.embed)
        delta = None  # the last sublayer's output, not yet added to the residual stream h
        if not self.fused:
            cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h, normed = self._add_norm(h, delta, layer["attn_norm"])
            qkv = F.linear(normed, layer["qkv"], layer["qkv_bias"])
            # Q and K heads side by side take RoPE in one pass (the same elementwise ops as two)
            qk = qkv[:, : q_size + kv_size].view(num_tokens, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            if self.fused:
                cpu_ops.rope_(qk, positions, self.cos, self.sin)
            else:
                qk = apply_rope(qk, cos, sin)
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = qkv[:, q_size + kv_size:].view(-1, cfg.num_kv_heads, cfg.head_dim)
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            attn = paged_attention_forward(q, k, v, k_cache, v_cache, meta)
            h, normed = self._add_norm(h, F.linear(attn, layer["o"]), layer["mlp_norm"])
            gate_up = F.linear(normed, layer["gate_up"])
            delta = F.linear(cpu_ops.silu_mul(gate_up) if self.fused else silu_mul(gate_up), layer["down"])
        return self._add_norm(h, delta, self.final_norm)[1]

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h + delta, RMSNorm(h + delta))``; the fused path adds in place."""
        if self.fused:
            return h, cpu_ops.add_rms_norm(h, delta, weight, self.config.rms_norm_eps)
        if delta is not None:
            h = h + delta
        return h, rms_norm(h, weight, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] for the given final hidden states."""
        return F.linear(hidden, self.lm_head).float()

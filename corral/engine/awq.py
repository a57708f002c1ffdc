"""Activation-aware scaling (AWQ-style) of the dense weights before group-wise int4 quantization (``w4a16``).

Round-to-nearest quantization treats every input channel alike, but a few channels carry activations far larger
than the rest, and their weights' rounding errors are multiplied by those activations. Scaling input channel ``j``
of a linear layer by ``s[j]`` (``W[:, j] * s[j]``) and its input by ``1 / s[j]`` changes nothing in exact
arithmetic, yet it moves the channel to a finer part of its group's grid: large-activation channels get more of
the codes. Following AWQ (Lin et al., 2023), ``s = mean|x|**alpha`` (normalized so the largest and smallest scale
straddle 1), and ``alpha`` is searched on a grid per layer for the least output error of the quantized layer on
calibration activations. ``alpha = 0`` is plain round-to-nearest, so on the sampled calibration rows the scales
never do worse than it (before clipping, which is searched on its own objective).

Where the ``1 / s`` goes, so that the model stays the same function:

- the fused QKV projection and the fused gate/up projection: into the RMSNorm weight before them;
- the down projection: into the up projection's rows (``silu(gate) * up / s`` is the down input over ``s``).

The output projection gets no scales: its input is attention over the value heads, and with grouped-query
attention one value channel feeds several query heads' columns, so no per-column scale folds into the values
(as AutoAWQ leaves it when the shapes differ).

Then AWQ's second half, clipping: each group of each projection (the output projection too) is clamped to
``±r * max|w|`` for the ``r`` of a small grid (1 among them) with the least error of that group's share of the
output on the calibration inputs. AutoAWQ leaves the query and key rows unclipped, since the attention scores
are their product and not their output; here clipping them by their own output error measured better (see
``CLIP_QK``). An outlying weight that stretches its group's grid is cut where that costs
less than the coarser grid would; unlike the scales, this changes the model.

The activations come from the dense float32 model run over a small calibration text that ships with the package
(``data/awq-calibration.txt``: Acts 1-4 of the King James Version, public domain, from Debian's
``bible-kjv-text``; its first 2,048 tokens), never from the text a perplexity is measured on. It costs one float32
pass over those tokens and two grid searches at load (about a minute for SmolLM2-135M on 2 cores).
"""

import logging
import os

import torch

from corral.engine.attention import AttentionMetadata, KVCache, PrefillSpan
from corral.engine.quant import quantize_int4
from corral.models import ModelConfig

log = logging.getLogger(__name__)

CALIBRATION_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "awq-calibration.txt")
ALPHAS = tuple(i / 20 for i in range(20))  # 0 (round-to-nearest) .. 0.95
WINDOW = 512  # calibration tokens per forward window
# calibration rows the errors are measured on, per projection: every (tokens / SEARCH_ROWS)-th. 512 rows did no
# better than 256 (group 64, perplexity on 8k tokens of bench/data/kjv-genesis.txt and 4k of another text: 9.70
# and 23.85 against 9.69 and 23.52) and take twice the search time
SEARCH_ROWS = 256
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)  # the share of a group's range kept (AWQ's clipping search)
CLIP_ROWS = 1024  # weight rows per clipping search batch
# clip the query and key rows too, by their own output error: without it (AutoAWQ's choice) the same two texts
# measured 9.74 and 23.53 against 9.69 and 23.52 at group 64
CLIP_QK = True


def calibration_ids(encode, limit: int = 2048) -> list[int]:
    """The shipped calibration text's token ids (at most ``limit``)."""
    with open(CALIBRATION_TEXT, encoding="utf-8") as f:
        return list(encode(f.read()))[:limit]


class _Inputs:
    """Per input channel, the sum of |x| over every calibration row, and a sample of rows for the search."""

    def __init__(self, inner, total: int):
        """``total``: the calibration rows that will pass, so that every ``total / SEARCH_ROWS``-th is kept."""
        self.inner, self.abs_sum, self.count, self.rows = inner, None, 0, []
        self.stride = max(1, -(-total // SEARCH_ROWS))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        total = x32.abs().sum(0)
        self.abs_sum = total if self.abs_sum is None else self.abs_sum + total
        first = -self.count % self.stride  # every stride-th row of the whole stream, across windows
        self.count += x32.shape[0]
        self.rows.append(x32[first:: self.stride].clone())
        return self.inner(x)

    def sample(self) -> torch.Tensor:
        """Every stride-th calibration row (at most SEARCH_ROWS)."""
        return torch.cat(self.rows)[:SEARCH_ROWS]


def _collect(weights: dict, config: ModelConfig, ids: list[int]) -> list[dict[str, _Inputs]]:
    """The inputs of every layer's fused QKV, gate/up and down projections in the dense float32 model."""
    from corral.engine.model import LlamaModel  # the model module imports quantization helpers from here

    model = LlamaModel(config, weights, torch.float32, "none")
    taps = []
    for layer in model.layers:
        tap = {name: _Inputs(layer[name], len(ids)) for name in ("qkv", "o", "gate_up", "down")}
        layer.update(tap)
        taps.append(tap)
    size = min(WINDOW, config.max_position)
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, size):
            window = ids[start: start + size]
            blocks = -(-len(window) // 16)
            caches = [KVCache.allocate(blocks, 16, config.num_kv_heads, config.head_dim, torch.float32)
                      for _ in range(config.num_layers)]
            meta = AttentionMetadata(torch.arange(len(window)), (), (PrefillSpan(0, len(window), None, len(window)),))
            model.forward(torch.tensor(window), torch.arange(len(window)), meta, caches)
    for tap in taps:  # the search needs the statistics only: let the float32 model go
        for inputs in tap.values():
            inputs.inner = None
    return taps


def best_scale(weight: torch.Tensor, inputs: _Inputs, group: int, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """The per-input-channel scale (float32 [K]) with the least output error of ``weight`` [N, K] quantized at
    ``group`` (scale and zero rounded to ``dtype``, as the kernel takes them) on the sampled inputs, and its
    alpha."""
    x = inputs.sample()
    mean_abs = (inputs.abs_sum / inputs.count).clamp(min=1e-8)
    reference = x @ weight.T
    best, best_error, best_alpha = torch.ones_like(mean_abs), float("inf"), 0.0
    for alpha in ALPHAS:
        s = mean_abs.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        quantized = quantize_int4(weight * s, group).dequantize(dtype) / s
        error = float((x @ quantized.T - reference).pow(2).mean())
        if error < best_error:
            best, best_error, best_alpha = s, error, alpha
    return best, best_alpha


def best_clip(weight: torch.Tensor, x: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """Per row and group of ``weight`` [N, K], the ratio of CLIP_RATIOS to clip it at (:func:`clip`) for the least
    error of that group's share of the output on ``x`` [T, K] (float32 [N, K / group])."""
    n, k = weight.shape
    xg = x.view(x.shape[0], k // group, group)
    best_ratio = torch.ones(n, k // group)
    for start in range(0, n, CLIP_ROWS):  # bounded memory: [T, rows, groups] at a time
        w = weight[start: start + CLIP_ROWS]
        best_error = torch.full((len(w), k // group), float("inf"))
        ratios = best_ratio[start: start + CLIP_ROWS]
        for ratio in CLIP_RATIOS:
            quantized = quantize_int4(clip(w, group, torch.full((len(w), k // group), ratio)), group).dequantize(dtype)
            error = torch.einsum("tgk,ngk->tng", xg, (w - quantized).view(len(w), k // group, group)).pow(2).mean(0)
            better = error < best_error
            best_error = torch.where(better, error, best_error)
            ratios[better] = ratio
    return best_ratio


def clip(weight: torch.Tensor, group: int, ratio: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] clamped per row and group to ``±ratio * max|w|`` (``ratio`` [N, K / group]; 1:
    unchanged), as AWQ clips: an outlying weight is cut, the other end of the range only if it is as far out."""
    n, k = weight.shape
    w = weight.view(n, k // group, group)
    bound = (w.abs().amax(-1) * ratio)[..., None]
    return torch.maximum(torch.minimum(w, bound), -bound).reshape(n, k)


def scale_weights(weights: dict, config: ModelConfig, ids: list[int], group: int,
                  dtype: torch.dtype = torch.bfloat16, clip_groups: bool = True) -> dict:
    """A copy of the dense float32 ``weights`` with every layer's QKV, gate/up and down projections scaled per
    input channel and the scales' inverses folded before them (see above): the same function, quantized at
    ``group`` with less error. Then, with ``clip_groups``, every projection's groups are clipped where that lowers
    the error (see :func:`clip_weights`)."""
    if len(ids) < 2:
        raise ValueError(f"AWQ calibration needs at least 2 tokens, got {len(ids)}")
    taps = _collect(weights, config, ids)
    out = dict(weights)
    alphas = []
    scales = []  # per layer: the input scales of qkv, gate_up and down (the output projection has none)
    for i, tap in enumerate(taps):
        p = f"model.layers.{i}."
        q, k, v = (p + f"self_attn.{x}_proj.weight" for x in "qkv")
        gate, up, down = (p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down"))
        layer_scales = {}
        for names, fold, tapped in (((q, k, v), p + "input_layernorm.weight", "qkv"),
                                    ((gate, up), p + "post_attention_layernorm.weight", "gate_up")):
            s, alpha = best_scale(torch.cat([weights[n].float() for n in names]), tap[tapped], group, dtype)
            for name in names:
                out[name] = weights[name].float() * s
            out[fold] = weights[fold].float() / s
            alphas.append(alpha)
            layer_scales[tapped] = s
        s, alpha = best_scale(weights[down].float(), tap["down"], group, dtype)
        out[down] = weights[down].float() * s
        out[up] = out[up] / s[:, None]  # after gate/up's own scaling of its columns
        alphas.append(alpha)
        layer_scales["down"] = s
        scales.append(layer_scales)
    log.info("AWQ scales from %d calibration tokens: alpha mean %.2f over %d projections (0: plain rounding)",
             len(ids), sum(alphas) / len(alphas), len(alphas))
    if clip_groups:
        clip_weights(out, taps, scales, group, dtype)
    return out


def clip_weights(weights: dict, taps: list[dict[str, _Inputs]], scales: list[dict[str, torch.Tensor]], group: int,
                 dtype: torch.dtype) -> None:
    """AWQ's second half, in place on the scaled ``weights``: each projection's groups clamped to the share of
    their range that gives the least output error on the (scaled) calibration inputs. Unlike the scales this
    changes the model, toward what rounding can represent; a ratio of 1 (no clipping) is always a candidate."""
    clipped = 0
    for i, (tap, layer_scales) in enumerate(zip(taps, scales)):
        p = f"model.layers.{i}."
        attention = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj") if CLIP_QK else ("self_attn.v_proj",)
        for names, tapped in ((attention, "qkv"), (("self_attn.o_proj",), "o"),
                              (("mlp.gate_proj", "mlp.up_proj"), "gate_up"), (("mlp.down_proj",), "down")):
            keys = [p + name + ".weight" for name in names]
            fused = torch.cat([weights[key].float() for key in keys])
            x = tap[tapped].sample()
            ratio = best_clip(fused, x / layer_scales[tapped] if tapped in layer_scales else x, group, dtype)
            clipped += int((ratio < 1).sum())
            for key, part in zip(keys, clip(fused, group, ratio).split([len(weights[key]) for key in keys])):
                weights[key] = part.contiguous()
    log.info("AWQ clipping: %d groups clipped", clipped)

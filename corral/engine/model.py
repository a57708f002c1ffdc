"""The Llama-family transformer in plain torch: RMSNorm, RoPE, grouped-query attention over a paged KV cache,
SwiGLU MLP, tied or untied LM head.

The forward pass takes one flat batch of tokens (every scheduled sequence's new tokens, decodes first) and an
:class:`~corral.engine.attention.AttentionMetadata` that says where each token's K/V goes and what each query
may see. No HF modeling code runs here; HF transformers is only the test oracle. Q/K and gate/up projections
are fused into one matmul each at load time, because on a 2-core CPU the number of ops per layer matters as
much as their size. The linears and the embedding are :mod:`corral.engine.quant` layers: dense, W8A16 or W4A16;
quantized layers take bfloat16 activations (torch's int8/int4 CPU kernels are many times slower in float32), so
a float32 model casts around them. What this leaves out: sliding-window attention, MoE, biases other than Q/K/V.
"""

import copy
import dataclasses
import math

import numpy as np
import torch
import torch.nn.functional as F

from corral.engine import hugepages
from corral.engine.attention import AttentionMetadata, KVCache, PrefillSpan, paged_attention_forward, write_kv
from corral.engine.quant import (Dense, Int4Groups, Int8Embedding, Int8Rows, IQ4Blocks, IQ4Tiles, IQ4XSBlocks,
                                 IQ4XSTiles, Q2Blocks, Q2Tiles, Q3Blocks, Q3Tiles, Q4Blocks, Q4KBlocks, Q4KTiles,
                                 Q4Tiles, Q5Blocks, Q5KBlocks, Q5KTiles, Q5Tiles, Q6Blocks, Q6Head, Q6Tiles, Q8Blocks,
                                 Q8Linear, Q8Tiles, SplitLinear, concat_blocks, quantize_int4, quantize_q8_blocks)
from corral import native
from corral.errors import ModelNotFoundError
from corral.kernels import cpu_ops
from corral.models import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies with the config's theta, and its ``linear`` or ``llama3`` scaling; a GGUF's per-pair
    ``freq_factors`` (its ``rope_freqs.weight``: llama3 scaling as llama.cpp's converter stores it) divide them
    first, as llama.cpp's RoPE divides each pair's angle."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = dict(config.rope_scaling or {})
    factors = scaling.pop("freq_factors", None)
    if factors is not None:
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
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


class _Cast:
    """A quantized linear run in bfloat16 inside a model of another dtype."""

    def __init__(self, inner, dtype: torch.dtype):
        self.inner, self.dtype, self.kind, self.nbytes = inner, dtype, inner.kind, inner.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(torch.bfloat16)).to(self.dtype)


class _CastOutput(_Cast):
    """An int8 embedding's lookups (token ids in, bfloat16 rows out) in a model of another dtype."""

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(ids).to(self.dtype)


class _Embedding:
    def __init__(self, weight: torch.Tensor):
        self.weight, self.nbytes = weight, weight.nbytes

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class _Rows:
    """An embedding looked up in Q8 or Q6 tiles, the LM head's when tied (the dequantized rows, float32)."""

    def __init__(self, table: Q8Tiles | Q6Head):
        self.table, self.nbytes = table, table.nbytes

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids)


# IQ4, Q4K, IQ4XS and Q5K tiles in the native step's kinds table, beside the Q tiles' bits (qmatmul.h)
IQ4_KIND, Q4K_KIND, IQ4XS_KIND, Q5K_KIND = 40, 41, 42, 51
# the native layer of each kind of blocks under w4a8
_TILES = {Q4Blocks: Q4Tiles, Q5Blocks: Q5Tiles, Q6Blocks: Q6Tiles, Q8Blocks: Q8Linear, IQ4Blocks: IQ4Tiles,
          Q3Blocks: Q3Tiles, Q2Blocks: Q2Tiles, Q4KBlocks: Q4KTiles, Q5KBlocks: Q5KTiles, IQ4XSBlocks: IQ4XSTiles}
_SHIPPED = tuple(_TILES)  # the blocks a file's tensor may be kept in


def _fused(blocks: list):
    """Blocks of one kind stacked along N, as one fused layer's (Q8 blocks: their codes and scales)."""
    if isinstance(blocks[0], Q8Blocks):
        return Q8Blocks(torch.cat([b.codes for b in blocks]), torch.cat([b.d for b in blocks]))
    return concat_blocks(blocks)


_MAX_VIEWS = 64  # long-lived tensors whose buffers one NativeStep keeps (weights, tables, caches: about 10)


class NativeStep:
    """The whole forward of a W4A8 model's step in one native call (``corral/csrc/decode_step.cpp``), for decodes,
    drafts and prompt spans (head size 64 or 128 for prompts): the same kernels as :meth:`LlamaModel.forward` on
    the same weights, so the same hidden states bit for bit. A linear is Q4 tiles (:class:`Q4Tiles`) or, where the
    file keeps more than 4 bits, Q5 (:class:`Q5Tiles`), Q6 (:class:`Q6Tiles`) or Q8 tiles (:class:`Q8Linear`), or
    IQ4 or IQ4XS tiles (:class:`IQ4Tiles`, :class:`IQ4XSTiles`: llama.cpp's non-linear 4-bit grid), or Q4K, Q5K, Q3
    or Q2 tiles (:class:`Q4KTiles`, :class:`Q5KTiles`, :class:`Q3Tiles`, :class:`Q2Tiles`: its Q4_K, Q5_K, Q3_K and
    Q2_K); a fused one whose parts differ in kind, each part at its own (:class:`SplitLinear`). The layers' tiles are
    moved into one buffer that the layers' linears then view (one copy of the weights)."""

    LINEARS = ("qkv", "o", "gate_up", "down")
    PROJECTIONS = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}  # the projections each fuses (q, k, v; gate, up)
    KINDS = {Q4Tiles: 4, Q5Tiles: 5, Q6Tiles: 6, Q8Linear: 8, IQ4Tiles: IQ4_KIND, Q3Tiles: 3,
             Q2Tiles: 2, Q4KTiles: Q4K_KIND, Q5KTiles: Q5K_KIND, IQ4XSTiles: IQ4XS_KIND}  # each layer's kinds

    @staticmethod
    def _parts(linear) -> list:
        """The native layers a linear runs as: its parts where they differ in kind (:class:`SplitLinear`), else it."""
        return linear.parts if isinstance(linear, SplitLinear) else [linear]

    @staticmethod
    def serves(model: "LlamaModel") -> bool:
        return (model.quantization == "w4a8" and model.fused and bool(model.layers)
                and all(all(type(part) in NativeStep.KINDS for part in NativeStep._parts(layer[name]))
                        and (layer[name].bias is None or name == "qkv")  # a QKV bias (Qwen2's) is added inside
                        for layer in model.layers for name in NativeStep.LINEARS)
                and len({layer["qkv"].bias is None for layer in model.layers}) == 1  # in every layer, or none
                and hasattr(native.module(), "decode_step"))

    def __init__(self, model: "LlamaModel"):
        cfg = model.config
        # each layer's projections' kinds (q, k, v, o, gate, up, down: Q2, Q3, Q4, Q5, Q6, Q8, IQ4, IQ4XS, Q4K, Q5K), a
        # fused linear's kind repeated for its parts; None where all are Q4 (the call then skips the table)
        kinds = [[kind for name in self.LINEARS for kind in self._kinds(layer[name], self.PROJECTIONS[name])]
                 for layer in model.layers]
        self.kinds = torch.tensor(kinds, dtype=torch.int64) if any(b != 4 for row in kinds for b in row) else None
        self.layer_bytes = [sum(part.tiles.numel() for name in self.LINEARS for part in self._parts(layer[name]))
                            for layer in model.layers]
        self.layer_tiles = self._gather_tiles(model)
        self.norms = torch.stack([w for layer in model.layers for w in (layer["attn_norm"], layer["mlp_norm"])] +
                                 [model.final_norm]).float().contiguous()
        # each layer's QKV bias (Qwen2's; float32 as the torch path adds it), or None where the model has none
        biases = [layer["qkv"].bias for layer in model.layers]
        self.qkv_bias = None if biases[0] is None else torch.stack(biases).float().contiguous()
        self.spec = torch.tensor([cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                  cfg.intermediate_size, model.embed.table.out_features, 0], dtype=torch.int64)
        self.embed_tiles = model.embed.table.tiles
        self.model = model
        self.head_tiles = model.lm_head.tiles if isinstance(model.lm_head, (Q8Tiles, Q6Head)) else None
        # set to float64 [8] to have each step add its seconds per part (bench/step_profile.py)
        self.profile: torch.Tensor | None = None
        self._views: dict[int, tuple[torch.Tensor, object]] = {}  # id -> (tensor, its buffer), for the long-lived
        self._block_size = 0  # spec[7], as a Python int: reading the tensor would be a torch call per step
        self._decode_args: tuple | None = None  # decode()'s caches and the buffers it passes at every call
        self._outputs = _StepOutputs(cfg.hidden_size, model.lm_head.out_features if self.head_tiles is not None else 0)

    @staticmethod
    def _kinds(linear, parts: int) -> list[int]:
        """The kinds of ``linear``'s ``parts`` projections: each part's where they differ, else its own ``parts``
        times."""
        if isinstance(linear, SplitLinear):
            return [NativeStep.KINDS[type(part)] for part in linear.parts]
        return [NativeStep.KINDS[type(linear)]] * parts

    @staticmethod
    def _gather_tiles(model: "LlamaModel") -> torch.Tensor:
        """Every layer's tiles in one buffer (on huge pages where granted: the step streams it whole), in layer
        order (a split linear's parts one after another), each layer's linears then a view of its part."""
        layers = [part for layer in model.layers for name in NativeStep.LINEARS
                  for part in NativeStep._parts(layer[name])]
        gathered = hugepages.zeros((sum(layer.tiles.numel() for layer in layers),), torch.uint8)
        offset = 0
        for layer in layers:
            size = layer.tiles.numel()
            gathered[offset: offset + size].copy_(layer.tiles.flatten())
            layer.tiles = gathered[offset: offset + size].view(layer.tiles.shape)
            offset += size
        return gathered

    def _view(self, tensor: torch.Tensor):
        """The buffer of a tensor that lives across steps (weights, tables, the KV cache), made once: a step
        after the forward's weight stream finds the interpreter's data cold, and each conversion costs there."""
        known = self._views.get(id(tensor))  # the entry holds the tensor, so no other object takes its id
        if known is None:
            if len(self._views) >= _MAX_VIEWS:  # a caller passing fresh tensors: convert them, never hoard them
                self._views.clear()
            known = self._views[id(tensor)] = (tensor, cpu_ops.buffer(tensor))
        return known[1]

    PARTS = ("embedding", "norms", "linears", "RoPE", "KV write", "attention", "SiLU", "LM head")

    @property
    def max_burst_rows(self) -> int:
        """The most logits rows a :meth:`decode_burst` call keeps its buffers for."""
        return self._outputs.keep_rows

    def truncated(self, model: "LlamaModel") -> "NativeStep":
        """The step of ``model``, this step's model cut to its first layers (:meth:`LlamaModel.truncated`): the
        same weight buffer, read only as far as those layers reach."""
        num_layers = model.config.num_layers
        step = copy.copy(self)
        step.layer_tiles = self.layer_tiles[: sum(self.layer_bytes[:num_layers])]
        step.layer_bytes = self.layer_bytes[:num_layers]
        step.kinds = None if self.kinds is None else self.kinds[:num_layers].contiguous()
        step.qkv_bias = None if self.qkv_bias is None else self.qkv_bias[:num_layers].contiguous()
        step.norms = torch.cat((self.norms[: 2 * num_layers], self.norms[-1:])).contiguous()
        step.spec = self.spec.clone()
        step.spec[0] = num_layers
        step.model, step.profile, step._views, step._block_size, step._decode_args = model, None, {}, 0, None
        step._outputs = _StepOutputs(self._outputs.hidden_size, self._outputs.vocab)  # its own buffers
        return step

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                 context_lens: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 spans: tuple[PrefillSpan, ...] = ()) -> torch.Tensor:
        """Final hidden states [T, hidden] of a flat batch of T rows: first single-query rows (decodes, a draft's
        rows), each over the keys of its ``tables`` row up to its ``context_lens`` entry, then the prompt
        ``spans`` one after another to the end, as :class:`PrefillSpan` gives them: without context blocks a
        sequence's first tokens, attending to their own fresh K/V, else over the cache through the blocks (the
        prompt kernels the torch path runs, so its bits). ``k_cache``/``v_cache`` every layer's cache
        [layers, blocks, block_size, kv_heads, head_dim] (float32, bfloat16 or int8 with ``k_scale``/``v_scale``
        [layers, blocks, block_size, kv_heads]), written at ``slots``."""
        model = self.model
        self._set_block_size(k_cache.shape[2])
        out = torch.empty(len(input_ids), model.config.hidden_size)
        view = self._view
        native.module().decode_step(
            view(self.spec), model.config.rms_norm_eps, *(cpu_ops.buffer(t.contiguous()) for t in
                                                          (input_ids, positions, slots, tables, context_lens)),
            view(self.embed_tiles), view(self.layer_tiles), view(self.norms), view(model.cos), view(model.sin),
            view(k_cache), view(v_cache), cpu_ops.buffer(out), torch.get_num_threads(),
            None if self.profile is None else self.profile.numpy(),
            *(None if s is None else view(s) for s in (k_scale, v_scale)),
            spans=[(span.start, span.end, None if span.context_blocks is None else cpu_ops.buffer(span.context_blocks),
                    span.num_context) for span in spans] or None,
            kinds=None if self.kinds is None else view(self.kinds),
            qkv_bias=None if self.qkv_bias is None else view(self.qkv_bias))
        return out

    def decode(self, input_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
               context_lens: list[int], threads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """What :meth:`__call__` computes, then the LM head: float32 logits [B, vocab], from the engine's own
        lists (``tables``: each row's block table, as long as it is), with no torch or numpy call on the way. A
        step after the forward's weight stream finds the caches cold, where each such call cost 10-30 us. The
        logits are a view of a buffer that the next call overwrites. Only where the LM head is Q8 tiles
        (:attr:`head_tiles`)."""
        _, logits, hidden_buffer, logits_buffer = self._outputs.rows(len(input_ids))
        self._native_decode((input_ids, positions, slots, tables, context_lens), threads, k_cache, v_cache, k_scale,
                            v_scale, hidden_buffer, logits_buffer, 1, 0)
        return logits

    def decode_burst(self, steps: int, pick_columns: int, input_ids: list[int], positions: list[int],
                     slots: list[int], tables: list[list[int]], context_lens: list[int], threads: int,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, end_ids: list[int] | None = None,
                     interrupt: np.ndarray | None = None, draws: tuple | None = None
                     ) -> tuple[torch.Tensor, list[list[int]], list[list[float]], bool]:
        """``steps`` tokens of B decodes in one call, as :meth:`decode` would make them one call each, each
        step's input the token picked at the step before (without ``draws``, ``cpu_ops.greedy_pick``'s over the first
        ``pick_columns`` logits, 0: all): (float32 logits [B * steps, vocab], each row's ``steps`` rows together,
        each row's ``steps`` tokens, their logprobs, and whether the native pass decided every token: where it
        could not, a NaN or +inf in a row, the token is 0 and only a verification of the rows may say what it is).
        ``steps`` 1 is :meth:`decode` with the pick made in its call. ``tables`` must hold every step's position.
        The logits are a view of a buffer that the next call overwrites. A burst ends early, every row with the
        same number of tokens, after a step where a row's pick is one of ``end_ids`` or ``interrupt`` (int64 [1],
        set by another thread while the call runs) is nonzero; its rows' logits stay at their places. ``draws``
        (temperature, top_k, top_p, min_p per row, and ``steps`` uniforms per row, step-major) makes each pick the
        sampler's native draw with that uniform instead of the greedy one; a draw it cannot decide ends the burst
        there, undecided."""
        hidden_buffer = self._outputs.rows(len(input_ids))[2]
        _, logits, _, logits_buffer = self._outputs.rows(len(input_ids) * steps)
        picks, logprobs, decided = self._native_decode((input_ids, positions, slots, tables, context_lens), threads,
                                                       k_cache, v_cache, k_scale, v_scale, hidden_buffer,
                                                       logits_buffer, steps, pick_columns or self._outputs.vocab,
                                                       end_ids, interrupt, draws)
        return logits, picks, logprobs, decided

    def _native_decode(self, rows: tuple, threads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, hidden_buffer, logits_buffer,
                       steps: int, pick_columns: int, end_ids: list[int] | None = None,
                       interrupt: np.ndarray | None = None, draws: tuple | None = None):
        args = self._decode_args
        if args is None or args[0] is not k_cache or args[1] is not v_cache or args[2] is not k_scale \
                or args[3] is not v_scale:  # the buffers that stay put, converted once (they are 12 calls)
            model, view = self.model, self._view
            self._set_block_size(k_cache.shape[2])
            args = self._decode_args = (
                k_cache, v_cache, k_scale, v_scale, (view(self.spec), model.config.rms_norm_eps),
                (view(self.embed_tiles), view(self.layer_tiles), view(self.norms), view(model.cos), view(model.sin),
                 view(k_cache), view(v_cache)),
                (None if k_scale is None else view(k_scale), None if v_scale is None else view(v_scale),
                 view(self.head_tiles)), None if self.kinds is None else view(self.kinds),
                None if self.qkv_bias is None else view(self.qkv_bias))
        return native.module().decode_step(*args[4], *rows, *args[5], hidden_buffer, threads,
                                           None if self.profile is None else self.profile.numpy(), *args[6],
                                           logits_buffer, steps, pick_columns, end_ids, interrupt, draws, None,
                                           args[7], args[8])

    def _set_block_size(self, block_size: int) -> None:
        if block_size != self._block_size:  # known once the cache is
            self.spec[7] = self._block_size = block_size


class _StepOutputs:
    """The native step's output buffers, kept across steps, for up to ``KEEP_BYTES`` of rows, with their views for
    each row count made once (a view is a torch and a numpy call, each tens of microseconds in a cold step). With
    an LM head they are made whole at the start: grown on demand, the buffer on huge pages took 28 ms to make at
    128 rows (16 sequences x 8 tokens) and 42 ms at 168, a stall of every stream at the first large burst. A step
    with more rows than that gets buffers of its own, not kept."""

    KEEP_BYTES = 32 << 20

    def __init__(self, hidden_size: int, vocab: int):
        self.hidden_size, self.vocab = hidden_size, vocab
        self.keep_rows = max(1, self.KEEP_BYTES // (4 * (hidden_size + vocab)))
        self._capacity = 0
        self._hidden, self._logits = torch.empty(0, hidden_size), torch.empty(0, vocab)
        self._rows: dict[int, tuple] = {}
        if vocab:
            self.rows(self.keep_rows)

    def __del__(self) -> None:
        try:  # the registry holds the views, so nothing of a dropped step outlives it
            cpu_ops.forget_buffers(known[1] for known in self._rows.values())
        except Exception:  # noqa: BLE001 - at interpreter exit the module may be half gone
            pass

    def rows(self, count: int) -> tuple:
        """(hidden [count, hidden_size], logits [count, vocab], and their buffers for the native call)."""
        known = self._rows.get(count)
        if known is not None:
            return known
        if count > self.keep_rows:  # a rare, large step: buffers of its own, freed with it
            hidden, logits = torch.empty(count, self.hidden_size), torch.empty(count, self.vocab)
            return hidden, logits, cpu_ops.buffer(hidden), cpu_ops.buffer(logits)
        if count > self._capacity:  # views of the old buffers stay valid for whoever still holds them
            self._capacity = min(max(count, 2 * self._capacity, 8), self.keep_rows)
            self._hidden = torch.empty(self._capacity, self.hidden_size)
            # every step writes its rows' logits (25 MB at 16 sequences x 8 tokens): huge pages where granted
            self._logits = hugepages.zeros((self._capacity, self.vocab), torch.float32)
            cpu_ops.forget_buffers(known[1] for known in self._rows.values())
            self._rows.clear()
        hidden, logits = self._hidden[:count], self._logits[:count]
        known = self._rows[count] = (hidden, logits, cpu_ops.buffer(hidden), cpu_ops.register_buffer(logits))
        return known


class LlamaModel:
    """Weights plus ``forward``. Plain tensors rather than ``nn.Module``: nothing here trains.

    ``quantization``: ``none``, ``w8a16``, ``w4a16`` (group-wise int4 of the dense weights, ``group_size`` along K),
    ``gguf`` (the :class:`~corral.engine.quant.Q4Blocks` in ``weights`` as they are, other tensors dense) or
    ``w4a8`` (Q4 blocks of 32, as shipped or quantized, Q2, Q3, Q4K, Q5, Q5K, Q6, IQ4, IQ4XS and Q8 blocks as shipped,
    a fused layer's parts of different kinds each at its own, and the embedding and LM head in Q8 tiles or, Q6_K as
    shipped, Q6 tiles, through the native kernels with float32 activations)."""

    def __init__(self, config: ModelConfig, weights: dict, dtype: torch.dtype, quantization: str = "none",
                 group_size: int = 32):
        self.config, self.dtype, self.quantization, self.group_size = config, dtype, quantization, group_size
        get = lambda name: weights[name].to(dtype).contiguous()  # noqa: E731
        if quantization == "w4a8":  # Q8 blocks of 32 (GGUF Q8_0 as shipped): lookups and logits from one copy
            if dtype != torch.float32:
                raise ValueError("w4a8 runs float32 activations")
            table = self._row_tiles(weights["model.embed_tokens.weight"])
            self.embed = _Rows(table)
            self.lm_head = table if config.tie_word_embeddings else self._row_tiles(weights["lm_head.weight"])
        elif quantization == "none":
            self.embed = _Embedding(get("model.embed_tokens.weight"))
            head = self.embed.weight if config.tie_word_embeddings else get("lm_head.weight")
            self.lm_head = Dense(head, None, dtype)
        else:  # int8 rows: the embedding's lookups and the LM head's logits through one copy when tied
            embed = Int8Embedding(self._dense(weights["model.embed_tokens.weight"]), torch.bfloat16)
            self.embed = embed if dtype == torch.bfloat16 else _CastOutput(embed, dtype)
            head = embed.head if config.tie_word_embeddings else \
                Int8Rows.from_dense(self._dense(weights["lm_head.weight"]), None, torch.bfloat16)
            self.lm_head = head if dtype == torch.bfloat16 else _Cast(head, dtype)
        self.final_norm = get("model.norm.weight")
        self.layers = [self._layer(weights, i, get) for i in range(config.num_layers)]
        freqs = torch.outer(torch.arange(config.max_position, dtype=torch.float32), rope_inv_freq(config))
        angles = torch.cat((freqs, freqs), dim=-1)
        # computed in float32 as HF does, then cast once: [max_position, head_dim] in the run dtype
        self.cos, self.sin = angles.cos().to(dtype), angles.sin().to(dtype)
        self.fused = cpu_ops.available(dtype) and self.final_norm.device.type == "cpu"
        self.native_step = NativeStep(self) if NativeStep.serves(self) else None

    def truncated(self, num_layers: int) -> "LlamaModel":
        """This model's first ``num_layers`` layers, then its final norm and LM head: an early exit that shares
        every weight with this model (self-speculation's draft model). Its own KV pool has ``num_layers``
        layers."""
        if not 1 <= num_layers <= self.config.num_layers:
            raise ValueError(f"a model of {self.config.num_layers} layers has no first {num_layers}")
        model = copy.copy(self)
        model.config = dataclasses.replace(self.config, num_layers=num_layers)
        model.layers = self.layers[:num_layers]
        model.native_step = None if self.native_step is None else self.native_step.truncated(model)
        return model

    @classmethod
    def _row_tiles(cls, value) -> Q6Head | Q8Tiles:
        """An embedding's or LM head's tiles under w4a8: Q6_K blocks as shipped, any other weight as Q8 rows
        (GGUF Q8_0 exactly)."""
        return Q6Head(value) if isinstance(value, Q6Blocks) else Q8Tiles(cls._dense(value))

    @staticmethod
    def _dense(value) -> torch.Tensor:
        return value.dequantize() if isinstance(value, _SHIPPED) else value.float()

    def _linear(self, parts: list, bias: torch.Tensor | None):
        """One (fused) linear layer from the weights of ``parts`` stacked along the output dimension."""
        if self.quantization == "w4a8":  # each part as shipped; a dense one (dequantized at load) to Q4 blocks of 32,
            # or to Q8 blocks beside a part the file keeps in 6 or 8 bits
            wide = any(isinstance(p, (Q6Blocks, Q8Blocks)) for p in parts)
            blocks = [p if isinstance(p, _SHIPPED) else
                      Q8Blocks(*quantize_q8_blocks(self._dense(p))) if wide else quantize_int4(self._dense(p), 32)
                      for p in parts]
            kinds = {type(b) for b in blocks}
            if kinds == {Q4Blocks, Q5Blocks}:  # a Q4 block is a Q5 block with the same d and m: one Q5 layer
                blocks, kinds = [Q5Blocks(*b[:3]) for b in blocks], {Q5Blocks}
            if len(kinds) == 1:  # one kind: the parts fused into one layer's tiles
                return _TILES[type(blocks[0])](_fused(blocks), bias)
            # parts the file keeps in different kinds: each on its own kernel, none rounded to another's
            return SplitLinear([_TILES[type(b)](b, None) for b in blocks], bias)
        if self.quantization == "gguf" and all(isinstance(p, Q4Blocks) for p in parts):
            layer = Int4Groups(concat_blocks(parts), bias, torch.bfloat16)
        else:
            weight = torch.cat([self._dense(p) for p in parts])
            if self.quantization in ("none", "gguf"):  # gguf: a tensor with no int4 kernel stays dense
                return Dense(weight, bias, self.dtype)
            layer = Int8Rows.from_dense(weight, bias, torch.bfloat16) if self.quantization == "w8a16" else \
                Int4Groups(quantize_int4(weight, self.group_size), bias, torch.bfloat16)
        return layer if self.dtype == torch.bfloat16 else _Cast(layer, self.dtype)

    def _layer(self, weights, i, get) -> dict:
        p = f"model.layers.{i}."
        has_bias = p + "self_attn.q_proj.bias" in weights
        qkv_bias = torch.cat([weights[p + f"self_attn.{x}_proj.bias"].float() for x in "qkv"]) if has_bias else None
        return {"attn_norm": get(p + "input_layernorm.weight"),
                "qkv": self._linear([weights[p + f"self_attn.{x}_proj.weight"] for x in "qkv"], qkv_bias),
                "o": self._linear([weights[p + "self_attn.o_proj.weight"]], None),
                "mlp_norm": get(p + "post_attention_layernorm.weight"),
                "gate_up": self._linear([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]],
                                        None),
                "down": self._linear([weights[p + "mlp.down_proj.weight"]], None)}

    def weight_bytes(self) -> int:
        linears = sum(layer[name].nbytes for layer in self.layers for name in ("qkv", "o", "gate_up", "down"))
        head = 0 if self.config.tie_word_embeddings else self.lm_head.nbytes
        return linears + self.embed.nbytes + head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], num_layers: int | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for the flat batch ``input_ids`` [T]. ``num_layers``:
        only the first that many layers, then the final norm (an early exit, as ``bench/early_exit.py`` measures
        it)."""
        cfg = self.config
        num_tokens, q_size, kv_size = len(input_ids), cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        h = self.embed(input_ids)
        delta = None  # the last sublayer's output, not yet added to the residual stream h
        if not self.fused:
            cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        for layer, cache in zip(self.layers[:num_layers], kv_caches):
            h, normed = self._add_norm(h, delta, layer["attn_norm"])
            qkv = layer["qkv"](normed)
            # Q and K heads side by side take RoPE in one pass (the same elementwise ops as two)
            qk = qkv[:, : q_size + kv_size].view(num_tokens, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            if self.fused:
                cpu_ops.rope_(qk, positions, self.cos, self.sin)
            else:
                qk = apply_rope(qk, cos, sin)
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = qkv[:, q_size + kv_size:].view(-1, cfg.num_kv_heads, cfg.head_dim)
            write_kv(k, v, cache, meta.slot_mapping)
            attn = paged_attention_forward(q, k, v, cache, meta)
            h, normed = self._add_norm(h, layer["o"](attn), layer["mlp_norm"])
            gate_up = layer["gate_up"](normed)
            delta = layer["down"](cpu_ops.silu_mul(gate_up) if self.fused else silu_mul(gate_up))
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
        return self.lm_head(hidden).float()

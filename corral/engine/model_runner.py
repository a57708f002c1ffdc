"""ModelRunner: owns the model and the paged KV pool; turns a ScheduledBatch into one forward pass and the
logits of the sequences that sample this step.

The flat batch puts single-token sequences (decodes, and one-token prefill tails) first, so attention can run
them as one batched call; see :mod:`corral.engine.attention`. A sequence samples when this step computes its
last uncomputed token; a chunk in the middle of a long prompt produces no logits.
"""

import logging

import torch

from corral.engine import awq, hugepages
from corral.engine.attention import AttentionMetadata, DecodeGroup, KVCache, PrefillSpan, group_prefills
from corral.engine.config import EngineConfig, kv_torch_dtype
from corral.engine.model import LlamaModel
from corral.engine.quant import check_group_size
from corral.engine.scheduler import ScheduledBatch
from corral.engine.sequence import Sequence
from corral.engine.weights import load_weights
from corral.errors import InvalidRequestError
from corral.kernels import paged_attention_cpu
from corral.models import ModelConfig, ModelFiles, load_tokenizer

log = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 1 << 30
DECODE_GROUP_SIZE = 16  # torch path: decodes per attention call; each group is padded to its own longest context


class ModelRunner:
    supports_drafts = True  # execute() returns a row per draft token (the engine drafts only for such runners)

    def __init__(self, config: EngineConfig, model_config: ModelConfig, files: ModelFiles | None,
                 model: LlamaModel | None = None):
        """``config`` with its formats resolved (see :mod:`corral.engine.formats`). ``model``: run this model
        (``model_config`` its config) instead of loading one from ``files``; a draft model that shares the
        target's weights is run this way, with a KV pool of its own."""
        self.config, self.model_config = config, model_config
        dtype = config.torch_dtype
        self.use_decode_kernel = paged_attention_cpu.load() is not None
        # every query as a decode's (see prepare): W4A8's integer products give a row the same bits in any batch,
        # torch's dense and weight-only products do not promise it
        self.deterministic = config.deterministic
        if self.deterministic and (config.quantization != "w4a8" or not self.use_decode_kernel):
            raise InvalidRequestError(
                f"deterministic needs quantization w4a8 and the native module (here quantization "
                f"{config.quantization!r}, the native module {'loaded' if self.use_decode_kernel else 'not loaded'}"
                "): only its integer products give a row the same bits at any row count", param="deterministic")
        if model is None:
            model = self.load_model(config, model_config, files)
        self.model = model
        self.block_size = config.block_size
        # a prefill over cached context runs alone through the native kernel; other prefills group into SDPA calls
        self.native_prefill = paged_attention_cpu.serves_prefills(dtype, model_config.head_dim)
        kv_dtype = dtype if config.kv_cache_dtype == "auto" else kv_torch_dtype(config.kv_cache_dtype)
        bytes_per_token = model_config.kv_bytes_per_token(kv_dtype.itemsize, scale_bytes=4 if kv_dtype == torch.int8
                                                          else 0)
        self.num_blocks = config.num_kv_blocks or max(
            1, (config.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES) // (bytes_per_token * config.block_size))
        # one tensor per field for every layer (the native step takes them whole); each layer's cache views it
        layers = model_config.num_layers
        whole = KVCache.allocate(layers * self.num_blocks, config.block_size, model_config.num_kv_heads,
                                 model_config.head_dim, kv_dtype)
        self.whole_kv = KVCache(*(None if t is None else t.view(layers, self.num_blocks, *t.shape[1:])
                                  for t in whole))
        self.kv_caches = [self.whole_kv.layer(i) for i in range(layers)]
        # the native decode step: a W4A8 model and the switch not turned off
        self.native_step = None if config.decode_step == "torch" else self.model.native_step
        if config.decode_step == "native" and self.native_step is None:
            raise InvalidRequestError("decode_step 'native' needs quantization w4a8 and the native module",
                                      param="decode_step")
        log.info("decode step: %s", self.decode_path)
        self._log_kv_bill(bytes_per_token, kv_dtype)
        log.info("weights: %s linears, %.1f MiB in all", config.quantization, self.model.weight_bytes() / 2**20)
        log.info("huge pages: %s; %.1f MiB of this process on them", f"asked for the streamed weights and the KV "
                 f"cache, buffers of {hugepages.MIN_BYTES >> 20} MiB and up" if hugepages.AVAILABLE else "off (not "
                 "Linux, no MADV_HUGEPAGE, transparent huge pages 'never' or unreadable, or CORRAL_HUGE_PAGES=0)",
                 hugepages.huge_bytes() / 2**20)

    @staticmethod
    def load_model(config: EngineConfig, model_config: ModelConfig, files: ModelFiles) -> LlamaModel:
        """The model in ``files``, in the formats of ``config``."""
        dtype = config.torch_dtype
        if config.quantization == "w4a16":
            check_group_size(config.quant_group_size, model_config)
        weights = load_weights(files, model_config, dtype if config.quantization == "none" else torch.float32,
                               keep_q4=config.quantization in ("gguf", "w4a8"), keep_q8=config.quantization == "w4a8")
        if config.awq:
            weights = awq.scale_weights(weights, model_config, awq.calibration_ids(load_tokenizer(files).encode),
                                        config.quant_group_size)
        return LlamaModel(model_config, weights, dtype, config.quantization, config.quant_group_size)

    @property
    def decode_path(self) -> str:
        """Which code runs the steps: ``native`` (one call per step; prompts too where the head size is 64 or 128)
        or ``torch`` (a call per op)."""
        return "native" if self.native_step is not None else "torch"

    def _log_kv_bill(self, bytes_per_token: int, kv_dtype: torch.dtype) -> None:
        cfg, num_tokens = self.model_config, self.num_blocks * self.block_size
        context = min(self.config.max_model_len or cfg.max_position, cfg.max_position)
        per_head = f"{cfg.head_dim} head dim x {kv_dtype.itemsize} B" + (" + a 4 B scale" if kv_dtype == torch.int8
                                                                          else "")
        log.info("KV cache (%s): 2 x %d layers x %d KV heads x (%s) = %d B per token; %d blocks of %d tokens = %d "
                 "tokens (%.1f MiB); %d sequences of %d tokens fit", str(kv_dtype).removeprefix("torch."),
                 cfg.num_layers, cfg.num_kv_heads, per_head, bytes_per_token, self.num_blocks, self.block_size,
                 num_tokens, num_tokens * bytes_per_token / 2**20, num_tokens // context, context)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks, every layer, K and V."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies])
        dst = torch.tensor([d for _, d in copies])
        for cache in self.kv_caches:
            cache.copy_blocks(src, dst)

    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor]:
        """Run one forward pass; return the sequences that sample and their float32 logits. A sequence with a
        draft has ``1 + len(draft)`` consecutive rows (its last token's, then each draft token's); the others one.
        The logits may be a view of a buffer that the next step overwrites."""
        lists = self._native_lists(batch)
        if lists is not None:  # the native step and its LM head: no torch call from here to the logits
            kv = self.whole_kv
            return list(batch.seqs), self.native_step.decode(*lists, torch.get_num_threads(), kv.k, kv.v,
                                                             kv.k_scale, kv.v_scale)
        return self._execute(batch)

    def execute_picking(self, batch: ScheduledBatch, pick_columns: int
                        ) -> tuple[list[Sequence], torch.Tensor, tuple[list[int], list[float]] | None]:
        """:meth:`execute`, and where the native step runs it with its LM head, every logits row's greedy pick
        among its first ``pick_columns`` (0: all) logits and that pick's logprob, made inside the same call
        (``cpu_ops.greedy_pick``'s pass, with no mask: the sampler's pick of a plain greedy row, bit for bit).
        The picks are None where that call did not run, or where its pass could not decide a row (a NaN or +inf
        in it: the sampler decides those)."""
        lists = self._native_lists(batch)
        if lists is not None:
            kv = self.whole_kv
            logits, picks, logprobs, decided = self.native_step.decode_burst(
                1, pick_columns, *lists, torch.get_num_threads(), kv.k, kv.v, kv.k_scale, kv.v_scale)
            picked = ([row[0] for row in picks], [row[0] for row in logprobs]) if decided else None
            return list(batch.seqs), logits, picked
        seqs, logits = self._execute(batch)
        return seqs, logits, None

    def _native_lists(self, batch: ScheduledBatch) -> tuple[list, ...] | None:
        """:meth:`prepare_decode`'s lists where the native step runs ``batch`` with its LM head, else None."""
        step = self.native_step
        return self.prepare_decode(batch) if step is not None and step.head_tiles is not None else None

    @property
    def max_burst_rows(self) -> int:
        """The most logits rows (sequences x tokens) a burst may make (:meth:`execute_burst`); 0: no bursts here
        (no native step with its LM head). Past it a step's logits would need a buffer of their own."""
        step = self.native_step
        return step.max_burst_rows if step is not None and step.head_tiles is not None else 0

    def execute_burst(self, batch: ScheduledBatch, steps: int, pick_columns: int, end_ids: list[int] | None = None,
                      interrupt=None, draws: tuple | None = None
                      ) -> tuple[list[Sequence], torch.Tensor, list[list[int]], list[list[float]], bool]:
        """``steps`` tokens for each of ``batch``'s decoding sequences in one native call (each step's input the
        token picked, among the first ``pick_columns`` logits, at the step before: the greedy one, or ``draws``'
        where given; the block tables hold room for every step, and a sequence's draft is empty): (the sequences,
        their float32 logits [B * steps, vocab] with each sequence's rows together, as a draft's, each sequence's
        tokens and their logprobs, and whether the native pass decided every token: see
        :meth:`NativeStep.decode_burst`, which ``end_ids`` and ``interrupt`` may end early). The logits may be a
        view of a buffer that the next step overwrites."""
        size = self.block_size
        ids, positions, slots, tables, lens = [], [], [], [], []
        for seq in batch.seqs:
            position, table = seq.num_computed_tokens, seq.block_table
            ids.append(seq.token_ids[position])
            positions.append(position)
            slots.append(table[position // size] * size + position % size)
            tables.append(table)
            lens.append(position + 1)
        kv = self.whole_kv
        return (list(batch.seqs), *self.native_step.decode_burst(steps, pick_columns, ids, positions, slots, tables,
                                                                 lens, torch.get_num_threads(), kv.k, kv.v,
                                                                 kv.k_scale, kv.v_scale, end_ids, interrupt,
                                                                 draws))

    def prepare_decode(self, batch: ScheduledBatch) -> tuple[list, ...] | None:
        """What :meth:`prepare` gives the native step, as the scheduler's own lists (token ids, positions, slots,
        each row's block table, context lengths), rows in batch order, for a step whose rows are all single
        queries that sample (decodes, with their drafts). None when a row is anything else (a prefill chunk, a
        one-token chunk that does not sample)."""
        size = self.block_size
        ids, positions, slots, tables, lens = [], [], [], [], []
        for seq, count in zip(batch.seqs, batch.num_new_tokens):
            start, table = seq.num_computed_tokens, seq.block_table
            if start + 1 != len(seq.token_ids) or count != 1 + len(seq.draft):
                return None
            ids.extend(seq.input_token_ids(start, count))
            for position in range(start, start + count):
                positions.append(position)
                slots.append(table[position // size] * size + position % size)
                tables.append(table)
                lens.append(position + 1)
        return ids, positions, slots, tables, lens

    @torch.inference_mode()
    def _execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor]:
        # single-query sequences (decodes, with their drafts) first, by context length, so decode groups pad little
        order = sorted(range(len(batch.seqs)), key=lambda i: (not _is_decode(batch.seqs[i], batch.num_new_tokens[i]),
                                                              batch.seqs[i].num_computed_tokens))
        seqs = [batch.seqs[i] for i in order]
        counts = [batch.num_new_tokens[i] for i in order]
        input_ids, positions, meta = self.prepare(seqs, counts)
        if self.native_step is not None and not meta.prefill_groups and (self.native_prefill or not meta.prefills):
            # with the decode kernel, all decodes are one group; prompt spans follow it
            tables, lens = (meta.decodes[0].block_tables, meta.decodes[0].context_lens) if meta.decodes else \
                (_NO_TABLES, _NO_LENS)
            hidden = self.native_step(input_ids, positions, meta.slot_mapping, tables, lens, *self.whole_kv,
                                      spans=meta.prefills)
        else:
            hidden = self.model.forward(input_ids, positions, meta, self.kv_caches)
        rows, sampling = [], []
        end = 0
        for seq, count in zip(seqs, counts):
            end += count
            if seq.num_computed_tokens + count == len(seq) + len(seq.draft):
                rows.extend(range(end - 1 - len(seq.draft), end))
                sampling.append(seq)
        # every row samples in a decode-only step: no gather (indexing by a list costs tens of microseconds)
        picked = hidden if len(rows) == len(hidden) else hidden.index_select(0, torch.tensor(rows, dtype=torch.long))
        logits = self.model.compute_logits(picked)  # zero rows when every sequence is mid-prefill
        return sampling, logits

    def prepare(self, seqs: list[Sequence], counts: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat input ids, positions and attention metadata for ``seqs`` advancing by ``counts`` tokens. A decode
        with a draft is one query row per token, each seeing the keys up to its own position: every layer writes
        the batch's K/V before it attends, so the draft's rows see one another's keys as a causal prefill would.
        Deterministic (``EngineConfig.deterministic``): a prompt chunk's tokens are single queries too, each over
        the cache up to its own position, so every query of a sequence is attended by the decode kernel from the
        K/V the cache holds, with the same arithmetic whether it comes in a fresh prompt, a later chunk, a
        prefix-cache hit, a recompute after preemption, a draft or a decode; the prompt kernels would read a fresh
        chunk's own K/V unrounded (bfloat16 and int8 caches) and sum in another order, and a last-bit difference
        can move an int8 rounding of the activations and, through the layers, a token."""
        size = self.block_size
        input_ids, positions, slots, prefills = [], [], [], []
        decode_rows: list[tuple[Sequence, int]] = []  # (sequence, keys its query sees)
        for seq, count in zip(seqs, counts):
            start = seq.num_computed_tokens
            table = seq.block_table
            input_ids.extend(seq.input_token_ids(start, count))
            positions.extend(range(start, start + count))
            slots.extend(table[p // size] * size + p % size for p in range(start, start + count))
            if self.deterministic or _is_decode(seq, count):
                decode_rows.extend((seq, start + i + 1) for i in range(count))
            else:
                context = None if start == 0 else torch.tensor(table[: -(-(start + count) // size)])
                prefills.append(PrefillSpan(len(input_ids) - count, len(input_ids), context, start + count))
        num_decodes = len(decode_rows)
        group_size = max(num_decodes, 1) if self.use_decode_kernel else DECODE_GROUP_SIZE
        decodes = tuple(self._decode_group(decode_rows[i: i + group_size], i) for i in range(0, num_decodes, group_size))
        fresh, groups = (tuple(prefills), ()) if self.native_prefill else group_prefills(prefills, size)
        meta = AttentionMetadata(torch.tensor(slots), decodes, fresh, groups)
        return torch.tensor(input_ids), torch.tensor(positions), meta

    def _decode_group(self, rows: list[tuple[Sequence, int]], start: int) -> DecodeGroup:
        """Block tables padded (with block 0) to the group's longest, and for the torch path the [B, 1, 1, L]
        mask of real keys. A sequence's consecutive rows (a draft's, a deterministic prompt chunk's) share one
        table, built once."""
        context_lens = torch.tensor([keys for _, keys in rows])
        width = -(-int(context_lens.max()) // self.block_size)
        runs: list[list] = []  # [sequence, its consecutive rows]
        for seq, _ in rows:
            if runs and runs[-1][0] is seq:
                runs[-1][1] += 1
            else:
                runs.append([seq, 1])
        tables = torch.tensor([seq.block_table[:width] + [0] * (width - len(seq.block_table[:width]))
                               for seq, _ in runs])
        if len(runs) < len(rows):
            tables = tables.repeat_interleave(torch.tensor([count for _, count in runs]), dim=0)
        mask = None if self.use_decode_kernel else \
            (torch.arange(width * self.block_size)[None, :] < context_lens[:, None])[:, None, None, :]
        return DecodeGroup(start, start + len(rows), tables, context_lens, mask)


_NO_TABLES, _NO_LENS = torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long)  # a step of prompts only


def _is_decode(seq: Sequence, count: int) -> bool:
    """Whether ``seq`` advancing by ``count`` is single queries: one token, or a decode token and its draft."""
    return count == 1 or (bool(seq.draft) and count == seq.num_scheduled_tokens
                          and seq.num_computed_tokens + 1 == len(seq))

"""Drafts from a model: a smaller model with the target's vocabulary, or the target's own first layers
(self-speculation), proposes the next tokens greedily, and the target verifies them like any other draft.

The draft model runs on a :class:`~corral.engine.model_runner.ModelRunner` of its own, with its own KV pool and
block manager (no prefix cache: a draft's blocks are private and short-lived). Each target sequence that drafts
has a *shadow*: a sequence in the draft pool holding the target's tokens, then the tokens it drafted. Before a
step drafts, each shadow is synced with its target: the draft tokens the target accepted keep their K/V, the
rest are truncated (the same rollback as the target's), and the tokens the shadow has not seen (the target's
token after the accepted ones, or a whole prompt the first time) are computed in the first draft round, at most
``max_num_batched_tokens`` tokens in all per draft forward (a budget of the draft model's own, beside the target's;
a long prompt takes several steps, and its sequence gets model drafts once it is caught up). Then every drafting
shadow advances one token per round, in one batched forward per round: the draft model's greedy pick among the
tokens the sequence's grammar allows (a copy of its guide advances with the draft, so a token the grammar forbids
is never proposed), until the sequence's draft length, an end-of-sequence token or the grammar's end.

A draft model's token is worth what it costs only when the draft model agrees with the target often enough:
the price of a draft token is the target's row (:func:`~corral.engine.speculation.draft_price`) plus the draft
model's own step, as a share of the target's (``draft_model_cost``; by default the ratio of the weight bytes the
two models stream per step). The catch-up of a shadow's prompt is not in that price: the first model draft of a
sequence costs a prefill of its prompt by the draft model. Each sequence learns its acceptance rate of model
drafts apart from its forced spans and prompt lookups, and a sequence whose rate does not pay stops asking the
draft model. The draft model is asked only where prompt lookup is on (``speculation``, the server's default or the
request's), and only for sequences that jump-forward and lookup leave without a draft.

The draft pool holds as many tokens as the target's. When a shadow finds no room, the shadows of sequences not
asking this step are released first; if there is still no room, the shadow is released and its sequence is not
asked again.

The draft changes nothing the target would produce: verification (:meth:`~corral.engine.sampler.Sampler.verify`)
treats a model draft as it treats any deterministic draft.
"""

import dataclasses
import logging
from collections.abc import Iterable

import numpy as np
import torch

from corral.engine.block_manager import BlockManager
from corral.engine.config import EngineConfig
from corral.engine.model_runner import ModelRunner
from corral.engine.scheduler import ScheduledBatch
from corral.engine.sequence import Sequence
from corral.errors import InvalidRequestError
from corral.fsm.guide import Guide
from corral.fsm.vocabulary import Vocabulary
from corral.kernels import cpu_ops
from corral.kernels.bitmask import apply_token_bitmask_

log = logging.getLogger(__name__)


class _Shadow:
    """A target sequence's twin in the draft pool. ``synced``: how many of ``seq.token_ids`` were the target's
    when it last drafted; the rest are its draft tokens."""

    def __init__(self, target: Sequence):
        self.seq = Sequence(target.request_id, target.prompt_token_ids, target.params)
        self.seq.token_ids.extend(target.output_token_ids)
        self.synced = len(target.token_ids)


class _Drafting:
    """One sequence's draft in the making: its shadow, how many tokens it may draft, its guide's probe."""

    def __init__(self, target: Sequence, shadow: _Shadow, cap: int):
        self.target, self.shadow, self.cap = target, shadow, cap
        self.probe: Guide | None = target.guide.probe() if target.guide is not None else None
        self.tokens: list[int] = []
        self.done = False


class ModelDrafter:
    """Greedy drafts from ``runner``'s model for target sequences over ``vocabulary``."""

    def __init__(self, runner, vocabulary: Vocabulary, cost: float, max_tokens_per_round: int):
        """``runner``: the draft model's runner (``num_blocks``, ``block_size``, ``execute``); ``cost``: its step
        as a share of the target's; ``max_tokens_per_round``: the tokens one draft forward may compute (catching
        shadows up on prompts is chunked under it)."""
        self.runner, self.cost, self.budget = runner, cost, max_tokens_per_round
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
        self.vocab_size = vocabulary.size
        self.eos_token_ids = frozenset(vocabulary.eos_token_ids)
        self.words = -(-vocabulary.size // 32)
        self.shadows: dict[int, _Shadow] = {}  # by the target's seq_id
        self.starved: set[int] = set()  # sequences whose shadow found no room: not asked again
        self.num_forwards = 0  # draft-model forward passes, all rounds
        self._asking: set[int] = set()  # this step's sequences that want a draft

    # -- the drafts of one step -----------------------------------------------------------------------------
    def propose(self, wanted: list[tuple[Sequence, int]], running: Iterable[Sequence]) -> None:
        """Set ``draft`` on each sequence of ``wanted`` (with the most tokens it may draft) that the draft model
        can serve this step. Shadows of sequences no longer in ``running`` are released first."""
        self.release_absent(running)
        self._asking = {target.seq_id for target, _ in wanted}
        drafting = [_Drafting(target, self._sync(target), cap) for target, cap in wanted
                    if target.seq_id not in self.starved]
        # round 0: each shadow computes what it has not seen (chunked); later rounds one token each
        active = self._round(drafting, catch_up=True)
        while active:
            active = self._round(active, catch_up=False)
        for d in drafting:
            if d.tokens:
                d.target.draft, d.target.num_draft_forced, d.target.draft_by_model = list(d.tokens), 0, True
                if d.probe is not None:  # the probe took every token
                    d.target.allowed_draft = (d.target.draft, len(d.target.token_ids))

    def _sync(self, target: Sequence) -> _Shadow:
        """The target's shadow, its K/V kept for the tokens the target has too and truncated past them."""
        shadow = self.shadows.get(target.seq_id)
        tokens = target.token_ids
        if shadow is None:
            shadow = self.shadows[target.seq_id] = _Shadow(target)
            return shadow
        seq = shadow.seq
        valid = min(seq.num_computed_tokens, shadow.synced)
        if valid == shadow.synced:  # its draft tokens the target accepted keep their K/V
            while valid < seq.num_computed_tokens and valid < len(tokens) and seq.token_ids[valid] == tokens[valid]:
                valid += 1
        if valid == len(tokens):  # every token seen: recompute the last, whose logits the next token needs
            valid -= 1
        del seq.token_ids[valid:]
        seq.token_ids.extend(tokens[valid:])
        if seq.block_table:
            self.block_manager.truncate(seq, valid)
        seq.num_computed_tokens = valid
        shadow.synced = len(tokens)
        return shadow

    def _round(self, drafting: list[_Drafting], catch_up: bool) -> list[_Drafting]:
        """One draft forward over ``drafting``; returns those that go on to another round."""
        seqs, counts, budget = [], [], self.budget
        for d in drafting:
            seq = d.shadow.seq
            count = min(seq.num_uncomputed_tokens, budget) if catch_up else 1
            if count <= 0 or not self._reserve(d, count):
                d.done = True
                continue
            seqs.append(seq)
            counts.append(count)
            budget -= count
        if not seqs:
            return []
        sampled, logits = self.runner.execute(ScheduledBatch(seqs, counts, []))
        self.num_forwards += 1
        for seq, count in zip(seqs, counts):
            seq.num_computed_tokens += count
        by_shadow = {id(d.shadow.seq): d for d in drafting}
        rows = [by_shadow[id(seq)] for seq in sampled]
        reached = {id(d) for d in rows}
        for d, token in zip(rows, self._pick(rows, logits)):
            if token is None:
                d.done = True
                continue
            d.tokens.append(token)
            d.shadow.seq.token_ids.append(token)
            if len(d.tokens) >= d.cap or (d.probe is not None and d.probe.is_finished()):
                d.done = True
        for d in drafting:
            if id(d) not in reached:
                d.done = True  # mid-prompt: no draft this step, the catch-up goes on next step
        return [d for d in drafting if not d.done]

    def _reserve(self, d: _Drafting, count: int) -> bool:
        """Blocks for ``count`` more tokens of ``d``'s shadow. Without room, the shadows of sequences that are not
        asking for a draft this step are released first; if that is not enough, ``d``'s shadow is released and its
        sequence is not asked again (so a prompt the pool cannot hold is not prefilled over and over)."""
        seq, bm = d.shadow.seq, self.block_manager
        for attempt in range(2):
            if not seq.block_table:
                if bm.can_allocate(seq, seq.num_computed_tokens + count):
                    bm.allocate(seq, seq.num_computed_tokens + count)
                    return True
            elif bm.can_append(seq, count):
                bm.append(seq, count)
                return True
            if attempt == 0:
                for seq_id in [s for s in self.shadows if s not in self._asking]:
                    self.release(seq_id)
        self.release(d.target.seq_id)
        self.starved.add(d.target.seq_id)
        return False

    def _pick(self, rows: list[_Drafting], logits: torch.Tensor) -> list[int | None]:
        """Per row, the draft model's greedy token among those the sequence's grammar allows after its draft so
        far; None where nothing is allowed or the pick ends the sequence. Each probe advances by its pick."""
        if not rows:
            return []
        masked = [i for i, d in enumerate(rows) if d.probe is not None]
        bitmask = np.zeros((len(rows), self.words), dtype=np.int32) if masked else None
        for i in masked:
            rows[i].probe.fill_mask(bitmask[i])
        dead = {i for i in masked if not bitmask[i].any()}
        bits = None if bitmask is None else torch.from_numpy(bitmask)
        which = None if bitmask is None else torch.tensor(masked, dtype=torch.long)
        picked = cpu_ops.greedy_pick(logits.contiguous(), self.vocab_size, bits, which) if not dead else None
        if picked is not None:
            tokens = picked[0]
        else:  # the torch path: mask, then the first largest
            work = logits[:, : self.vocab_size].float().clone()
            if bits is not None:
                apply_token_bitmask_(work, bits, which)
            tokens = torch.argmax(work, dim=-1).tolist()
        out: list[int | None] = []
        for i, (d, token) in enumerate(zip(rows, tokens)):
            if i in dead or token in self.eos_token_ids or (d.probe is not None and not d.probe.advance(token)):
                out.append(None)
            else:
                out.append(token)
        return out

    # -- shadows --------------------------------------------------------------------------------------------
    def release(self, seq_id: int) -> None:
        shadow = self.shadows.pop(seq_id, None)
        if shadow is not None and shadow.seq.block_table:
            self.block_manager.free(shadow.seq)

    def finished(self, seq_id: int) -> None:
        """The target sequence finished or was aborted: nothing of it stays."""
        self.release(seq_id)
        self.starved.discard(seq_id)

    def release_absent(self, running: Iterable[Sequence]) -> None:
        """Release the shadows of sequences that finished, were aborted or were preempted."""
        live = {seq.seq_id for seq in running if not seq.is_finished}
        for seq_id in [s for s in self.shadows if s not in live]:
            self.release(seq_id)
        self.starved &= live


def build(config: EngineConfig, target: ModelRunner, vocabulary: Vocabulary) -> ModelDrafter | None:
    """The draft model ``config`` names (None when it names none): ``draft_model`` loaded in the target's formats
    (and cut to ``draft_layers`` when given), or with ``draft_model`` unset, the target's own first
    ``draft_layers`` layers, sharing its weights."""
    if config.draft_model is None and config.draft_layers is None:
        return None
    layers = config.draft_layers
    if config.draft_model is None:
        _check_layers(layers, target.model_config.num_layers)
        model = target.model.truncated(layers)
        what = f"the target's first {layers} of {target.model_config.num_layers} layers"
    else:
        from corral.models import load_model_config, load_tokenizer, resolve_model

        files = resolve_model(config.draft_model)
        if Vocabulary.from_tokenizer(load_tokenizer(files)).token_bytes != vocabulary.token_bytes:
            raise InvalidRequestError("the draft model's vocabulary differs from the target's", param="draft_model")
        model_config = load_model_config(files)
        if model_config.max_position < target.model_config.max_position:
            raise InvalidRequestError(f"the draft model's context ({model_config.max_position} tokens) is shorter "
                                      f"than the target's ({target.model_config.max_position})", param="draft_model")
        if layers is not None:  # cut before the layers are built: the rest is never held
            _check_layers(layers, model_config.num_layers)
            model_config = dataclasses.replace(model_config, num_layers=layers)
        model = ModelRunner.load_model(config, model_config, files)
        what = f"{config.draft_model}, {model.config.num_layers} layers"
    # the draft pool holds as many tokens as the target's; a draft is never longer than its target
    # (its numerics never reach an output, which verification decides: it keeps the fast prompt kernels)
    draft_config = dataclasses.replace(config, num_kv_blocks=target.num_blocks, enable_prefix_caching=False,
                                       decode_step="torch" if config.decode_step == "torch" else "auto",
                                       deterministic=False)
    runner = ModelRunner(draft_config, model.config, None, model=model)
    cost = config.draft_model_cost
    if cost is None:
        cost = model.weight_bytes() / target.model.weight_bytes()
    log.info("draft model: %s; a draft step costs %.2f of a target step (%s)", what, cost,
             "given" if config.draft_model_cost is not None else "weight bytes")
    return ModelDrafter(runner, vocabulary, cost, config.max_num_batched_tokens)


def _check_layers(layers: int, num_layers: int) -> None:
    if not 1 <= layers <= num_layers:
        raise InvalidRequestError(f"draft_layers must be in 1..{num_layers} (the model's layers), got {layers}",
                                  param="draft_layers")

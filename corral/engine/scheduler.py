"""Scheduler: each step, decide how many tokens every sequence advances, under a token budget and a cap on
running sequences.

Order of a step (vLLM V1's policy, in one pass):

1. running sequences that decode (one uncomputed token, and its draft when it has one) first, those without a
   draft before those with one, then running sequences still in a chunked prefill, oldest first; each takes
   ``min(uncomputed, budget left)`` tokens. A
   draft is cut to the budget, and dropped when the pool cannot hold it (a draft never preempts);
2. when the pool cannot hold a running sequence's new tokens, the *newest* running sequence is preempted by
   recompute: its blocks are freed, it goes back to the front of the queue and later recomputes prompt plus
   output (the prefix cache often makes that cheap). A sequence may preempt itself;
3. then waiting sequences, first come first served, each starting from its prefix-cache hit, while the budget,
   the sequence cap and the pool allow. None is admitted in a step that preempted. A waiting sequence whose
   next uncached block is one a running prefill is computing right now (same chain hash) is held back, keeping
   its place in the queue, and the ones behind it go on: next step that block is a cache hit instead of being
   computed twice (SGLang's cache-aware admission, reduced to the one block that decides it).

What this leaves out: priorities, and swapping KV to host memory (recompute is what a small model wants).
"""

from collections import deque
from typing import NamedTuple

from corral.engine.block_manager import BlockManager
from corral.engine.sequence import Sequence, SequenceStatus


class ScheduledBatch(NamedTuple):
    seqs: list[Sequence]  # decodes first (those without a draft, then those with), then prefill chunks
    num_new_tokens: list[int]  # per sequence, how many tokens it advances this step
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        assert max_num_batched_tokens >= max_num_seqs, "every running sequence must fit one decode token"
        self.block_manager = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is the newest
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        plain = self._plain_decodes()
        if plain is not None:
            return plain
        budget = self.max_num_batched_tokens
        planned: dict[int, tuple[Sequence, int]] = {}  # seq_id → (seq, tokens), insertion order = batch order
        preempted: list[Sequence] = []
        # stable: decodes first, drafted ones after the others (their rows then split from the logits as two views,
        # not copies; a draft cut below to nothing leaves its sequence among them, and the split copies), then
        # prefills
        for seq in self._decodes_first():
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                seq.draft = []
                continue
            if seq.draft:  # a draft is cut to the budget, and dropped rather than preempt anyone
                seq.draft = seq.draft[: budget - seq.num_uncomputed_tokens]
                if seq.draft and not self.block_manager.can_append(seq, seq.num_scheduled_tokens):
                    seq.draft = []
                seq.num_draft_forced = min(seq.num_draft_forced, len(seq.draft))
            num_new = min(seq.num_scheduled_tokens, budget)
            while not self.block_manager.can_append(seq, num_new):
                victim = self.running[-1]
                if victim.seq_id in planned:
                    budget += planned.pop(victim.seq_id)[1]
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.append(seq, num_new)
                planned[seq.seq_id] = (seq, num_new)
                budget -= num_new
        if not preempted:
            budget = self._admit(planned, budget)
        seqs = [seq for seq, _ in planned.values()]
        return ScheduledBatch(seqs, [n for _, n in planned.values()], preempted)

    def _plain_decodes(self) -> ScheduledBatch | None:
        """The usual decode step, where the walk in :meth:`schedule` would change nothing and admit no one: every
        running sequence decodes its one uncomputed token and its whole draft into room its own last block
        already has, all of them within the token budget, and the queue is empty. The same batch, in the same
        order (the drafted ones after the others), without the walk; None where any of that does not hold."""
        running = self.running
        if self.waiting or not running:
            return None
        size, refs, live = self.block_manager.block_size, self.block_manager.ref_counts, SequenceStatus.RUNNING
        budget, drafted = self.max_num_batched_tokens, False
        for seq in running:
            computed, table, count = seq.num_computed_tokens, seq.block_table, 1 + len(seq.draft)
            budget -= count
            if budget < 0 or len(seq.token_ids) - computed != 1 or seq.status is not live \
                    or count > len(table) * size - computed or refs[table[computed // size]] != 1:
                return None
            drafted = drafted or count > 1
        if not drafted:
            return ScheduledBatch(list(running), [1] * len(running), [])
        seqs = [seq for seq in running if not seq.draft] + [seq for seq in running if seq.draft]
        return ScheduledBatch(seqs, [1 + len(seq.draft) for seq in seqs], [])

    def _decodes_first(self) -> list[Sequence]:
        """The running sequences in the order a batch takes them (stable within each kind)."""
        plain, drafted, prefills = [], [], []
        for seq in self.running:
            if len(seq.token_ids) - seq.num_computed_tokens != 1:
                prefills.append(seq)
            else:
                (drafted if seq.draft else plain).append(seq)
        return plain + drafted + prefills if drafted or prefills else plain

    def _admit(self, planned: dict, budget: int) -> int:
        if not self.waiting:  # the usual decode step: no walk over the running sequences' prompt blocks
            return budget
        bm = self.block_manager
        in_flight = self._blocks_in_flight() if bm.enable_prefix_caching else None
        held: list[Sequence] = []
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if len(self.running) + 1 + seq.num_forks_pending > self.max_num_seqs:
                break
            hits = bm.find_cached_prefix(seq)
            if in_flight and self._next_block_hash(seq, hits) in in_flight:
                held.append(self.waiting.popleft())
                continue
            num_new = min(len(seq) - len(hits) * bm.block_size, budget)
            if not bm.can_allocate(seq, len(hits) * bm.block_size + num_new, hits):
                break
            self.waiting.popleft()
            bm.allocate(seq, len(hits) * bm.block_size + num_new, hits)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            planned[seq.seq_id] = (seq, num_new)
            budget -= num_new
            if in_flight is not None:
                in_flight.update(self._uncached_block_hashes(seq))
        self.waiting.extendleft(reversed(held))  # held sequences keep their place at the front
        return budget

    def _uncached_block_hashes(self, seq: Sequence) -> list[int]:
        """Chain hashes of ``seq``'s full prompt blocks that are not cached yet (it is computing them)."""
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        return self.block_manager.chain_hashes(seq.token_ids, seq.cache_salt, parent, len(seq.block_hashes),
                                               seq.num_prompt_tokens // self.block_manager.block_size)

    def _blocks_in_flight(self) -> set[int]:
        return {h for seq in self.running if seq.num_computed_tokens < seq.num_prompt_tokens
                for h in self._uncached_block_hashes(seq)}

    def _next_block_hash(self, seq: Sequence, hits: list[int]) -> int | None:
        """Chain hash of the first full block of ``seq`` past its cache ``hits`` (None: no such block)."""
        bm = self.block_manager
        if len(hits) >= (len(seq) - 1) // bm.block_size:
            return None
        parent = bm.block_hash[hits[-1]] if hits else None
        return bm.chain_hashes(seq.token_ids, seq.cache_salt, parent, len(hits), len(hits) + 1)[0]

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and queue it first, to recompute everything it has so far."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.draft = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Retire ``seq`` (finished or aborted), running or waiting, and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

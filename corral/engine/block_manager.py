"""BlockManager: the paged KV pool's bookkeeping: block tables, reference counts, the prefix cache, fork and
copy-on-write. It never touches K/V data; copies it asks for are handed to the model runner.

Prefix cache (vLLM V1's design): a *full* block is keyed by the chain hash ``hash((parent hash, its token ids,
extra key))``, the extra key being the request's cache salt, so tenants never share blocks. A block whose
reference count drops to 0 goes to the free queue but keeps its hash; a later prompt with the same prefix takes
it back. Allocation takes free blocks in LRU order, and only then forgets the taken block's hash. A prompt
fully in the cache still computes its last block (there must be a token to sample from), so hits stop at
``len(prompt) - 1`` tokens, rounded down to a block.

Only a sequence's last, partial block is ever written, so copy-on-write concerns that block alone: after a
fork it is shared, and the first sequence to write into it gets a private copy.
"""

from collections import OrderedDict

from corral.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies for the model runner
        self.num_queried_tokens = self.num_hit_tokens = 0
        self._num_cached_free = 0  # free blocks with a hash; kept as they move (stats read it every step)

    # -- counts ---------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return self._num_cached_free

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ---------------------------------------------------------------------------------------
    def chain_hashes(self, token_ids: list[int], extra_key, parent: int | None = None, start: int = 0,
                     stop: int | None = None) -> list[int]:
        """Hashes of the full blocks ``start .. stop`` of ``token_ids``, chained from ``parent``."""
        size, hashes = self.block_size, []
        stop = len(token_ids) // size if stop is None else stop
        for i in range(start, stop):
            parent = hash((parent, tuple(token_ids[i * size:(i + 1) * size]), extra_key))
            hashes.append(parent)
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq``, at most ``len(seq) - 1`` tokens. No side effects."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for h in self.chain_hashes(seq.token_ids, seq.cache_salt, stop=(len(seq) - 1) // self.block_size):
            block = self.hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    # -- allocation -----------------------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> bool:
        """Whether ``seq`` (with no blocks yet) can cover ``num_tokens`` tokens, reusing ``hits``."""
        num_revived = sum(1 for b in hits if self.ref_counts[b] == 0)  # cached but free: leaves the free queue
        return self.num_blocks_for(num_tokens) - len(hits) + num_revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> None:
        """First allocation: take the prefix-cache ``hits``, then fresh blocks up to ``num_tokens`` tokens."""
        assert not seq.block_table and self.can_allocate(seq, num_tokens, hits)
        for block in hits:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
                self._num_cached_free -= 1  # a hit is a hashed block
            self.ref_counts[block] += 1
        seq.block_table = list(hits)
        seq.block_hashes = [self.block_hash[b] for b in hits]
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self.num_queried_tokens += len(seq)
            self.num_hit_tokens += seq.num_cached_tokens
        self._extend(seq, num_tokens)

    def num_blocks_to_append(self, seq: Sequence, num_new_tokens: int) -> int:
        """Fresh blocks ``seq`` needs to write ``num_new_tokens`` more: new blocks plus a copy-on-write one."""
        if self._has_room(seq, num_new_tokens):
            return 0
        need = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return max(need, 0) + int(self._needs_copy_on_write(seq, num_new_tokens))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_blocks_to_append(seq, num_new_tokens) <= self.num_free_blocks

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room for ``num_new_tokens`` more computed tokens, copying a shared last block first."""
        if self._has_room(seq, num_new_tokens):
            return
        assert self.can_append(seq, num_new_tokens)
        if self._needs_copy_on_write(seq, num_new_tokens):
            shared = seq.block_table[-1]
            private = self._take_free_block()
            self.ref_counts[shared] -= 1
            seq.block_table[-1] = private
            self.pending_copies.append((shared, private))
        self._extend(seq, seq.num_computed_tokens + num_new_tokens)

    def _has_room(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether ``seq``'s blocks already hold ``num_new_tokens`` more tokens, starting in a block of its own
        (no copy to make): most decode steps, asked of every sequence, so one test and no other call."""
        table, computed = seq.block_table, seq.num_computed_tokens
        return 0 < num_new_tokens <= len(table) * self.block_size - computed and \
            self.ref_counts[table[computed // self.block_size]] == 1

    def _needs_copy_on_write(self, seq: Sequence, num_new_tokens: int) -> bool:
        last = seq.num_computed_tokens // self.block_size  # the block the first new token lands in
        return (num_new_tokens > 0 and last < len(seq.block_table) and seq.num_computed_tokens % self.block_size != 0
                and self.ref_counts[seq.block_table[last]] > 1)

    def _extend(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) < self.num_blocks_for(num_tokens):
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        assert self.ref_counts[block] == 0
        old = self.block_hash[block]
        if old is not None:  # evicted: its prefix is forgotten only now that the block is reused
            self._num_cached_free -= 1
            if self.hash_to_block.get(old) == block:
                del self.hash_to_block[old]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of ``seq``'s blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= len(seq.block_hashes):  # most steps: no block filled
            return
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        for i, h in enumerate(self.chain_hashes(seq.token_ids, seq.cache_salt, parent, len(seq.block_hashes), num_full),
                              start=len(seq.block_hashes)):
            block = seq.block_table[i]
            if h not in self.hash_to_block and self.block_hash[block] is None:
                self.hash_to_block[h] = block
                self.block_hash[block] = h
            seq.block_hashes.append(h)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the first ``num_tokens`` tokens (a rejected draft's). They were written only
        past ``num_computed_tokens``, so they hold no hash; they go to the front of the free queue."""
        while len(seq.block_table) > max(self.num_blocks_for(num_tokens), 1):
            block = seq.block_table.pop()
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] == 0 and self.block_hash[block] is None, "a draft block was shared"
            self.free_queue[block] = None
            self.free_queue.move_to_end(block, last=False)

    # -- release and sharing --------------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``. Tail blocks enter the free queue first, so they are evicted first."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
                self._num_cached_free += self.block_hash[block] is not None
        seq.block_table, seq.block_hashes = [], []
        seq.num_computed_tokens = 0

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares all of ``parent``'s blocks (its partial last block is copied on the first write)."""
        assert not child.block_table
        for block in parent.block_table:
            self.ref_counts[block] += 1
        child.block_table, child.block_hashes = list(parent.block_table), list(parent.block_hashes)
        child.num_computed_tokens, child.num_cached_tokens = parent.num_computed_tokens, parent.num_cached_tokens

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their data, just no longer shareable)."""
        self.hash_to_block.clear()
        self.block_hash = [None] * self.num_blocks
        self._num_cached_free = 0

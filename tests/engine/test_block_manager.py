"""BlockManager with fake sequences: exact block tables, reference counts, hits, eviction order, copy-on-write."""

import pytest

from corral.engine.block_manager import BlockManager
from corral.engine.sampling_params import SamplingParams
from corral.engine.sequence import Sequence

PARAMS = SamplingParams(max_tokens=8)


def seq(tokens, salt=None) -> Sequence:
    return Sequence("r", list(tokens), PARAMS, cache_salt=salt)


def test_allocate_takes_blocks_in_order_and_counts_them():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = seq(range(10))
    assert bm.can_allocate(a, 10)
    bm.allocate(a, 10)
    assert a.block_table == [0, 1, 2]
    assert (bm.num_used_blocks, bm.num_free_blocks) == (3, 3)
    assert not bm.can_allocate(seq(range(13)), 13)  # needs 4 of the 3 left


def test_append_adds_a_block_only_at_a_block_boundary():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(range(3))
    bm.allocate(a, 3)
    a.num_computed_tokens = 3
    assert bm.num_blocks_to_append(a, 1) == 0  # token 3 fits block 0
    bm.append(a, 1)
    a.num_computed_tokens = 4
    assert bm.num_blocks_to_append(a, 1) == 1
    bm.append(a, 5)
    assert a.block_table == [0, 1, 2]


def test_prefix_hit_reuses_full_blocks_and_stops_before_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(12))
    bm.allocate(a, 12)
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)
    b = seq([*range(8), 99, 98])  # shares two full blocks with a
    assert bm.find_cached_prefix(b) == [0, 1]
    same = seq(range(12))  # a full hit would leave nothing to compute: the last block is recomputed
    assert bm.find_cached_prefix(same) == [0, 1]
    bm.allocate(b, 10, bm.find_cached_prefix(b))
    assert b.block_table == [0, 1, 3]
    assert (b.num_computed_tokens, b.num_cached_tokens) == (8, 8)
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (12 + 10, 8)


def test_cache_salt_separates_tenants():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(9), salt="tenant-a")
    bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    assert bm.find_cached_prefix(seq(range(9), salt="tenant-a")) == [0, 1]
    assert bm.find_cached_prefix(seq(range(9), salt="tenant-b")) == []
    assert bm.find_cached_prefix(seq(range(9))) == []


def test_freed_blocks_keep_their_hash_until_reused_in_lru_order():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    bm.free(a)
    # tail first: block 2 (partial, no hash) then 1 then 0 join the queue after the never-used block 3
    assert list(bm.free_queue) == [3, 2, 1, 0]
    assert (bm.num_used_blocks, bm.num_cached_free_blocks) == (0, 2)
    again = seq([1, 2, 3, 4, 9])
    hits = bm.find_cached_prefix(again)
    assert hits == [0, 1]
    assert bm.can_allocate(again, 5, hits)
    bm.allocate(again, 5, hits)
    assert again.block_table == [0, 1, 3]
    bm.free(again)
    c = seq([7, 7, 7, 7, 7, 7, 7])  # needs all 4 blocks: evicts in LRU order 2, 3, 1, 0
    bm.allocate(c, 7)
    assert c.block_table == [2, 3, 1, 0]
    assert bm.hash_to_block == {} and bm.num_cached_free_blocks == 0


def test_fork_shares_blocks_and_copies_the_partial_block_on_write():
    bm = BlockManager(num_blocks=6, block_size=4)
    parent = seq(range(6))
    bm.allocate(parent, 6)
    parent.num_computed_tokens = 6
    child = seq(range(6))
    bm.fork(parent, child)
    assert child.block_table == [0, 1] and bm.ref_counts[:2] == [2, 2]
    assert bm.num_blocks_to_append(child, 1) == 1  # block 1 is shared and would be written
    bm.append(child, 1)
    assert child.block_table == [0, 2] and bm.ref_counts[:3] == [2, 1, 1]
    assert bm.take_pending_copies() == [(1, 2)] and bm.take_pending_copies() == []
    bm.append(parent, 1)  # the parent now owns block 1 alone: no copy
    assert parent.block_table == [0, 1] and bm.take_pending_copies() == []
    bm.free(parent)
    bm.free(child)
    assert bm.num_used_blocks == 0 and bm.ref_counts == [0] * 6


def test_fork_at_a_block_boundary_needs_no_copy():
    bm = BlockManager(num_blocks=4, block_size=4)
    parent = seq(range(8))
    bm.allocate(parent, 8)
    parent.num_computed_tokens = 8
    child = seq(range(8))
    bm.fork(parent, child)
    assert bm.num_blocks_to_append(child, 1) == 1  # a fresh block, not a copy
    bm.append(child, 1)
    assert child.block_table == [0, 1, 2] and bm.take_pending_copies() == []


@pytest.mark.parametrize("enable", [True, False])
def test_prefix_caching_switch(enable):
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=enable)
    a = seq([1, 2, 3])
    bm.allocate(a, 3)
    a.num_computed_tokens = 3
    bm.cache_full_blocks(a)
    assert bm.find_cached_prefix(seq([1, 2, 3])) == ([0] if enable else [])


def test_the_cached_free_count_follows_every_move():
    """Kept as blocks move (stats read it every step); checked against a recount after each random operation."""
    import random

    rng = random.Random(0)
    bm = BlockManager(num_blocks=24, block_size=4)
    live: list[Sequence] = []
    hits_seen = 0
    for _ in range(2000):
        op = rng.random()
        if op < 0.4 and len(live) < 6:
            new = seq([rng.randrange(3) for _ in range(rng.randrange(1, 14))])
            hits = bm.find_cached_prefix(new)
            if bm.can_allocate(new, len(new), hits):
                bm.allocate(new, len(new), hits)
                new.num_computed_tokens = len(new)
                bm.cache_full_blocks(new)
                live.append(new)
        elif op < 0.7 and live:
            one = rng.choice(live)
            if bm.can_append(one, 1):
                one.append_token(rng.randrange(3))
                bm.append(one, 1)
                one.num_computed_tokens += 1
                bm.cache_full_blocks(one)
        elif live:
            bm.free(live.pop(rng.randrange(len(live))))
        assert bm.num_cached_free_blocks == sum(1 for b in bm.free_queue if bm.block_hash[b] is not None)
        hits_seen += bm.num_cached_free_blocks > 0
    assert hits_seen > 100  # the walk did keep cached free blocks around


def test_append_counts_match_first_principles_after_forks_and_truncations():
    """The blocks an append needs, checked after every random operation against a count made from the table alone:
    new blocks past the table, plus one copy where the block the first new token lands in is partial and shared.
    An append then takes exactly that many free blocks, and the landing block is the sequence's own."""
    import random

    rng = random.Random(1)
    size = 4
    bm = BlockManager(num_blocks=40, block_size=size)
    live: list[Sequence] = []
    fast = copies = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.2 and len(live) < 8:
            new = seq([rng.randrange(3) for _ in range(rng.randrange(1, 14))])
            if bm.can_allocate(new, len(new)):
                bm.allocate(new, len(new))
                new.num_computed_tokens = len(new)
                live.append(new)
        elif op < 0.35 and live and len(live) < 8:
            parent = rng.choice(live)
            child = seq(parent.token_ids)
            bm.fork(parent, child)
            live.append(child)
        elif op < 0.85 and live:
            one, count = rng.choice(live), rng.randrange(1, 7)
            table, computed = one.block_table, one.num_computed_tokens
            landing = computed // size
            expected = max(-(-(computed + count) // size) - len(table), 0) + int(
                landing < len(table) and computed % size != 0 and bm.ref_counts[table[landing]] > 1)
            assert bm.num_blocks_to_append(one, count) == expected
            assert bm.can_append(one, count) == (expected <= bm.num_free_blocks)
            if expected <= bm.num_free_blocks:
                free_before = bm.num_free_blocks
                bm.append(one, count)
                assert free_before - bm.num_free_blocks == expected
                assert bm.ref_counts[one.block_table[landing]] == 1 or computed % size == 0
                fast += expected == 0
                copies += bool(bm.take_pending_copies())
                # the step computed a run of them (a draft's rejected tail gives its blocks back, as the engine's do)
                kept = count if rng.random() < 0.5 else rng.randrange(1, count + 1)
                bm.truncate(one, computed + kept)
                one.num_computed_tokens = computed + kept
                one.token_ids.extend([1] * (one.num_computed_tokens - len(one.token_ids)))
        elif live:
            bm.free(live.pop(rng.randrange(len(live))))
    assert fast > 300 and copies > 20  # both the common case and copy-on-write were walked

"""Scheduler with fake sequences: exact per-step tables of (request, tokens advanced), blocks and preemptions."""

from corral.engine.block_manager import BlockManager
from corral.engine.sampling_params import SamplingParams
from corral.engine.scheduler import Scheduler
from corral.engine.sequence import Sequence, SequenceStatus

PARAMS = SamplingParams(max_tokens=8)


def make(num_blocks=16, block_size=4, max_num_seqs=8, budget=8, prefix=True) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size, prefix), max_num_seqs, budget)


def add(sched: Scheduler, name: str, num_tokens: int, first_token: int = 0) -> Sequence:
    seq = Sequence(name, list(range(first_token, first_token + num_tokens)), PARAMS)
    sched.add(seq)
    return seq


def step(sched: Scheduler) -> list[tuple[str, int]]:
    """One schedule plus what the engine does after the forward: commit the K/V, sample where the prompt is done."""
    batch = sched.schedule()
    for seq, count in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += count
        sched.block_manager.cache_full_blocks(seq)
        if seq.num_computed_tokens == len(seq):
            seq.append_token(1000 + len(seq))
    return [(seq.request_id, count) for seq, count in zip(batch.seqs, batch.num_new_tokens)]


def test_chunked_prefill_under_the_token_budget_then_decodes():
    sched = make(budget=8)
    a, b = add(sched, "a", 10), add(sched, "b", 6, first_token=50)
    assert step(sched) == [("a", 8)]  # a's first chunk uses the whole budget; b waits
    assert a.block_table == [0, 1] and b.status is SequenceStatus.WAITING
    assert step(sched) == [("a", 2), ("b", 6)]  # a finishes its prompt, b is admitted with what is left
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4]
    assert step(sched) == [("a", 1), ("b", 1)]
    assert a.num_output_tokens == 2 and b.num_output_tokens == 2


def test_decodes_come_before_prefill_chunks():
    sched = make(budget=6, max_num_seqs=2)
    a = add(sched, "a", 3)
    assert step(sched) == [("a", 3)]
    b = add(sched, "b", 20, first_token=100)
    assert step(sched) == [("a", 1), ("b", 5)]
    assert step(sched) == [("a", 1), ("b", 5)]
    assert b.num_computed_tokens == 10 and a.num_computed_tokens == 5


def test_max_num_seqs_caps_admission():
    sched = make(max_num_seqs=2, budget=16)
    for name in "abc":
        add(sched, name, 2, first_token=ord(name) * 10)
    assert step(sched) == [("a", 2), ("b", 2)]
    assert [s.request_id for s in sched.waiting] == ["c"]


def test_preemption_by_recompute_takes_the_newest_and_frees_its_blocks():
    sched = make(num_blocks=4, block_size=4, budget=16)
    a, b = add(sched, "a", 7), add(sched, "b", 7, first_token=50)
    assert step(sched) == [("a", 7), ("b", 7)]  # 2 blocks each: the pool is full
    assert step(sched) == [("a", 1), ("b", 1)]  # token 8 of each fits its second block
    # a's 9th token needs a third block: b (newest) is preempted, its blocks go back, it waits first in line
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["a"] and batch.preempted == [b]
    assert b.block_table == [] and b.num_computed_tokens == 0 and sched.waiting[0] is b
    assert a.block_table == [0, 1, 3] and sched.num_preemptions == 1  # b's tail block is reused first
    assert sched.block_manager.num_used_blocks == 3


def test_a_sequence_alone_may_preempt_itself():
    sched = make(num_blocks=2, block_size=4, budget=16)
    a = add(sched, "a", 8)
    assert step(sched) == [("a", 8)]
    batch = sched.schedule()  # its 9th token needs a third block that does not exist
    assert batch.seqs == [] and batch.preempted == [a] and sched.block_manager.num_used_blocks == 0


def test_a_prefix_hit_starts_the_prefill_after_the_cached_blocks():
    sched = make(num_blocks=16, block_size=4, budget=32)
    a = add(sched, "a", 10)
    assert step(sched) == [("a", 10)]
    b = Sequence("b", list(range(9)) + [77], PARAMS)  # shares a's first two full blocks
    sched.add(b)
    assert step(sched) == [("a", 1), ("b", 2)]
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]


def test_a_request_waits_one_step_for_a_prefix_a_running_prefill_is_computing():
    """Arriving together, b shares a's first two blocks: b is held while a computes them (c, unrelated, goes
    ahead of it), then starts after them instead of computing them a second time."""
    sched = make(num_blocks=16, block_size=4, budget=32)
    a = add(sched, "a", 10)
    b = Sequence("b", list(range(9)) + [77], PARAMS)
    sched.add(b)
    c = add(sched, "c", 6, first_token=50)
    assert step(sched) == [("a", 10), ("c", 6)]
    assert [s.request_id for s in sched.waiting] == ["b"]
    assert step(sched) == [("a", 1), ("c", 1), ("b", 2)]
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]


def test_without_the_prefix_cache_nothing_is_held():
    sched = make(num_blocks=16, block_size=4, budget=32, prefix=False)
    add(sched, "a", 10)
    sched.add(Sequence("b", list(range(9)) + [77], PARAMS))
    assert step(sched) == [("a", 10), ("b", 10)]


def test_finish_frees_everything_at_once():
    sched = make()
    a, b = add(sched, "a", 5), add(sched, "b", 30, first_token=100)
    step(sched)
    sched.finish(a)
    sched.finish(b)  # b is mid-prefill or waiting; either way nothing remains
    assert sched.block_manager.num_used_blocks == 0 and not sched.has_unfinished()
    assert a.status is SequenceStatus.FINISHED and b.status is SequenceStatus.FINISHED


def test_drafted_decodes_come_after_the_other_decodes_and_before_prefills():
    """So that a step's plain rows and drafted rows are two runs of the logits, split as views, not copies."""
    sched = make(num_blocks=32, budget=16, max_num_seqs=4)
    a, b, c = add(sched, "a", 3), add(sched, "b", 3, first_token=10), add(sched, "c", 3, first_token=20)
    assert step(sched) == [("a", 3), ("b", 3), ("c", 3)]
    d = add(sched, "d", 20, first_token=30)
    assert step(sched) == [("a", 1), ("b", 1), ("c", 1), ("d", 13)]  # d runs, its prefill chunked
    a.draft = [7, 8]
    batch = sched.schedule()
    assert d.status is SequenceStatus.RUNNING and sched.running[0] is a
    assert [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)] == \
        [("b", 1), ("c", 1), ("a", 3), ("d", 7)]


def _batch(sched: Scheduler):
    batch = sched.schedule()
    return ([(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)],
            [s.request_id for s in batch.preempted],
            [(s.request_id, s.index, s.block_table, s.draft, s.num_draft_forced) for s in sched.running])


def test_the_plain_decode_step_makes_the_batch_the_walk_makes():
    """The steady decode step skips the walk over the running sequences (``_plain_decodes``): over random traffic
    (arrivals, finishes, drafts, forks sharing a last block, a pool small enough to preempt), wherever it answers,
    its batch and the block tables after it are those of the walk, and it answers in most decode steps, drafted
    ones among them."""
    import copy
    import random

    rng = random.Random(7)
    sched = make(num_blocks=40, block_size=4, max_num_seqs=6, budget=12)
    answered = decode_steps = shared = drafted = 0
    for i in range(600):
        if rng.random() < 0.08 and len(sched.waiting) < 3:
            add(sched, f"r{i}", rng.randint(1, 9), first_token=rng.randint(0, 3) * 100)
        running = [s for s in sched.running if s.status is SequenceStatus.RUNNING]
        if running and rng.random() < 0.05:
            victim = rng.choice(running)
            sched.finish(victim)
        for seq in running:
            if seq.status is SequenceStatus.RUNNING and seq.num_uncomputed_tokens == 1 and rng.random() < 0.15:
                seq.draft = [rng.randint(0, 50) for _ in range(rng.randint(1, 3))]
        if running and rng.random() < 0.1 and len(sched.running) < 6:
            parent = rng.choice(running)
            if parent.status is SequenceStatus.RUNNING and parent.num_uncomputed_tokens == 1 and not parent.draft:
                child = parent.fork(1)
                sched.block_manager.fork(parent, child)
                child.status = SequenceStatus.RUNNING
                sched.running.append(child)
                shared += parent.num_computed_tokens % 4 != 0  # a last block the next write must copy
        fast = copy.deepcopy(sched)
        plain = fast._plain_decodes()
        if all(s.num_uncomputed_tokens == 1 for s in sched.running) and sched.running and not sched.waiting:
            decode_steps += 1
        if plain is not None:
            answered += 1
            drafted += any(n > 1 for n in plain.num_new_tokens)
            walked = copy.deepcopy(sched)
            walked._plain_decodes = lambda: None
            assert _batch(fast) == _batch(walked)
        step(sched)
        for seq in list(sched.running):
            seq.draft = []
            if seq.status is SequenceStatus.RUNNING and seq.num_output_tokens >= PARAMS.max_tokens:
                sched.finish(seq)
    assert answered > 0.5 * decode_steps > 50 and shared > 10 and drafted > 10, (answered, decode_steps, shared, drafted)


def test_drafts_past_the_token_budget_go_through_the_walk_that_cuts_them():
    """Drafts whose tokens all fit their own blocks but not the step's budget: the plain decode step declines,
    and the walk cuts the last drafted sequence's draft to what the budget leaves."""
    sched = make(num_blocks=16, block_size=8, max_num_seqs=4, budget=6)
    a, b = add(sched, "a", 2), add(sched, "b", 2, first_token=10)
    assert step(sched) == [("a", 2), ("b", 2)]
    a.draft, b.draft = [5, 6], [7, 8]  # 3 + 3 tokens, room for them in each block, a budget of 6
    assert sched._plain_decodes() is not None
    b.draft = [7, 8, 9]  # 3 + 4 tokens: past the budget
    assert sched._plain_decodes() is None
    batch = sched.schedule()
    assert [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)] == [("a", 3), ("b", 3)]
    assert b.draft == [7, 8]

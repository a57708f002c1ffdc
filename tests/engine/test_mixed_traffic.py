"""Mixed traffic on the toy model: whatever runs beside a request, it gets the output it gets alone.

Random requests (greedy, seeded sampling with every knob, penalties, bias, ``n > 1``, beams, grammars, stop
strings and ids, limits, top logprobs, drafts on or off, cumulative or final outputs) arrive at random steps, and
some are aborted, in an engine whose pool is small enough to preempt and whose prompts share prefixes (so the
prefix cache serves some). The runner checks, before each step, that every computed position of every sequence
still holds that sequence's own token (a block freed, shared or rolled back wrongly shows up), and after each step
the engine's block counts must match what the running sequences hold. Each request that was not aborted must
then equal the same request run alone in a fresh engine with room to spare: tokens, text, finish and stop
reasons, logprobs. The toy model's logits depend only on the tokens before them, so any difference is the
engine's.
"""

import collections
import random

import pytest

from corral.errors import PromptTooLongError
from corral.engine.sampling_params import BeamSearchParams, SamplingParams
from corral.fsm.compiler import GrammarCompiler
from corral.fsm.vocabulary import Vocabulary
from corral.grammar.regex_parser import parse_regex
from tests.engine.test_beam_search import EOS, TOKENS, ToyModel
from tests.engine.test_speculation import draft_engine

PATTERNS = ["(ab|c)+", "a[bc]{0,3}(ab){2}c", "(a|b)cabab(c|ab|b){1,2}", "c*(ab)?c{2,5}", "(a|b|c){1,30}"]
BASES = [[0, 2, 1, 0, 2, 2, 0, 1], [3, 3, 1, 0], [2, 0, 1, 0, 2, 3, 1, 1, 0, 2, 2, 1]]  # shared prompt prefixes


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(Vocabulary.from_token_bytes(TOKENS, eos_token_ids=[EOS]))


def random_params(rng: random.Random, index: int) -> SamplingParams | BeamSearchParams:
    if rng.random() < 0.1:
        return BeamSearchParams(beam_width=rng.randint(1, 3), max_tokens=rng.randint(1, 10),
                                length_penalty=rng.choice([0.0, 1.0]))
    knobs = {}
    if rng.random() < 0.5:
        knobs.update(temperature=0.0)
    else:
        knobs.update(temperature=rng.choice([0.5, 1.0, 1.5]), seed=1000 + index, n=rng.choice([1, 1, 2, 3]))
        if rng.random() < 0.4:
            knobs.update(top_p=rng.choice([0.5, 0.9]), top_k=rng.choice([0, 2, 3]), min_p=rng.choice([0.0, 0.1]))
    if rng.random() < 0.3:
        knobs.update(repetition_penalty=rng.choice([1.0, 1.3]), frequency_penalty=rng.choice([0.0, 0.6]),
                     presence_penalty=rng.choice([0.0, 0.4]))
    if rng.random() < 0.2:
        knobs.update(logit_bias={rng.randrange(4): rng.choice([-2.0, 1.5])})
    if rng.random() < 0.3:
        knobs.update(stop=[rng.choice(["ca", "bb", "abc", "cc"])])
    if rng.random() < 0.2:
        knobs.update(stop_token_ids=[rng.randrange(4)])
    if rng.random() < 0.3:
        knobs.update(logprobs=rng.choice([0, 2]))
    max_tokens = rng.randint(1, 32)
    return SamplingParams(max_tokens=max_tokens, min_tokens=rng.choice([0, 0, min(3, max_tokens)]),
                          ignore_eos=rng.random() < 0.6, jump_forward=rng.choice([None, True, False]),
                          speculation=rng.choice([None, True, False]),
                          output_kind=rng.choice(["cumulative", "final"]), **knobs)


def random_requests(rng: random.Random, compiler, count: int) -> list[tuple]:
    requests = []
    for i in range(count):
        prompt = rng.choice(BASES)[:rng.randint(1, 12)] + [rng.randrange(4) for _ in range(rng.randint(0, 5))]
        pattern = rng.choice(PATTERNS) if rng.random() < 0.5 else None
        arrival = rng.randint(0, 12)
        abort_at = arrival + rng.randint(0, 12) if rng.random() < 0.15 else None
        requests.append((f"r{i}", prompt, random_params(rng, i), pattern, arrival, abort_at))
    return requests


def guide_for(compiler, pattern: str | None):
    return compiler.compile_node(parse_regex(pattern)).new_guide() if pattern else None


def summary(output) -> list[tuple]:
    return [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
            for c in sorted(output.outputs, key=lambda c: c.index)]


def check_blocks(engine) -> None:
    bm = engine.block_manager
    held = collections.Counter(b for seq in engine.scheduler.running for b in seq.block_table)
    for seq in engine.scheduler.running:
        assert len(seq.block_table) <= bm.num_blocks_for(len(seq) + len(seq.draft)), seq
    # a block the running sequences do not hold may still be counted by a waiting one (beams keep theirs)
    assert all(bm.ref_counts[b] >= held.get(b, 0) for b in range(bm.num_blocks)), "a block is held uncounted"


def run_mixed(engine, compiler, requests) -> tuple[dict, set]:
    """The finished outputs, and the requests aborted or refused."""
    finals, aborted, step = {}, set(), 0
    pending = sorted(requests, key=lambda r: r[4])
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][4] <= step:
            request_id, prompt, params, pattern, _, _ = pending.pop(0)
            try:
                engine.add_request(request_id, prompt, params, guide=guide_for(compiler, pattern))
            except PromptTooLongError:  # a group too wide for this pool, whatever runs beside it: out alone
                aborted.add(request_id)
        for request_id, _, _, _, _, abort_at in requests:
            if abort_at == step and request_id not in finals:
                engine.abort(request_id)
                aborted.add(request_id)
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
        check_blocks(engine)
        step += 1
        assert step < 5000, "no progress"
    return finals, aborted


@pytest.mark.parametrize("seed", range(6))
def test_every_request_gets_its_output_alone_whatever_runs_beside_it(compiler, seed):
    rng = random.Random(seed)
    model = ToyModel(seed=seed, sharpness=rng.choice([1.0, 2.5]))
    requests = random_requests(rng, compiler, 40)
    engine = draft_engine(model, num_blocks=rng.choice([16, 24]), max_num_seqs=rng.choice([6, 8]),
                          budget=rng.choice([16, 40]))
    engine.defer_masks = rng.choice([None, True, False])
    engine._cores = rng.choice([1, 10 ** 6])  # masks before the forward, or on a worker beside it
    preempted = []
    preempt = engine.scheduler.preempt
    engine.scheduler.preempt = lambda seq: (preempted.append(seq.request_id), preempt(seq))
    finals, aborted = run_mixed(engine, compiler, requests)
    assert engine.block_manager.num_used_blocks == 0 and not any(engine.block_manager.ref_counts)
    assert not engine.scheduler.running and not engine.scheduler.waiting
    kept = [r for r in requests if r[0] not in aborted]
    assert set(finals) >= {r[0] for r in kept}
    for request_id, prompt, params, pattern, _, _ in kept:
        alone = draft_engine(model, num_blocks=512)
        engine_alone, = (o for o in _run_one(alone, request_id, prompt, params, guide_for(compiler, pattern)))
        assert summary(finals[request_id]) == summary(engine_alone), (request_id, params, pattern)
    assert preempted, "the pool was meant to be tight enough to preempt"


def _run_one(engine, request_id, prompt, params, guide):
    engine.add_request(request_id, prompt, params, guide=guide)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                yield output

"""Drafts from a draft model (corral/engine/draft_model.py) on the toy model: they change no output, their shadows
roll back with the target, and every draft block comes back.

The draft model runs on the same checking runner as the target: before every draft forward it verifies that each
computed position of each shadow still holds that shadow's own token, and after every sync the test checks that
those tokens are the target's. So a rejected draft token left in a shadow's computed prefix, or a block given back
while still used, fails the test where it happens.
"""

import collections
import re

import pytest

from corral.engine.config import EngineConfig
from corral.engine.draft_model import ModelDrafter
from corral.engine.sampling_params import SamplingParams
from corral.engine.speculation import Draft
from corral.errors import InvalidRequestError
from corral.grammar.regex_parser import parse_regex
from tests.engine.test_beam_groups import run_all
from tests.engine.test_beam_search import ToyModel
from tests.engine.test_speculation import (AMBIGUOUS, BLOCK_SIZE, OFF, PROMPT, VOCAB, DraftKVRunner, chi_square_p,
                                           compiler, draft_engine, text_of)

MODEL_ONLY = dict(jump_forward=False, speculation=True)
__all__ = ["compiler"]  # the fixture, shared


def with_draft_model(engine, draft: ToyModel, num_blocks: int = 256, cost: float = 0.0, budget: int = 256):
    """``engine`` with ``draft`` as its draft model and prompt lookup silenced, so every draft is the model's.
    Every model draft is checked against its sequence's grammar as it is proposed."""
    runner = DraftKVRunner(draft, num_blocks)
    runner.block_size = BLOCK_SIZE
    drafter = engine.model_drafter = ModelDrafter(runner, VOCAB, cost, budget)
    engine.drafter.propose = lambda *args, **kwargs: Draft([], 0)
    propose = drafter.propose

    def checked(wanted, running):
        propose(wanted, running)
        for seq, cap in wanted:
            assert len(seq.draft) <= cap and (seq.draft_by_model or not seq.draft)
            if seq.guide is not None:
                probe = seq.guide.copy()
                assert all(probe.advance(token) for token in seq.draft), "the grammar forbids a draft token"

    drafter.propose = checked
    sync = drafter._sync

    def synced(target):
        # after a sync, every token the shadow holds K/V for is its target's (the runner then checks the K/V)
        shadow = sync(target)
        computed = shadow.seq.num_computed_tokens
        assert computed < len(target) and shadow.seq.token_ids[:computed] == target.token_ids[:computed]
        assert shadow.seq.token_ids == target.token_ids
        return shadow

    drafter._sync = synced
    return engine


def check_shadows(engine) -> None:
    """Between steps, each shadow's tokens are its target's tokens as they were when it drafted (the target has
    only grown since), then its own draft tokens; it holds blocks for no more than those."""
    running = {seq.seq_id: seq for seq in engine.scheduler.running}
    bm = engine.model_drafter.block_manager
    for seq_id, shadow in engine.model_drafter.shadows.items():
        target, seq = running[seq_id], shadow.seq
        assert shadow.synced <= len(target) and seq.token_ids[:shadow.synced] == target.token_ids[:shadow.synced]
        assert seq.num_computed_tokens <= len(seq) and len(seq.block_table) <= bm.num_blocks_for(len(seq))


@pytest.mark.parametrize("pattern", [AMBIGUOUS, "(ab|c)+", None])
@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=1.0, seed=3),
                                    dict(temperature=0.8, top_p=0.9, seed=5, presence_penalty=0.5,
                                         logit_bias={2: 1.0})])
@pytest.mark.parametrize("draft_seed", [11, 12])  # the target itself (drafts mostly kept), another model
def test_model_drafts_change_no_output(compiler, pattern, params, draft_seed):
    target = ToyModel(seed=11, sharpness=2.5)
    outputs = {}
    for name, switches in (("off", OFF), ("on", MODEL_ONLY)):
        engine = draft_engine(target)
        if name == "on":
            with_draft_model(engine, ToyModel(seed=draft_seed, sharpness=2.5))
        requests = []
        for i in range(6):
            guide = compiler.compile_node(parse_regex(pattern)).new_guide() if pattern else None
            seeded = {"seed": params["seed"] + i} if "seed" in params else {}
            p = SamplingParams(max_tokens=12, logprobs=2, ignore_eos=pattern is None, **{**params, **seeded},
                               **switches)
            requests.append((f"r{i}", PROMPT[i:], p, guide))
        outputs[name] = run_all(engine, requests), engine
    (off, _), (on, on_engine) = outputs["off"], outputs["on"]
    for request_id, out in off.items():
        a, b = out.outputs[0], on[request_id].outputs[0]
        assert (a.token_ids, a.finish_reason, a.text, a.logprobs) == (b.token_ids, b.finish_reason, b.text,
                                                                      b.logprobs), request_id
        if pattern and a.finish_reason == "stop":
            assert re.fullmatch(pattern, text_of(a.token_ids))
    stats = on_engine.stats()
    assert stats.num_model_draft_tokens == stats.num_draft_tokens > 0 and stats.num_draft_model_forwards > 0
    if draft_seed == 11 and params == dict(temperature=0):
        assert stats.num_model_accepted_tokens > stats.num_model_draft_tokens / 2, "the target drafting for itself"
    drafter = on_engine.model_drafter
    assert not drafter.shadows and drafter.block_manager.num_used_blocks == 0, "a shadow outlived its request"


def test_shadows_roll_back_with_their_target(compiler):
    """Step by step, each shadow holds its target's tokens; the checking runner verifies their K/V."""
    engine = with_draft_model(draft_engine(ToyModel(seed=8, sharpness=4.0)), ToyModel(seed=9, sharpness=4.0))
    for i in range(4):
        guide = compiler.compile_node(parse_regex("(a|b|ab|c){20,40}")).new_guide()
        engine.add_request(f"r{i}", PROMPT[i:], SamplingParams(temperature=1.0, seed=i, max_tokens=40,
                                                               ignore_eos=True, **MODEL_ONLY), guide=guide)
    while engine.has_unfinished_requests():
        engine.step()
        check_shadows(engine)
    stats = engine.stats()
    assert stats.num_model_draft_tokens > stats.num_model_accepted_tokens > 0, "no rejection tested"
    assert engine.model_drafter.block_manager.num_used_blocks == 0


def test_a_full_draft_pool_releases_shadows_and_drafts_less(compiler):
    """A draft pool too small for every shadow: shadows that find no room are released, outputs do not move,
    and every block comes back."""
    target = ToyModel(seed=3, sharpness=2.0)
    requests = lambda switches: [(f"r{i}", PROMPT[i % 5:], SamplingParams(temperature=0, max_tokens=20,  # noqa: E731
                                                                          ignore_eos=True, **switches), None)
                                 for i in range(12)]
    off = run_all(draft_engine(target), requests(OFF))
    engine = with_draft_model(draft_engine(target), target, num_blocks=10)
    drafter = engine.model_drafter
    on = run_all(engine, requests(MODEL_ONLY))
    assert {k: v.outputs[0].token_ids for k, v in off.items()} == {k: v.outputs[0].token_ids for k, v in on.items()}
    assert engine.stats().num_model_accepted_tokens > 0
    assert drafter.block_manager.num_used_blocks == 0 and not drafter.shadows and not drafter.starved


def test_a_shadow_that_can_never_fit_is_not_asked_again(compiler):
    """A prompt the draft pool cannot hold: one try, then its sequence drafts no more from the model (no prefill
    over and over); its output does not move."""
    target = ToyModel(seed=3, sharpness=2.0)
    params = lambda switches: SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, **switches)  # noqa: E731
    (off,) = run_all(draft_engine(target), [("r", PROMPT, params(OFF), None)]).values()
    # 8 tokens of pool for a 12-token prompt, caught up 4 tokens a round: two chunks fit, the third does not
    engine = with_draft_model(draft_engine(target), target, num_blocks=2, budget=4)
    engine.add_request("r", PROMPT, params(MODEL_ONLY))
    forwards = []
    while engine.has_unfinished_requests():
        out = engine.step()
        forwards.append(engine.stats().num_draft_model_forwards)
    assert out[0].outputs[0].token_ids == off.outputs[0].token_ids
    assert forwards[-1] == 2 and engine.stats().num_model_draft_tokens == 0
    assert engine.model_drafter.block_manager.num_used_blocks == 0 and not engine.model_drafter.starved


def test_abort_and_preemption_release_shadows(compiler):
    target = ToyModel(seed=6, sharpness=3.0)
    engine = with_draft_model(draft_engine(target, num_blocks=12, max_num_seqs=6, budget=64), target)
    drafter = engine.model_drafter
    for i in range(6):
        engine.add_request(f"r{i}", PROMPT[i:], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                               **MODEL_ONLY))
    for _ in range(6):
        engine.step()
    assert drafter.shadows
    shadowed = next(iter(drafter.shadows))
    request_id = next(s.request_id for s in engine.scheduler.running if s.seq_id == shadowed)
    engine.abort(request_id)
    assert shadowed not in drafter.shadows, "an aborted sequence's shadow outlived it"
    preempted = 0
    while engine.has_unfinished_requests():
        engine.step()
        preempted = engine.scheduler.num_preemptions
        running = {s.seq_id for s in engine.scheduler.running}
        waiting = {s.seq_id for s in engine.scheduler.waiting}  # preempted this step: released at the next
        assert set(drafter.shadows) <= running | waiting
        drafter.release_absent(engine.scheduler.running)
        assert set(drafter.shadows) <= running
        check_shadows(engine)
    assert preempted > 0, "the target pool never preempted: the test tested nothing"
    assert drafter.block_manager.num_used_blocks == 0 and not drafter.shadows


def test_model_drafts_stop_where_they_do_not_pay(compiler):
    target = ToyModel(seed=5, sharpness=3.0)
    requests = [(f"r{i}", PROMPT[i:], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, **MODEL_ONLY),
                 None) for i in range(3)]
    costly = with_draft_model(draft_engine(target), target, cost=0.8)  # 0.5 (the prior) < 0.8: never asked
    run_all(costly, requests)
    assert costly.stats().num_draft_model_forwards == 0
    # a draft model that never agrees: its rate falls below the price and the sequences stop asking it
    engine = with_draft_model(draft_engine(target), ToyModel(seed=99, sharpness=0.01), cost=0.3)
    per_step = []
    for request_id, prompt, params, guide in requests:
        engine.add_request(request_id, prompt, params, guide=guide)
    while engine.has_unfinished_requests():
        before = engine.stats().num_model_draft_tokens
        engine.step()
        per_step.append(engine.stats().num_model_draft_tokens - before)
    assert sum(per_step[:5]) > 0 and sum(per_step[-10:]) == 0, per_step


def sample_counts(compiler, model_drafts: bool, num: int, **params) -> collections.Counter:
    target = ToyModel(seed=21, sharpness=1.2)
    engine = draft_engine(target, num_blocks=2048, max_num_seqs=256, budget=4096)
    if model_drafts:
        with_draft_model(engine, ToyModel(seed=22, sharpness=1.2), num_blocks=2048, budget=4096)
    grammar = compiler.compile_node(parse_regex(AMBIGUOUS))
    counts = collections.Counter()
    switches = MODEL_ONLY if model_drafts else OFF
    for start in range(0, num, 256):
        requests = [(f"s{start + i}", PROMPT[(start + i) % 5:], SamplingParams(max_tokens=8, **params, **switches),
                     grammar.new_guide()) for i in range(min(256, num - start))]
        for out in run_all(engine, requests, max_steps=100_000).values():
            counts[tuple(out.outputs[0].token_ids)] += 1
    assert not model_drafts or engine.stats().num_model_draft_tokens > num
    return counts


def test_unseeded_sampling_has_the_same_distribution_with_model_drafts(compiler):
    params = dict(temperature=1.0, top_p=0.9)
    off, on = sample_counts(compiler, False, 10_000, **params), sample_counts(compiler, True, 10_000, **params)
    assert chi_square_p(off, on) > 1e-3, (off.most_common(5), on.most_common(5))


@pytest.mark.parametrize("field, value", [("draft_layers", 0), ("draft_layers", True), ("draft_layers", 2.5),
                                          ("draft_model", ""), ("draft_model_cost", 1.5),
                                          ("draft_model_cost", -0.1)])
def test_bad_draft_settings_are_typed_errors(field, value):
    with pytest.raises(InvalidRequestError) as err:
        EngineConfig(**{field: value})
    assert err.value.param == field

"""Beam search inside the engine, on the real model: the beams equal the search run over the model's exact
logprobs, they share the prompt's blocks by fork, nothing leaks, and other requests in the same batches or a
preemption change nothing.

The oracle computes each prefix's next-token row by a fresh full prefill of prompt + prefix, a different path
from the engine's forked decodes; the two agree to about 1e-6, far below any gap the searches below meet."""

import re

import pytest
import torch

from corral.engine import EngineConfig, LLMEngine
from corral.engine.beam_search import BeamSearchParams, beam_search, beam_search_engine
from corral.engine.sampling_params import SamplingParams
from corral.engine.scheduler import ScheduledBatch
from corral.engine.sequence import Sequence
from corral.fsm.compiler import GrammarCompiler
from corral.grammar.constraint import Constraint
from tests.engine.real_model import PROMPTS, assert_same_or_near_tie, chat, greedy

SYSTEM = " ".join(f"Rule {i}: keep every answer short and kind." for i in range(30))


def exact_logprobs(engine: LLMEngine, prompt: list[int]):
    """NextTokenLogprobs of the engine's model after ``prompt``: a full prefill of every prefix, in blocks it frees."""
    def next_token_logprobs(prefixes):
        seqs = [Sequence("oracle", prompt + list(prefix), SamplingParams()) for prefix in prefixes]
        for seq in seqs:
            engine.block_manager.allocate(seq, len(seq))
        order, logits = engine.runner.execute(ScheduledBatch(seqs, [len(s) for s in seqs], []))
        for seq in seqs:
            engine.block_manager.free(seq)
        rows = torch.log_softmax(logits[:, : engine.vocabulary.size].float(), dim=-1)
        return rows[[order.index(seq) for seq in seqs]]
    return next_token_logprobs


def run_beams(engine: LLMEngine, request_id: str, prompt: list[int], params: BeamSearchParams, guide=None):
    """Add one beam request (its own cache salt: no prefix hit), step to its end; the final output."""
    engine.add_request(request_id, prompt, params, guide=guide, cache_salt=request_id)
    return next(o for o in engine.stream() if o.request_id == request_id and o.finished)


def assert_same_beams(output, hypotheses):
    assert [tuple(c.token_ids) for c in output.outputs] == [h.token_ids for h in hypotheses]
    assert [c.finish_reason for c in output.outputs] == [h.finish_reason for h in hypotheses]
    assert [c.cumulative_logprob for c in output.outputs] == pytest.approx(
        [h.cumulative_logprob for h in hypotheses], abs=1e-3)


@pytest.fixture(scope="module")
def compiler(engine):
    return GrammarCompiler(engine.vocabulary)


@pytest.mark.parametrize("params", [BeamSearchParams(beam_width=3, max_tokens=4, length_penalty=1.0),
                                    BeamSearchParams(beam_width=2, max_tokens=5, length_penalty=0.0,
                                                     early_stopping=True)])
def test_beams_equal_the_search_over_the_models_exact_logprobs(engine, params):
    prompt = chat(engine, "Say something about the sea.")
    expected = beam_search(exact_logprobs(engine, prompt), params, eos_token_ids=engine.vocabulary.eos_token_ids)
    out = run_beams(engine, f"exact-{params.beam_width}", prompt, params)
    assert len(out.outputs) == params.beam_width
    assert_same_beams(out, expected)
    for c in out.outputs:
        assert c.text == engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)


def test_constrained_beams_equal_the_search_and_only_spell_the_language(engine, compiler):
    pattern = r"(yes|no|maybe)\. [A-Z][a-z]{1,6}"
    guide = compiler.compile(Constraint("regex", pattern)).new_guide()
    prompt = chat(engine, "Is the sea blue? Answer, then one word.")
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    expected = beam_search(exact_logprobs(engine, prompt), params, eos_token_ids=engine.vocabulary.eos_token_ids,
                           guide=guide)
    out = run_beams(engine, "constrained", prompt, params, guide=guide)
    assert_same_beams(out, expected)
    for c in out.outputs:
        if c.finish_reason == "stop":
            assert re.fullmatch(pattern, c.text), c.text
        else:  # cut by max_tokens: still a prefix the grammar accepts
            replay = guide.copy()
            assert all(replay.advance(t) for t in c.token_ids)
    assert any(c.finish_reason == "stop" for c in out.outputs)


def test_beams_share_the_prompts_blocks_and_copy_only_the_partial_one(engine):
    prompt = chat(engine, "Name a colour, please.", system=SYSTEM)
    params = BeamSearchParams(beam_width=4, max_tokens=4)
    bm, size = engine.block_manager, engine.config.block_size
    assert len(prompt) > 300 and len(prompt) % size != 0  # a long prompt whose last block is partial
    copies = []
    copy_blocks = engine.runner.copy_blocks
    engine.runner.copy_blocks = lambda pairs: (copies.extend(pairs), copy_blocks(pairs))
    try:
        computed_before = engine.stats().num_tokens_computed
        engine.add_request("share", prompt, params, cache_salt="share")
        most_used, shared_seen = 0, False
        while engine.has_unfinished_requests():
            outputs = engine.step()
            most_used = max(most_used, bm.num_used_blocks)
            beams = [s for s in engine.scheduler.running if s.request_id == "share"]
            if len(beams) == params.beam_width:
                full = len(prompt) // size
                assert all(s.block_table[:full] == beams[0].block_table[:full] for s in beams)
                assert all(bm.ref_counts[b] == params.beam_width for b in beams[0].block_table[:full])
                shared_seen = True
    finally:
        engine.runner.copy_blocks = copy_blocks
    assert shared_seen
    (out,) = [o for o in outputs if o.request_id == "share"]
    assert out.finished and len(out.outputs) == params.beam_width
    unshared = params.beam_width * bm.num_blocks_for(len(prompt) + params.max_tokens)
    # the prompt's full blocks once, and per beam a private tail (the copied partial block, then maybe one more)
    assert most_used <= bm.num_blocks_for(len(prompt)) + 2 * params.beam_width
    assert most_used < unshared / 2
    assert copies and all(bm.ref_counts[dst] == 0 for _, dst in copies)  # copies were made, and are all freed
    # the prompt ran once; then one token per live beam per step
    decodes = engine.stats().num_tokens_computed - computed_before - len(prompt)
    assert decodes <= params.beam_width * (params.max_tokens - 1)
    print(f"beam blocks: prompt {len(prompt)} tokens, width {params.beam_width}: at most {most_used} blocks used, "
          f"{unshared} unshared, {len(copies)} copy-on-write copies")
    assert bm.num_used_blocks == 0 and not any(bm.ref_counts)


def test_abort_in_the_middle_frees_every_beam(engine):
    prompt = chat(engine, "Describe a forest.", system=SYSTEM)
    engine.add_request("abort-beams", prompt, BeamSearchParams(beam_width=4, max_tokens=50), cache_salt="abort")
    for _ in range(8):
        engine.step()
        if sum(s.request_id == "abort-beams" for s in engine.scheduler.running) == 4:
            break
    engine.step()
    assert sum(s.request_id == "abort-beams" for s in engine.scheduler.running) == 4
    assert engine.block_manager.num_used_blocks > 0
    engine.abort("abort-beams")
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_used_blocks == 0 and not any(engine.block_manager.ref_counts)
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_a_beam_request_among_ordinary_requests_gives_the_same_beams(engine):
    prompt = chat(engine, "Say something about the sea.")
    params = BeamSearchParams(beam_width=3, max_tokens=4)
    alone = run_beams(engine, "alone", prompt, params)
    others = [chat(engine, q) for q in PROMPTS[:3]]
    expected = [o.outputs[0].token_ids for o in engine.generate(others, greedy(6))]
    engine.add_request("mixed", prompt, params, cache_salt="alone")  # same salt: the same (cached) prompt path
    engine.add_request("other-0", others[0], greedy(6))
    finals, shared_steps, num_steps = {}, 0, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            finals[o.request_id] = o
        running = {s.request_id for s in engine.scheduler.running}
        shared_steps += "mixed" in running and len(running) > 1
        num_steps += 1
        if num_steps == 2:  # more arrive while the beams run
            engine.add_request("other-1", others[1], greedy(6))
            engine.add_request("other-2", others[2], greedy(6))
    assert shared_steps >= 3
    assert [c.token_ids for c in finals["mixed"].outputs] == [c.token_ids for c in alone.outputs]
    assert [c.cumulative_logprob for c in finals["mixed"].outputs] == pytest.approx(
        [c.cumulative_logprob for c in alone.outputs], abs=1e-3)
    for i, (ids, exp) in enumerate(zip(others, expected)):
        assert_same_or_near_tie(engine, ids, exp, finals[f"other-{i}"].outputs[0].token_ids)
    assert engine.block_manager.num_used_blocks == 0


def test_preempted_beams_wait_for_their_group_and_change_nothing(engine):
    prompt = chat(engine, "Say something about the sea.")
    params = BeamSearchParams(beam_width=3, max_tokens=4)
    alone = run_beams(engine, "before-preemption", prompt, params)
    others = [chat(engine, PROMPTS[0])]
    expected = [o.outputs[0].token_ids for o in engine.generate(others, greedy(6))]
    # A budget of 16 tokens a step and no prefix cache: a preempted beam recomputes its ~40 tokens over several
    # steps, while its siblings already hold their rows.
    small = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=16,
                                   enable_prefix_caching=False))
    small.add_request("beams", prompt, params)
    for i, ids in enumerate(others):
        small.add_request(f"other-{i}", ids, greedy(6))
    finals, num_forced, num_waiting_steps = {}, 0, 0
    while small.has_unfinished_requests():
        finals.update((o.request_id, o) for o in small.step())
        beams = [s for s in small.scheduler.running if s.request_id == "beams"]
        holding = [s for s in beams if s.num_uncomputed_tokens == 0]
        num_waiting_steps += bool(holding)
        if num_forced == 0 and len(beams) == params.beam_width:
            small.scheduler.preempt(beams[1])  # what the scheduler does when the pool runs short
            num_forced += 1
        elif num_forced == 1 and holding:
            small.scheduler.preempt(holding[0])  # a beam that already has its row
            num_forced += 1
    assert num_forced == 2 and num_waiting_steps >= 2
    assert [c.token_ids for c in finals["beams"].outputs] == [c.token_ids for c in alone.outputs]
    assert [c.cumulative_logprob for c in finals["beams"].outputs] == pytest.approx(
        [c.cumulative_logprob for c in alone.outputs], abs=1e-3)
    for i, (ids, exp) in enumerate(zip(others, expected)):
        assert_same_or_near_tie(engine, ids, exp, finals[f"other-{i}"].outputs[0].token_ids)
    assert small.block_manager.num_used_blocks == 0 and not any(small.block_manager.ref_counts)


def test_beam_requests_that_cannot_run_are_refused(engine):
    from corral.errors import InvalidRequestError, PromptTooLongError
    with pytest.raises(InvalidRequestError, match="beam_width=99 exceeds max_num_seqs") as info:
        engine.add_request("too-wide", [1, 2, 3], BeamSearchParams(beam_width=99))
    assert info.value.param == "beam_width"
    bm, longest = engine.block_manager, engine.max_model_len
    width = bm.num_blocks // bm.num_blocks_for(longest) + 1  # one full-length sequence fits, width unshared do not
    with pytest.raises(PromptTooLongError, match=rf"beam_width \({width}\) x"):
        engine.add_request("too-long", [1, 2, 3], BeamSearchParams(beam_width=width, max_tokens=longest))
    assert not engine.has_unfinished_requests()


def test_width_one_without_length_penalty_is_greedy(engine):
    prompt = chat(engine, "Say something about the sea.")
    (out,) = engine.generate([prompt], greedy(3))
    (best,) = beam_search_engine(engine, prompt, BeamSearchParams(beam_width=1, max_tokens=3, length_penalty=0))
    assert list(best.token_ids) == out.outputs[0].token_ids
    assert best.cumulative_logprob == pytest.approx(out.outputs[0].cumulative_logprob, abs=1e-4)


def test_constrained_beams_are_the_grammars_best_strings(engine, compiler):
    prompt = chat(engine, "Pick a digit between 0 and 9.")
    guide = compiler.compile(Constraint("regex", "[0-9]")).new_guide()
    hypotheses = beam_search_engine(engine, prompt, BeamSearchParams(beam_width=3, max_tokens=4), guide=guide)
    # Oracle: the engine's own constrained greedy decoding, each time leaving out the digits already found.
    expected, digits = [], "0123456789"
    for _ in range(3):
        allowed = "".join(d for d in digits if d not in expected)
        regex_guide = compiler.compile(Constraint("regex", f"[{allowed}]")).new_guide()
        (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=2), [regex_guide])
        expected.append(out.outputs[0].text)
        assert len(out.outputs[0].token_ids) == 1  # a digit is one token, and the grammar then finishes
        if len(expected) == 1:
            best_logprob = out.outputs[0].cumulative_logprob
    assert [engine.tokenizer.decode(list(h.token_ids)) for h in hypotheses] == expected
    assert [h.finish_reason for h in hypotheses] == ["stop"] * 3
    assert hypotheses[0].cumulative_logprob == pytest.approx(best_logprob, abs=1e-4)


def test_sampled_siblings_share_the_prompts_blocks_by_fork(engine):
    """``n > 1`` takes the same path as beams: the siblings are forks of the computed prompt."""
    prompt = chat(engine, "Name a colour, please.", system=SYSTEM)
    bm, size = engine.block_manager, engine.config.block_size
    engine.add_request("siblings", prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=3, ignore_eos=True),
                       cache_salt="siblings")
    while not any(s.request_id == "siblings" and s.num_output_tokens for s in engine.scheduler.running):
        engine.step()
    siblings = [s for s in engine.scheduler.running if s.request_id == "siblings"]
    assert len(siblings) == 3
    assert all(s.block_table == siblings[0].block_table for s in siblings)  # the partial block too, until written
    assert all(bm.ref_counts[b] == 3 for b in siblings[0].block_table)
    assert bm.num_used_blocks == bm.num_blocks_for(len(prompt))
    engine.step()  # each writes its first output token: the shared partial block is copied, the full ones stay
    full = len(prompt) // size
    assert all(s.block_table[:full] == siblings[0].block_table[:full] for s in siblings), siblings
    assert len({s.block_table[full] for s in siblings}) == 3
    list(engine.stream())
    assert bm.num_used_blocks == 0

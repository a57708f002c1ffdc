"""Drafts (jump-forward and prompt lookup) on the toy model: they change no output, only the number of steps.

The runner's "KV cache" stores each position's token id and checks, before every step, that each computed
position of each sequence still holds that sequence's own token: a rejected draft token left in the computed
prefix, a block given back while still used, or one shared wrongly shows up as a wrong token. Its logits row at a
draft position is the toy model's row after the draft tokens before it, as a real forward pass gives.
"""

import collections
import math
import random
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from corral import native
from corral.engine import sampler as sampler_module
from corral.engine import speculation
from corral.engine.config import EngineConfig
from corral.engine.llm_engine import LLMEngine
from corral.engine.sampling_params import BeamSearchParams, SamplingParams
from corral.engine.speculation import (MAX_NGRAM, Drafter, PyNgramIndex, Rate, SpecState, best_rate, draft_price,
                                       settle_shadow)
from corral.fsm.compiler import GrammarCompiler
from corral.fsm.vocabulary import Vocabulary
from corral.grammar.regex_parser import parse_regex
from corral.kernels import cpu_ops
from tests.engine.test_beam_groups import assert_equals_search, run_all
from tests.engine.test_beam_search import EOS, TOKENS, ToyModel

BLOCK_SIZE = 4
VOCAB = Vocabulary.from_token_bytes(TOKENS, special_ids=[EOS], eos_token_ids=[EOS])
OFF = dict(jump_forward=False, speculation=False)
ON = dict(jump_forward=True, speculation=True)
needs_native = pytest.mark.skipif(native.module() is None, reason="the native module is off or missing")
# After the first byte, "c" then "abab" are forced: "ab ab", "a b ab", "a ba b"... spell it, and the model
# decides which (the drafter proposes the longest match, less the tail it backs off).
AMBIGUOUS = "(a|b)cabab(c|ab|b){1,2}"


class DraftKVRunner:
    supports_drafts = True

    def __init__(self, model: ToyModel, num_blocks: int):
        self.model, self.num_blocks = model, num_blocks
        self.slots: dict[tuple[int, int], tuple[int, int]] = {}
        self.rows = 0  # logits rows computed: every draft token costs one

    def copy_blocks(self, copies):
        for src, dst in copies:
            for offset in range(BLOCK_SIZE):
                self.slots[dst, offset] = self.slots.get((src, offset))

    def execute(self, batch):
        sampling, rows = [], []
        for seq, count in zip(batch.seqs, batch.num_new_tokens):
            table, start, ids = seq.block_table, seq.num_computed_tokens, seq.token_ids + seq.draft
            for p in range(start):
                assert self.slots.get((table[p // BLOCK_SIZE], p % BLOCK_SIZE)) == (p, ids[p]), \
                    f"{seq}: position {p} lost its K/V"
            for p in range(start, start + count):
                self.slots[table[p // BLOCK_SIZE], p % BLOCK_SIZE] = (p, ids[p])
            if start + count == len(ids):
                sampling.append(seq)
                outputs = seq.output_token_ids
                rows.extend(self.model.logprobs(tuple(outputs + seq.draft[:j])) for j in range(len(seq.draft) + 1))
        self.rows += len(rows)
        return sampling, torch.stack(rows).float() if rows else torch.zeros(0, len(TOKENS))


def draft_engine(model: ToyModel, num_blocks: int = 256, max_num_seqs: int = 16, budget: int = 256,
                 **config) -> LLMEngine:
    config = EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=num_blocks, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=budget, draft_row_cost=0.0, **config)
    return LLMEngine(config, runner=DraftKVRunner(model, num_blocks), vocabulary=VOCAB,
                     model_config=SimpleNamespace(vocab_size=len(TOKENS), max_position=96))


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(Vocabulary.from_token_bytes(TOKENS, eos_token_ids=[EOS]))


def text_of(token_ids) -> str:
    return b"".join(TOKENS[t] for t in token_ids if t != EOS).decode()


def assert_same_completion(a, b, request_id: str) -> None:
    """Two completions of one request: the same tokens, text, finish and stop reasons, logprobs and cumulative
    logprob."""
    assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == \
        (b.token_ids, b.text, b.finish_reason, b.stop_reason), request_id
    assert (a.logprobs, a.cumulative_logprob) == (b.logprobs, b.cumulative_logprob), request_id


PROMPT = [0, 2, 1, 0, 2, 2, 0, 1, 2, 3, 0, 2]  # lookups find many continuations in it


@pytest.mark.parametrize("pattern", [AMBIGUOUS, "(ab|c)+", "a[bc]{0,3}(ab){2}c", None])
@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=1.0, seed=3),
                                    dict(temperature=0.8, top_p=0.9, seed=5, presence_penalty=0.5,
                                         repetition_penalty=1.3),
                                    dict(temperature=0, logit_bias={2: 1.5}, frequency_penalty=0.7)])
def test_drafts_change_no_output(compiler, pattern, params):
    """Greedy and seeded sampling give the same tokens, logprobs and finish with drafts on and off, in fewer
    steps; each row draws the same uniform either way."""
    model = ToyModel(seed=11, sharpness=2.5)
    outputs = {}
    for name, switches in (("off", OFF), ("on", ON)):
        engine = draft_engine(model)
        requests = []
        for i in range(6):
            guide = compiler.compile_node(parse_regex(pattern)).new_guide() if pattern else None
            p = SamplingParams(max_tokens=12, logprobs=2, ignore_eos=pattern is None, **{**params, **({"seed": params["seed"] + i}
                                                                          if "seed" in params else {})}, **switches)
            requests.append((f"r{i}", PROMPT[i:], p, guide))
        outputs[name] = run_all(engine, requests), engine
    (off, off_engine), (on, on_engine) = outputs["off"], outputs["on"]
    for request_id, out in off.items():
        a, b = out.outputs[0], on[request_id].outputs[0]
        assert (a.token_ids, a.finish_reason, a.text) == (b.token_ids, b.finish_reason, b.text), request_id
        assert a.logprobs == b.logprobs and a.cumulative_logprob == b.cumulative_logprob
        assert a.num_draft_tokens == 0 and b.num_forward_passes == len(b.token_ids) - b.num_accepted_tokens
        if pattern and a.finish_reason == "stop":
            assert re.fullmatch(pattern, text_of(a.token_ids))
    stats = on_engine.stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert sum(o.outputs[0].num_forward_passes for o in on.values()) < sum(len(o.outputs[0].token_ids)
                                                                           for o in on.values())
    for engine in (off_engine, on_engine):
        assert engine.block_manager.num_used_blocks == 0 and not any(engine.block_manager.ref_counts)


@pytest.mark.parametrize("logprobs", [None, 0])
def test_an_unguided_drafts_tokens_end_where_single_steps_end(logprobs):
    """An unguided draft's verified tokens are emitted as one run (one stop check for them all): with stop
    strings, stop ids, EOS and length limits falling inside drafts, greedy and seeded sampled requests give the
    tokens, text, finish and stop reasons and logprobs of a run without drafts."""
    model = ToyModel(seed=5, sharpness=2.0)
    outputs, runs = {}, {}
    for name, switches in (("off", OFF), ("on", ON)):
        engine = draft_engine(model)
        emit_run = engine._emit_run
        runs[name] = collections.Counter()

        def counted(seq, *args, _run=emit_run, _name=name):
            ended = _run(seq, *args)
            runs[_name][(seq.finish_reason, type(seq.stop_reason).__name__) if ended else None] += 1
            return ended
        engine._emit_run = counted
        requests = []
        for i in range(40):
            params = dict(temperature=0) if i % 3 else dict(temperature=1.0, seed=i)
            stops = dict(stop=[["ba"], ["ca", "bb"]][i % 2]) if i % 4 == 0 else \
                dict(stop_token_ids=[i % 4]) if i % 4 == 1 else {}
            p = SamplingParams(max_tokens=4 + i % 13, logprobs=logprobs, ignore_eos=i % 4 != 2, **params, **stops,
                               **switches)
            requests.append((f"r{i}", PROMPT[i % 7:] * 2, p, None))
        outputs[name] = run_all(engine, requests), engine
    (off, off_engine), (on, on_engine) = outputs["off"], outputs["on"]
    for engine in (off_engine, on_engine):
        assert engine.block_manager.num_used_blocks == 0 and not any(engine.block_manager.ref_counts)
    reasons = collections.Counter()
    for request_id, out in off.items():
        a, b = out.outputs[0], on[request_id].outputs[0]
        assert_same_completion(a, b, request_id)
        reasons[a.finish_reason, type(a.stop_reason).__name__] += 1
    assert on_engine.stats().num_accepted_tokens > 0 and not runs["off"], runs
    # each way to end met inside a verified run: a stop string, a stop id, EOS and the length limit
    assert {("stop", "str"), ("stop", "int"), ("stop", "NoneType"), ("length", "NoneType")} <= set(runs["on"]), runs


class PickingKVRunner(DraftKVRunner):
    """The toy runner with the native step's picking call: every logits row's greedy pick and its logprob, made
    by the sampler's own greedy pass (as the native call makes them where it computes the logits)."""

    def execute_picking(self, batch, pick_columns):
        seqs, logits = self.execute(batch)
        picks = cpu_ops.greedy_pick(logits, pick_columns or logits.shape[1], None, None)
        return seqs, logits, picks


def test_unguided_drafts_verified_on_picks_end_where_single_steps_end():
    """Plain greedy unguided requests whose steps pick every row in the call (drafts verified on those picks, the
    logits never split): the tokens, text, finish and stop reasons, logprobs (top 0 or none) and cumulative
    logprobs of a run without drafts, with stop strings, stop ids, EOS, ``max_tokens``, the model's length,
    ``min_tokens`` (its steps go to the sampler) and ``n`` siblings among them."""
    model = ToyModel(seed=5, sharpness=2.0)
    outputs, picked_drafts = {}, []
    for name, switches in (("off", OFF), ("on", ON)):
        runner = PickingKVRunner(model, 256) if name == "on" else DraftKVRunner(model, 256)
        engine = LLMEngine(EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=256, max_num_seqs=16,
                                        max_num_batched_tokens=256, draft_row_cost=0.0),
                           runner=runner, vocabulary=VOCAB,
                           model_config=SimpleNamespace(vocab_size=len(TOKENS), max_position=48))
        verified = engine._verify_picked
        engine._verify_picked = lambda drafted, picks, _verify=verified: \
            picked_drafts.extend(drafted) or _verify(drafted, picks)
        requests = []
        for i in range(40):
            extra = dict(stop=[["ba"], ["ca", "bb"]][i % 2]) if i % 5 == 0 else \
                dict(stop_token_ids=[1]) if i % 5 == 1 else dict(min_tokens=5) if i % 5 == 2 else \
                dict(n=2) if i % 10 == 3 else {}
            p = SamplingParams(temperature=0, max_tokens=4 + i % 13 if i % 7 else 40, logprobs=0 if i % 3 == 0 else None,
                               ignore_eos=i % 4 != 2, **extra, **switches)
            prompt = (PROMPT * 3)[:12 + i % 30]  # up to 41 of the model's 48 positions: some reach its length
            requests.append((f"r{i}", prompt, p, None))
        outputs[name] = run_all(engine, requests), engine
    (off, off_engine), (on, on_engine) = outputs["off"], outputs["on"]
    reasons = collections.Counter()
    for request_id, out in off.items():
        assert len(out.outputs) == len(on[request_id].outputs)
        for a, b in zip(out.outputs, on[request_id].outputs):
            assert_same_completion(a, b, request_id)
            reasons[a.finish_reason, type(a.stop_reason).__name__] += 1
    assert {("stop", "str"), ("stop", "int"), ("stop", "NoneType"), ("length", "NoneType")} <= set(reasons), reasons
    assert on_engine.stats().num_accepted_tokens > 0 and len(picked_drafts) > 20, len(picked_drafts)
    for engine in (off_engine, on_engine):
        assert engine.block_manager.num_used_blocks == 0 and not any(engine.block_manager.ref_counts)


def test_penalties_that_read_the_native_tally_change_no_output(compiler, monkeypatch):
    """Seeded n = 2 and greedy requests with repetition, frequency and presence penalties, drafts on, guided or
    not, in a pool small enough to preempt: the same tokens and logprobs whether the penalties read each
    sequence's native tally (caught up step by step) or its tokens, and every sequence made one tally."""
    made = []
    real = sampler_module.cpu_ops.token_tally

    def counted():
        made.append(real())
        return made[-1]

    outputs = {}
    for name, tally in (("tokens", lambda: None), ("tally", counted)):
        monkeypatch.setattr(sampler_module.cpu_ops, "token_tally", tally)
        engine = draft_engine(ToyModel(seed=5, sharpness=2.0), num_blocks=40, max_num_seqs=6)
        requests = []
        for i in range(6):
            knobs = dict(temperature=0.9, seed=i, n=2) if i % 2 else dict(temperature=0)
            guide = compiler.compile_node(parse_regex("(ab|c)+")).new_guide() if i % 3 == 0 else None
            requests.append((f"r{i}", PROMPT[i:] * 2, SamplingParams(
                max_tokens=24, logprobs=1, ignore_eos=guide is None, repetition_penalty=1.4, frequency_penalty=0.6,
                presence_penalty=0.3, **knobs, **ON), guide))
        outputs[name] = run_all(engine, requests)
    assert made and all(tally is not None for tally in made)
    assert len(made) == sum(len(out.outputs) for out in outputs["tally"].values())  # one per sequence
    for request_id, out in outputs["tokens"].items():
        for a, b in zip(out.outputs, outputs["tally"][request_id].outputs, strict=True):
            assert (a.token_ids, a.logprobs, a.finish_reason) == (b.token_ids, b.logprobs, b.finish_reason)
    assert sum(made[0].counts().values()) > 0


def test_jump_forward_drafts_the_forced_span_less_its_tail(compiler):
    guide = compiler.compile_node(parse_regex("acabab(c|b)")).new_guide()
    drafter = Drafter(VOCAB)
    assert guide.advance(0)  # "a"
    assert guide.forced_bytes() == b"cabab"
    before = list(guide.states)
    forced = drafter.forced_tokens(guide, room=10)
    # longest match is c, ab, ab; the last "ab" ends the span where a choice follows, so it is backed off
    assert forced == [3, 2] and guide.states == before
    assert drafter.forced_tokens(guide, room=1) == [3]
    done = compiler.compile_node(parse_regex("acab")).new_guide()
    done.advance(0)
    assert drafter.forced_tokens(done, room=10) == [3, 2], "nothing can follow the span: its tail stays"


def test_the_tokenizers_cut_of_a_forced_span_is_asked_once(compiler, monkeypatch):
    """A grammar forces the same spans again and again: the tokenizer cuts each once (spans up to
    MAX_CACHED_SPAN_BYTES, at most MAX_CACHED_SPANS of them), and the tokens are the same as uncached."""
    from corral.engine import speculation
    byte_token = {b: i for i, b in enumerate(TOKENS)}
    calls = []

    def encode(text):  # one token per character: another cut than the longest match ("ab" is a token)
        calls.append(text)
        return [byte_token[c.encode()] for c in text]
    drafter = Drafter(VOCAB, encode)
    guide = compiler.compile_node(parse_regex("acabab(c|b)")).new_guide()
    assert guide.advance(0)
    first = drafter.forced_tokens(guide, room=10)
    assert first == drafter.forced_tokens(guide, room=10) == [3, 0, 1, 0] and calls == ["cabab"]
    long_span = "ab" * 200  # past MAX_CACHED_SPAN_BYTES: cut every time
    assert drafter._encoded(long_span.encode()) == drafter._encoded(long_span.encode()) and len(calls) == 3
    monkeypatch.setattr(speculation, "MAX_CACHED_SPANS", 2)
    for span in (b"a", b"b", b"c", b"a"):
        drafter._encoded(span)
    assert len(drafter._cut) <= 2 and len(calls) == 7


@pytest.fixture(params=["python", pytest.param("native", marks=needs_native)])
def ngram_kind(request, monkeypatch):
    """Each prompt-lookup test with the native n-gram index and with its Python twin."""
    if request.param == "python":
        monkeypatch.setattr(speculation, "ngram_index", lambda order=MAX_NGRAM: PyNgramIndex(order))
    return request.param


def test_prompt_lookup_proposes_what_followed_the_longest_suffix_and_the_guide_allows(compiler, ngram_kind):
    drafter, state = Drafter(VOCAB), SpecState()
    tokens = [0, 1, 3, 2, 0, 1, 3, 3, 0, 1]
    draft = drafter.propose(tokens, None, state, forced_cap=0, lookup_cap=3, room=10)
    assert draft.tokens == [3, 3, 0] and draft.num_forced == 0  # "3 0 1" was last followed by... "0 1" -> 3 3 0
    guide = compiler.compile_node(parse_regex("[ab]*c[ab]*")).new_guide()
    for t in (0, 1):
        guide.advance(t)
    assert drafter.propose([0, 1], guide, SpecState(), forced_cap=0, lookup_cap=3, room=10).tokens == []
    tokens = [0, 1, 3, 0, 0, 1]
    draft = drafter.propose(tokens, guide, SpecState(), forced_cap=0, lookup_cap=4, room=10)
    assert draft.tokens == [3, 0, 0, 1]
    guide.advance(3)
    draft = drafter.propose(tokens + [3], guide, SpecState(), forced_cap=0, lookup_cap=4, room=10)
    assert 3 not in draft.tokens, "a second c is not allowed: the draft stops before it"


def test_a_lookup_draft_is_capped_by_the_record_of_its_match_length(ngram_kind):
    """The longest matching suffix decides both what is drafted and whose cap applies: a three-token match is
    capped by the three-token record, a one-token match by the one-token record, and none is drafted where the
    matched length's cap is 0 (a shorter match is weaker evidence, so it is not tried instead)."""
    drafter = Drafter(VOCAB)
    tokens = [0, 1, 2, 3, 3, 2, 1, 0, 1, 2]  # "0 1 2" was followed by "3 3 2 1 0"
    state = SpecState()
    draft = drafter.propose(tokens, None, state, forced_cap=0, lookup_cap=(5, 5, 2), room=10)
    assert draft.tokens == [3, 3] and state.lookup_order == 3
    assert drafter.propose(tokens, None, state, forced_cap=0, lookup_cap=(5, 5, 0), room=10).tokens == []
    assert state.lookup_order == 0
    tokens = [2, 3, 1, 0, 1, 3]  # only "3" matches: it was followed by "1 0 1 3"
    state = SpecState()
    draft = drafter.propose(tokens, None, state, forced_cap=0, lookup_cap=(1, 8, 8), room=10)
    assert draft.tokens == [1] and state.lookup_order == 1
    state.record(num_tested=1, num_forced=0, num_accepted=0)
    assert (state.lookup[0].reached, state.lookup[0].accepted) == (1, 0) and state.lookup[2].reached == 0


def test_draft_length_follows_the_acceptance_rate_and_the_price():
    assert draft_price(1, 0.25) == 0.25 and draft_price(16, 0.25) == pytest.approx(4 / 4.75)
    assert draft_price(64, 0.25) > 0.95 and draft_price(1000, 0.0) == 0.0
    rate = Rate()
    assert rate.length(8, draft_price(1, 0.25)) == 2  # prior 1/2: 0.5**2 >= 0.25 > 0.5**3
    assert rate.length(8, draft_price(4, 0.25)) == 0 and rate.length(8, 0.0) == 8
    rate.record(40, 39)
    assert rate.length(8, draft_price(1, 0.25)) == 8 and rate.length(8, draft_price(16, 0.25)) == 3
    rate.record(40, 0)
    rate.record(40, 0)
    assert rate.length(8, draft_price(1, 0.25)) == 1 and rate.length(8, draft_price(2, 0.25)) == 0
    state = SpecState()
    state.lookup_order = 2  # the lookup tokens came from a two-token match
    state.record(num_tested=6, num_forced=2, num_accepted=1)  # the second forced token was rejected
    assert (state.forced.reached, state.forced.accepted) == (2, 1)
    assert all(rate.reached == 0 for rate in state.lookup)
    state.record(num_tested=6, num_forced=2, num_accepted=4)  # both forced kept, 2 of 4 lookups, a third reached
    assert (state.lookup[1].reached, state.lookup[1].accepted) == (3, 2)
    assert state.lookup[0].reached == state.lookup[2].reached == 0  # the other match lengths keep their own record


class _Decoding:
    """What :meth:`Drafter.propose_all` reads of a decoding sequence."""

    def __init__(self, token_ids, max_tokens=1000):
        self.token_ids, self.guide, self.spec, self.num_output_tokens = token_ids, None, None, 0
        self.draft, self.num_draft_forced, self.draft_by_model = [], 0, False
        self.params = SamplingParams(temperature=0, max_tokens=max_tokens)

    def __len__(self):
        return len(self.token_ids)


def test_a_shadow_is_recorded_as_its_verification_would_be(ngram_kind):
    """A stopped match length's shadow: the tokens that length would have drafted, checked once the tokens that
    came decide it: kept up to the first that differs (that one reached), or all of them; undecided while every
    token so far agrees."""
    drafter = Drafter(VOCAB)
    tokens = [0, 1, 2, 3, 3, 2, 1, 0, 1, 2]  # "0 1 2" was followed by "3 3 2 1 0"
    state = SpecState()
    drafter.shadow(tokens, None, state, (5, 5, 5), 4)
    assert state.shadow is None  # the length that matched drafts: nothing to shadow
    drafter.shadow(tokens, None, state, (5, 5, 0), 4)
    assert state.shadow == (3, len(tokens), [3, 3, 2, 1])
    settle_shadow(tokens + [3], state)
    assert state.shadow is not None and state.lookup[2].reached == 0  # one token came, and it agrees
    settle_shadow(tokens + [3, 3, 0], state)  # the third differs: two kept, three reached
    assert state.shadow is None and (state.lookup[2].reached, state.lookup[2].accepted) == (3, 2)
    drafter.shadow(tokens, None, state, (0, 0, 0), 2)
    settle_shadow(tokens + [3, 3, 0], state)  # both came as drafted
    assert (state.lookup[2].reached, state.lookup[2].accepted) == (3 * 0.8 + 2, 2 * 0.8 + 2)
    assert state.lookup[0].reached == state.lookup[1].reached == 0


def test_a_stopped_lookup_drafts_again_once_its_text_repeats():
    """Without shadows a length whose record fell below the price would never be verified again, so never drafted
    again. Here the text turns into a cycle: the stopped lengths' shadows agree with it and, with no row spent
    (no draft) until then, lookup drafts again within a few steps. Text that contradicts every shadow keeps it
    stopped. At 256 sequences no rate can pay, so no shadow is even looked up."""
    drafter, config = Drafter(VOCAB), EngineConfig(jump_forward=False, speculation=True)
    for repeats in (True, False):
        seq = _Decoding([0, 1, 2, 3, 1, 0, 3, 2])
        seq.spec = SpecState()
        for rate in seq.spec.lookup:  # every length stopped at one sequence's price
            rate.record(12, 0)
        assert all(rate.length(8, draft_price(1, config.draft_row_cost)) == 0 for rate in seq.spec.lookup)
        undrafted = 0
        for step in range(40):
            drafter.propose_all([seq], config, 10_000)
            if seq.draft:
                break
            undrafted += 1
            shadow, token = seq.spec.shadow, step % 4
            if not repeats and shadow is not None:  # whatever the pending shadow does not expect next
                token = (shadow[2][len(seq.token_ids) - shadow[1]] + 1) % 4
            seq.token_ids.append(token)
        assert (undrafted < 20) == repeats, undrafted
        if repeats:
            assert seq.draft == [(undrafted + k) % 4 for k in range(len(seq.draft))]  # the cycle, continued
    seq = _Decoding([0, 1, 2, 3, 0, 1, 2])  # a shadow waiting when its length drafts again is dropped
    seq.spec = SpecState()
    drafter.propose_all([seq] * 4, config, 10_000)  # at 4 sequences the prior 1/2 is under the price: a shadow
    assert seq.spec.shadow == (3, 7, [3, 0, 1, 2]) and not seq.draft
    seq.token_ids.append(3)
    drafter.propose_all([seq], config, 10_000)  # alone it drafts: its verification records, the shadow does not
    assert seq.spec.shadow is None and seq.draft == [0, 1] and seq.spec.lookup[2].reached == 0
    assert draft_price(256, config.draft_row_cost) > best_rate(config.num_speculative_tokens)
    seq = _Decoding([0, 1, 2, 3, 0, 1, 2])
    seq.spec = SpecState()
    drafter.propose_all([seq] * 256, config, 10_000)
    assert seq.spec.shadow is None and not seq.draft


def test_stop_strings_max_tokens_and_grammar_end_cut_a_draft(compiler):
    model = ToyModel(seed=2, sharpness=3.0)
    for params in (dict(stop=["bc"]), dict(max_tokens=3), dict(stop_token_ids=[3]), dict(min_tokens=4)):
        outs = []
        for switches in (OFF, ON):
            engine = draft_engine(model)
            guide = compiler.compile_node(parse_regex(AMBIGUOUS)).new_guide()
            p = SamplingParams(temperature=0, **{"max_tokens": 12, **params}, **switches)
            outs.append(run_all(engine, [("r", PROMPT, p, guide)])["r"].outputs[0])
            assert engine.block_manager.num_used_blocks == 0
        assert (outs[0].token_ids, outs[0].text, outs[0].finish_reason, outs[0].stop_reason) == \
            (outs[1].token_ids, outs[1].text, outs[1].finish_reason, outs[1].stop_reason), params
        if "max_tokens" in params:
            assert len(outs[1].token_ids) == 3


def test_a_forced_span_past_the_state_cap_ends_only_its_sequence_as_without_drafts():
    """The forced span is walked on the shared automaton, which may meet its state cap there: the span stops short
    (what it found is still forced), the sequence meets the cap where it would without drafts and ends with it,
    and the request beside it goes on."""
    from corral.budget import Budget
    from corral.fsm.fsm_guide import FSMGuide
    from corral.fsm.lazy_dfa import LazyDFA
    from corral.fsm.token_index import TokenIndex
    outs = []
    for switches in (OFF, ON):
        index = TokenIndex(LazyDFA(parse_regex("(ab){40}c"), Budget(max_states=24)), VOCAB)  # 80 forced bytes
        engine = draft_engine(ToyModel(seed=4))
        requests = [("capped", PROMPT, SamplingParams(temperature=0, max_tokens=60, **switches), FSMGuide(index)),
                    ("free", PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **switches), None)]
        outs.append({k: o.outputs[0] for k, o in run_all(engine, requests).items()})
        assert engine.block_manager.num_used_blocks == 0
    for request_id in ("capped", "free"):
        a, b = outs[0][request_id], outs[1][request_id]
        assert (a.token_ids, a.finish_reason, a.stop_reason) == (b.token_ids, b.finish_reason, b.stop_reason)
    capped = outs[1]["capped"]
    assert capped.finish_reason == "error" and "cap of 24 states" in capped.stop_reason and capped.token_ids
    assert outs[1]["free"].finish_reason == "length" and len(outs[1]["free"].token_ids) == 6


def test_prompt_ids_past_the_vocabulary_are_drafted_into_no_guide():
    """A model's embedding may have rows past the tokenizer's vocabulary (padding), and a prompt may hold such an
    id; prompt lookup drafts it, and the guides refuse it as a token that spells nothing (where they failed the
    step on it), regular and context-free alike, drafts on as off."""
    from corral.fsm.cfg_guide import CFGGuide
    from corral.grammar.constraint import Constraint
    compiler = GrammarCompiler(VOCAB)
    prompt = [0, 6, 1, 6, 2, 6, 3, 6, 0, 6, 1, 6]  # 6 and 7: rows of the model, no token of the vocabulary
    outs = []
    for switches in (OFF, ON):
        engine = LLMEngine(EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=256, max_num_batched_tokens=256,
                                        draft_row_cost=0.0, **switches),
                           runner=DraftKVRunner(ToyModel(seed=4), 256), vocabulary=VOCAB,
                           model_config=SimpleNamespace(vocab_size=8, max_position=96))
        cfg = compiler.compile(Constraint("grammar", 'start: "a" start "b" | "c"')).new_guide()
        regular = compiler.compile_node(parse_regex("[abc]{1,30}")).new_guide()
        assert isinstance(cfg, CFGGuide) and not cfg.copy().advance(6) and not regular.copy().advance(7)
        requests = [("regular", prompt, SamplingParams(temperature=0, max_tokens=20, **switches), regular),
                    ("cfg", prompt, SamplingParams(temperature=0, max_tokens=20, **switches), cfg),
                    ("free", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **switches), None)]
        outs.append({k: o.outputs[0] for k, o in run_all(engine, requests).items()})
        assert engine.block_manager.num_used_blocks == 0
    for request_id in ("regular", "cfg", "free"):
        a, b = outs[0][request_id], outs[1][request_id]
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason), request_id
        assert a.finish_reason in ("stop", "length") and a.token_ids, request_id
    assert re.fullmatch("[abc]{1,30}", outs[1]["regular"].text)
    assert re.fullmatch("(a*)c(b*)", outs[1]["cfg"].text)


# "abd": after "ab" no token spells "d", so the mask there allows nothing and the sequence ends with an error
DEFERRED_PATTERNS = [AMBIGUOUS, "(ab|c)+", "a[bc]{0,3}(ab){2}c", "abd", "(a|b|c){2,9}"]


def outputs_with_masks(compiler, model, switches, defer: bool) -> dict:
    """Every pattern under plain greedy requests (stop strings, stop ids, limits among them), with sampled and
    top-logprob requests beside them, on one engine whose plain greedy rows defer their masks or not."""
    engine = draft_engine(model, **switches)
    engine.defer_masks = defer
    requests = []
    for i in range(3 * len(DEFERRED_PATTERNS)):
        guide = compiler.compile_node(parse_regex(DEFERRED_PATTERNS[i % len(DEFERRED_PATTERNS)])).new_guide()
        extra = [dict(), dict(stop=["cab"], max_tokens=4, logprobs=0),
                 dict(stop_token_ids=[3], min_tokens=2)][i // len(DEFERRED_PATTERNS)]
        if i % 4 == 3:
            extra = dict(temperature=0.9, seed=i)
        elif i % 7 == 5:
            extra = dict(logprobs=2)
        p = SamplingParams(**{"temperature": 0, "max_tokens": 8, **extra}, **switches)
        requests.append((f"r{i}", PROMPT[i % 5:], p, guide))
    outputs = run_all(engine, requests)
    assert engine.block_manager.num_used_blocks == 0 and not any(engine.block_manager.ref_counts)
    return outputs


@pytest.mark.parametrize("switches", [OFF, ON])
def test_deferred_masks_change_no_output(compiler, switches, monkeypatch):
    """A plain greedy guided row whose mask waits for its token (its unmasked argmax, the mask filled and the
    row picked again only where the grammar refuses it) gives the tokens, text, logprobs, finish and stop reasons
    and draft counts that masks filled before every step give, beside sampled and top-logprob rows that fill
    theirs; fewer masks are filled, and the emits of tokens a probe took already take the probe's step
    (``Guide.advance_as``) instead of asking the grammar again."""
    from corral.fsm.fsm_guide import FSMGuide
    fills, mode, taken, asked = collections.Counter(), [None], collections.Counter(), [0]
    fill_mask, advance, advance_as = FSMGuide.fill_mask, FSMGuide.advance, FSMGuide.advance_as

    def counted(self, row):
        fills[mode[0]] += 1
        fill_mask(self, row)

    def counted_advance(self, token):
        asked[0] += 1
        return advance(self, token)

    def counted_as(self, token, probe, index):
        before = asked[0]
        result = advance_as(self, token, probe, index)
        taken[mode[0]] += asked[0] == before
        taken["a draft's", mode[0]] += asked[0] == before and index > 0  # a walk's probe, past its first token
        return result
    monkeypatch.setattr(FSMGuide, "fill_mask", counted)
    monkeypatch.setattr(FSMGuide, "advance", counted_advance)
    monkeypatch.setattr(FSMGuide, "advance_as", counted_as)
    model = ToyModel(seed=7, sharpness=2.0)
    runs = {}
    for defer in (False, True):
        mode[0] = defer
        runs[defer] = outputs_with_masks(compiler, model, switches, defer)
    eager, deferred = runs[False], runs[True]
    assert eager.keys() == deferred.keys()
    reasons = collections.Counter()
    for request_id, out in eager.items():
        a, b = out.outputs[0], deferred[request_id].outputs[0]
        assert_same_completion(a, b, request_id)
        assert (a.num_draft_tokens, a.num_accepted_tokens, a.num_forced_tokens) == \
            (b.num_draft_tokens, b.num_accepted_tokens, b.num_forced_tokens), request_id
        reasons[a.finish_reason] += 1
    assert reasons["error"] and reasons["stop"] and reasons["length"], reasons
    if switches is ON:
        assert sum(o.outputs[0].num_accepted_tokens for o in deferred.values()) > 0
    # fewer: the refused rows' alone (this toy model's argmax breaks these grammars often), and the other rows'
    assert 0 < fills[True] < fills[False], fills
    assert taken[True] > 0 and not taken[False], taken
    if switches is ON:
        assert taken["a draft's", True] > 0, taken


@pytest.mark.parametrize("fail_at", [2, 4, 6])
def test_a_guide_that_fails_inside_a_verified_run_ends_its_sequence_at_that_token(compiler, fail_at, monkeypatch):
    """A guide that meets a limit while a token is emitted (here forced at output token ``fail_at``) ends its
    sequence with an error at that token, counted and with its logprob, whether the token came alone or inside a
    verified run of drafted tokens (emitted as a run, its guide advanced token by token): the same tokens, text,
    reasons and logprobs with drafts on as off, and some sequence failed inside a run of verified tokens."""
    advance = LLMEngine._advance_guide

    def failing(seq, token):
        if seq.num_output_tokens == fail_at:
            seq.guide.error = "a limit"
            return False
        return advance(seq, token)
    monkeypatch.setattr(LLMEngine, "_advance_guide", staticmethod(failing))
    emit_run, in_runs = LLMEngine._emit_run, collections.Counter()

    def counted_run(self, seq, tokens, logprobs, now):
        ended = emit_run(self, seq, tokens, logprobs, now)
        in_runs[len(tokens) > 1 and seq.finish_reason == "error"] += 1  # it failed inside a run of tokens
        return ended
    monkeypatch.setattr(LLMEngine, "_emit_run", counted_run)
    outs, accepted = {}, 0
    for switches in (OFF, ON):
        engine = draft_engine(ToyModel(seed=7, sharpness=2.0), **switches)
        engine.defer_masks = True
        requests = [(f"r{i}", PROMPT[i % 5:], SamplingParams(temperature=0, max_tokens=8),
                     compiler.compile_node(parse_regex(pattern)).new_guide())
                    for i, pattern in enumerate([AMBIGUOUS, "a[bc]{0,3}(ab){2}c"] * 3)]
        done = run_all(engine, requests)
        assert engine.block_manager.num_used_blocks == 0
        outs[switches is ON] = {k: (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
                                    o.outputs[0].stop_reason, o.outputs[0].logprobs, o.outputs[0].cumulative_logprob)
                                for k, o in done.items()}
        accepted = sum(o.outputs[0].num_accepted_tokens for o in done.values())
    assert outs[False] == outs[True]
    assert accepted > 0 and in_runs[True] > 0, in_runs
    ended = [v for v in outs[True].values() if v[2] == "error"]
    assert ended and all(len(v[0]) == fail_at and v[3] == "a limit" for v in ended), outs[True]


class PrefersC(ToyModel):
    """A model whose argmax is always "c", then "ab", "b", "a", EOS."""

    def __init__(self):
        super().__init__(seed=0)

    def logprobs(self, prefix: tuple[int, ...]) -> torch.Tensor:
        return torch.log_softmax(torch.tensor([0.0, 0.5, 1.0, 3.0, -1.0], dtype=torch.float64), dim=0)


@pytest.mark.parametrize("pattern", ["(ab)+", "abd", "ab(c|ab)*"])
@pytest.mark.parametrize("claim", [None, "other tokens", "an earlier length"])
def test_deferred_masks_verify_a_draft_the_grammar_refuses(compiler, pattern, claim):
    """A draft of tokens the grammar refuses (here "c, c, b" at every step, as a draft model might propose them),
    whose first is the model's own argmax: deferred masks reject it where the masked rows would, test the draft up
    to the token the grammar refuses, and end a sequence whose mask allows nothing with an error, as masks filled
    before the step do (tokens, reasons, logprobs and draft counts alike). A drafter's record that its guide
    allowed a draft is trusted only for that draft at that length: a stale one (another draft, or the same one
    before the last token) changes nothing."""
    outs = {}
    for defer in (False, True):
        engine = draft_engine(PrefersC(), jump_forward=False, speculation=True)
        engine.defer_masks = defer

        def propose_all(decoding, config, max_model_len, model_cost=None):
            for seq in decoding:
                room = min(seq.params.max_tokens - seq.num_output_tokens, max_model_len - len(seq)) - 1
                seq.spec = seq.spec or SpecState()
                seq.draft, seq.num_draft_forced, seq.draft_by_model = [3, 3, 1][:max(room, 0)], 0, False
                seq.allowed_draft = {None: None, "other tokens": ([0, 2, 2], len(seq.token_ids)),
                                     "an earlier length": (list(seq.draft), len(seq.token_ids) - 1)}[claim]
            return []
        engine.drafter.propose_all = propose_all
        guide = compiler.compile_node(parse_regex(pattern)).new_guide()
        out = run_all(engine, [("r", PROMPT, SamplingParams(temperature=0, max_tokens=6), guide)])["r"].outputs[0]
        assert engine.block_manager.num_used_blocks == 0
        outs[defer] = (out.token_ids, out.text, out.finish_reason, out.stop_reason, out.logprobs,
                       out.cumulative_logprob, out.num_draft_tokens, out.num_accepted_tokens)
    assert outs[False] == outs[True]
    drafted, accepted, finish = outs[True][6], outs[True][7], outs[True][2]
    assert {"(ab)+": (drafted > 0, accepted, finish), "abd": (drafted, accepted, finish),
            "ab(c|ab)*": (drafted > 0, accepted > 0, finish)}[pattern] == \
        {"(ab)+": (True, 0, "length"), "abd": (0, 0, "error"), "ab(c|ab)*": (True, True, "length")}[pattern], outs


class Poisoned(ToyModel):
    """The toy model, with +inf on "c" at every row, and every logit NaN after an output that starts "b, b"."""

    def logprobs(self, prefix: tuple[int, ...]) -> torch.Tensor:
        row = super().logprobs(prefix).clone()
        row[3] = float("inf")
        if prefix[:2] == (1, 1):
            row[:] = float("nan")
        return row


@pytest.mark.parametrize("switches", [OFF, ON])
def test_logits_with_nothing_finite_to_choose_end_their_sequence_alone(compiler, switches):
    """+inf on a token the grammar refuses is ruled out by the mask, filled first or deferred (the same tokens);
    a sequence whose logits leave nothing finite to choose ends alone with an error naming it, and the others
    go on, unguided ones too."""
    from corral.engine.llm_engine import NO_FINITE_LOGIT
    outs = {}
    for defer in (False, True):
        engine = draft_engine(Poisoned(seed=3), **switches)
        engine.defer_masks = defer
        requests = [(f"g{i}", PROMPT[i:], SamplingParams(temperature=0, max_tokens=8, **switches),
                     compiler.compile_node(parse_regex(pattern)).new_guide())
                    for i, pattern in enumerate(["(ab)+", "(a|ab)+b?", "bb(a|b)+", "a(ab|b)*"])]
        requests.append(("free", PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, **switches), None))
        outs[defer] = {k: o.outputs[0] for k, o in run_all(engine, requests).items()}
        assert engine.block_manager.num_used_blocks == 0
    for request_id, a in outs[False].items():
        b = outs[True][request_id]
        assert (a.token_ids, a.finish_reason, a.stop_reason) == (b.token_ids, b.finish_reason, b.stop_reason), \
            request_id
    assert (outs[True]["g2"].token_ids, outs[True]["g2"].finish_reason, outs[True]["g2"].stop_reason) == \
        ([1, 1], "error", NO_FINITE_LOGIT)
    assert outs[True]["free"].finish_reason == "error" and outs[True]["free"].token_ids == [], \
        "an unguided row's +inf is nothing finite to choose too"
    for request_id in ("g0", "g1", "g3"):
        assert outs[True][request_id].finish_reason in ("stop", "length") and 3 not in outs[True][request_id].token_ids


class NaNOnC(ToyModel):
    """The toy model, with NaN on "c" at every row."""

    def logprobs(self, prefix: tuple[int, ...]) -> torch.Tensor:
        row = super().logprobs(prefix).clone()
        row[3] = float("nan")
        return row


@pytest.mark.parametrize("switches", [OFF, ON])
def test_a_nan_the_grammar_rules_out_changes_no_token(compiler, switches):
    """A NaN on a token every grammar here refuses is masked away like any other value (the CPU mask left it in
    place, so the sequence ended with an error on CPU where on a GPU it went on): the guided requests give the
    tokens of the same model without the NaN, masks filled first or deferred, and only their logprobs, whose raw
    normalizer the NaN leaves undefined, are NaN. An unguided request, whose row the NaN poisons, ends alone."""
    from corral.engine.llm_engine import NO_FINITE_LOGIT
    patterns = ["(ab)+", "(a|ab)+b?", "bb(a|b)+", "a(ab|b)*"]

    def run(model, defer):
        engine = draft_engine(model, **switches)
        engine.defer_masks = defer
        requests = [(f"g{i}", PROMPT[i:], SamplingParams(temperature=0, max_tokens=8, logprobs=1, **switches),
                     compiler.compile_node(parse_regex(pattern)).new_guide()) for i, pattern in enumerate(patterns)]
        requests.append(("free", PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, **switches),
                         None))
        outs = {k: o.outputs[0] for k, o in run_all(engine, requests).items()}
        assert engine.block_manager.num_used_blocks == 0
        return outs
    clean = run(ToyModel(seed=3), False)
    for defer in (False, True):
        outs = run(NaNOnC(seed=3), defer)
        for i in range(len(patterns)):
            a, b = clean[f"g{i}"], outs[f"g{i}"]
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason) and b.finish_reason != "error"
            assert a.token_ids and all(math.isnan(lp) for lp, _ in b.logprobs), (i, defer)
        assert (outs["free"].finish_reason, outs["free"].stop_reason, outs["free"].token_ids) == \
            ("error", NO_FINITE_LOGIT, [])


def test_a_beam_whose_logits_hold_nan_or_plus_inf_is_dropped_and_the_batch_goes_on(compiler):
    """A guided beam search beside a greedy request, on a model with NaN rows after "b, b" (and on another with
    +inf on a token, which makes every row's raw logprobs NaN): the beams those rows would extend are dropped as
    dead ends are (no token the grammar refuses, no NaN score), the step never fails, and the greedy request's
    output is its output alone."""

    class NaNAfterBB(ToyModel):
        def logprobs(self, prefix: tuple[int, ...]) -> torch.Tensor:
            row = super().logprobs(prefix)
            return torch.full_like(row, float("nan")) if prefix[:2] == (1, 1) else row
    for model in (Poisoned(seed=3), NaNAfterBB(seed=3)):
        _beams_beside_greedy(compiler, model, expect_hypotheses=isinstance(model, NaNAfterBB))


def _beams_beside_greedy(compiler, model, expect_hypotheses: bool):
    alone = run_all(draft_engine(model), [("free", PROMPT, SamplingParams(temperature=0, max_tokens=6), None)])
    engine = draft_engine(model)
    beams = BeamSearchParams(beam_width=3, max_tokens=5)
    out = run_all(engine, [("beams", PROMPT, beams, compiler.compile_node(parse_regex("(a|b)+")).new_guide()),
                           ("free", PROMPT, SamplingParams(temperature=0, max_tokens=6), None)])
    assert out["free"].outputs[0].token_ids == alone["free"].outputs[0].token_ids
    hypotheses = [o.token_ids for o in out["beams"].outputs]
    assert bool(hypotheses) == expect_hypotheses, hypotheses  # +inf: every beam dropped at its first row
    assert all(3 not in h and tuple(h[:2]) != (1, 1) for h in hypotheses), hypotheses
    assert all(math.isfinite(o.cumulative_logprob) for o in out["beams"].outputs)
    assert engine.block_manager.num_used_blocks == 0 and not any(engine.block_manager.ref_counts)


def test_masks_wait_for_plain_greedy_rows_where_no_core_is_free(compiler):
    """By default a mask waits for its token where masks are filled on the engine's thread (the forward takes
    every core), for plain greedy rows alone; ``defer_masks`` overrides it."""
    engine = draft_engine(ToyModel(seed=1))

    def seq(seq_id, error=False, **params):
        return SimpleNamespace(seq_id=seq_id, params=SamplingParams(**{"temperature": 0, **params}), is_beam=False,
                               num_forks_pending=0, num_output_tokens=1,
                               guide=SimpleNamespace(is_error=lambda: error))
    rows = [seq(1), seq(2, logprobs=2), seq(3, temperature=0.7), seq(4, min_tokens=3), seq(5, logit_bias={1: 1.0}),
            seq(6, logprobs=0), seq(7, error=True)]  # 7: its guide met an error already, which its mask reports
    engine._cores = torch.get_num_threads()
    assert engine._deferred(rows) == {1, 6}
    engine._cores = torch.get_num_threads() + 1  # a core beside the forward: the worker fills masks there
    assert not engine._deferred(rows)
    engine.defer_masks = True
    assert engine._deferred(rows) == {1, 6}
    engine.defer_masks, engine._cores = False, torch.get_num_threads()
    assert not engine._deferred(rows)


def test_n_and_beams_run_beside_drafts(compiler):
    model = ToyModel(seed=4, sharpness=2.0)
    beams = BeamSearchParams(beam_width=3, max_tokens=5)
    out = {}
    for name, switches in (("off", OFF), ("on", ON)):
        engine = draft_engine(model)
        requests = [("n", PROMPT, SamplingParams(temperature=0.5, seed=9, n=3, max_tokens=10, ignore_eos=True,
                                                 **switches), None),
                    ("beams", PROMPT[:5], beams, None)]
        out[name] = run_all(engine, requests)
        assert engine.block_manager.num_used_blocks == 0 and not any(engine.block_manager.ref_counts)
    assert [o.token_ids for o in out["off"]["n"].outputs] == [o.token_ids for o in out["on"]["n"].outputs]
    assert sum(o.num_accepted_tokens for o in out["on"]["n"].outputs) > 0
    assert_equals_search(out["on"]["beams"], model, beams)


def snapshot(seq) -> tuple:
    guide_states = tuple(seq.guide.states) if seq.guide is not None else None
    return (tuple(seq.token_ids), seq.num_computed_tokens, len(seq.block_table), tuple(seq.block_hashes),
            guide_states, seq.detokenizer.visible_text(False), seq.cumulative_logprob)


def test_rollback_leaves_what_a_run_without_drafts_holds(compiler):
    """After every drafted step, the sequence's tokens, computed prefix, block count, prefix-cache hashes, guide
    states and detokenized text equal those of a run without drafts at the same length."""
    model = ToyModel(seed=8, sharpness=4.0)  # sharp enough that drafts are kept, flat enough that some are not
    seen = {}
    for name, switches in (("off", OFF), ("on", ON)):
        engine = draft_engine(model)
        guide = compiler.compile_node(parse_regex("(a|b|ab|c){20,40}")).new_guide()
        engine.add_request("r", PROMPT, SamplingParams(temperature=1.0, seed=1, max_tokens=40, ignore_eos=True,
                                                       **switches),
                           guide=guide)
        (seq,) = engine.scheduler.waiting
        states = {}
        while engine.has_unfinished_requests():
            engine.step()
            if not seq.is_finished:
                states[len(seq)] = snapshot(seq)
        seen[name] = states, engine
    (off, _), (on, on_engine) = seen["off"], seen["on"]
    assert on_engine.stats().num_draft_tokens > on_engine.stats().num_accepted_tokens > 0, "no rejection tested"
    assert len(on) < len(off)
    for length, state in on.items():
        assert state == off[length], length


def test_no_block_leaks_over_a_thousand_random_drafts(compiler):
    """Random drafts (any token, any length) under a tight pool, with preemption and prefix caching: every
    block comes back, and no running sequence ever holds more blocks than its tokens need."""
    rng = random.Random(0)
    model = ToyModel(seed=3, sharpness=1.0)
    engine = draft_engine(model, num_blocks=40, max_num_seqs=8, budget=40)
    propose = engine._propose_drafts
    num_drafts = 0

    def random_drafts():
        nonlocal num_drafts
        propose()
        for seq in engine.scheduler.running:
            if seq.num_uncomputed_tokens == 1 and not seq.num_forks_pending and rng.random() < 0.7:
                room = seq.params.max_tokens - seq.num_output_tokens - 1
                seq.draft = [rng.randrange(4) for _ in range(rng.randint(0, max(0, min(6, room))))]
                seq.num_draft_forced = 0
                seq.spec = seq.spec or SpecState()
                num_drafts += bool(seq.draft)

    engine._propose_drafts = random_drafts
    pattern = "(a|b|ab|c){1,30}"
    requests = [(f"r{i}", PROMPT[: rng.randint(1, len(PROMPT))],
                 SamplingParams(temperature=1.0, seed=i, max_tokens=rng.randint(1, 30), n=rng.choice([1, 1, 2])),
                 compiler.compile_node(parse_regex(pattern)).new_guide() if i % 2 else None) for i in range(400)]
    for request_id, prompt, params, guide in requests:
        engine.add_request(request_id, prompt, params, guide=guide)
    while engine.has_unfinished_requests():
        for output in engine.step():
            for c in output.outputs:
                if c.finish_reason == "stop" and output.request_id in {r[0] for r in requests[1::2]}:
                    assert re.fullmatch(pattern, text_of(c.token_ids))
        bm = engine.block_manager
        for seq in engine.scheduler.running:
            assert len(seq.block_table) <= bm.num_blocks_for(len(seq)), seq
        held = collections.Counter(b for seq in engine.scheduler.running for b in seq.block_table)
        assert all(bm.ref_counts[b] == held.get(b, 0) for b in range(bm.num_blocks)), "a block leaked or is shared"
    assert num_drafts >= 1000
    assert engine.block_manager.num_used_blocks == 0 and not any(engine.block_manager.ref_counts)
    assert engine.block_manager.num_free_blocks == 40


# ---- the distribution under sampling --------------------------------------------------------------------------
def sample_texts(compiler, switches: dict, num: int, **params) -> collections.Counter:
    engine = draft_engine(ToyModel(seed=21, sharpness=1.2), num_blocks=2048, max_num_seqs=256, budget=4096)
    grammar = compiler.compile_node(parse_regex(AMBIGUOUS))
    torch.manual_seed(1234 if switches["speculation"] else 4321)
    counts = collections.Counter()
    for start in range(0, num, 256):
        requests = [(f"s{start + i}", PROMPT[(start + i) % 5:], SamplingParams(max_tokens=8, **params, **switches),
                     grammar.new_guide()) for i in range(min(256, num - start))]
        for out in run_all(engine, requests, max_steps=100_000).values():
            counts[tuple(out.outputs[0].token_ids)] += 1
    assert not switches["speculation"] or engine.stats().num_draft_tokens > num  # drafts were really tested
    return counts


def chi_square_p(a: collections.Counter, b: collections.Counter) -> float:
    """Two-sample chi-square p-value over the outcomes, rare ones (< 10 in both) pooled."""
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    table = [[a[k] for k in keys], [b[k] for k in keys]]
    rest = [sum(a.values()) - sum(table[0]), sum(b.values()) - sum(table[1])]
    if min(rest) > 0:
        table = [row + [r] for row, r in zip(table, rest)]
    return chi2_contingency(np.array(table))[1]


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=1.0, top_p=0.9)])
def test_unseeded_sampling_has_the_same_distribution_with_drafts(compiler, params):
    off = sample_texts(compiler, OFF, 10_000, **params)
    on = sample_texts(compiler, ON, 10_000, **params)
    assert chi_square_p(off, on) > 1e-3, (off.most_common(5), on.most_common(5))


def test_the_chi_square_test_rejects_a_biased_acceptance_rule(compiler, monkeypatch):
    """Accept every draft token the mask-forced check would let through (here, with no mask: any token with a
    finite logit): the test must see the bias."""
    def biased(draft, draw, possible, generator):
        chosen = []
        for j, token in enumerate(draft.tokens):
            at = draft.start + j
            if possible(at, token):
                chosen.append((token, at))
                continue
            chosen.append((draw(at, sampler_module._uniform(generator)), at))
            return chosen, j
        if draft.final:
            at = draft.start + len(draft.tokens)
            chosen.append((draw(at, sampler_module._uniform(generator)), at))
        return chosen, len(draft.tokens)

    off = sample_texts(compiler, OFF, 10_000, temperature=1.0)
    monkeypatch.setattr(sampler_module, "_verify_sampled", biased)
    on = sample_texts(compiler, ON, 10_000, temperature=1.0)
    assert chi_square_p(off, on) < 1e-6


def test_plain_and_drafted_rows_are_split_as_views_when_each_is_one_run():
    """The scheduler puts drafted decodes last, so the split copies nothing (it copied a few MB a step at 16
    sequences); rows in any other order are still taken right, as copies."""
    import types

    import torch

    from corral.engine.llm_engine import LLMEngine

    logits = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    plain = [types.SimpleNamespace(draft=[]) for _ in range(2)]
    drafted = [types.SimpleNamespace(draft=[5, 6]), types.SimpleNamespace(draft=[9, 9])]
    (seqs, rows), (with_drafts, draft_rows) = LLMEngine._split_drafts(None, plain + drafted[:1], logits[:5])
    assert seqs == plain and rows.data_ptr() == logits.data_ptr() and torch.equal(rows, logits[:2])
    assert with_drafts == [(drafted[0], 0)] and draft_rows.data_ptr() == logits[2].data_ptr()
    assert torch.equal(draft_rows, logits[2:5])
    mixed = [drafted[0], plain[0], drafted[1], plain[1]]  # rows: 0-2, 3, 4-6, 7: not runs
    logits = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    (seqs, rows), (with_drafts, draft_rows) = LLMEngine._split_drafts(None, mixed, logits)
    assert seqs == plain and torch.equal(rows, logits[[3, 7]])
    assert with_drafts == [(drafted[0], 0), (drafted[1], 3)] and torch.equal(draft_rows, logits[[0, 1, 2, 4, 5, 6]])


def test_siblings_of_a_seed_at_the_top_of_its_range_draw_and_the_batch_goes_on():
    """Siblings draw with the request's seed plus their index: from the largest seed the API takes (2**64 - 1)
    that passed torch's range and failed the step, every request in flight with it. Seeds wrap modulo 2**64, as
    torch takes a negative one, so a seed and the same seed plus 2**64 draw alike."""
    from corral.engine.sampler import make_generator
    assert torch.rand(4, generator=make_generator(3 + 2**64)).tolist() == \
        torch.rand(4, generator=make_generator(3)).tolist()
    assert torch.rand(4, generator=make_generator(2**64 - 5)).tolist() == \
        torch.rand(4, generator=torch.Generator().manual_seed(-5)).tolist()  # torch's own reading of -5
    engine = draft_engine(ToyModel(seed=2), **OFF)
    outs = run_all(engine, [
        ("top", PROMPT, SamplingParams(temperature=1.0, n=3, seed=2**64 - 1, max_tokens=6, ignore_eos=True), None),
        ("bystander", PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), None)])
    assert [len(c.token_ids) for c in outs["top"].outputs] == [6, 6, 6]
    assert len(outs["bystander"].outputs[0].token_ids) == 6
    wrapped = run_all(draft_engine(ToyModel(seed=2), **OFF), [
        ("low", PROMPT, SamplingParams(temperature=1.0, n=3, seed=-1, max_tokens=6, ignore_eos=True), None)])
    assert [c.token_ids for c in wrapped["low"].outputs] == [c.token_ids for c in outs["top"].outputs]

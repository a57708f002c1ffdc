"""Beam search on a toy model: with a wide enough beam it equals brute-force enumeration, constrained or not, for
every length penalty; narrow beams behave as their definition says."""

import math
import re
import zlib

import numpy as np
import pytest
import torch

from corral.engine.beam_search import BeamSearchParams, beam_search, length_normalized_score
from corral.errors import InvalidRequestError
from corral.fsm.compiler import GrammarCompiler
from corral.fsm.vocabulary import Vocabulary
from corral.grammar.regex_parser import parse_regex

TOKENS = [b"a", b"b", b"ab", b"c", b"<eos>"]
EOS = 4


class ToyModel:
    """Next-token logprobs that are a fixed pseudo-random function of the prefix; counts its calls."""

    def __init__(self, seed: int, sharpness: float = 1.5):
        self.seed, self.sharpness, self.num_calls = seed, sharpness, 0

    def logprobs(self, prefix: tuple[int, ...]) -> torch.Tensor:
        rng = np.random.default_rng([self.seed, zlib.crc32(bytes(prefix)), len(prefix)])
        return torch.log_softmax(torch.tensor(rng.normal(size=len(TOKENS)) * self.sharpness), dim=0)

    def __call__(self, prefixes):
        self.num_calls += 1
        return torch.stack([self.logprobs(tuple(p)) for p in prefixes])


def allowed_ids(guide) -> list[int]:
    row = np.zeros(1, dtype=np.int32)
    guide.fill_mask(row)
    return [t for t in range(len(TOKENS)) if row[0] >> t & 1]


def brute_force(model: ToyModel, max_tokens: int, alpha: float, guide=None):
    """Every hypothesis the search space holds, by depth-first enumeration, scored, best first."""
    out = []

    def visit(prefix, total, guide):
        if len(prefix) == max_tokens:
            out.append((prefix, total, "length"))
            return
        logprobs = model.logprobs(prefix)
        for token_id in allowed_ids(guide) if guide is not None else range(len(TOKENS)):
            value = total + logprobs[token_id].item()
            if token_id == EOS:
                out.append((prefix + (token_id,), value, "stop"))
                continue
            child = guide.copy() if guide is not None else None
            if child is not None and (child.advance(token_id), child.is_finished())[1]:
                out.append((prefix + (token_id,), value, "stop"))
                continue
            visit(prefix + (token_id,), value, child)

    visit((), 0.0, guide)
    scored = [(length_normalized_score(v, len(p), alpha), p, v, r) for p, v, r in out]
    return sorted(scored, key=lambda s: s[0], reverse=True)


def assert_same(hypotheses, expected):
    assert [h.token_ids for h in hypotheses] == [e[1] for e in expected]
    assert [h.finish_reason for h in hypotheses] == [e[3] for e in expected]
    # The search sums float32 logprobs, the oracle float64 ones.
    assert [h.score for h in hypotheses] == pytest.approx([e[0] for e in expected], abs=1e-5)
    assert [h.cumulative_logprob for h in hypotheses] == pytest.approx([e[2] for e in expected], abs=1e-5)


@pytest.mark.parametrize("alpha", [0.0, 1.0, 2.5, -0.5])
@pytest.mark.parametrize("seed", [0, 1])
def test_wide_beam_equals_brute_force(alpha, seed):
    model, max_tokens = ToyModel(seed), 4
    expected = brute_force(model, max_tokens, alpha)
    assert len(expected) == 4**4 + (1 + 4 + 16 + 64)
    params = BeamSearchParams(beam_width=len(expected), max_tokens=max_tokens, length_penalty=alpha)
    assert_same(beam_search(model, params, eos_token_ids=[EOS]), expected)


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(Vocabulary.from_token_bytes(TOKENS, eos_token_ids=[EOS]))


@pytest.mark.parametrize("pattern", ["a[bc]{0,3}", "(ab|c)+", "[abc]*c"])
@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_constrained_wide_beam_equals_brute_force_over_the_grammar(compiler, pattern, alpha):
    root = compiler.compile_node(parse_regex(pattern)).new_guide()
    model, max_tokens = ToyModel(seed=len(pattern), sharpness=2.0), 5
    expected = brute_force(model, max_tokens, alpha, root)
    params = BeamSearchParams(beam_width=len(expected), max_tokens=max_tokens, length_penalty=alpha)
    hypotheses = beam_search(model, params, eos_token_ids=[EOS], guide=root)
    assert_same(hypotheses, expected)
    assert root.states == [0], "the caller's guide must be left untouched"
    texts = {b"".join(TOKENS[t] for t in h.token_ids if t != EOS).decode() for h in hypotheses
             if h.finish_reason == "stop"}
    assert texts and all(re.fullmatch(pattern, text) for text in texts)


def test_width_one_is_greedy_without_length_penalty():
    model = ToyModel(seed=3, sharpness=1.0)
    prefix = ()
    while len(prefix) < 8 and (not prefix or prefix[-1] != EOS):
        prefix += (int(torch.argmax(model.logprobs(prefix))),)
    params = BeamSearchParams(beam_width=1, max_tokens=8, length_penalty=0.0)
    (best,) = beam_search(model, params, eos_token_ids=[EOS])
    assert best.token_ids == prefix


class TableModel:
    """Next-token probabilities from a table keyed by prefix; unlisted prefixes put 0.9 on EOS."""

    def __init__(self, table):
        self.table, self.num_calls = table, 0

    def __call__(self, prefixes):
        self.num_calls += 1
        rows = []
        for prefix in prefixes:
            probs = self.table.get(tuple(prefix), {EOS: 0.9, 0: 0.04, 1: 0.03, 2: 0.02, 3: 0.01})
            rows.append([math.log(probs[t]) if probs.get(t) else -math.inf for t in range(len(TOKENS))])
        return torch.tensor(rows)


def test_a_second_beam_finds_what_greedy_misses():
    # Greedy takes "a" (0.55), then "a" (0.36) and EOS: 0.198 in all; "b" then EOS is 0.45 * 0.9.
    table = {(): {0: 0.55, 1: 0.45}, (0,): {EOS: 0.3, 0: 0.36, 1: 0.34}, (1,): {EOS: 0.9, 0: 0.1},
             (0, 0): {EOS: 1.0}, (0, 1): {EOS: 1.0}}
    params = BeamSearchParams(beam_width=1, max_tokens=4, length_penalty=0.0)
    assert beam_search(TableModel(table), params, eos_token_ids=[EOS])[0].token_ids == (0, 0, EOS)
    params = BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=0.0)
    best = beam_search(TableModel(table), params, eos_token_ids=[EOS])[0]
    assert best.token_ids == (1, EOS) and best.cumulative_logprob == pytest.approx(math.log(0.45 * 0.9))


def test_early_stopping_ends_once_beam_width_hypotheses_finish():
    table = {(): {0: 0.5, 1: 0.3, EOS: 0.2}}
    early = TableModel(table)
    hypotheses = beam_search(early, BeamSearchParams(beam_width=2, max_tokens=10, early_stopping=True),
                             eos_token_ids=[EOS])
    # Step 1 finishes (EOS); step 2 finishes "a EOS" and "b EOS": two finished, stop after two calls.
    assert early.num_calls == 2 and len(hypotheses) == 2
    exact = TableModel(table)
    beam_search(exact, BeamSearchParams(beam_width=2, max_tokens=10, early_stopping=False), eos_token_ids=[EOS])
    assert exact.num_calls > early.num_calls


def test_params_are_checked():
    with pytest.raises(InvalidRequestError, match="beam_width") as info:
        BeamSearchParams(beam_width=0)
    assert info.value.param == "beam_width"
    with pytest.raises(InvalidRequestError, match="length_penalty"):
        BeamSearchParams(length_penalty=float("inf"))


class _Limited:
    """A guide stand-in whose advance meets a limit on the tokens in ``refused`` (its mask allowed them)."""

    def __init__(self, refused):
        self.refused, self.error = set(refused), None

    def copy(self):
        return _Limited(self.refused)

    def advance(self, token_id):
        if token_id in self.refused:
            self.error = "the grammar's automaton reached its cap of 8 states"
            return False
        return True

    def is_finished(self):
        return False


def test_beams_that_meet_a_limit_never_push_out_results_or_end_the_search():
    """Width 2: beam 0's two best tokens both meet a limit, beam 1's two go on. The beam gives one error, which
    neither takes a live slot nor counts toward stopping; results come first, errors only fill what they leave."""
    from corral.engine.beam_search import _hypothesis, select_extensions, with_errors
    params = BeamSearchParams(beam_width=2, max_tokens=8, length_penalty=0.0)
    logprobs = torch.log(torch.tensor([[0.5, 0.4, 0.05, 0.05], [0.5, 0.3, 0.1, 0.1]]))
    chosen = select_extensions([-0.1, -0.2], [_Limited({0, 1}), _Limited(())], logprobs, params, frozenset())
    errors = [e for e in chosen if e.error]
    live = [e for e in chosen if not e.is_finished]
    assert len(errors) == 1 and errors[0].beam == 0 and "cap of 8 states" in errors[0].error
    assert [(e.beam, e.token_id) for e in live] == [(1, 0), (1, 1)]
    done = [_hypothesis((5,), -1.5, params, "stop")]
    error = _hypothesis((0,), -0.1, params, "error", "cap")
    assert with_errors(done, [error], params) == done + [error]  # the result first, though the error scores more
    assert with_errors(done * 2, [error], params) == done * 2
    assert [h.finish_reason for h in with_errors([], [error, error], params)] == ["error", "error"]

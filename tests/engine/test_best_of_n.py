"""Best-of-N: the selection rule on hand-made candidates, and on the real model the default scorer never returns
a lower-scored candidate than one it drew."""

import math
import re

import pytest

from corral.engine.best_of_n import best_of_n, mean_token_logprob, score_candidates, select_best
from corral.engine.outputs import CompletionOutput
from corral.engine.sampling_params import SamplingParams
from corral.errors import InvalidRequestError


def completion(index, token_ids, cumulative, reason="stop", text=""):
    return CompletionOutput(index, token_ids, text, reason, None, None, cumulative)


def test_default_score_is_the_mean_token_logprob():
    assert mean_token_logprob(completion(0, [5, 6, 7, 2], -2.0)) == -0.5
    assert mean_token_logprob(completion(0, [], 0.0)) == -math.inf


def test_selection_takes_the_highest_score_and_the_first_among_equals():
    drawn = [completion(0, [1, 2], -3.0), completion(1, [1, 2, 3, 4], -4.0), completion(2, [9], -1.0),
             completion(3, [8, 8, 8, 8], -4.0)]
    scored = score_candidates(drawn)
    assert [c.score for c in scored] == [-1.5, -1.0, -1.0, -1.0]
    assert select_best(scored).completion.index == 1


def test_errors_and_nan_rank_below_everything():
    drawn = [completion(0, [1], -100.0), completion(1, [1], 0.0, reason="error"), completion(2, [1], -0.1)]
    scored = score_candidates(drawn, scorer=lambda c: math.nan if c.index == 2 else c.cumulative_logprob)
    assert [c.score for c in scored] == [-100.0, -math.inf, -math.inf]
    assert select_best(scored).completion.index == 0


def test_a_verifier_returning_bool_is_a_scorer():
    drawn = [completion(i, [1], -float(i), text=t) for i, t in enumerate(["12", "x", "42", "y"])]
    best = select_best(score_candidates(drawn, scorer=lambda c: c.text.isdigit() and int(c.text) % 7 == 0))
    assert best.completion.text == "42" and best.score == 1.0


@pytest.fixture(scope="module")
def engine():
    from corral.engine.config import EngineConfig
    from corral.engine.llm_engine import LLMEngine
    return LLMEngine(EngineConfig(num_kv_blocks=256, max_num_seqs=16))


def chat(engine, text: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_real_model_best_is_never_below_a_drawn_candidate(engine):
    params = SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=1234, logprobs=0)
    result = best_of_n(engine, chat(engine, "Name a color."), params, return_candidates=True)
    scores = [c.score for c in result.candidates]
    assert len(result.candidates) == 4 and all(math.isfinite(s) for s in scores)
    assert result.score == max(scores) and result.best in [c.completion for c in result.candidates]
    for candidate in result.candidates:  # the score is the mean of the logprobs the engine reported
        per_token = [logprob for logprob, _ in candidate.completion.logprobs]
        assert candidate.score == pytest.approx(sum(per_token) / len(per_token), abs=1e-6)
    assert len({tuple(c.completion.token_ids) for c in result.candidates}) > 1, "four identical samples"


def test_real_model_constrained_candidates_all_match_and_a_custom_scorer_wins(engine):
    from corral.fsm.compiler import GrammarCompiler
    from corral.grammar.constraint import Constraint
    guide = GrammarCompiler(engine.vocabulary).compile(Constraint("regex", "[0-9]{1,3}")).new_guide()
    params = SamplingParams(n=4, temperature=1.2, max_tokens=4, seed=7)
    result = best_of_n(engine, chat(engine, "Pick a number."), params, guide=guide,
                       scorer=lambda c: int(c.text), return_candidates=True)
    texts = [c.completion.text for c in result.candidates]
    assert all(re.fullmatch("[0-9]{1,3}", t) for t in texts), texts
    assert result.best.text == max(texts, key=int) and result.score == max(int(t) for t in texts)


def test_best_of_one_is_refused(engine):
    with pytest.raises(InvalidRequestError, match="n >= 2") as info:
        best_of_n(engine, "x", SamplingParams(n=1))
    assert info.value.param == "n"


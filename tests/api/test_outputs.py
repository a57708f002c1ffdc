"""Choice selection (Best-of-N, self-consistency) and the logprob/usage wire pieces, on hand-made outputs."""

import pytest

from corral.api.outputs import TokenLogprobRow, logprob_rows, select_choices, usage
from corral.engine.outputs import CompletionOutput
from corral.schemas.prepare import Strategy


def out(index, text, cumulative, num_tokens=4, reason="stop"):
    return CompletionOutput(index, list(range(num_tokens)), text, reason, cumulative_logprob=cumulative)


def test_best_of_keeps_the_n_best_by_mean_token_logprob_and_errors_last():
    outputs = [out(0, "a", -4.0), out(1, "b", -2.0, num_tokens=1), out(2, "c", -1.0, reason="error"),
               out(3, "d", -4.0, num_tokens=8)]
    # means: a -1.0, b -2.0, c error (-inf), d -0.5
    assert [o.text for o in select_choices(Strategy("best_of", 4), outputs, 2)] == ["d", "a"]
    assert [o.text for o in select_choices(Strategy("best_of", 4), outputs, 4)] == ["d", "a", "b", "c"]


def test_beam_search_returns_the_n_best_of_its_beams():
    """best_of=4 with n=2 searches 4 beams and returns the 2 best (they come best first), as vLLM's does; the
    completions endpoint numbers the choices of each prompt from prompt * n, so more would collide."""
    outputs = [out(i, t, -float(i)) for i, t in enumerate("wxyz")]
    assert [o.text for o in select_choices(Strategy("beam_search", 4), outputs[::-1], 2)] == ["w", "x"]
    assert [o.text for o in select_choices(Strategy("beam_search", 4), outputs, 4)] == ["w", "x", "y", "z"]


def test_self_consistency_votes_on_json_values_at_the_pointer():
    texts = ['{"answer": 4, "why": "x"}', '{"answer": 5}', '{"why": "y", "answer": 4.0}', '{"answer": 5}',
             '{"answer": 4}']
    outputs = [out(i, t, -1.0) for i, t in enumerate(texts)]
    (winner,) = select_choices(Strategy("self_consistency", 5, pointer="/answer"), outputs, 1)
    assert winner.index == 0  # 4, 4.0 and 4 are one answer; the first drawn speaks for it
    (whole,) = select_choices(Strategy("self_consistency", 5), outputs, 1)
    assert whole.index == 1  # on whole documents only {"answer": 5} repeats


def test_self_consistency_on_text_and_ignoring_truncated_samples():
    outputs = [out(0, "no", 0), out(1, "yes", 0), out(2, " yes", 0), out(3, "no", 0, reason="length"),
               out(4, "no", 0, reason="length")]
    assert select_choices(Strategy("self_consistency", 5), outputs, 1)[0].index == 1


def test_sample_returns_every_output_in_index_order():
    outputs = [out(1, "b", 0), out(0, "a", 0)]
    assert [o.index for o in select_choices(Strategy("sample", 2), outputs, 2)] == [0, 1]


def test_logprob_rows_read_the_engine_format():
    completion = CompletionOutput(0, [7, 9], "xy", "stop", logprobs=[(-0.1, [(7, -0.1), (3, -2.5)]), (-0.7, None)])
    assert logprob_rows(completion) == [TokenLogprobRow(7, -0.1, [(7, -0.1), (3, -2.5)]),
                                        TokenLogprobRow(9, -0.7, [])]
    assert logprob_rows(CompletionOutput(0, [1], "z")) == []


def test_logprobs_that_are_not_finite_go_on_the_wire_as_the_floor():
    """A NaN or +inf in the model's logits makes a row's normalizer infinite; JSON cannot carry what follows."""
    import json

    from corral.api.outputs import LOGPROB_FLOOR, chat_logprobs, completion_logprobs
    from corral.fsm.vocabulary import Vocabulary

    nan, inf = float("nan"), float("inf")
    completion = CompletionOutput(0, [0, 1, 2], "abc", "stop", logprobs=[(nan, [(0, nan), (1, -inf)]), -inf,
                                                                         {2: -0.5, 1: inf}])
    rows = logprob_rows(completion)
    assert [row.logprob for row in rows] == [LOGPROB_FLOOR, LOGPROB_FLOOR, -0.5]
    assert rows[0].top == [(0, LOGPROB_FLOOR), (1, LOGPROB_FLOOR)] and rows[2].top == [(2, -0.5), (1, LOGPROB_FLOOR)]
    vocab = Vocabulary.from_token_bytes([b"a", b"b", b"c", b"<eos>"], eos_token_ids=[3])
    for wire in (chat_logprobs(vocab, rows, 2), completion_logprobs(vocab, rows, 2, 0)):
        json.dumps(wire.model_dump(mode="json"), allow_nan=False)  # raises on a NaN or infinity, as the server's


@pytest.mark.parametrize("prompt, completion, cached", [(10, 5, 0), (7, 0, 7)])
def test_usage_adds_up(prompt, completion, cached):
    u = usage(prompt, completion, cached)
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens, u.prompt_tokens_details.cached_tokens) == (
        prompt, completion, prompt + completion, cached)

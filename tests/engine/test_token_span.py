"""TokenSpan: a sequence's prompt or output (and a draft after it) read in place reads as the copy it replaces."""

import random

import pytest

from corral.engine.sampling_params import SamplingParams
from corral.engine.sequence import Sequence, TokenSpan


@pytest.mark.parametrize("seed", range(50))
def test_a_span_reads_as_the_slice_and_tail_it_stands_for(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(1000) for _ in range(rng.randrange(12))]
    start = rng.randrange(len(tokens) + 1)
    stop = rng.randrange(start, len(tokens) + 1)
    tail = tuple(rng.randrange(1000) for _ in range(rng.randrange(4)))
    span, copy = TokenSpan(tokens, start, stop, tail), tokens[start:stop] + list(tail)
    assert len(span) == len(copy) and list(span) == copy and [*span] == copy
    for index in range(-len(copy), len(copy)):
        assert span[index] == copy[index]
    for index in (len(copy), -len(copy) - 1):
        with pytest.raises(IndexError):
            span[index]
    assert span[1:-1] == copy[1:-1] and span[::2] == copy[::2]
    assert (3 in span) == (3 in copy) and span.count(copy[0] if copy else 0) == copy.count(copy[0] if copy else 0)


def test_a_sequences_spans_are_its_prompt_and_output_and_do_not_follow_later_tokens():
    seq = Sequence("r", [1, 2, 3], SamplingParams())
    seq.append_token(7)
    seq.append_token(8)
    prompt, output = seq.spans()
    assert list(prompt) == seq.prompt_token_ids == [1, 2, 3] and list(output) == seq.output_token_ids == [7, 8]
    seq.append_token(9)
    assert list(output) == [7, 8]  # the step's view: a token appended afterwards is not in it
    assert list(seq.spans([4, 5])[1]) == [7, 8, 9, 4, 5]

"""SamplingParams: ranges are checked with the parameter named, containers are normalised to hashable tuples."""

import pytest

from corral.engine.sampling_params import SamplingParams, make_logit_bias
from corral.errors import InvalidRequestError


@pytest.mark.parametrize("kwargs,param,message", [
    (dict(n=0), "n", "n must be an integer >= 1"),
    (dict(n=True), "n", "n must be an integer"),
    (dict(temperature=-0.1), "temperature", ">= 0"),
    (dict(temperature=float("nan")), "temperature", "finite"),
    (dict(top_p=0.0), "top_p", r"\(0, 1\]"),
    (dict(top_p=1.5), "top_p", r"\(0, 1\]"),
    (dict(top_k=-1), "top_k", "0 turns it off"),
    (dict(min_p=1.1), "min_p", r"\[0, 1\]"),
    (dict(seed=1.5), "seed", "integer"),
    (dict(max_tokens=0), "max_tokens", ">= 1"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens", r"max_tokens=4"),
    (dict(stop=("",)), "stop", "non-empty"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids", ">= 0"),
    (dict(logit_bias={7: 100.5}), "logit_bias", r"\(7, 100.5\)"),
    (dict(logit_bias=((1, 1.0), (1, 2.0))), "logit_bias", "twice"),
    (dict(logit_bias={"x": 1}), "logit_bias", "token ids"),
    (dict(repetition_penalty=0.0), "repetition_penalty", r"\[0.01, 100\]"),
    (dict(repetition_penalty=1e6), "repetition_penalty", r"\[0.01, 100\]"),  # it would overflow logits to inf
    (dict(frequency_penalty=2.5), "frequency_penalty", r"\[-2, 2\]"),
    (dict(presence_penalty=-3), "presence_penalty", r"\[-2, 2\]"),
    (dict(logprobs=21), "logprobs", r"\[0, 20\]"),
    (dict(output_kind="deltas"), "output_kind", "cumulative, delta, final"),
])
def test_out_of_range_names_the_parameter(kwargs, param, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_containers_become_hashable_tuples():
    params = SamplingParams(stop="END", stop_token_ids=[5, 3], logit_bias={"12": 3, 4: -1.5})
    assert params.stop == ("END",)
    assert params.stop_token_ids == (5, 3)
    assert params.logit_bias == ((4, -1.5), (12, 3.0))
    assert params == SamplingParams(stop=["END"], stop_token_ids=(5, 3), logit_bias=make_logit_bias({12: 3, 4: -1.5}))
    assert len({params, SamplingParams(stop=("END",), stop_token_ids=(5, 3), logit_bias=((4, -1.5), (12, 3.0)))}) == 1


def test_defaults_and_derived_flags():
    assert SamplingParams().is_greedy is False and SamplingParams(temperature=0).is_greedy
    assert not SamplingParams().has_penalties
    assert SamplingParams(presence_penalty=0.5).has_penalties
    assert SamplingParams(repetition_penalty=1.2).has_penalties
    assert make_logit_bias(None) == ()

"""Self-consistency: exact votes over hand-made samples, normalisation, pointers checked against the schema, and
one real-model run whose votes must agree with its own samples."""

import pytest

from corral.engine.sampling_params import SamplingParams
from corral.engine.self_consistency import (check_pointer, majority_vote, normalize_answer, resolve_pointer,
                                            self_consistency)
from corral.errors import InvalidRequestError

SCHEMA = {"type": "object", "properties": {"reasoning": {"type": "string", "maxLength": 40},
                                           "answer": {"type": "integer"}},
          "required": ["reasoning", "answer"]}


@pytest.mark.parametrize("value,expected", [
    ("  Forty   Two ", "forty two"), ("42", 42), (" 4.0 ", 4), (42.0, 42), (0.1 + 0.2, 0.3), (True, True),
    (1, 1), (None, None), ("nan", "nan"), ({"b": 1, "a": [2.0]}, '{"a":[2.0],"b":1}'), ("", ""),
])
def test_normalisation(value, expected):
    assert normalize_answer(value) == expected
    assert type(normalize_answer(value)) is type(expected)


def test_votes_count_normalised_answers_and_abstentions():
    texts = ['{"answer": 42}', '{"answer": "42"}', '{"answer": 41.0}', "not json", '{"other": 1}',
             '{"answer": 41}', '{"answer": 42.0}']
    result = majority_vote(texts, "/answer")
    assert result.answer == 42 and result.votes == {42: 3, 41: 2}
    assert result.agreement == 3 / 7 and result.num_samples == 7 and result.num_abstained == 2
    assert result.answers == [42, 42, 41, None, None, 41, 42]


def test_a_tie_goes_to_the_answer_drawn_first():
    result = majority_vote(['{"a": "no"}', '{"a": "Yes"}', '{"a": "yes "}', '{"a": "NO"}'], "/a")
    assert result.answer == "no" and result.votes == {"no": 2, "yes": 2} and result.agreement == 0.5


def test_all_abstaining_gives_no_answer():
    result = majority_vote(["{}", "[]"], "/answer")
    assert result.answer is None and result.votes == {} and result.agreement == 0.0 and result.num_abstained == 2


def test_pointer_escapes_and_indices():
    document = {"a/b": {"m~n": [10, {"x": 3}]}}
    assert resolve_pointer(document, "/a~1b/m~0n/1/x") == 3
    assert majority_vote(['{"a/b": {"m~n": [7]}}'], "/a~1b/m~0n/0").answer == 7
    assert majority_vote(['{"list": [1]}'], "/list/5").answer is None


def test_pointer_must_name_what_the_schema_declares():
    check_pointer(SCHEMA, "/answer")
    check_pointer({"type": "array", "items": {"type": "object", "properties": {"v": {}}}}, "/3/v")
    check_pointer({"$ref": "#/$defs/x"}, "/anything")  # a $ref on the way ends the check
    with pytest.raises(InvalidRequestError, match="declares no 'answr' under '/'") as info:
        check_pointer(SCHEMA, "/answr")
    assert info.value.param == "pointer"
    with pytest.raises(InvalidRequestError, match="starts with '/'"):
        check_pointer(SCHEMA, "answer")


def test_low_temperature_and_single_samples_are_refused():
    with pytest.raises(InvalidRequestError, match="temperature >= 0.7") as info:
        self_consistency(None, None, "p", SCHEMA, params=SamplingParams(n=4, temperature=0.5))
    assert info.value.param == "temperature"
    with pytest.raises(InvalidRequestError, match="n >= 2"):
        self_consistency(None, None, "p", SCHEMA, params=SamplingParams(n=1, temperature=1.0))


def test_real_model_votes_agree_with_the_samples():
    from corral.engine.config import EngineConfig
    from corral.engine.llm_engine import LLMEngine
    from corral.fsm.compiler import GrammarCompiler
    engine = LLMEngine(EngineConfig(num_kv_blocks=256, max_num_seqs=16))
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 + 4? Answer in JSON."}])
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    params = SamplingParams(n=4, temperature=0.8, max_tokens=12, seed=5)
    result = self_consistency(engine, GrammarCompiler(engine.vocabulary), prompt, schema, params=params)
    assert result.num_samples == 4 and len(result.answers) == 4
    samples = [a for a in result.answers if a is not None]
    assert all(isinstance(a, int) for a in samples)
    assert result.votes == {a: samples.count(a) for a in samples}
    assert list(result.votes.values()) == sorted(result.votes.values(), reverse=True)
    assert result.num_abstained == 4 - len(samples)
    if samples:
        assert result.agreement == result.votes[result.answer] / 4 == max(result.votes.values()) / 4


def test_answers_python_cannot_parse_are_missing_not_errors():
    """A sample nested past Python's parser, or with an integer past its digit limit, has no answer (where the
    RecursionError or ValueError escaped and failed the request with a 500)."""
    from corral.engine.self_consistency import _MISSING, extract_answer
    assert extract_answer("[" * 1200 + "]" * 1200, "") is _MISSING
    assert extract_answer('{"a": ' + "7" * 5000 + "}", "/a") is _MISSING
    assert extract_answer('{"a": 1' + "0" * 400 + "}", "/a") is _MISSING  # float() overflows

"""What a request means for the engine: prompt ids, SamplingParams, output budget, strategy."""

import pytest

from corral.engine.sampling_params import SamplingParams
from corral.errors import InvalidRequestError, PromptTooLongError
from corral.models import load_tokenizer
from corral.schemas.chat import ChatCompletionRequest
from corral.schemas.completions import CompletionRequest
from corral.schemas.limits import RequestLimits
from corral.schemas.prepare import Strategy, prepare_chat, prepare_completion, strategy_of

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=MSG, **body)


def test_chat_prompt_is_the_models_template(tok):
    prepared = prepare_chat(chat(max_tokens=7), tok, max_model_len=2048)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prepared.prompt_token_ids == tok.encode(text)
    assert tok.decode(prepared.prompt_token_ids).endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert prepared.params == SamplingParams(max_tokens=7)
    assert prepared.constraint is None and prepared.strategy == Strategy()


def test_openai_parameters_map_onto_sampling_params(tok):
    req = chat(max_completion_tokens=9, max_tokens=3, temperature=0.0, top_p=0.5, top_k=-1, min_p=0.1, seed=3,
               stop="END", frequency_penalty=0.5, presence_penalty=-0.5, repetition_penalty=1.2,
               logit_bias={"42": -100}, logprobs=True, top_logprobs=4, n=2, min_tokens=2)
    assert prepare_chat(req, tok, max_model_len=2048).params == SamplingParams(
        n=2, temperature=0.0, top_p=0.5, top_k=0, min_p=0.1, seed=3, max_tokens=9, min_tokens=2, stop=("END",),
        logit_bias=((42, -100.0),), repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=-0.5,
        logprobs=4)


def test_output_budget_defaults_to_the_rest_of_the_context(tok):
    num_prompt = len(prepare_chat(chat(max_tokens=1), tok, max_model_len=2048).prompt_token_ids)
    assert prepare_chat(chat(), tok, max_model_len=100).params.max_tokens == 100 - num_prompt
    assert prepare_chat(chat(), tok, max_model_len=100, default_max_tokens=5).params.max_tokens == 5
    with pytest.raises(PromptTooLongError, match=f"maximum context length is 100 tokens. However, you requested "
                                                 f"{num_prompt + 90} tokens \\({num_prompt} in the messages, 90"):
        prepare_chat(chat(max_tokens=90), tok, max_model_len=100)
    with pytest.raises(PromptTooLongError, match=f"your messages resulted in {num_prompt} tokens"):
        prepare_chat(chat(), tok, max_model_len=num_prompt)


def test_logit_bias_past_the_vocabulary_is_refused(tok):
    with pytest.raises(InvalidRequestError, match="token id 49152, past the vocabulary of 49152"):
        prepare_chat(chat(logit_bias={"49152": 1}, max_tokens=1), tok, max_model_len=2048)


@pytest.mark.parametrize("body, param, message", [
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens", r"min_tokens \(5\) must be at most max_tokens \(4\)"),
    ({"max_completion_tokens": 4, "min_tokens": 10**30}, "min_tokens", "must be at most max_tokens"),
    ({"top_logprobs": 3}, "top_logprobs", "top_logprobs needs logprobs set to true"),
    ({"logit_bias": {"1_0": 1}}, "logit_bias", "token ids written in digits"),
    ({"logit_bias": {" 7 ": 1}}, "logit_bias", "token ids written in digits"),
    ({"logit_bias": {"\u0665": 1}}, "logit_bias", "token ids written in digits"),  # an Arabic-Indic five
    ({"self_consistency": 3, "self_consistency_pointer": "/a~2"}, "self_consistency_pointer", "'~' as '~0'"),
    ({"self_consistency": 3, "self_consistency_pointer": "/a~"}, "self_consistency_pointer", "'~' as '~0'"),
    ({"self_consistency": 3, "self_consistency_pointer": "a"}, "self_consistency_pointer", "starts with '/'"),
])
def test_values_that_would_be_silently_changed_are_refused(tok, body, param, message):
    """Each of these was taken and quietly changed (min_tokens cut to max_tokens, top_logprobs dropped, a bias
    key read by int() in any script or with underscores, a pointer escape read as text)."""
    with pytest.raises(InvalidRequestError, match=message) as info:
        prepare_chat(chat(**{"max_tokens": 8, **body}), tok, max_model_len=2048)
    assert info.value.param == param
    prepare_chat(chat(min_tokens=10**6), tok, max_model_len=2048)  # no max_tokens: the context caps min_tokens


def test_duplicate_tool_names_and_boolean_token_ids_are_refused(tok):
    from pydantic import ValidationError

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    other = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    with pytest.raises(InvalidRequestError, match=r"tools\[1\] is named 'f', as tools\[0\] is") as info:
        prepare_chat(chat(tools=[tool, other], max_tokens=4), tok, max_model_len=2048)
    assert info.value.param == "tools[1].function.name"
    with pytest.raises(ValidationError):
        CompletionRequest(model="m", prompt=[True, False])
    with pytest.raises(ValidationError):
        CompletionRequest(model="m", prompt=[[1, 2], [True]])


@pytest.mark.parametrize("body, expected", [
    ({"n": 2}, Strategy("sample", 2)),
    ({"n": 2, "best_of": 5}, Strategy("best_of", 5)),
    ({"best_of": 1}, Strategy("sample", 1)),
    ({"self_consistency": 7}, Strategy("self_consistency", 7)),
    ({"self_consistency": 7, "self_consistency_pointer": "/a"}, Strategy("self_consistency", 7, pointer="/a")),
    ({"use_beam_search": True, "best_of": 4, "length_penalty": 0.5}, Strategy("beam_search", 4, 0.5)),
])
def test_strategy(body, expected):
    assert strategy_of(chat(**body)) == expected


@pytest.mark.parametrize("body, message", [
    ({"n": 3, "best_of": 2}, r"best_of \(2\) must be >= n \(3\)"),
    ({"self_consistency": 3, "n": 2}, "self_consistency returns one answer; n must be 1"),
    ({"self_consistency": 3, "best_of": 4}, "'best_of' and 'self_consistency' cannot be combined"),
    ({"best_of": 4, "stream": True}, "'best_of' cannot be streamed"),
])
def test_strategy_errors(body, message):
    with pytest.raises(InvalidRequestError, match=message):
        strategy_of(chat(**body))


def test_best_of_draws_best_of_samples(tok):
    prepared = prepare_chat(chat(best_of=3, max_tokens=4), tok, max_model_len=2048)
    assert (prepared.params.n, prepared.params.logprobs) == (3, None)


def test_self_consistency_pointer_must_exist_in_the_schema(tok):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}}
    body = {"self_consistency": 3, "guided_json": schema, "max_tokens": 4}
    assert prepare_chat(chat(**body, self_consistency_pointer="/answer"), tok,
                        max_model_len=2048).strategy == Strategy("self_consistency", 3, pointer="/answer")
    with pytest.raises(InvalidRequestError, match="declares no 'reply' under '/'"):
        prepare_chat(chat(**body, self_consistency_pointer="/reply"), tok, max_model_len=2048)


def test_completion_prompts_in_every_shape(tok):
    ids = tok.encode("Hello")
    shapes = {"Hello": [ids], "ids": [ids], "batch": [ids, ids]}
    for prompt, expected in (("Hello", shapes["Hello"]), (ids, shapes["ids"]), ([ids, ids], shapes["batch"])):
        batch = prepare_completion(CompletionRequest(model="m", prompt=prompt, max_tokens=2), tok, max_model_len=64)
        assert [p.prompt_token_ids for p in batch] == expected
    with pytest.raises(InvalidRequestError, match=r"prompt token ids must be in \[0, 49152\)"):
        prepare_completion(CompletionRequest(model="m", prompt=[1, 99999]), tok, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="'suffix' is not supported"):
        prepare_completion(CompletionRequest(model="m", prompt="a", suffix="b"), tok, max_model_len=64)


LIMITS = RequestLimits(max_messages=2, max_prompts=2, max_sequences=8, max_stop=2, max_stop_chars=4,
                       max_stop_token_ids=2, max_logit_bias=2)


@pytest.mark.parametrize("body, param, message", [
    ({"messages": MSG * 3}, "messages", "at most 2 messages are allowed, this request has 3"),
    ({"n": 9}, "n", "would run 9 sequences at once"),
    ({"use_beam_search": True, "best_of": 9}, "n", "would run 9 sequences at once"),
    ({"stop": ["a", "b", "c"]}, "stop", "at most 2 stop sequences"),
    ({"stop": "toolong"}, "stop", "at most 4 characters"),
    ({"stop_token_ids": [1, 2, 3]}, "stop_token_ids", "at most 2 ids"),
    ({"logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias", "at most 2 entries"),
])
def test_chat_limits_name_the_parameter(tok, body, param, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        prepare_chat(ChatCompletionRequest(model="m", **{"messages": MSG, **body}), tok, max_model_len=2048,
                     limits=LIMITS)
    assert info.value.param == param


def test_completion_limits_count_prompts_and_their_sequences(tok):
    with pytest.raises(InvalidRequestError, match="at most 2 prompts") as info:
        prepare_completion(CompletionRequest(model="m", prompt=["a", "b", "c"]), tok, max_model_len=2048,
                           limits=LIMITS)
    assert info.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match=r"9 sequences at once \(1 prompts x 9 per prompt\)"):
        prepare_completion(CompletionRequest(model="m", prompt="a", n=9), tok, max_model_len=2048, limits=LIMITS)
    assert len(prepare_completion(CompletionRequest(model="m", prompt=["a", "b"], n=4), tok, max_model_len=2048,
                                  limits=LIMITS)) == 2

"""A step that raises fails the requests in flight with a 500 and frees them; the server keeps serving."""

import openai
import pytest

from corral.fsm.vocabulary import Vocabulary
from corral.models import load_tokenizer

from api_fakes import FakeCompiler, FakeEngine
from api_serving import make_context, running_server


class FailOnceEngine(FakeEngine):
    """Raises on its first step, as a failed kernel or an internal assert would."""

    failed = False

    def step(self):
        if not self.failed:
            self.failed = True
            raise RuntimeError("boom in step")
        return super().step()


def test_a_failed_step_fails_its_requests_and_the_server_goes_on():
    tok = load_tokenizer()
    engine = FailOnceEngine(tok, lambda prompt_ids, params: '{"a": 1}')
    ctx = make_context(engine, FakeCompiler(), tok, Vocabulary.from_tokenizer(tok))
    with running_server(ctx) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.InternalServerError, match="boom in step"):
            client.chat.completions.create(model="test-model", messages=messages, max_tokens=20)
        assert not engine.requests and engine.aborted  # its blocks were freed
        again = client.chat.completions.create(model="test-model", messages=messages, max_tokens=20)
        assert again.choices[0].message.content == '{"a": 1}' and again.choices[0].finish_reason == "stop"

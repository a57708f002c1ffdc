"""The native decode step (``corral/csrc/decode_step.cpp``) against the torch path of the same W4A8 model.

Both run the same kernels on the same weights in the same order, so the claim is bit-for-bit: every sampled
token and every logprob of a greedy run equal, for single sequences and for a batch of 16 whose contexts differ
(the step attends over each one's own blocks), with the prefix cache on."""

import pytest
import torch

from corral import native
from corral.engine import EngineConfig, LLMEngine
from corral.kernels.cpu_ops import buffer
from tests.engine.real_model import PROMPTS, chat, greedy

pytestmark = pytest.mark.skipif(native.module() is None, reason="the native module is off or missing")
QUESTIONS = PROMPTS + [f"Name {n} animals that live in the {place}." for n, place in
                       [(2, "sea"), (3, "desert"), (4, "forest"), (5, "mountains"), (2, "arctic"), (3, "jungle"),
                        (4, "river"), (5, "savanna")]]


@pytest.fixture(scope="module")
def engines():
    made = {step: LLMEngine(EngineConfig(quantization="w4a8", dtype="auto", kv_cache_dtype="auto", decode_step=step,
                                         num_kv_blocks=256, num_threads=2)) for step in ("native", "torch")}
    assert made["native"].runner.decode_path == "native" and made["torch"].runner.decode_path == "torch"
    return made


def run(engine, prompts, max_tokens=12):
    outs = engine.generate(prompts, greedy(max_tokens, logprobs=3, ignore_eos=True))
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def test_sixteen_prompts_in_one_batch_are_bit_for_bit_the_torch_path(engines):
    prompts = [chat(engines["native"], q) for q in QUESTIONS]
    assert len(prompts) == 16 and len({len(p) for p in prompts}) > 4  # contexts of different lengths
    assert run(engines["native"], prompts) == run(engines["torch"], prompts)


def test_one_sequence_at_a_time_is_the_torch_path(engines):
    prompts = [chat(engines["native"], f"Count from {n} to {n + 5}.") for n in (3, 40, 700)]
    assert [run(engines["native"], [p])[0] for p in prompts] == [run(engines["torch"], [p])[0] for p in prompts]


def test_bad_buffers_are_refused(engines):
    step = engines["native"].runner.model.native_step
    runner = engines["native"].runner
    one = torch.tensor([1])
    table = torch.zeros(1, 1, dtype=torch.int64)
    with pytest.raises(IndexError, match="outside the vocabulary"):
        step(torch.tensor([10 ** 7]), torch.tensor([0]), one * 0, table, one, runner.whole_kv.k, runner.whole_kv.v)
    with pytest.raises(IndexError, match="slot outside the cache"):
        step(one, torch.tensor([0]), torch.tensor([10 ** 9]), table, one, runner.whole_kv.k, runner.whole_kv.v)
    with pytest.raises(IndexError, match="context length"):
        step(one, torch.tensor([0]), one * 0, table, torch.tensor([17]), runner.whole_kv.k, runner.whole_kv.v)
    with pytest.raises(ValueError, match="k_cache"):
        step(one, torch.tensor([0]), one * 0, table, one, runner.whole_kv.k[:2], runner.whole_kv.v[:2])
    spare = buffer(torch.zeros(1, dtype=torch.int64))  # never read: the spec is checked first
    with pytest.raises(ValueError, match="spec"):
        native.module().decode_step(buffer(torch.zeros(7, dtype=torch.int64)), 1e-5, *([spare] * 13), 1, None, None,
                                    None)
    with pytest.raises(TypeError):  # a buffer that is None where none may be
        native.module().decode_step(buffer(torch.zeros(8, dtype=torch.int64)), 1e-5, *([None] * 13), 1, None, None,
                                    None)


def test_an_int8_kv_cache_is_written_and_read_as_the_torch_path_does():
    made = [LLMEngine(EngineConfig(quantization="w4a8", dtype="auto", kv_cache_dtype="int8", decode_step=step,
                                   num_kv_blocks=64, num_threads=2)) for step in ("native", "torch")]
    assert [e.runner.decode_path for e in made] == ["native", "torch"]
    prompts = [chat(made[0], q) for q in QUESTIONS[:4]]
    assert run(made[0], prompts) == run(made[1], prompts)
    assert torch.equal(made[0].runner.whole_kv.k, made[1].runner.whole_kv.k)  # the same codes
    assert torch.equal(made[0].runner.whole_kv.v_scale, made[1].runner.whole_kv.v_scale)  # and scales


def test_the_switch_is_stated_and_native_is_refused_where_it_cannot_run():
    from corral.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="decode_step 'native' needs quantization w4a8"):
        LLMEngine(EngineConfig(quantization="none", dtype="float32", decode_step="native", num_kv_blocks=16))


def test_a_model_cut_to_its_first_layers_steps_natively_as_its_torch_path(engines):
    """Self-speculation's draft model (``LlamaModel.truncated``): the native step over the first 12 layers' slice
    of the weight buffer, with the final norm after them, is bit for bit the torch path of the same 12 layers."""
    import dataclasses

    from corral.engine.model_runner import ModelRunner

    target = engines["native"]
    cut = target.runner.model.truncated(12)
    assert cut.config.num_layers == 12 and cut.layers[0] is target.runner.model.layers[0]
    outputs = {}
    for step in ("native", "torch"):
        config = dataclasses.replace(target.config, decode_step=step, num_kv_blocks=128, draft_layers=None)
        runner = ModelRunner(config, cut.config, None, model=cut)
        assert runner.decode_path == step
        engine = LLMEngine(config, runner=runner, model_config=cut.config, vocabulary=target.vocabulary,
                           tokenizer=target.tokenizer)
        outputs[step] = run(engine, [chat(target, q) for q in QUESTIONS[:6]])
    assert outputs["native"] == outputs["torch"]
    assert outputs["native"] != run(target, [chat(target, q) for q in QUESTIONS[:6]])  # 12 layers, not 30

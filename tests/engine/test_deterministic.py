"""Deterministic mode (``EngineConfig.deterministic``) on the real W4A8 model: a request's tokens and logprobs are
the same bits whatever the prefix cache holds, however its prompt is cut into chunks, whether it is preempted and
recomputed, and whatever runs beside it (drafts, bursts, the native step or the torch path).

Without it, a prompt's own attention runs in the prompt kernels, over its fresh K/V unrounded and in another order
than a decode's; a later request that finds that prompt in the prefix cache reads the bfloat16 cache instead, and
a last-bit difference can move an int8 rounding of the activations and, layers later, a token (how often:
``bench/deterministic.py`` and the README's Deterministic mode)."""

import pytest

from corral import native
from corral.engine import EngineConfig, LLMEngine, SamplingParams
from corral.errors import InvalidRequestError
from tests.engine.real_model import PROMPTS, chat, greedy

pytestmark = pytest.mark.skipif(native.module() is None, reason="the native module is off or missing")

# a long prompt too: chunked where the batch budget is 64 tokens
LONG = "Summarize this: " + " ".join(f"The river passed mill {i}, and the road crossed it there." for i in range(12))


def deterministic(**overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"quantization": "w4a8", "dtype": "auto", "kv_cache_dtype": "bfloat16",
                                     "num_threads": 2, "deterministic": True, **overrides}))


@pytest.fixture(scope="module")
def reference() -> LLMEngine:
    """One request's arithmetic with nothing to vary it: the torch path, no cache, no draft, no burst."""
    return deterministic(decode_step="torch", enable_prefix_caching=False, jump_forward=False, speculation=False,
                         decode_burst=1, num_kv_blocks=512)


def requests(engine: LLMEngine) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [chat(engine, q) for q in PROMPTS[:6]] + [chat(engine, LONG)]
    params = [greedy(24, logprobs=2, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=1.2, top_p=0.95, seed=i, max_tokens=24, ignore_eos=True, logprobs=0,
                             presence_penalty=0.5 if i == 2 else 0.0)
              for i in range(len(prompts))]
    return prompts, params


def bits(outs) -> list:
    return [[(c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason) for c in o.outputs] for o in outs]


def test_a_prefix_cache_hit_gives_the_same_bits_as_the_first_run(reference):
    engine = deterministic(num_kv_blocks=512)
    prompts, params = requests(engine)
    first = engine.generate(prompts, params)
    again = engine.generate(prompts, params)
    assert all(o.num_cached_tokens >= 16 for o in again)  # every prompt's full blocks came from the cache
    assert bits(again) == bits(first) == bits(reference.generate(prompts, params))


def test_chunks_preemption_drafts_and_bursts_give_the_same_bits(reference):
    # 7 prompts of 30-190 tokens with 24 tokens each, against 20 blocks of 16: recompute is unavoidable; a 64-token
    # budget cuts the long prompt (and others, at the budget's edge) into chunks
    engine = deterministic(num_kv_blocks=20, max_num_batched_tokens=64, decode_burst=4)
    prompts, params = requests(engine)
    assert max(len(p) for p in prompts) > 128
    got = engine.generate(prompts, params)
    assert engine.stats().num_preemptions > 0
    assert engine.runner.decode_path == "native"
    assert bits(got) == bits(reference.generate(prompts, params))
    # one at a time, each alone in its batch (greedy ones in bursts, the long one drafting by prompt lookup)
    assert bits([engine.generate([p], q)[0] for p, q in zip(prompts, params)]) == bits(got)
    stats = engine.stats()
    assert stats.num_burst_steps > 0 and stats.num_draft_tokens > 0


def test_an_int8_cache_is_deterministic_too():
    engine, oracle = (deterministic(kv_cache_dtype="int8", num_kv_blocks=512, enable_prefix_caching=caching,
                                    decode_step=step) for caching, step in ((True, "native"), (False, "torch")))
    prompts, params = requests(engine)
    engine.generate(prompts, params)  # fills the prefix cache
    again = engine.generate(prompts, params)
    assert all(o.num_cached_tokens >= 16 for o in again)
    assert bits(again) == bits(oracle.generate(prompts, params))


@pytest.mark.parametrize("quantization", ["none", "w4a16"])
def test_products_that_may_change_with_the_row_count_are_refused(quantization):
    with pytest.raises(InvalidRequestError, match="deterministic needs quantization w4a8") as refused:
        LLMEngine(EngineConfig(quantization=quantization, dtype="float32", deterministic=True))
    assert refused.value.param == "deterministic"


def test_the_server_and_the_command_line_say_so(capsys, tmp_path):
    from corral import cli
    from corral.api.launch import build_context

    args = cli.parser().parse_args(["serve", "--deterministic"])
    assert cli._formats(args)["deterministic"] is True
    assert cli._formats(cli.parser().parse_args(["serve"]))["deterministic"] is False
    assert cli.main(["serve", "--quantization", "none", "--deterministic"]) == 2  # refused before it serves
    assert "corral: deterministic needs quantization w4a8" in capsys.readouterr().err
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "boolean"}')
    assert cli.main(["generate", "--schema", str(schema), "--quantization", "none", "--deterministic", "Yes?"]) == 1
    assert "corral: deterministic needs quantization w4a8" in capsys.readouterr().err
    ctx = build_context(deterministic(num_kv_blocks=64))
    assert ctx.config.deterministic is True
    assert ctx.config.system_fingerprint.endswith("-deterministic")  # its prompts' numerics are not the default's
    assert 'deterministic="true"' in ctx.metrics.render(0, 0)

"""Beam search on the real model through the engine: width 1 is the engine's own greedy decoding, and constrained
beams are the grammar's best strings in the order the engine's constrained greedy decoding finds them."""

import pytest

from corral.engine.beam_search import BeamSearchParams, beam_search_engine
from corral.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine():
    from corral.engine.config import EngineConfig
    from corral.engine.llm_engine import LLMEngine
    return LLMEngine(EngineConfig(num_kv_blocks=256, max_num_seqs=16))


def chat(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def test_width_one_without_length_penalty_is_greedy(engine):
    prompt = chat(engine, "Say something about the sea.")
    (greedy,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=3))
    (best,) = beam_search_engine(engine, prompt, BeamSearchParams(beam_width=1, max_tokens=3, length_penalty=0))
    assert list(best.token_ids) == greedy.outputs[0].token_ids
    assert best.cumulative_logprob == pytest.approx(greedy.outputs[0].cumulative_logprob, abs=1e-4)


def test_constrained_beams_are_the_grammars_best_strings(engine):
    from corral.fsm.compiler import GrammarCompiler
    from corral.grammar.constraint import Constraint
    compiler = GrammarCompiler(engine.vocabulary)
    prompt = chat(engine, "Pick a digit between 0 and 9.")
    hits_before = engine.stats().prefix_cache_hits
    guide = compiler.compile(Constraint("regex", "[0-9]")).new_guide()
    hypotheses = beam_search_engine(engine, prompt, BeamSearchParams(beam_width=3, max_tokens=4), guide=guide)
    assert engine.stats().prefix_cache_hits > hits_before, "beam requests should reuse the prompt's cached blocks"
    # Oracle: the engine's own constrained greedy decoding, each time leaving out the digits already found.
    expected, digits = [], "0123456789"
    for _ in range(3):
        allowed = "".join(d for d in digits if d not in expected)
        regex_guide = compiler.compile(Constraint("regex", f"[{allowed}]")).new_guide()
        (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=2), [regex_guide])
        expected.append(out.outputs[0].text)
        assert len(out.outputs[0].token_ids) == 1  # a digit is one token, and the grammar then finishes
        if len(expected) == 1:
            best_logprob = out.outputs[0].cumulative_logprob
    assert [engine.tokenizer.decode(list(h.token_ids)) for h in hypotheses] == expected
    assert [h.finish_reason for h in hypotheses] == ["stop"] * 3
    assert hypotheses[0].cumulative_logprob == pytest.approx(best_logprob, abs=1e-4)

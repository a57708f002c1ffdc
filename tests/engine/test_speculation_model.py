"""Drafts on the real model, in the format ``make serve`` runs (``auto``): greedy outputs are token-identical with
jump-forward and prompt lookup on and off, alone and in one batch, over 10 MaskBench dev schemas, 5 free-text
prompts and 5 regex/choice constraints at 32 tokens (``bench/speculation.py --check`` runs the full set). The
check is exact because the native decode step computes each row the same way whatever else is in the batch."""

import gzip
import json
import os

import pytest

from corral.engine import EngineConfig, LLMEngine, SamplingParams
from corral.errors import CorralError
from corral.fsm.compiler import GrammarCompiler
from corral.grammar.constraint import Constraint

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "maskbench-dev.jsonl.gz")
FREE = ["Tell a story about a lighthouse keeper.", "Explain how a bicycle stays upright.",
        "List five uses for a paperclip.", "Describe the water cycle.", "Write a limerick about a cat."]
CONSTRAINTS = [(Constraint("regex", r"\d{3}-\d{3}-\d{4}"), "Give a phone number."),
               (Constraint("regex", r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"), "Give a date."),
               (Constraint("regex", r"[a-z]+@[a-z]+\.(com|org)"), "Give an email address."),
               (Constraint("choice", ["positive", "negative", "neutral"]), "Sentiment of 'I loved it'?"),
               (Constraint("choice", ["January", "February", "March", "April"]), "Which month follows March?")]


def dev_schemas(num: int) -> list[dict]:
    with gzip.open(DATA, "rt") as f:
        entries = [json.loads(line) for line in f]
    step = len(entries) // num
    return [entries[k * step]["schema"] for k in range(num)]


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(dtype="auto", quantization="auto", kv_cache_dtype="auto", num_kv_blocks=1024))


@pytest.mark.skipif(not os.path.exists(DATA), reason="the MaskBench dev set is not present next to the repository")
def test_greedy_outputs_are_identical_with_drafts_on_and_off(engine):
    compiler = GrammarCompiler(engine.vocabulary)
    jobs = []
    for schema in dev_schemas(10):
        try:
            grammar = compiler.compile(Constraint("json_schema", schema))
        except CorralError:
            continue
        jobs.append(("Produce one JSON value of the expected structure.", grammar))
    jobs += [(prompt, None) for prompt in FREE]
    jobs += [(prompt, compiler.compile(constraint)) for constraint, prompt in CONSTRAINTS]
    assert len(jobs) >= 18
    prompts = [engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]))
               for p, _ in jobs]

    def run(switches: dict, together: bool) -> list:
        # both sides start from an empty prefix cache: a prompt computed over cached blocks rounds differently
        engine.block_manager.reset_prefix_cache()
        params = SamplingParams(temperature=0, max_tokens=32, **switches)
        guides = lambda chosen: [g.new_guide() if g is not None else None for _, g in chosen]  # noqa: E731
        if together:
            return engine.generate(prompts, params, guides(jobs))
        return [engine.generate([p], params, guides([job]))[0] for p, job in zip(prompts, jobs)]

    for together in (False, True):
        off = run(dict(jump_forward=False, speculation=False), together)
        on = run(dict(jump_forward=True, speculation=True), together)
        for i, (a, b) in enumerate(zip(off, on)):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, (i, together, a.outputs[0].text,
                                                                      b.outputs[0].text)
        assert sum(o.outputs[0].num_accepted_tokens for o in on) > 0
        passes = sum(o.outputs[0].num_forward_passes for o in on)
        assert passes < sum(len(o.outputs[0].token_ids) for o in on)

"""Random walks through guides for real dev schemas, with the default model's vocabulary: every finished walk
must be JSON that ``jsonschema`` validates.

A walk picks random allowed tokens for a random number of steps (stopping early at EOS when it is allowed), then
finishes along a shortest byte path to acceptance, spelled with single-byte tokens; every token goes through the
mask and ``advance``. A fixed sample of the dev set runs here (sized to the test budget); ``bench/maskbench.py``
covers the whole set under the MaskBench protocol.
"""

import gzip
import json
import os
import random
from collections import deque

import jsonschema
import numpy as np
import pytest

from corral.errors import UserInputError
from corral.fsm.compiler import GrammarCompiler
from corral.fsm.vocabulary import Vocabulary
from corral.grammar.constraint import Constraint
from corral.models import load_tokenizer

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "maskbench-dev.jsonl.gz")
NUM_SCHEMAS, WALKS_PER_SCHEMA, MAX_RANDOM_TOKENS = 60, 20, 24
MAX_SEARCH_STATES = 20000


def _sample() -> list[dict]:
    if not os.path.exists(DATA):
        return []
    with gzip.open(DATA, "rt") as f:
        entries = [json.loads(line) for line in f]
    return random.Random(1234).sample(entries, NUM_SCHEMAS)


SAMPLE = _sample()


@pytest.fixture(scope="module")
def setup():
    tokenizer = load_tokenizer()
    vocab = Vocabulary.from_tokenizer(tokenizer)
    byte_tokens = {}
    for token_id, data in enumerate(vocab.token_bytes):
        if len(data) == 1 and token_id not in vocab.special_ids:
            byte_tokens.setdefault(data[0], token_id)
    # SmolLM2 spells 235 single bytes; the missing ones are never valid UTF-8 or JSON-text bytes (0xC0, 0xC1,
    # 0xF5-0xFF, some controls), so the finishing path below only uses bytes that have a token.
    assert len(byte_tokens) >= 235 and all(byte_tokens.get(b) is not None for b in range(0x20, 0x7F))
    return vocab, GrammarCompiler(vocab), byte_tokens


def shortest_completion(index, state: int, byte_tokens: dict[int, int]) -> bytes | None:
    """Breadth-first over the DFA: the shortest bytes (each with a token) from ``state`` to acceptance."""
    parents, queue = {state: None}, deque([state])
    while queue and len(parents) < MAX_SEARCH_STATES:
        current = queue.popleft()
        if index.is_accepting(current):
            path = []
            while parents[current] is not None:
                current, byte = parents[current]
                path.append(byte)
            return bytes(reversed(path))
        row = index.row(current)
        live = [b for b in np.flatnonzero(row >= 0).tolist() if b in byte_tokens]
        # Whitespace and non-ASCII bytes only multiply the search (flexible whitespace, UTF-8 lead bytes); the
        # shortest way out never needs them when another byte is possible.
        preferred = [b for b in live if 0x20 < b < 0x80]
        for byte in preferred or live:
            following = int(row[byte])
            if following not in parents:
                parents[following] = (current, byte)
                queue.append(following)
    return None


def allowed(row: np.ndarray, vocab_size: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size])


def walk(grammar, vocab, byte_tokens, rng) -> bytes | None:
    guide, text = grammar.new_guide(), b""
    row = np.zeros((vocab.size + 31) // 32, dtype=np.int32)
    eos = vocab.eos_token_ids[0]
    for _ in range(rng.randrange(MAX_RANDOM_TOKENS)):
        guide.fill_mask(row)
        ids = allowed(row, vocab.size)
        assert len(ids), "a live guide never has an empty mask"
        if eos in ids and rng.random() < 0.3:
            break
        token_id = int(rng.choice(ids[ids != eos])) if len(ids) > 1 or ids[0] != eos else eos
        if token_id == eos:
            break
        assert guide.advance(token_id)
        text += vocab.token_bytes[token_id]
    completion = shortest_completion(grammar.index, guide.state, byte_tokens)
    if completion is None:
        return None
    for byte in completion:
        guide.fill_mask(row)
        token_id = byte_tokens[byte]
        assert (row[token_id >> 5] >> (token_id & 31)) & 1
        assert guide.advance(token_id)
    guide.fill_mask(row)
    assert (row[eos >> 5] >> (eos & 31)) & 1 and guide.is_accepting()
    assert guide.advance(eos) and guide.is_finished()
    return text + completion


@pytest.mark.skipif(not SAMPLE, reason="the MaskBench dev set is not present next to the repository")
@pytest.mark.parametrize("entry", SAMPLE, ids=[e["id"] for e in SAMPLE])
def test_random_walks_give_documents_the_schema_validates(setup, entry):
    vocab, compiler, byte_tokens = setup
    try:
        grammar = compiler.compile(Constraint("json_schema", entry["schema"], whitespace="flexible"))
    except UserInputError:
        return  # refusing a schema is allowed (counted by the bench); accepting a wrong document is not
    validator = jsonschema.validators.validator_for(entry["schema"])(entry["schema"])
    rng = random.Random(entry["id"])
    completed = 0
    for _ in range(WALKS_PER_SCHEMA):
        document = walk(grammar, vocab, byte_tokens, rng)
        if document is None:
            continue
        completed += 1
        instance = json.loads(document.decode("utf-8"))
        errors = [e.message for e in validator.iter_errors(instance)]
        assert not errors, (document, errors)
    assert completed >= WALKS_PER_SCHEMA // 2, "most walks must find a way to finish"

"""JSON Schema → AST on a fixed sample of the MaskBench dev schemas: every schema that compiles accepts each of its
valid instances and rejects each invalid one, as ``json.dumps`` writes them (flexible whitespace) and compactly.

The AST is matched with the reference matcher (``regex_match``): the printed Python regexes of real schemas run
to megabytes, which Python's ``re`` compiles too slowly for a test.
"""

import gzip
import json
import random
from pathlib import Path

from typing import NamedTuple

import pytest

from corral.errors import UserInputError
from corral.grammar.json_schema import schema_to_node
from corral.grammar.regex_match import fullmatch

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "maskbench-dev.jsonl.gz"
SAMPLE_SIZE = 300
MIN_COMPILED_FRACTION = 0.93  # measured: 287 of 300 compile (flexible)
MAX_MISSED_FRACTION = 0.03  # measured: 6 of 287 reject a valid instance (property order, nesting)


def _sample() -> list[dict]:
    if not DATA.exists():
        return []
    rows = [json.loads(line) for line in gzip.open(DATA, "rt")]
    return random.Random(20261129).sample(rows, SAMPLE_SIZE)


SAMPLE = _sample()
COMPACT_IDS = {row["id"] for row in SAMPLE[:100]}  # the compact policy on a third of the sample


class Outcome(NamedTuple):
    schema_id: str
    whitespace: str
    compiled: bool
    invalid_accepted: list
    valid_rejected: list


@pytest.fixture(scope="module")
def outcomes() -> list[Outcome]:
    if not SAMPLE:
        pytest.skip(f"MaskBench dev data not found at {DATA}")
    out = []
    for row in SAMPLE:
        modes = (("flexible", None), ("compact", (",", ":"))) if row["id"] in COMPACT_IDS else (("flexible", None),)
        for whitespace, separators in modes:
            try:
                node = schema_to_node(row["schema"], whitespace=whitespace)
            except UserInputError:
                out.append(Outcome(row["id"], whitespace, False, [], []))
                continue
            verdicts = [(t, fullmatch(node, json.dumps(t["data"], separators=separators))) for t in row["tests"]]
            out.append(Outcome(row["id"], whitespace, True,
                               [t["data"] for t, accepted in verdicts if accepted and not t["valid"]],
                               [t["data"] for t, accepted in verdicts if not accepted and t["valid"]]))
    return out


def test_no_invalid_instance_is_accepted(outcomes):
    unsound = [(o.schema_id, o.whitespace, o.invalid_accepted) for o in outcomes if o.invalid_accepted]
    assert unsound == []


def test_most_sampled_schemas_compile_and_accept_their_valid_instances(outcomes):
    compiled = [o for o in outcomes if o.compiled]
    missed = [(o.schema_id, o.whitespace) for o in compiled if o.valid_rejected]
    # Floors pinned below a measured run of this sample: a drop below them is a regression.
    assert len(compiled) >= MIN_COMPILED_FRACTION * len(outcomes)
    assert len(missed) <= MAX_MISSED_FRACTION * len(compiled), missed[:10]

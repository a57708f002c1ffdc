"""Self-consistency that knows the schema: N structured samples, one answer each, a majority vote.

The output is constrained by a JSON Schema, so every sample parses, and the answer is read exactly where the
schema puts it, by a JSON pointer such as ``/answer``, rather than fished out of free text. Before the pointer
is used it is checked against the schema: a pointer to a property the schema does not declare is an error, not
a vote of abstentions. Answers are normalised before voting: strings are case-folded with runs of whitespace
collapsed, a string that spells a number votes as that number, integral floats vote as integers, and containers
vote by their canonical JSON. A sample whose answer is missing abstains. Ties go to the answer drawn first.

Left out: weighting votes by sample probability (plain majority, as in the original method).
"""

import json
import math
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import NamedTuple

from corral.engine.sampling_params import SamplingParams
from corral.errors import InvalidRequestError
from corral.grammar.constraint import Constraint

MIN_TEMPERATURE = 0.7
_MISSING = object()


class SelfConsistencyResult(NamedTuple):
    answer: Hashable | None  # None when every sample abstained
    votes: dict  # normalised answer -> count, most votes first
    agreement: float  # votes for the answer / samples drawn
    num_samples: int
    num_abstained: int
    answers: list  # each sample's normalised answer in draw order, None where it abstained


def pointer_tokens(pointer: str) -> list[str]:
    """RFC 6901: '/a~1b/0' -> ['a/b', '0']."""
    if pointer and not pointer.startswith("/"):
        raise InvalidRequestError(f"a JSON pointer starts with '/', got {pointer!r}", param="pointer")
    if any(char == "~" and pointer[i + 1:i + 2] not in ("0", "1") for i, char in enumerate(pointer)):
        raise InvalidRequestError(f"a JSON pointer writes '~' as '~0' and '/' as '~1', got {pointer!r}",
                                  param="pointer")
    return [t.replace("~1", "/").replace("~0", "~") for t in pointer.split("/")[1:]]


def resolve_pointer(document, pointer: str):
    """The value at ``pointer``, or ``_MISSING``."""
    for token in pointer_tokens(pointer):
        if isinstance(document, dict) and token in document:
            document = document[token]
        elif isinstance(document, list) and token.isdigit() and int(token) < len(document):
            document = document[int(token)]
        else:
            return _MISSING
    return document


def check_pointer(schema: dict | bool, pointer: str) -> None:
    """Raise InvalidRequestError unless the schema declares what ``pointer`` names (through ``properties``,
    ``items`` and ``prefixItems``; a ``$ref`` or a combinator on the way ends the check, accepting)."""
    node = schema
    for depth, token in enumerate(pointer_tokens(pointer)):
        if not isinstance(node, dict) or any(k in node for k in ("$ref", "anyOf", "oneOf", "allOf")):
            return
        if token in node.get("properties", {}):
            node = node["properties"][token]
        elif token.isdigit() and int(token) < len(node.get("prefixItems", [])):
            node = node["prefixItems"][int(token)]
        elif token.isdigit() and isinstance(node.get("items"), dict):
            node = node["items"]
        else:
            where = "/" + "/".join(pointer_tokens(pointer)[:depth])
            raise InvalidRequestError(f"the schema declares no {token!r} under {where!r}, so pointer {pointer!r} "
                                      f"can never hold an answer", param="pointer")


def normalize_answer(value) -> Hashable:
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, str):
        text = " ".join(value.split()).casefold()
        try:
            number = float(text)
        except ValueError:
            return text
        return normalize_answer(number) if math.isfinite(number) else text
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            return value
        number = float(f"{float(value):.12g}")  # 0.1 + 0.2 and 0.3 vote together
        return int(number) if number.is_integer() else number
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def extract_answer(text: str, pointer: str):
    """The normalised answer in one sample, or ``_MISSING`` when the text is not JSON or lacks it."""
    try:
        value = resolve_pointer(json.loads(text), pointer)
        return value if value is _MISSING else normalize_answer(value)
    # not JSON (or an integer past the digit limit), nested too deep, or a number past float's range
    except (ValueError, RecursionError, OverflowError):
        return _MISSING


def majority_vote(texts: Sequence[str], pointer: str) -> SelfConsistencyResult:
    answers = [extract_answer(text, pointer) for text in texts]
    votes = Counter(a for a in answers if a is not _MISSING)  # Counter keeps first-seen order among equals
    num_abstained = len(answers) - sum(votes.values())
    per_sample = [None if a is _MISSING else a for a in answers]
    if not votes:
        return SelfConsistencyResult(None, {}, 0.0, len(texts), num_abstained, per_sample)
    ranked = dict(votes.most_common())
    answer = next(iter(ranked))
    return SelfConsistencyResult(answer, ranked, ranked[answer] / len(texts), len(texts), num_abstained, per_sample)


def self_consistency(engine, compiler, prompt: str | Sequence[int], schema: dict, *, pointer: str = "/answer",
                     params: SamplingParams | None = None) -> SelfConsistencyResult:
    """Draw ``params.n`` samples of ``prompt`` under ``schema`` and vote on the answer at ``pointer``.
    ``compiler``: a GrammarCompiler for the engine's vocabulary. Default: 8 samples at temperature 0.8."""
    return self_consistency_many(engine, compiler, [prompt], schema, pointer=pointer, params=params)[0]


def self_consistency_many(engine, compiler, prompts: Sequence[str | Sequence[int]], schema: dict, *,
                          pointer: str = "/answer", params: SamplingParams | None = None
                          ) -> list[SelfConsistencyResult]:
    """:func:`self_consistency` for several prompts under one schema, batched together on the engine."""
    params = params or SamplingParams(n=8, temperature=0.8, max_tokens=256)
    if params.temperature < MIN_TEMPERATURE:
        raise InvalidRequestError(f"self-consistency samples at temperature >= {MIN_TEMPERATURE} so that the "
                                  f"samples differ; got {params.temperature}", param="temperature")
    if params.n < 2:
        raise InvalidRequestError(f"self-consistency needs n >= 2 samples, got n={params.n}", param="n")
    check_pointer(schema, pointer)
    grammar = compiler.compile(Constraint("json_schema", schema))
    outputs = engine.generate(list(prompts), params, [grammar.new_guide() for _ in prompts])
    return [majority_vote([completion.text for completion in output.outputs], pointer) for output in outputs]

"""GrammarCompiler: constraint kinds, the LRU cache, budgets, and typed errors for bad or hostile input."""

import json
import time

import numpy as np
import pytest

from corral.errors import GrammarTooComplexError, InvalidGrammarError, InvalidRegexError, UserInputError
from corral.fsm.compiler import GrammarCompiler
from corral.fsm.vocabulary import Vocabulary
from corral.grammar.constraint import Constraint

EOS = 256


@pytest.fixture(scope="module")
def byte_vocab():
    """One token per byte, plus EOS: a guide driven by this vocabulary accepts exactly the grammar's strings."""
    return Vocabulary.from_token_bytes([bytes([b]) for b in range(256)] + [b"<eos>"], eos_token_ids=[EOS])


@pytest.fixture(scope="module")
def compiler(byte_vocab):
    return GrammarCompiler(byte_vocab)


def accepts(grammar, text: str) -> bool:
    guide = grammar.new_guide()
    row = np.zeros(9, dtype=np.int32)
    for byte in text.encode("utf-8"):
        guide.fill_mask(row)
        allowed = bool((row[byte >> 5] >> (byte & 31)) & 1)
        if guide.advance(byte) != allowed:
            raise AssertionError("mask and advance disagree")
        if not allowed:
            return False
    guide.fill_mask(row)
    assert bool((row[EOS >> 5] >> (EOS & 31)) & 1) == guide.is_accepting()
    return guide.is_accepting()


def nest(depth: int) -> str:
    """An object holding ``depth - 1`` nested arrays: ``depth`` containers in all."""
    return '{"k": ' + "[" * (depth - 1) + "1" + "]" * (depth - 1) + "}"


def test_json_object_accepts_objects_nested_without_a_limit(compiler):
    grammar = compiler.compile(Constraint("json_object", whitespace="flexible"))
    for text in ['{}', '{"a": 1, "b": [true, null, -1.5e3, "x\\u00e9\\n"]}', '{ "a" :{"b":{}} }', nest(6), nest(7),
                 nest(200), '{"a": ' * 60 + '{}' + '}' * 60]:
        assert accepts(grammar, text), text
        json.loads(text)
    for text in ['[]', '1', '{"a": 1,}', '{"a" 1}', '{"a": 01}', '{"a": "\x01"}', '{"a":      1}', nest(200)[:-1],
                 nest(50) + "}"]:
        assert not accepts(grammar, text), text


def test_json_object_compact_allows_no_whitespace(compiler):
    grammar = compiler.compile(Constraint("json_object"))
    assert accepts(grammar, '{"a":[1,2]}') and not accepts(grammar, '{"a": [1,2]}')


def test_regex_and_choice(compiler):
    assert accepts(compiler.compile(Constraint("regex", r"\d{3}-[a-z]+")), "123-abc")
    assert not accepts(compiler.compile(Constraint("regex", r"\d{3}-[a-z]+")), "12-abc")
    choice = compiler.compile(Constraint("choice", ["yes", "no", "yes!"]))
    assert [accepts(choice, t) for t in ["yes", "no", "yes!", "ye", "maybe"]] == [True, True, True, False, False]


def test_json_schema_goes_through_schema_to_node(compiler):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}, "required": ["n"],
              "additionalProperties": False}
    grammar = compiler.compile(Constraint("json_schema", schema, whitespace="flexible"))
    assert accepts(grammar, '{"n": 3}') and accepts(grammar, '{"n": 42}')
    assert not accepts(grammar, '{"n": 2}') and not accepts(grammar, '{}')


def test_repeat_compile_is_a_cache_hit_and_options_are_part_of_the_key(compiler):
    constraint = Constraint("regex", "a+b")
    first = compiler.compile(constraint)
    hits = compiler.num_hits
    start = time.perf_counter()
    assert compiler.compile(Constraint("regex", "a+b")) is first
    assert time.perf_counter() - start < 0.01 and compiler.num_hits == hits + 1
    assert compiler.compile(Constraint("regex", "a+b", whitespace="flexible")) is not first


def test_lru_is_bounded_in_bytes(byte_vocab):
    small = GrammarCompiler(byte_vocab, cache_bytes=1)
    first = small.compile(Constraint("regex", "a"))
    small.compile(Constraint("regex", "b"))
    assert small.compile(Constraint("regex", "a")) is not first  # bigger than the bound: never cached
    assert small.cache_nbytes() == 0


def test_the_byte_bound_holds_while_cached_grammars_grow(byte_vocab):
    """Masks fill in after compilation: each new mask re-counts its grammar, and the cache evicts at once."""
    pattern = "[a-z]{0,60}"  # one state per letter: every letter walked is a new mask
    constraints = [Constraint("regex", f"{pattern}{tail}") for tail in "012"]
    bound = sum(GrammarCompiler(byte_vocab).compile(c).nbytes() for c in constraints)  # all three, as compiled
    bounded = GrammarCompiler(byte_vocab, cache_bytes=bound)
    grammars = [bounded.compile(c) for c in constraints]
    assert bounded.cache_nbytes() <= bound and len(bounded._cache) == 3
    row = np.zeros(-(-byte_vocab.size // 32), dtype=np.int32)
    guide = grammars[0].new_guide()
    for letter in b"abcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwxyz":
        guide.fill_mask(row)
        assert guide.advance(letter)
        assert bounded.cache_nbytes() <= bound  # at every mask, not at the next store
    assert len(bounded._cache) < 3  # the growth pushed the least recently used grammars out
    assert bounded.compile(Constraint("regex", f"{pattern}2")) is grammars[2]  # the most recent one stayed


@pytest.mark.parametrize("constraint, error, message", [
    (Constraint("choice", []), InvalidGrammarError, "non-empty list of strings"),
    (Constraint("choice", ["a", 1]), InvalidGrammarError, "non-empty list of strings"),
    (Constraint("regex", "[^\\s\\S]"), InvalidGrammarError, "the regex constraint matches no string"),
    (Constraint("regex", "a(?=b)"), InvalidRegexError, "lookahead is not supported at offset 1"),
    (Constraint("json_schema", {"type": "integer", "minimum": 5, "maximum": 1}), UserInputError, "contradict each other"),
])
def test_bad_constraints_raise_typed_errors(compiler, constraint, error, message):
    with pytest.raises(error, match=message):
        compiler.compile(constraint)


def test_grammar_constraints_compile_lark_and_gbnf_and_cache_them(compiler):
    lark = compiler.compile(Constraint("grammar", 'start: "a" start "b" | "ab"'))
    gbnf = compiler.compile(Constraint("grammar", 'root ::= "a" root "b" | "ab"'))
    for grammar in (lark, gbnf):
        assert accepts(grammar, "aaabbb") and not accepts(grammar, "aaabb") and not accepts(grammar, "")
    assert compiler.compile(Constraint("grammar", 'start: "a" start "b" | "ab"')) is lark


def test_time_budget_gives_grammar_too_complex(byte_vocab):
    hurried = GrammarCompiler(byte_vocab, time_budget_s=0.05)
    start = time.perf_counter()
    with pytest.raises(GrammarTooComplexError, match="time budget of 0.05 s"):
        hurried.compile(Constraint("choice", [f"option number {i}" for i in range(300_000)]))
    assert time.perf_counter() - start < 1.0


def test_a_large_choice_compiles_within_the_default_budget(compiler):
    grammar = compiler.compile(Constraint("choice", [f"option {i}" for i in range(20000)]))
    assert accepts(grammar, "option 19999") and accepts(grammar, "option 1")
    assert not accepts(grammar, "option 20000") and not accepts(grammar, "option ")


HOSTILE_SCHEMAS = [
    {"type": "string", "maxLength": 10**9},
    {"type": "string", "pattern": "^(a+)+$"},
    {"type": "string", "pattern": "(x|x|x|x)*y", "minLength": 3, "maxLength": 5000},
    {"enum": [f"value-{i}" for i in range(500)]},
    {"oneOf": [{"oneOf": [{"type": "integer"}, {"type": "string"}]}] * 8},
    {"type": "array", "items": {"type": "array", "items": {"type": "array", "items": {"type": "object"}}},
     "maxItems": 1000},
    {"$ref": "#/definitions/missing"},
    {"type": 5},
    {"type": "integer", "minimum": 10, "maximum": 1},
    {"anyOf": [{"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200)}}]},
]


@pytest.mark.parametrize("schema", HOSTILE_SCHEMAS, ids=range(len(HOSTILE_SCHEMAS)))
def test_hostile_schemas_compile_or_fail_typed_within_the_budget(byte_vocab, schema):
    budgeted = GrammarCompiler(byte_vocab, time_budget_s=2.0)
    start = time.perf_counter()
    try:
        grammar = budgeted.compile(Constraint("json_schema", schema))
        row = np.zeros(9, dtype=np.int32)
        grammar.new_guide().fill_mask(row)
        assert row.any()
    except UserInputError:
        pass
    assert time.perf_counter() - start < 4.0


def test_a_structure_nested_past_the_recursion_limit_is_refused_not_a_crash(compiler):
    with pytest.raises(GrammarTooComplexError, match="nests too deeply"):
        compiler.compile(Constraint("regex", "(" * 3000 + "a" + ")" * 3000))


def _tool(i: int) -> dict:
    return {"index": i, "name": f"tool_{i}", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                         "unit": {"enum": ["celsius", "fahrenheit"]},
                                         f"days_{i}": {"type": "integer", "minimum": 1, "maximum": 14},
                                         "when": {"type": "string", "format": "date"},
                                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
        "required": ["city", f"days_{i}"], "additionalProperties": False}}


def test_128_tools_compile_under_one_budget_and_calls_match_their_own_schema(byte_vocab):
    """The server's default tool bound, each tool a schema of its own, compiled as one constraint."""
    compiler = GrammarCompiler(byte_vocab)  # the default 10 s budget covers all 128 together
    value = {"tools": [_tool(i) for i in range(128)], "mode": "required", "parallel": True, "answer": None}
    start = time.monotonic()
    grammar = compiler.compile(Constraint("tools", value))
    assert time.monotonic() - start < 10
    call = '<tool_call>{"name": "tool_77", "arguments": {"city":"Oslo","days_77":3}}</tool_call>'
    assert accepts(grammar, call) and accepts(grammar, call + "\n" + call.replace("77", "5"))
    assert not accepts(grammar, call.replace("days_77", "days_76"))


def test_one_budget_covers_every_tool(byte_vocab):
    """Each tool alone compiles well inside the 1 s budget; forty together do not. A budget per tool would let all
    forty through (several seconds); the one budget of the request stops them part-way."""
    one = {"type": "object", "properties": {f"p{i}": {"type": "integer", "minimum": i} for i in range(300)},
           "required": [f"p{i}" for i in range(300)]}
    alone = GrammarCompiler(byte_vocab, time_budget_s=1.0)
    alone.compile(Constraint("tools", {"tools": [{"index": 0, "name": "t0", "parameters": one}], "mode": "required",
                                       "parallel": False, "answer": None}))
    value = {"tools": [{"index": i, "name": f"t{i}", "parameters": {**one, "title": str(i)}} for i in range(40)],
             "mode": "required", "parallel": False, "answer": None}
    compiler = GrammarCompiler(byte_vocab, time_budget_s=1.0)
    start = time.monotonic()
    with pytest.raises(GrammarTooComplexError, match=r"tools\[\d+\] .*time budget of 1 s"):
        compiler.compile(Constraint("tools", value))
    assert time.monotonic() - start < 6  # generous for slow machines: forty tools would take far longer


@pytest.mark.parametrize("required_every", [1, 5, None])
def test_objects_with_hundreds_of_members_compile(byte_vocab, required_every):
    """Hundreds of declared properties, all, some or none required: built by loops, not recursion, and not
    refused as nested too deeply."""
    names = [f"p{i}" for i in range(400)]
    required = [] if required_every is None else names[::required_every]
    schema = {"type": "object", "properties": {n: {"type": "integer"} for n in names}, "required": required,
              "additionalProperties": False}
    grammar = GrammarCompiler(byte_vocab).compile(Constraint("json_schema", schema))
    document = {n: 1 for n in names if n in required or n.endswith("7")}
    assert accepts(grammar, json.dumps(document, separators=(",", ":")))
    assert not accepts(grammar, json.dumps({**document, "extra": 1}, separators=(",", ":")))
    if required:
        assert not accepts(grammar, json.dumps({n: 1 for n in names[1:]}, separators=(",", ":")))


def test_a_language_no_token_can_begin_is_refused_at_compile_time():
    vocab = Vocabulary.from_token_bytes([b"a", b"b", b"<eos>"], eos_token_ids=[2])
    with pytest.raises(InvalidGrammarError, match="no sequence of this model's tokens can spell"):
        GrammarCompiler(vocab).compile(Constraint("regex", "c+"))
    assert GrammarCompiler(vocab).compile(Constraint("regex", "ab")).new_guide() is not None

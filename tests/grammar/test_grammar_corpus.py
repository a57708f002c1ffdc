"""The bundled grammar corpus (``bench/grammars/``) against two references: lark, the oracle of what a Lark grammar
accepts, and llguidance, whose masks Corral's must equal token for token.

Each grammar ships as Lark and as a GBNF twin, with at least 20 valid and 20 invalid documents. Here:

- the labels are lark's verdicts (the corpus is checked against its oracle first);
- the Lark grammar and its GBNF twin accept exactly the valid documents, byte by byte and as the default
  model's tokens;
- random walks through the guide end in text that lark parses;
- along the valid documents and along random walks, Corral's mask equals llguidance's, with the default model's
  vocabulary, except for the differences named in ``DIFFERENCES``.
"""

import json
import os
import random

import lark
import llguidance
import llguidance.numpy
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from corral.errors import GrammarTooComplexError
from corral.fsm.compiler import GrammarCompiler
from corral.fsm.random_walk import random_document, single_byte_tokens
from corral.fsm.vocabulary import Vocabulary
from corral.grammar.constraint import Constraint
from corral.models import load_tokenizer

CORPUS = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "grammars")
NAMES = ("json", "arithmetic", "sql", "c_like", "pgn", "yaml_flow", "tool_call")

# llguidance's options for the comparison. By default it forces the bytes a grammar forces as canonically
# tokenized tokens (its mask then holds only those, not every token that spells a prefix of them), and refuses
# %ignore text before the first lexeme (lark allows it). Both are policies on top of the language; the
# differential compares languages, so both are turned off on llguidance's side.
LLG_OPTIONS = '%llguidance {"no_forcing": true, "allow_initial_skip": true}\n'
# Inline %json: llguidance's default whitespace there is flexible, Corral's is compact; both keep the schema's
# property order. The comparison fixes compact whitespace on llguidance's side.
LLG_JSON_OPTIONS = '"x-guidance": {"whitespace_flexible": false}, '

# Known differences, by name: each is a reason llguidance's language differs from lark's (which Corral follows).
DIFFERENCES = {
    "trailing-ignore": "llguidance refuses %ignore text after a complete document (once the end may follow); "
                       "lark, and Corral, accept it",
    "dotless-i": "the i flag: Python's re, and so lark and Corral, folds i/I with U+0131 (ı) and U+0130 (İ); "
                 "llguidance uses Unicode simple case folding, which does not",
    "json-strings": "llguidance's %json strings refuse U+007F unescaped and the escapes \\/ and \\uXXXX, all of "
                    "which RFC 8259 (and Corral) allow",
}


def _load(name: str) -> dict:
    with open(os.path.join(CORPUS, f"{name}.json")) as f:
        entry = json.load(f)
    for ext in ("lark", "gbnf"):
        with open(os.path.join(CORPUS, f"{name}.{ext}")) as f:
            entry[ext] = f.read()
    oracle_file = entry.get("lark_oracle")
    with open(os.path.join(CORPUS, oracle_file or f"{name}.lark")) as f:
        entry["oracle_text"] = f.read()
    entry["oracle_parser"] = entry.get("lark_oracle_parser") or entry["lark_parser"]
    return entry


CORPUS_ENTRIES = {name: _load(name) for name in NAMES}


@pytest.fixture(scope="module")
def setup():
    tokenizer = load_tokenizer()
    vocab = Vocabulary.from_tokenizer(tokenizer)
    llg_tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab.size,
                                           eos_token=vocab.eos_token_ids[0])
    return tokenizer, vocab, GrammarCompiler(vocab), llg_tokenizer


@pytest.fixture(scope="module")
def byte_compiler():
    vocab = Vocabulary.from_token_bytes([bytes([b]) for b in range(256)] + [b"<eos>"], eos_token_ids=[256])
    return GrammarCompiler(vocab)


def _oracle(entry: dict) -> lark.Lark:
    return lark.Lark(entry["oracle_text"], parser=entry["oracle_parser"])


def _parses(oracle: lark.Lark, text: str) -> bool:
    try:
        oracle.parse(text)
        return True
    except lark.exceptions.LarkError:
        return False


def _accepts_bytes(grammar, text: str) -> bool:
    guide = grammar.new_guide()
    return all(guide.advance(b) for b in text.encode()) and guide.is_accepting()


def _accepts_tokens(grammar, vocab, token_ids: list[int]) -> bool:
    guide, row = grammar.new_guide(), np.zeros((vocab.size + 31) // 32, dtype=np.int32)
    for token_id in token_ids + [vocab.eos_token_ids[0]]:
        guide.fill_mask(row)
        if not (row[token_id >> 5] >> (token_id & 31)) & 1 or not guide.advance(token_id):
            return False
    return guide.is_finished()


@pytest.mark.parametrize("name", NAMES)
def test_the_corpus_labels_are_lark_verdicts(name):
    entry, oracle = CORPUS_ENTRIES[name], _oracle(CORPUS_ENTRIES[name])
    assert len(entry["valid"]) >= 20 and len(entry["invalid"]) >= 20
    assert [d for d in entry["valid"] if not _parses(oracle, d)] == []
    assert [d for d in entry["invalid"] if _parses(oracle, d)] == []


@pytest.mark.parametrize("name", NAMES)
def test_the_lark_grammar_and_its_gbnf_twin_accept_exactly_what_lark_parses(byte_compiler, name):
    entry = CORPUS_ENTRIES[name]
    verdicts = {}
    for ext in ("lark", "gbnf"):
        grammar = byte_compiler.compile(Constraint("grammar", entry[ext]))
        verdicts[ext] = [_accepts_bytes(grammar, d) for d in entry["valid"] + entry["invalid"]]
    assert verdicts["lark"] == verdicts["gbnf"]
    assert verdicts["lark"] == [True] * len(entry["valid"]) + [False] * len(entry["invalid"])


@pytest.mark.parametrize("name", NAMES)
def test_every_valid_document_is_accepted_as_the_models_tokens(setup, name):
    tokenizer, vocab, compiler, _ = setup
    entry = CORPUS_ENTRIES[name]
    for ext in ("lark", "gbnf"):
        grammar = compiler.compile(Constraint("grammar", entry[ext]))
        refused = [d for d in entry["valid"] if not _accepts_tokens(grammar, vocab, tokenizer.encode(d))]
        assert refused == [], ext


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_random_walks_end_in_text_lark_parses(setup, name, seed):
    _, vocab, compiler, _ = setup
    entry = CORPUS_ENTRIES[name]
    grammar = compiler.compile(Constraint("grammar", entry["lark"]))
    try:
        document = random_document(grammar, vocab, single_byte_tokens(vocab), random.Random(seed),
                                   max_random_tokens=16)
    except GrammarTooComplexError as exc:  # as in tests/fsm/test_random_walks.py: a limit refuses, and says which
        assert "fuel" in str(exc) or "cap" in str(exc), exc
        return
    if document is not None:
        assert _parses(_oracle(entry), document.decode()), document


# ---- the llguidance differential -------------------------------------------------------------------------------

def _ids(row: np.ndarray, size: int) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:size]).tolist())


def _explained(guide, vocab, ours: set[int], theirs: set[int], grammar_text: str, before: bytes) -> str | None:
    """The name of the known difference that explains ``ours`` != ``theirs`` (None: unexplained)."""
    extra, missing = ours - theirs, theirs - ours
    if missing:
        return None  # llguidance allows a token Corral refuses: no known difference does that
    eos = vocab.eos_token_ids[0]
    if eos in theirs and eos in ours and all(_is_ignored_text(guide, t) for t in sorted(extra)[:64]):
        return "trailing-ignore"
    texts = [vocab.token_bytes[t] for t in extra]
    if '"i' in grammar_text and all(b"\xc4\xb1" in t or b"\xc4\xb0" in t or t.endswith(b"\xc4") for t in texts):
        return "dotless-i"
    escape = before.endswith(b"\\") and not before.endswith(b"\\\\")  # (enough for the corpus's strings)
    if "%json" in grammar_text and all(b"\x7f" in t or b"\\u" in t or b"\\/" in t
                                       or (escape and t[:1] in (b"u", b"/")) for t in texts):
        return "json-strings"
    return None


def _is_ignored_text(guide, token_id: int) -> bool:
    """The token is %ignore text: after it the parser stands where it stood (only the lexer moved)."""
    session, probe = guide.session, guide.copy()
    before = {s for s, _ in session.readings(guide.config)} | set(session.sets_between_lexemes(guide.config))
    return probe.advance(token_id) and {s for s, _ in session.readings(probe.config)} <= before


def _compare_along(tokenizer, vocab, grammar, matcher, token_ids: list[int], grammar_text: str, seen: dict) -> None:
    guide, theirs_matcher = grammar.new_guide(), matcher.deep_copy()
    words = (vocab.size + 31) // 32
    ours_row, theirs_row = np.zeros(words, dtype=np.int32), np.zeros(words, dtype=np.int32)
    for position in range(len(token_ids) + 1):
        guide.fill_mask(ours_row)
        llguidance.numpy.fill_next_token_bitmask(theirs_matcher, theirs_row.reshape(1, -1), 0)
        token_id = token_ids[position] if position < len(token_ids) else None
        if not np.array_equal(ours_row, theirs_row):
            ours, theirs = _ids(ours_row, vocab.size), _ids(theirs_row, vocab.size)
            before = b"".join(vocab.token_bytes[t] for t in token_ids[:position])
            reason = _explained(guide, vocab, ours, theirs, grammar_text, before)
            assert reason is not None, (
                f"after {tokenizer.backend.decode(token_ids[:position])[-60:]!r}: Corral alone allows "
                f"{[vocab.token_bytes[t] for t in sorted(ours - theirs)[:10]]}, llguidance alone "
                f"{[vocab.token_bytes[t] for t in sorted(theirs - ours)[:10]]}")
            seen[reason] = seen.get(reason, 0) + 1
            if token_id in ours - theirs:
                return  # the document goes where llguidance's language does not: nothing left to compare
        if token_id is None:
            return
        assert guide.advance(token_id) and theirs_matcher.consume_token(token_id), token_ids[:position + 1]


def _llg_matcher(llg_tokenizer, text: str):
    text = LLG_OPTIONS + text.replace("%json {", "%json {" + LLG_JSON_OPTIONS)
    grammar = llguidance.LLMatcher.grammar_from_lark(text)
    matcher = llguidance.LLMatcher(llg_tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher


@pytest.mark.parametrize("name", NAMES)
def test_masks_equal_llguidance_along_valid_documents_and_random_walks(setup, name):
    tokenizer, vocab, compiler, llg_tokenizer = setup
    entry = CORPUS_ENTRIES[name]
    grammar = compiler.compile(Constraint("grammar", entry["lark"]))
    matcher = _llg_matcher(llg_tokenizer, entry["lark"])
    seen: dict[str, int] = {}
    documents = list(entry["valid"])
    rng, byte_tokens = random.Random(name), single_byte_tokens(vocab)
    for _ in range(6):
        walk = random_document(grammar, vocab, byte_tokens, rng, max_random_tokens=12)
        if walk is not None:
            documents.append(walk.decode())
    for document in documents:
        _compare_along(tokenizer, vocab, grammar, matcher, tokenizer.encode(document), entry["lark"], seen)
    assert set(seen) <= set(DIFFERENCES)


# llguidance's lexeme options (its tool-calling pattern as its documentation writes it, with a TEXT that may be
# empty; suffix=; stop= where llguidance takes nothing back):
# (grammar, documents)
LEXEME_OPTIONS = [
    ('start: f_call* f_end\nf_end: TEXT\nTEXT: /(.|\\n)*/\nf_head[lazy]: TEXT "<function"\n'
     'f_call: f_head "=get_time>" %json {"type": "object", "properties": {"tz": {"type": "string"}}, '
     '"required": ["tz"], "additionalProperties": false} "</function>"',
     ['Let me check.<function=get_time>{"tz":"UTC"}</function> Done.', "No call here at all.",
      '<function=get_time>{"tz":"CET"}</function>']),
    ('start: item+\nitem[suffix=";"]: /[a-z ]+/', ["one; two three;", "a;b;"]),
    ('start: para+\npara: line "\\n"\nline[stop="\\n"]: /[a-zA-Z ,.]*/', ["Hello there.\nSecond line, here.\n"]),
]


@pytest.mark.parametrize("text, documents", LEXEME_OPTIONS, ids=["lazy-tool-call", "suffix", "stop"])
def test_lexeme_options_equal_llguidance(setup, text, documents):
    tokenizer, vocab, compiler, llg_tokenizer = setup
    grammar = compiler.compile(Constraint("grammar", text))
    matcher = _llg_matcher(llg_tokenizer, text)
    seen: dict[str, int] = {}
    for document in documents:
        assert _accepts_tokens(grammar, vocab, tokenizer.encode(document)), document
        _compare_along(tokenizer, vocab, grammar, matcher, tokenizer.encode(document), text, seen)
    assert set(seen) <= set(DIFFERENCES)

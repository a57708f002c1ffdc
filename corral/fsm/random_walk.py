"""Random documents from a compiled grammar, drawn token by token through its guide: a fuzzer for the masks.

A walk picks random allowed tokens for a random number of steps (stopping early at EOS when it is allowed), then
finishes along a byte path to acceptance (closing bytes first), spelled with single-byte tokens. Every token goes
through ``fill_mask`` and ``advance``, so a walk checks the guide's own contract as it goes (a live guide never has
an empty mask; every finishing byte's token is allowed; EOS is allowed exactly at the end). A guide stopped by a
decoding limit (a state cap, a memory cap, a mask's fuel) raises that limit's ``GrammarTooComplexError``: it refuses
the schema, as the engine ends the sequence with the limit's error. The document it returns must then satisfy the
constraint: the tests check that with ``jsonschema`` on a fixed sample of the MaskBench dev set, and
``bench/random_walks.py`` over all of it.
"""

import random

import numpy as np

from corral.errors import GrammarTooComplexError
from corral.fsm.vocabulary import Vocabulary

MAX_SEARCH_STATES = 20000


class WalkError(AssertionError):
    """The guide broke its contract during a walk (empty mask, a disallowed finishing token, EOS misplaced)."""


def single_byte_tokens(vocab: Vocabulary) -> dict[int, int]:
    """byte -> the id of a token spelling exactly that byte (specials excluded)."""
    byte_tokens: dict[int, int] = {}
    for token_id, data in enumerate(vocab.token_bytes):
        if len(data) == 1 and token_id not in vocab.special_ids:
            byte_tokens.setdefault(data[0], token_id)
    return byte_tokens


# Bytes that close or finish JSON pieces come first, so that the search tends to leave a value as soon as it can
# (a string closes on '"', a number ends after '0', containers close); then alphanumerics, other printable ASCII,
# and last the backslash (escapes only lengthen strings), whitespace and non-ASCII.
_ORDER = b'"0}],:' + bytes(sorted(range(0x21, 0x7F), key=lambda b: (not chr(b).isalnum(), b == 0x5C, b)))
_PREFERENCE = {byte: rank for rank, byte in reversed(list(enumerate(_ORDER)))}  # a byte's first place wins


def _rank(byte: int) -> int:
    return _PREFERENCE.get(byte, 0x100 + byte)


def finishing_bytes(index, state: int, byte_tokens: dict[int, int]) -> bytes | None:
    """Bytes (each with a token) that take the byte DFA from ``state`` to acceptance: a depth-first search in
    closing-first byte order, never revisiting a state; None past ``MAX_SEARCH_STATES`` visited states.
    ``index``: a ``TokenIndex`` (``index.dfa.next_state``) or a context-free ``ParseSession`` (``move``), whose
    states are configurations.

    The DFA is trimmed (every live state reaches acceptance), so the search rarely backtracks; a breadth-first
    search for the *shortest* path instead blew up on schemas with many required properties of any type.
    """
    candidates = sorted(byte_tokens, key=_rank)
    lazy = hasattr(index, "dfa")
    next_state = index.dfa.next_state if lazy else index.move

    def successors(current: int):
        # A DFA's, lazily, one byte class at a time: a whole row derives every class, and the search mostly takes
        # the first. A configuration's live bytes come in one native call: a search that backs out of a state has
        # asked every byte, one call each (a depth-limited search that fails does that everywhere).
        live = None if lazy else set(index.live_bytes(current).tolist())
        for byte in candidates:
            if live is None or byte in live:
                following = next_state(current, byte)
                if following >= 0:
                    yield byte, following

    if index.is_accepting(state):
        return b""
    # A context-free grammar can nest forever along the closing-first order (a recursive member's key sorts
    # first): its search is depth-limited, and retried deeper when the limit cut it.
    for limit in ((None,) if lazy else (64, 256, 1024)):
        found = _search(state, successors, index.is_accepting, limit)
        if found is not None:
            return found
    return None


def _search(state: int, successors, is_accepting, limit: int | None) -> bytes | None:
    depth_of, path = {state: 0}, []
    stack = [successors(state)]
    while stack:
        for byte, following in stack[-1]:
            seen = depth_of.get(following)
            if seen is not None and (limit is None or seen <= len(path) + 1):
                continue  # unlimited: never revisit; limited: only when reached by a shorter path
            depth_of[following] = len(path) + 1
            path.append(byte)
            if is_accepting(following):
                return bytes(path)
            if len(depth_of) > MAX_SEARCH_STATES:
                return None
            if limit is not None and len(path) >= limit:
                path.pop()
                continue
            stack.append(successors(following))
            break
        else:
            stack.pop()
            if path:
                path.pop()
    return None


def allowed_ids(row: np.ndarray, vocab_size: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size])


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise WalkError(message)


def random_document(grammar, vocab: Vocabulary, byte_tokens: dict[int, int], rng: random.Random,
                    max_random_tokens: int = 24) -> bytes | None:
    """One walk; the document's bytes, or None when no finishing path was found within the search bound."""
    guide, text = grammar.new_guide(), b""
    row = np.zeros((vocab.size + 31) // 32, dtype=np.int32)
    eos = vocab.eos_token_ids[0]

    def allows(token_id: int) -> bool:
        return bool((row[token_id >> 5] >> (token_id & 31)) & 1)

    def fill() -> None:
        guide.fill_mask(row)
        if getattr(guide, "error", None) is not None:
            raise GrammarTooComplexError(guide.error)

    for _ in range(rng.randrange(max_random_tokens)):
        fill()
        ids = allowed_ids(row, vocab.size)
        _check(len(ids) > 0, "a live guide has an empty mask")
        if eos in ids and rng.random() < 0.3:
            break
        token_id = int(rng.choice(ids[ids != eos])) if len(ids) > 1 or ids[0] != eos else eos
        if token_id == eos:
            break
        _check(guide.advance(token_id), f"the guide refused token {token_id}, which its mask allowed")
        text += vocab.token_bytes[token_id]
    if hasattr(guide, "session"):  # the context-free path: search its configurations
        with guide.session.lock:
            completion = finishing_bytes(guide.session, guide.config, byte_tokens)
    else:
        completion = finishing_bytes(grammar.index, guide.state, byte_tokens)
    if completion is None:
        return None
    for byte in completion:
        fill()
        token_id = byte_tokens[byte]
        _check(allows(token_id), f"the mask refuses byte {byte:#x} on a path to acceptance")
        _check(guide.advance(token_id), f"the guide refused byte {byte:#x} on a path to acceptance")
    fill()
    _check(allows(eos) and guide.is_accepting(), "EOS is not allowed in an accepting state")
    _check(guide.advance(eos) and guide.is_finished(), "the guide did not finish on EOS")
    return text + completion

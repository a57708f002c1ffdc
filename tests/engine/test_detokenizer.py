"""IncrementalDetokenizer: a run of tokens added at once gives what adding them one by one gives."""

import random

import pytest

from corral.engine.detokenizer import IncrementalDetokenizer
from corral.fsm.vocabulary import Vocabulary

# single bytes (every lead and continuation byte of UTF-8, and bytes never valid in it), whole characters of 1 to 4
# bytes, characters cut in two, and two specials: runs split characters across tokens and hold invalid bytes
PIECES = [bytes([b]) for b in range(256)] + [
    "é".encode(), "€".encode(), "😀".encode(), "😀".encode()[:2], "😀".encode()[2:], "€".encode()[:1],
    "ab", "the end", "\n\n", " x",
]
VOCAB = Vocabulary(tuple(p if isinstance(p, bytes) else p.encode() for p in PIECES) + (b"<s>", b"</s>"),
                   frozenset({len(PIECES), len(PIECES) + 1}), (len(PIECES) + 1,))


def one_by_one(tokens, stop, skip):
    detok = IncrementalDetokenizer(VOCAB, stop, skip)
    for i, token in enumerate(tokens):
        hit = detok.add_token(token)
        if hit is not None:
            return detok, i + 1, hit
    return detok, len(tokens), None


@pytest.mark.parametrize("stop", [(), ("the end",), ("\n\n", "é")])
@pytest.mark.parametrize("skip", [True, False])
def test_a_run_added_at_once_is_the_same_as_one_token_at_a_time(stop, skip):
    rng = random.Random(f"{stop}{skip}")
    for _ in range(300):
        tokens = [rng.randrange(VOCAB.size) for _ in range(rng.randrange(1, 12))]
        want, want_used, want_stop = one_by_one(tokens, stop, skip)
        got = IncrementalDetokenizer(VOCAB, stop, skip)
        assert got.add_tokens(tokens) == (want_used, want_stop), tokens
        assert (got.text, got.stopped_by) == (want.text, want.stopped_by), tokens
        if want_stop is None:  # a split character is held the same way: the next token and the end agree too
            tail = [rng.randrange(256)]
            want.add_token(tail[0])
            got.add_tokens(tail)
            want.finish()
            got.finish()
            assert got.text == want.text, tokens + tail


def test_runs_in_turn_build_the_text_of_single_tokens():
    rng = random.Random(3)
    tokens = [rng.randrange(VOCAB.size) for _ in range(2000)]
    want, _, _ = one_by_one(tokens, (), True)
    got = IncrementalDetokenizer(VOCAB)
    at = 0
    while at < len(tokens):
        size = rng.randrange(1, 17)
        assert got.add_tokens(tokens[at: at + size]) == (len(tokens[at: at + size]), None)
        at += size
    assert got.text == want.text and "\ufffd" in got.text  # invalid bytes were met, and replaced alike

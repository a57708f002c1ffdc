"""Vocabulary: every token id mapped to its exact bytes, plus which ids a grammar may never allow.

Three vocabulary families are read:

- byte-level BPE (GPT-2 style): each byte is spelled by one printable character (``Ġ`` is space, ``Ċ`` newline);
- SentencePiece: ``▁`` is a space and ``<0xNN>`` pieces are single raw bytes (byte fallback);
- tiktoken rank files: base64 of the raw bytes, one token a line.

Special (control) tokens and ids with no bytes are never allowed by a grammar; the EOS ids are allowed exactly in
accepting states. What this leaves out: normalisers (NFC, lower-casing) are not applied, since a grammar
constrains the bytes the model emits, not the text the tokenizer read.
"""

import base64
import functools
import hashlib
from dataclasses import dataclass
from typing import Iterable

import numpy as np


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """The GPT-2 map from the printable character that spells a byte back to the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:  # bytes that are not printable are spelled by the code points from 256 up, in byte order
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def byte_level_piece_to_bytes(piece: str) -> bytes:
    decoder = _byte_level_decoder()
    if all(c in decoder for c in piece):
        return bytes(decoder[c] for c in piece)
    return piece.encode("utf-8")  # an added token written as plain text


def sentencepiece_piece_to_bytes(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


@dataclass(frozen=True, eq=False)
class Vocabulary:
    """Token id → exact bytes. Immutable and shared; its ``hash`` keys the compiled-grammar cache."""

    token_bytes: tuple[bytes, ...]
    special_ids: frozenset[int]  # never allowed by a grammar: control tokens and ids with no bytes
    eos_token_ids: tuple[int, ...]
    added_ids: frozenset[int] = frozenset()  # added tokens that are plain text (allowed like any other)

    def __post_init__(self):
        assert self.eos_token_ids, "a vocabulary needs at least one EOS id"
        assert all(0 <= i < len(self.token_bytes) for i in self.eos_token_ids), self.eos_token_ids
        empty = {i for i, b in enumerate(self.token_bytes) if not b}
        object.__setattr__(self, "special_ids", frozenset(self.special_ids) | empty)

    @property
    def size(self) -> int:
        return len(self.token_bytes)

    @functools.cached_property
    def hash(self) -> str:
        h = hashlib.sha256()
        h.update(np.asarray([len(b) for b in self.token_bytes], dtype=np.int64).tobytes())
        h.update(b"".join(self.token_bytes))
        h.update(repr((sorted(self.special_ids), self.eos_token_ids)).encode())
        return h.hexdigest()

    @functools.cached_property
    def lengths(self) -> np.ndarray:
        """int32 [size]: byte length of each token."""
        return np.fromiter((len(b) for b in self.token_bytes), dtype=np.int32, count=self.size)

    @functools.cached_property
    def byte_matrix(self) -> np.ndarray:
        """uint8 [size, max_len]: token bytes, zero padded on the right (``lengths`` says where each ends)."""
        matrix = np.zeros((self.size, int(self.lengths.max(initial=1))), dtype=np.uint8)
        flat = np.frombuffer(b"".join(self.token_bytes), dtype=np.uint8)
        rows = np.repeat(np.arange(self.size), self.lengths)
        cols = np.arange(flat.size) - np.repeat(np.cumsum(self.lengths) - self.lengths, self.lengths)
        matrix[rows, cols] = flat
        return matrix

    @functools.cached_property
    def grammar_token_ids(self) -> np.ndarray:
        """int64: the ids a grammar may ever allow (everything but special and empty tokens)."""
        allowed = np.ones(self.size, dtype=bool)
        allowed[list(self.special_ids)] = False
        return np.flatnonzero(allowed)

    @classmethod
    def from_token_bytes(cls, token_bytes: Iterable[bytes], special_ids: Iterable[int] = (),
                         eos_token_ids: Iterable[int] = ()) -> "Vocabulary":
        return cls(tuple(token_bytes), frozenset(special_ids), tuple(eos_token_ids))

    @classmethod
    def from_byte_level_pieces(cls, pieces: Iterable[str], special_ids: Iterable[int],
                               eos_token_ids: Iterable[int], added_ids: Iterable[int] = ()) -> "Vocabulary":
        return cls._from_pieces(pieces, byte_level_piece_to_bytes, special_ids, eos_token_ids, added_ids)

    @classmethod
    def from_sentencepiece_pieces(cls, pieces: Iterable[str], special_ids: Iterable[int],
                                  eos_token_ids: Iterable[int], added_ids: Iterable[int] = ()) -> "Vocabulary":
        return cls._from_pieces(pieces, sentencepiece_piece_to_bytes, special_ids, eos_token_ids, added_ids)

    @classmethod
    def _from_pieces(cls, pieces, piece_to_bytes, special_ids, eos_token_ids, added_ids) -> "Vocabulary":
        special = frozenset(special_ids)  # control tokens are spelled as their text, never through the byte map
        token_bytes = tuple(p.encode("utf-8") if i in special else piece_to_bytes(p) for i, p in enumerate(pieces))
        return cls(token_bytes, special, tuple(eos_token_ids), frozenset(added_ids))

    @classmethod
    def from_tiktoken_file(cls, path: str, special_tokens: dict[str, int],
                           eos_token_ids: Iterable[int]) -> "Vocabulary":
        """A tiktoken rank file (``base64 rank`` lines) plus its special tokens; gaps become empty ids."""
        ranks: dict[int, bytes] = {}
        with open(path, "rb") as f:
            for line in f:
                if line.strip():
                    encoded, rank = line.split()
                    ranks[int(rank)] = base64.b64decode(encoded)
        for text, rank in special_tokens.items():
            ranks[rank] = text.encode("utf-8")
        token_bytes = tuple(ranks.get(i, b"") for i in range(max(ranks) + 1))
        return cls(token_bytes, frozenset(special_tokens.values()), tuple(eos_token_ids))

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "Vocabulary":
        """From a :class:`corral.models.Tokenizer` (byte-level BPE or SentencePiece)."""
        build = cls.from_byte_level_pieces if tokenizer.kind == "byte_level" else cls.from_sentencepiece_pieces
        return build(tokenizer.pieces, tokenizer.special_ids, tokenizer.eos_token_ids)

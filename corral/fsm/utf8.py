"""Code point ranges → UTF-8 byte-range sequences, so an automaton over bytes can match Unicode classes.

``utf8_sequences(lo, hi)`` yields sequences of byte ranges; the strings they match are exactly the UTF-8
encodings of the code points in ``[lo, hi]``, surrogates (U+D800–U+DFFF, which UTF-8 cannot carry) left out.
The split follows the usual scheme: cut the range at encoding-length boundaries, then wherever the low and
high code points disagree above a continuation-byte boundary, until every byte position is an independent range.
"""

from collections.abc import Iterator

ByteRanges = tuple[tuple[int, int], ...]

_LENGTH_LIMITS = (0x7F, 0x7FF, 0xFFFF, 0x10FFFF)
_SURROGATES = (0xD800, 0xDFFF)


def utf8_sequences(lo: int, hi: int) -> Iterator[ByteRanges]:
    """Byte-range sequences covering the UTF-8 encodings of code points ``lo..hi`` (inclusive), in order."""
    assert 0 <= lo <= hi <= 0x10FFFF, (lo, hi)
    for start, end in _without_surrogates(lo, hi):
        yield from _split(start, end)


def _without_surrogates(lo: int, hi: int) -> list[tuple[int, int]]:
    parts = []
    if lo < _SURROGATES[0]:
        parts.append((lo, min(hi, _SURROGATES[0] - 1)))
    if hi > _SURROGATES[1]:
        parts.append((max(lo, _SURROGATES[1] + 1), hi))
    return parts


def _split(lo: int, hi: int) -> Iterator[ByteRanges]:
    for limit in _LENGTH_LIMITS[:-1]:
        if lo <= limit < hi:  # the range spans two encoding lengths
            yield from _split(lo, limit)
            yield from _split(limit + 1, hi)
            return
    if hi <= 0x7F:
        yield ((lo, hi),)
        return
    num_bytes = len(chr(lo).encode("utf-8", "surrogatepass"))
    for i in range(1, num_bytes):
        mask = (1 << (6 * i)) - 1
        if lo & ~mask != hi & ~mask:
            if lo & mask:
                yield from _split(lo, lo | mask)
                yield from _split((lo | mask) + 1, hi)
                return
            if hi & mask != mask:
                yield from _split(lo, (hi & ~mask) - 1)
                yield from _split(hi & ~mask, hi)
                return
    low_bytes = chr(lo).encode("utf-8", "surrogatepass")
    high_bytes = chr(hi).encode("utf-8", "surrogatepass")
    yield tuple(zip(low_bytes, high_bytes))

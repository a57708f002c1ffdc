"""The regex AST: the one language representation that every constraint compiles to.

Nodes are immutable and hashable, over Unicode code points; the automaton layer encodes code points as
UTF-8 bytes. ``Intersect`` is beyond what a textual regex can say (JSON Schema needs it for ``pattern`` together
with ``minLength``); everything else prints back to a Python ``re`` pattern with :func:`to_python_regex`, which
the tests use as an oracle.
"""

from dataclasses import dataclass

MAX_CODE_POINT = 0x10FFFF


@dataclass(frozen=True)
class CharSet:
    """A set of code points as sorted, disjoint, non-adjacent inclusive ranges. Empty matches nothing."""

    ranges: tuple[tuple[int, int], ...]

    @staticmethod
    def of(*ranges: tuple[int, int]) -> "CharSet":
        merged: list[list[int]] = []
        for lo, hi in sorted(ranges):
            assert 0 <= lo <= hi <= MAX_CODE_POINT, (lo, hi)
            if merged and lo <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        return CharSet(tuple((lo, hi) for lo, hi in merged))

    @staticmethod
    def chars(text: str) -> "CharSet":
        return CharSet.of(*((ord(c), ord(c)) for c in text))

    def negate(self) -> "CharSet":
        out, start = [], 0
        for lo, hi in self.ranges:
            if lo > start:
                out.append((start, lo - 1))
            start = hi + 1
        if start <= MAX_CODE_POINT:
            out.append((start, MAX_CODE_POINT))
        return CharSet(tuple(out))

    def union(self, other: "CharSet") -> "CharSet":
        return CharSet.of(*self.ranges, *other.ranges)

    def __contains__(self, code_point: int) -> bool:
        return any(lo <= code_point <= hi for lo, hi in self.ranges)


@dataclass(frozen=True)
class Concat:
    parts: tuple["Node", ...]


@dataclass(frozen=True)
class Alt:
    options: tuple["Node", ...]


@dataclass(frozen=True)
class Repeat:
    """``node`` repeated between ``min`` and ``max`` times (``max=None``: unbounded)."""

    node: "Node"
    min: int
    max: int | None

    def __post_init__(self):
        assert self.min >= 0 and (self.max is None or self.max >= self.min), (self.min, self.max)


@dataclass(frozen=True)
class Intersect:
    """Strings matched by every part (product automaton)."""

    parts: tuple["Node", ...]


@dataclass(frozen=True)
class Ref:
    """A named rule of a context-free grammar, standing where a recursive ``$ref`` recurs. Never reaches an
    automaton: :mod:`corral.grammar.schema_grammar` turns a tree holding refs into grammar rules."""

    name: str


Node = CharSet | Concat | Alt | Repeat | Intersect | Ref

EMPTY = Concat(())  # matches the empty string
NOTHING = CharSet(())  # matches no string


def literal(text: str) -> Node:
    return Concat(tuple(CharSet.of((ord(c), ord(c))) for c in text))


def seq(*parts: Node) -> Node:
    return parts[0] if len(parts) == 1 else Concat(parts)


def alt(*options: Node) -> Node:
    return options[0] if len(options) == 1 else Alt(options)


def optional(node: Node) -> Node:
    return Repeat(node, 0, 1)


def _escape_code_point(cp: int) -> str:
    char = chr(cp)
    if char.isalnum() and cp < 128:
        return char
    return f"\\U{cp:08x}" if cp > 0xFFFF else f"\\u{cp:04x}"


def to_python_regex(node: Node) -> str:
    """Print ``node`` as a Python ``re`` pattern with the same language (for tests; ``Intersect`` is refused)."""
    if isinstance(node, CharSet):
        if not node.ranges:
            return "[^\\s\\S]"
        if len(node.ranges) == 1 and node.ranges[0][0] == node.ranges[0][1]:
            return _escape_code_point(node.ranges[0][0])
        body = "".join(_escape_code_point(lo) if lo == hi else f"{_escape_code_point(lo)}-{_escape_code_point(hi)}"
                       for lo, hi in node.ranges)
        return f"[{body}]"
    if isinstance(node, Concat):
        return "".join(f"(?:{to_python_regex(p)})" if isinstance(p, Alt) else to_python_regex(p) for p in node.parts)
    if isinstance(node, Alt):
        return "(?:" + "|".join(to_python_regex(o) for o in node.options) + ")"
    if isinstance(node, Repeat):
        upper = "" if node.max is None else str(node.max)
        return f"(?:{to_python_regex(node.node)}){{{node.min},{upper}}}"
    raise TypeError(f"{type(node).__name__} has no Python regex form")

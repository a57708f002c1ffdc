"""JSON strings as regex ASTs: every JSON spelling of a set of decoded strings.

String keywords (``minLength``/``maxLength``, ``pattern``, ``format``, ``enum`` of strings, property names) all
speak of the *decoded* value, while the automaton reads the JSON text. So each constraint is first written as an
AST over decoded code points, intersected there, and then :func:`spell` maps every character class to all of its
JSON spellings in one AST transform: the raw character where JSON allows it, the short escape (``\\"`` ``\\\\``
``\\/`` ``\\b`` ``\\f`` ``\\n`` ``\\r`` ``\\t``), ``\\uXXXX`` with hex digits in either case, and a UTF-16 surrogate
pair for characters beyond the BMP. Every spelling unit decodes to exactly one character and no unit is a prefix
of another, so the transform is exact: a body is accepted iff its decoded value is in the language, and
``maxLength`` counts characters of the decoded value (an escape is one character, as ``jsonschema`` counts).

Left out: lone surrogates (``\\ud800`` without its pair), which decode to no Unicode character.
"""

import functools
import json

from corral.grammar.json_numbers import fixed_width_range, hex_digits
from corral.grammar.node_builder import NodeBuilder, share
from corral.grammar.regex_ast import MAX_CODE_POINT, Alt, CharSet, Concat, Intersect, Node, Repeat

SURROGATES = CharSet.of((0xD800, 0xDFFF))
ANY_CHAR = SURROGATES.negate()  # every Unicode scalar value
_RAW = CharSet.of((0x20, 0x21), (0x23, 0x5B), (0x5D, 0xD7FF), (0xE000, MAX_CODE_POINT))  # no '"', '\', C0 controls
_SHORT_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "\b": "b", "\f": "f", "\n": "n", "\r": "r", "\t": "t"}
QUOTE = CharSet.chars('"')
_ASCII = CharSet.of((0, 0x7F))
_BEYOND_ASCII = _ASCII.negate()


def intersect_chars(a: CharSet, b: CharSet) -> CharSet:
    return a.negate().union(b.negate()).negate()


def _u_escape(b: NodeBuilder, low: int, high: int) -> Node:
    """``\\uXXXX`` for every 16-bit value in ``[low, high]``."""
    digits = lambda v: [(v >> shift) & 15 for shift in (12, 8, 4, 0)]  # noqa: E731
    return b.concat(b.literal("\\u"), fixed_width_range(b, digits(low), digits(high), 16, hex_digits))


def _astral_escapes(b: NodeBuilder, low: int, high: int) -> Node:
    """Surrogate-pair escapes of the code points in ``[low, high]`` (all beyond the BMP)."""
    (high_a, low_a), (high_z, low_z) = divmod(low - 0x10000, 0x400), divmod(high - 0x10000, 0x400)
    pair = lambda h1, h2, l1, l2: b.concat(_u_escape(b, 0xD800 + h1, 0xD800 + h2),  # noqa: E731
                                           _u_escape(b, 0xDC00 + l1, 0xDC00 + l2))
    if high_a == high_z:
        return pair(high_a, high_a, low_a, low_z)
    options = [pair(high_a, high_a, low_a, 0x3FF), pair(high_z, high_z, 0, low_z)]
    if high_a + 1 <= high_z - 1:
        options.append(pair(high_a + 1, high_z - 1, 0, 0x3FF))
    return b.alt(options)


def spell_chars(b: NodeBuilder, chars: CharSet) -> Node:
    """Every JSON spelling (inside a string) of every character in ``chars``."""
    return _shared_spelling(chars)


@functools.lru_cache(maxsize=8192)
def _shared_spelling(chars: CharSet) -> Node:
    """Spellings are immutable, so every schema shares them (about 0.3 ms each to build; patterns and formats
    have hundreds of classes). Built outside any schema's budget; the schema's builder counts them on use.

    A class with characters on both sides of U+0080 is spelled as its ASCII part or its part beyond: the spelling
    of a class is the union of its characters' spellings, so the language is the same. Classes that differ in a
    few ASCII characters (the escape hatch at each node of a property-name trie) then share the spelling of the
    part beyond ASCII, most of the AST, as one node object, which the automaton layer converts once per grammar."""
    b = NodeBuilder(max_nodes=1 << 40)
    ascii_part, beyond = intersect_chars(chars, _ASCII), intersect_chars(chars, _BEYOND_ASCII)
    if ascii_part.ranges and beyond.ranges:
        return share(b.alt([_shared_spelling(ascii_part), _shared_spelling(beyond)]))
    return share(_spell_chars(b, chars))


def _spell_chars(b: NodeBuilder, chars: CharSet) -> Node:
    options: list[Node] = [intersect_chars(chars, _RAW)]
    options += [b.literal("\\" + esc) for char, esc in _SHORT_ESCAPES.items() if ord(char) in chars]
    for low, high in intersect_chars(chars, ANY_CHAR).ranges:
        if low <= 0xFFFF:
            options.append(_u_escape(b, low, min(high, 0xFFFF)))
        if high > 0xFFFF:
            options.append(_astral_escapes(b, max(low, 0x10000), high))
    return b.alt(options)


def spell(b: NodeBuilder, node: Node, memo: dict | None = None) -> Node:
    """The language of JSON string bodies whose decoded value is in ``node``'s language."""
    memo = b.cache.setdefault("spell", {}) if memo is None else memo
    hit = memo.get(id(node)) or _STABLE.get(id(node))
    if hit is not None:
        return hit[1]
    if isinstance(node, CharSet):
        out = spell_chars(b, node)
    elif isinstance(node, Concat):
        out = b.concat(*(spell(b, p, memo) for p in node.parts))
    elif isinstance(node, Repeat):
        out = b.repeat(spell(b, node.node, memo), node.min, node.max)
    elif isinstance(node, Intersect):
        out = b.intersect(*(spell(b, p, memo) for p in node.parts))
    else:
        out = b.alt([spell(b, o, memo) for o in node.options])
    memo[id(node)] = (node, out)
    return out


_HEX = CharSet.of((48, 57), (65, 70), (97, 102))
# A spelling unit that does not pair surrogate escapes: a pair counts as two units, and lone surrogates pass.
# Sound wherever at most an upper bound on the length applies (the decoded value is never longer than the count
# of units), and about a tenth the size of the exact unit, so plain strings use it.
LOOSE_UNIT = Alt((_RAW, Concat((CharSet.chars("\\"), CharSet.chars('"\\/bfnrt'))),
                  Concat((CharSet.chars("\\"), CharSet.chars("u"), _HEX, _HEX, _HEX, _HEX))))


def loose_string_node(b: NodeBuilder, max_length: int | None) -> Node:
    """JSON strings of at most ``max_length`` characters and no other constraint (see ``LOOSE_UNIT``)."""
    key = ("loose_string", max_length)
    if key not in b.cache:
        if max_length is None:  # every string of any-value and every plain string property: one node per process
            b.count(_ANY_STRING)
            b.cache[key] = _ANY_STRING
        else:
            b.cache[key] = b.concat(QUOTE, b.repeat(LOOSE_UNIT, 0, max_length), QUOTE)
    return b.cache[key]


_ANY_STRING = share(Concat((QUOTE, Repeat(LOOSE_UNIT, 0, None), QUOTE)))


_STABLE: dict[int, tuple[Node, Node]] = {}  # id -> (node living as long as the process, its spelling)


def register_stable(node: Node) -> Node:
    """Spell a node that lives as long as the process (a ``format``) once, for every schema that uses it."""
    if id(node) not in _STABLE:
        _STABLE[id(node)] = (node, spell(NodeBuilder(max_nodes=1 << 40), node, {}))
    return node


def length_node(b: NodeBuilder, min_length: int, max_length: int | None) -> Node:
    """Decoded strings of ``min_length..max_length`` characters."""
    return b.repeat(ANY_CHAR, min_length, max_length)


def string_node(b: NodeBuilder, decoded: Node) -> Node:
    """A whole JSON string (quotes included) whose decoded value is in ``decoded``'s language."""
    return b.concat(QUOTE, spell(b, decoded), QUOTE)


def string_literal(b: NodeBuilder, value: str) -> Node:
    """One string value (``enum``/``const`` members, property names), spelled as ``json.dumps`` writes it
    (ensure_ascii), or with its non-ASCII characters raw. A deliberate narrowing of :func:`spell`: a literal
    spelled every way costs about ten times the automaton, and these two spellings are what encoders emit."""
    key = ("string_literal", value)
    if key not in b.cache:
        b.cache[key] = _string_literal(b, value)
    return b.cache[key]


def _string_literal(b: NodeBuilder, value: str) -> Node:
    units = []
    for char in value:
        canonical = json.dumps(char)[1:-1]
        if ord(char) < 0x80 or 0xD800 <= ord(char) <= 0xDFFF:
            units.append(b.literal(canonical))
        else:
            units.append(b.alt([CharSet.of((ord(char), ord(char))), b.literal(canonical)]))
    return b.concat(QUOTE, *units, QUOTE)

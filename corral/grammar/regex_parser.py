"""Regex text → regex AST, for Python ``re`` syntax and the ECMA-262 subset that JSON Schema ``pattern`` uses.

Supported: literals, classes and negated classes, ``\\d \\w \\s`` and their negations (Unicode meanings for
Python, ASCII for ECMA), ``.``, escapes (``\\n \\t \\xNN \\uXXXX \\u{X} \\UXXXXXXXX \\cX``), quantifiers
``* + ? {m} {m,} {m,n}`` and their lazy forms (laziness does not change the language), alternation, groups
(capturing, ``(?:``, named), ``(?#comments)`` and the anchors ``^ $`` (plus ``\\A \\Z`` for Python).

Left out, refused with :class:`UnsupportedRegexError` naming the construct and its offset: lookaround,
backreferences, word boundaries, atomic groups, possessive quantifiers, inline flags, anchors inside a
repetition. ``$`` means the end of the text; Python's ``$`` also matches before a final newline, which a
generation constraint has no use for.

``search=True`` gives JSON Schema ``pattern`` semantics: the pattern may match anywhere unless anchored.
"""

import functools
from typing import Literal

from corral.errors import InvalidRegexError, UnsupportedRegexError
from corral.grammar.node_builder import MAX_REPEAT_COUNT, count_text, repeat_count
from corral.grammar.regex_ast import EMPTY, MAX_CODE_POINT, NOTHING, Alt, CharSet, Concat, Node, Repeat

Flavor = Literal["python", "ecma"]

ANY_CHAR = CharSet.of((0, MAX_CODE_POINT))
_ECMA_SPACE = CharSet.of((9, 13), (32, 32), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
                         (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF))
_ECMA_CLASSES = {"d": CharSet.of((48, 57)), "w": CharSet.of((48, 57), (65, 90), (95, 95), (97, 122)),
                 "s": _ECMA_SPACE}
_SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}
_UNSUPPORTED_GROUPS = (("(?=", "lookahead"), ("(?!", "negative lookahead"), ("(?<=", "lookbehind"),
                       ("(?<!", "negative lookbehind"), ("(?P=", "backreference"), ("(?>", "atomic group"),
                       ("(?(", "conditional group"))


@functools.cache
def _python_class(letter: str) -> CharSet:
    """Python's Unicode meaning of ``\\d``, ``\\w`` or ``\\s``, found by asking ``str`` about every code point."""
    test = {"d": str.isdecimal, "w": lambda c: c.isalnum() or c == "_", "s": str.isspace}[letter]
    ranges, start = [], None
    for cp in range(MAX_CODE_POINT + 2):
        inside = cp <= MAX_CODE_POINT and test(chr(cp))
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            ranges.append((start, cp - 1))
            start = None
    return CharSet(tuple(ranges))


# A variant is one way of matching: (needs the match to start the text, needs it to end the text, node).
_Variant = tuple[bool, bool, Node]


class _Parser:
    def __init__(self, pattern: str, flavor: Flavor, dotall: bool = False):
        assert flavor in ("python", "ecma"), flavor
        self.pattern, self.flavor, self.pos, self.dotall = pattern, flavor, 0, dotall

    # ---- helpers -------------------------------------------------------------------------------------------
    def error(self, message: str, offset: int | None = None):
        return InvalidRegexError(message, pattern=self.pattern, offset=self.pos if offset is None else offset)

    def unsupported(self, construct: str, offset: int):
        return UnsupportedRegexError(f"{construct} is not supported",
                                     pattern=self.pattern, offset=offset)

    def peek(self, text: str) -> bool:
        return self.pattern.startswith(text, self.pos)

    def at_end(self) -> bool:
        return self.pos >= len(self.pattern)

    # ---- grammar ---------------------------------------------------------------------------------------------
    def parse(self) -> list[_Variant]:
        variants = self.alternation()
        if not self.at_end():
            raise self.error("unbalanced parenthesis")
        return variants

    def alternation(self) -> list[_Variant]:
        variants = self.sequence()
        while self.peek("|"):
            self.pos += 1
            variants = variants + self.sequence()
        return variants

    def sequence(self) -> list[_Variant]:
        variants: list[_Variant] = [(False, False, EMPTY)]
        while not self.at_end() and not self.peek("|") and not self.peek(")"):
            start = self.pos
            atom = self.atom()
            atom = self.quantified(atom, start)
            variants = _concat_variants(variants, atom)
        return variants

    def quantified(self, atom: list[_Variant], atom_start: int) -> list[_Variant]:
        bounds = self.quantifier()
        if bounds is None:
            return atom
        if any(begin or end for begin, end, _ in atom):
            raise self.unsupported("an anchor inside a repetition", atom_start)
        low, high = bounds
        if self.peek("?"):
            self.pos += 1  # lazy: same language
        elif self.peek("+"):
            raise self.unsupported("a possessive quantifier", self.pos)
        if self.quantifier_ahead():
            raise self.error("multiple repeat")
        return [(False, False, _repeat(atom[0][2] if len(atom) == 1 else Alt(tuple(n for _, _, n in atom)),
                                       low, high))]

    def quantifier_ahead(self) -> bool:
        saved = self.pos
        found = self.quantifier() is not None
        self.pos = saved
        return found

    def quantifier(self) -> tuple[int, int | None] | None:
        if self.at_end():
            return None
        char = self.pattern[self.pos]
        if char in "*+?":
            self.pos += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
        if char == "{":
            return self.braces()
        return None

    def braces(self) -> tuple[int, int | None] | None:
        """``{m}``, ``{m,}``, ``{m,n}`` (and ``{,n}`` in Python); anything else is a literal ``{``."""
        end = self.pattern.find("}", self.pos)
        if end < 0:
            return None
        body = self.pattern[self.pos + 1:end]
        low_text, comma, high_text = body.partition(",")
        if not low_text.isdigit() and not (self.flavor == "python" and comma and low_text == ""):
            return None
        if not (high_text == "" or high_text.isdigit()) or not (low_text + high_text).isascii():
            return None
        # the schema path's bound on counts (the native automaton's are 32-bit; past the bound none would compile
        # inside the budget anyway): a valid regex that Corral does not compile
        for text in (low_text, high_text):
            if text and repeat_count(text) is None:
                raise UnsupportedRegexError(f"a repeat count of {count_text(text)} is past the limit of "
                                            f"{MAX_REPEAT_COUNT}", pattern=self.pattern, offset=self.pos)
        low = int(low_text) if low_text else 0
        high = (None if high_text == "" else int(high_text)) if comma else low
        if high is not None and high < low:
            raise self.error("min repeat greater than max repeat", self.pos)
        self.pos = end + 1
        return low, high

    def atom(self) -> list[_Variant]:
        start = self.pos
        char = self.pattern[self.pos]
        if char == "(":
            return self.group()
        if char in "*+?" or (char == "{" and self.quantifier_ahead()):
            raise self.error("nothing to repeat")
        self.pos += 1
        if char == "^":
            return [(True, False, EMPTY)]
        if char == "$":
            return [(False, True, EMPTY)]
        if char == ".":
            if self.dotall:
                return _single(ANY_CHAR)
            excluded = "\n" if self.flavor == "python" else "\n\r\u2028\u2029"
            return _single(CharSet.chars(excluded).negate())
        if char == "[":
            return _single(self.char_class(start))
        if char == "\\":
            return self.escape(start)
        if char == ")":
            raise self.error("unbalanced parenthesis", start)
        return _single(CharSet.chars(char))

    def group(self) -> list[_Variant]:
        start = self.pos
        for prefix, construct in _UNSUPPORTED_GROUPS:
            if self.peek(prefix):
                raise self.unsupported(construct, start)
        if self.peek("(?#"):
            end = self.pattern.find(")", self.pos)
            if end < 0:
                raise self.error("missing ), unterminated comment", start)
            self.pos = end + 1
            return [(False, False, EMPTY)]
        if self.peek("(?:"):
            self.pos += 3
        elif self.peek("(?P<") or self.peek("(?<"):
            end = self.pattern.find(">", self.pos)
            name = self.pattern[self.pattern.index("<", self.pos) + 1:end] if end > 0 else ""
            if end < 0 or not name.isidentifier():
                raise self.error("bad group name", start)
            self.pos = end + 1
        elif self.peek("(?"):
            raise self.unsupported("an inline flag group", start)
        else:
            self.pos += 1
        variants = self.alternation()
        if not self.peek(")"):
            raise self.error("missing ), unterminated subpattern", start)
        self.pos += 1
        return variants

    def escape(self, start: int) -> list[_Variant]:
        if self.at_end():
            raise self.error("bad escape (end of pattern)", start)
        char = self.pattern[self.pos]
        if char in "bB":
            raise self.unsupported("a word boundary", start)
        if char.isdigit() and char != "0":
            raise self.unsupported("a backreference", start)
        if char == "k" and self.peek("k<"):
            raise self.unsupported("a backreference", start)
        if self.flavor == "python" and char in "AZ":
            self.pos += 1
            return [(char == "A", char == "Z", EMPTY)]
        return _single(self.class_escape(start, in_class=False))

    def class_escape(self, start: int, *, in_class: bool) -> CharSet:
        """The escape after a backslash at ``start`` (the cursor is just past the backslash)."""
        char = self.pattern[self.pos]
        self.pos += 1
        if char.lower() in "dws":
            chars = _python_class(char.lower()) if self.flavor == "python" else _ECMA_CLASSES[char.lower()]
            return chars.negate() if char.isupper() else chars
        if char in _SIMPLE_ESCAPES and not (char == "a" and self.flavor == "ecma"):
            return CharSet.chars(_SIMPLE_ESCAPES[char])
        if char == "b" and in_class:
            return CharSet.chars("\b")
        if char == "0":
            if self.flavor == "python":
                digits = self.take_digits("01234567", 2)
                return CharSet.chars(chr(int("0" + digits, 8)))
            return CharSet.chars("\0")
        if char == "x":
            return CharSet.chars(chr(self.hex_digits(2, start)))
        if char == "u":
            if self.flavor == "ecma" and self.peek("{"):
                end = self.pattern.find("}", self.pos)
                code = self.pattern[self.pos + 1:end] if end > 0 else ""
                if not code or any(c not in "0123456789abcdefABCDEF" for c in code) or int(code, 16) > MAX_CODE_POINT:
                    raise self.error("bad \\u{...} escape", start)
                self.pos = end + 1
                return CharSet.chars(chr(int(code, 16)))
            return CharSet.chars(chr(self.hex_digits(4, start)))
        if char == "U" and self.flavor == "python":
            code = self.hex_digits(8, start)
            if code > MAX_CODE_POINT:
                raise self.error("bad escape \\U", start)
            return CharSet.chars(chr(code))
        if char == "c" and self.flavor == "ecma" and not self.at_end() and self.pattern[self.pos].isascii() \
                and self.pattern[self.pos].isalpha():
            self.pos += 1
            return CharSet.chars(chr(ord(self.pattern[self.pos - 1]) % 32))
        if char == "N" and self.flavor == "python":
            raise self.unsupported("a named character escape", start)
        if char.isascii() and char.isalnum():
            raise self.error(f"bad escape \\{char}", start)
        return CharSet.chars(char)

    def take_digits(self, alphabet: str, limit: int) -> str:
        taken = ""
        while len(taken) < limit and not self.at_end() and self.pattern[self.pos] in alphabet:
            taken += self.pattern[self.pos]
            self.pos += 1
        return taken

    def hex_digits(self, count: int, start: int) -> int:
        digits = self.take_digits("0123456789abcdefABCDEF", count)
        if len(digits) != count:
            raise self.error(f"incomplete escape, expected {count} hex digits", start)
        return int(digits, 16)

    def char_class(self, start: int) -> CharSet:
        negated = self.peek("^")
        self.pos += negated
        members = NOTHING
        first = True
        while True:
            if self.at_end():
                raise self.error("unterminated character set", start)
            if self.peek("]") and not (first and self.flavor == "python"):
                self.pos += 1
                break
            first = False
            low = self.class_atom()
            if self.peek("-") and not self.pattern.startswith("]", self.pos + 1) and self.pos + 1 < len(self.pattern):
                dash = self.pos
                self.pos += 1
                high = self.class_atom()
                if not _is_single(low) or not _is_single(high):
                    if self.flavor == "python":
                        raise self.error("bad character range", dash)
                    members = members.union(low).union(high).union(CharSet.chars("-"))
                    continue
                if high.ranges[0][0] < low.ranges[0][0]:
                    raise self.error("bad character range", dash)
                low = CharSet.of((low.ranges[0][0], high.ranges[0][0]))
            members = members.union(low)
        return members.negate() if negated else members

    def class_atom(self) -> CharSet:
        start = self.pos
        char = self.pattern[self.pos]
        self.pos += 1
        if char != "\\":
            return CharSet.chars(char)
        if self.at_end():
            raise self.error("bad escape (end of pattern)", start)
        if self.pattern[self.pos] == "B" or (self.pattern[self.pos].isdigit() and self.pattern[self.pos] != "0"):
            raise self.error(f"bad escape \\{self.pattern[self.pos]} in a character class", start)
        return self.class_escape(start, in_class=True)


def _is_single(chars: CharSet) -> bool:
    return len(chars.ranges) == 1 and chars.ranges[0][0] == chars.ranges[0][1]


def _single(node: Node) -> list[_Variant]:
    return [(False, False, node)]


def _repeat(node: Node, low: int, high: int | None) -> Node:
    return node if (low, high) == (1, 1) else Repeat(node, low, high)


def nullable(node: Node) -> bool:
    """Whether ``node`` matches the empty string."""
    if isinstance(node, CharSet):
        return False
    if isinstance(node, Concat):
        return all(nullable(p) for p in node.parts)
    if isinstance(node, Alt):
        return any(nullable(o) for o in node.options)
    if isinstance(node, Repeat):
        return node.min == 0 or nullable(node.node)
    return all(nullable(p) for p in node.parts)


def _append(left: Node, right: Node) -> Node:
    if left == EMPTY:
        return right
    if right == EMPTY:
        return left
    left_parts = left.parts if isinstance(left, Concat) else (left,)
    return Concat(left_parts + (right,))


def _concat_variants(left: list[_Variant], right: list[_Variant]) -> list[_Variant]:
    """Concatenate two variant lists. A ``^`` in the right part forces the left part to match empty; a ``$`` in
    the left part forces the right part to match empty (subtle: that is how ``a^b`` and ``a$b`` die)."""
    out = []
    for left_begin, left_end, left_node in left:
        for right_begin, right_end, right_node in right:
            head, tail = left_node, right_node
            if right_begin and head != EMPTY:
                if not nullable(head):
                    continue
                head = EMPTY
            if left_end and tail != EMPTY:
                if not nullable(tail):
                    continue
                tail = EMPTY
            out.append((left_begin or right_begin, left_end or right_end, _append(head, tail)))
    return out


def parse_regex(pattern: str, *, flavor: Flavor = "python", search: bool = False, dotall: bool = False) -> Node:
    """Parse ``pattern`` into a regex AST over code points.

    ``search=False``: the AST matches exactly the strings ``re.fullmatch`` accepts. ``search=True``: it matches
    the strings in which the pattern occurs (``re.search``), which is JSON Schema ``pattern`` semantics.
    ``dotall``: ``.`` matches a newline too (the ``s`` flag).
    Raises :class:`InvalidRegexError` for malformed text, :class:`UnsupportedRegexError` for constructs beyond
    regular languages, both naming the offset.
    """
    if not isinstance(pattern, str):
        raise InvalidRegexError("a regex must be a string", pattern=repr(pattern), offset=0)
    variants = _Parser(pattern, flavor, dotall).parse()
    options = []
    for begin, end, node in variants:
        if search:
            node = Concat(((EMPTY if begin else Repeat(ANY_CHAR, 0, None)), node,
                           (EMPTY if end else Repeat(ANY_CHAR, 0, None))))
        if node not in options:
            options.append(node)
    if not options:
        return NOTHING
    return options[0] if len(options) == 1 else Alt(tuple(options))

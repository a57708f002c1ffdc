"""GBNF (llama.cpp's grammar format, which XGrammar reads as EBNF) → :class:`corral.grammar.cfg.Grammar`.

Syntax: ``name ::= alternatives`` (names of letters, digits, ``-`` and ``_``), literals ``"..."`` with the
escapes ``\\n \\r \\t \\\\ \\" \\xHH \\uHHHH \\UHHHHHHHH``, classes ``[a-z]`` and ``[^...]``, ``.`` (any
character), groups ``( )``, ``* + ?``, ``{m}``, ``{m,}``, ``{m,n}``, ``{,n}``, ``#`` comments; the start is
``root``. A rule runs until the next ``name ::=``, so alternatives may continue on the next line.

GBNF has no lexer: its language is over characters. So the grammar is lexed exactly (``Grammar.greedy`` False:
a lexeme may end wherever it matches, every cut of the text is kept), and then every part of a rule that names
no other rule (a literal, a class, ``[^"\\]*``) can be one lexeme: the parser only steps where rules meet.
"""

import re

from corral.errors import InvalidGrammarError
from corral.grammar.cfg import Expr, Grammar, GrammarBuilder, merged_lexemes
from corral.grammar.node_builder import MAX_REPEAT_COUNT, count_text, repeat_count
from corral.grammar.regex_ast import MAX_CODE_POINT, CharSet

MAX_GRAMMAR_CHARS = 1 << 20
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
_RULE_START = re.compile(r"[ \t]*([A-Za-z][A-Za-z0-9_-]*)[ \t]*::=", re.MULTILINE)
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-", "^": "^",
            "/": "/", "f": "\f", "v": "\v", "0": "\0"}
ANY = CharSet.of((0, MAX_CODE_POINT))


def looks_like_gbnf(text: str) -> bool:
    """GBNF defines rules with ``::=``, which Lark never does."""
    return _RULE_START.search(text) is not None


class _GbnfParser:
    def __init__(self, text: str, builder: GrammarBuilder):
        self.text, self.pos, self.b = text, 0, builder

    def line(self) -> int:
        return self.text.count("\n", 0, self.pos) + 1

    def error(self, message: str) -> InvalidGrammarError:
        return InvalidGrammarError(f"GBNF grammar: {message} (line {self.line()})")

    def space(self) -> None:
        text = self.text
        while self.pos < len(text):
            char = text[self.pos]
            if char in " \t\r\n":
                self.pos += 1
            elif char == "#":
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end
            else:
                return

    def parse(self) -> None:
        self.space()
        if self.pos >= len(self.text):
            raise self.error("the grammar is empty")
        while self.pos < len(self.text):
            match = _RULE_START.match(self.text, self.pos)
            if match is None:
                raise self.error(f"expected 'name ::=' at {self.text[self.pos:self.pos + 20]!r}")
            line = self.line()
            self.pos = match.end()
            self.b.add_rule(match.group(1), merged_lexemes(self.alternatives(nested=False)), line)
            self.space()

    def at_rule_start(self) -> bool:
        return _RULE_START.match(self.text, self.pos) is not None

    def alternatives(self, nested: bool) -> Expr:
        options = [self.sequence(nested)]
        while self.pos < len(self.text) and self.text[self.pos] == "|":
            self.pos += 1
            options.append(self.sequence(nested))
        return options[0] if len(options) == 1 else ("alt", tuple(options))

    def sequence(self, nested: bool) -> Expr:
        items: list[Expr] = []
        while True:
            self.space()
            if self.pos >= len(self.text) or self.text[self.pos] in "|)" or self.at_rule_start():
                break
            items.append(self.postfix(self.atom()))
        if not items:
            return ("empty",)
        return items[0] if len(items) == 1 else ("seq", tuple(items))

    def postfix(self, atom: Expr) -> Expr:
        text = self.text
        while self.pos < len(text):
            char = text[self.pos]
            if char in "*+?":
                self.pos += 1
                atom = ("repeat", atom, 1 if char == "+" else 0, 1 if char == "?" else None)
            elif char == "{":
                end = text.find("}", self.pos)
                body = text[self.pos + 1:end] if end > 0 else ""
                match = re.fullmatch(r"\s*([0-9]*)\s*(,?)\s*([0-9]*)\s*", body)
                if end < 0 or match is None or (not match.group(1) and not match.group(3)):
                    raise self.error(f"bad repetition {text[self.pos:self.pos + 12]!r}")
                for digits in (match.group(1), match.group(3)):
                    if digits and repeat_count(digits) is None:
                        raise self.error(f"a repetition count of {count_text(digits)} is past the limit of "
                                         f"{MAX_REPEAT_COUNT}")
                low = int(match.group(1) or 0)
                high = (int(match.group(3)) if match.group(3) else None) if match.group(2) else low
                if high is not None and high < low:
                    raise self.error(f"the repetition {{{low},{high}}}: the maximum is below the minimum")
                self.pos = end + 1
                atom = ("repeat", atom, low, high)
            else:
                return atom
        return atom

    def atom(self) -> Expr:
        text, start = self.text, self.pos
        char = text[start]
        if char == '"':
            self.pos += 1
            chars = []
            while True:
                if self.pos >= len(text) or text[self.pos] == "\n":
                    raise self.error("a string is not closed")
                if text[self.pos] == '"':
                    self.pos += 1
                    break
                chars.append(self.char())
            if not chars:
                return ("empty",)
            parts = tuple(("chars", CharSet.of((c, c))) for c in chars)
            return parts[0] if len(parts) == 1 else ("seq", parts)
        if char == "[":
            return ("chars", self.char_class())
        if char == ".":
            self.pos += 1
            return ("chars", ANY)
        if char == "(":
            self.pos += 1
            inner = self.alternatives(nested=True)
            self.space()
            if self.pos >= len(text) or text[self.pos] != ")":
                raise self.error("a group is not closed with ')'")
            self.pos += 1
            return inner
        match = _NAME.match(text, start)
        if match is None:
            raise self.error(f"unexpected {char!r}")
        self.pos = match.end()
        return ("name", match.group(), self.line())

    def char(self) -> int:
        text = self.text
        if self.pos >= len(text):
            raise self.error("the grammar ends inside a string or a character class")
        char = text[self.pos]
        self.pos += 1
        if char != "\\":
            return ord(char)
        if self.pos >= len(text):
            raise self.error("the grammar ends inside a string or a character class")
        escape = text[self.pos]
        self.pos += 1
        if escape in _ESCAPES:
            return ord(_ESCAPES[escape])
        digits = {"x": 2, "u": 4, "U": 8}.get(escape)
        if digits is None:
            raise self.error(f"unknown escape \\{escape}")
        hex_text = text[self.pos:self.pos + digits]
        if len(hex_text) != digits or not all(c in "0123456789abcdefABCDEF" for c in hex_text):
            raise self.error(f"\\{escape} needs {digits} hex digits")
        self.pos += digits
        value = int(hex_text, 16)
        if value > MAX_CODE_POINT:
            raise self.error(f"\\{escape}{hex_text} is past the last code point")
        return value

    def char_class(self) -> CharSet:
        text = self.text
        self.pos += 1
        negate = self.pos < len(text) and text[self.pos] == "^"
        self.pos += negate
        ranges = []
        while True:
            if self.pos >= len(text):
                raise self.error("a character class is not closed with ']'")
            if text[self.pos] == "]":
                self.pos += 1
                break
            low = self.char()
            high = low
            if text.startswith("-", self.pos) and not text.startswith("-]", self.pos):
                self.pos += 1
                high = self.char()
                if high < low:
                    raise self.error(f"the range {chr(low)!r}-{chr(high)!r} is reversed")
            ranges.append((low, high))
        chars = CharSet.of(*ranges) if ranges else CharSet(())
        return chars.negate() if negate else chars


def parse_gbnf(text: str, *, start: str = "root") -> Grammar:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidGrammarError(f"GBNF grammar: longer than {MAX_GRAMMAR_CHARS} characters")
    builder = GrammarBuilder(kind="GBNF grammar", greedy=False)
    _GbnfParser(text, builder).parse()
    return builder.build(start)

"""Lark grammar text → :class:`corral.grammar.cfg.Grammar`, in the dialect llguidance defines.

Lark's own syntax: ``rule: a b | c``, continuation lines starting with ``|``, ``TERMINAL: ...`` (upper case),
priorities ``NAME.2``, literals ``"x"`` and ``"x"i``, regexes ``/x/flags`` (flags ``i``, ``s``; ``m``, ``u``, ``l``
change nothing here), ranges ``"a".."z"``, ``(...)``, ``[...]`` (optional), ``? * +``, ``~ n`` and ``~ n..m``,
aliases ``-> name`` (ignored: they name tree nodes), rule modifiers ``? ! _`` (ignored), ``%import common.NAME``
(``-> ALIAS``) and ``%import common (A, B)``, ``%ignore``, ``%declare``. llguidance's additions: ``x{m,n}``
repetition, ``%json { schema }`` inline JSON Schemas, special tokens ``<|name|>`` and ``<[id]>`` / ``<[a-b]>``,
``%llguidance {...}`` (options, ignored), and lexeme options on a definition whose body is terminals only (a rule
then becomes one lexeme): ``[lazy]`` (the shortest match), ``suffix=S`` (lazy, ending with ``S``: a string, a
regex or a terminal), ``stop="s"`` (lazy, ending with ``s``, which the rule does not keep: the text goes on with
``s`` read again as the start of what follows, llguidance's result wherever it needs no backtracking, since a
sent token is never taken back), ``capture``/``stop_capture`` (names for the caller; ignored), ``temperature=``
(ignored, with a warning). A terminal may match the empty string, as in llguidance (``cfg.py``'s
``lexeme_symbol``).

Refused with :class:`InvalidGrammarError` naming the line: templates (llguidance refuses them too),
``%override``/``%extend``, imports from anything but ``common``, ``stop=`` with a regex or ``""`` (the end of
sequence, which llguidance takes back) and ``max_tokens=`` (a bound on tokens, not on text).

Why not lark's own loader: it cannot read llguidance's additions, and it compiles terminal regexes with Python's
``re``. Here every regex goes through Corral's own parser (no user regex reaches a backtracking engine); lark
stays the oracle the tests check this front-end against.
"""

import json
import re

from corral.errors import InvalidRegexError, UserInputError
from corral.grammar.cfg import Expr, Grammar, GrammarBuilder, case_folded
from corral.grammar.node_builder import MAX_REPEAT_COUNT, count_text, repeat_count
from corral.grammar.regex_ast import Alt, CharSet, Concat, Intersect, Node, Repeat
from corral.grammar.regex_parser import parse_regex

MAX_GRAMMAR_CHARS = 1 << 20

_TOKEN = re.compile(r"""
    (?P<ws>[ \t\f\r]+|\\\n)
  | (?P<comment>//[^\n]*|\#[^\n]*)
  | (?P<nl>\n)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<special><\|[^|\n]{1,200}\|>|<\[[0-9]{1,9}(?:-[0-9]{1,9})?\]>)
  | (?P<directive>%[a-z_]+)
  | (?P<name>[!?]?[A-Za-z_][A-Za-z_0-9]*)
  | (?P<number>-?[0-9]+)
  | (?P<op>\.\.|->|[:|()\[\]*+?~{},.=])
""", re.VERBOSE)  # the grammar's own text, linear: no nested quantifiers


class _Tokens:
    def __init__(self, text: str):
        self.items: list[tuple[str, str, int]] = []
        pos, line = 0, 1
        while pos < len(text):
            if text.startswith("%json", pos) or text.startswith("%llguidance", pos):
                directive = "%json" if text.startswith("%json", pos) else "%llguidance"
                self.items.append(("directive", directive, line))
                pos, line = self._json_body(text, pos + len(directive), line)
                continue
            match = _TOKEN.match(text, pos)
            if match is None:
                raise _error(f"unexpected character {text[pos]!r}", line)
            kind = match.lastgroup
            if kind == "nl" or (kind == "ws" and "\n" in match.group()):
                self.items.append(("nl", "", line))
                line += 1
            elif kind not in ("ws", "comment"):
                self.items.append((kind, match.group(), line))
            pos = match.end()
        self.items.append(("nl", "", line))
        self.items.append(("end", "", line))
        self.pos = 0

    def _json_body(self, text: str, pos: int, line: int) -> tuple[int, int]:
        while pos < len(text) and text[pos] in " \t\r\n":
            line += text[pos] == "\n"
            pos += 1
        try:
            value, end = json.JSONDecoder().raw_decode(text, pos)
        except ValueError as exc:
            raise _error(f"the JSON after %json/%llguidance does not parse: {exc}", line) from None
        self.items.append(("json", value, line))
        return end, line + text.count("\n", pos, end)

    def peek(self, offset: int = 0) -> tuple[str, str, int]:
        return self.items[min(self.pos + offset, len(self.items) - 1)]

    def next(self) -> tuple[str, str, int]:
        item = self.items[self.pos]
        self.pos += 1
        return item

    def accept(self, value: str) -> bool:
        if self.peek()[1] == value and self.peek()[0] in ("op", "directive"):
            self.pos += 1
            return True
        return False

    def expect(self, value: str, what: str) -> None:
        kind, text, line = self.peek()
        if not self.accept(value):
            raise _error(f"expected '{value}' {what}, found {text or kind!r}", line)

    def skip_newlines(self) -> None:
        while self.peek()[0] == "nl":
            self.pos += 1


MAX_PRIORITY = 1_000_000  # lark's priorities are small integers; the native lexer holds them in 32 bits


def _priority(number: str, name: str, line: int) -> int:
    """A terminal's priority, bounded to +-``MAX_PRIORITY``."""
    magnitude = repeat_count(number.lstrip("-"), MAX_PRIORITY)
    if magnitude is None:
        raise _error(f"the priority {count_text(number)} of '{name}' is past the limit of +-{MAX_PRIORITY}", line)
    return -magnitude if number.startswith("-") else magnitude


def _error(message: str, line: int) -> UserInputError:
    from corral.errors import InvalidGrammarError

    return InvalidGrammarError(f"Lark grammar: {message} (line {line})")


class _LarkParser:
    def __init__(self, text: str, builder: GrammarBuilder, *, module: str | None = None):
        self.t = _Tokens(text)
        self.b = builder
        self.module = module  # set while reading the bundled common grammar

    def parse(self) -> None:
        t = self.t
        while True:
            t.skip_newlines()
            kind, text, line = t.peek()
            if kind == "end":
                return
            if kind == "directive":
                self.directive()
            elif kind == "name":
                self.definition()
            else:
                raise _error(f"expected a rule, a terminal or a %directive, found {text!r}", line)
            kind, text, line = t.peek()
            if kind not in ("nl", "end"):
                raise _error(f"unexpected {text!r} after the definition", line)

    def definition(self) -> None:
        t = self.t
        _, raw_name, line = t.next()
        name = raw_name.lstrip("!?")
        options: dict = {}
        if t.peek()[1] == "{" and t.peek()[0] == "op":
            raise _error(f"'{name}' is a template; templates are not supported", line)
        if t.accept("."):
            kind, number, _ = t.next()
            if kind != "number":
                raise _error(f"expected a priority number after '{name}.'", line)
            options["priority"] = _priority(number, name, line)
        lexeme: dict = {}
        if t.accept("["):
            self.attributes(name, options, lexeme, line)
        t.expect(":", f"after '{name}'")
        expr = self.expansions()
        if lexeme:  # llguidance's lexeme options: the body, terminals only, becomes one lazy lexeme
            options["lazy"] = True
            if "suffix" in lexeme:
                expr = ("seq", (expr, lexeme["suffix"]))
            if "stop" in lexeme:
                expr = ("seq", (expr, ("literal", lexeme["stop"], False)))
                options["replay"] = lexeme["stop"].encode()
        if name.lstrip("_")[:1].isupper():
            self.b.add_terminal(name, expr, line, **options)
        elif options.get("lazy"):  # a rule whose body is one lexeme: a terminal of its own under it
            hidden = f"{name}[lexeme]"
            self.b.add_terminal(hidden, expr, line, **options)
            self.b.add_rule(name, ("name", hidden, line), line)
        else:
            self.b.add_rule(name, expr, line)

    def attributes(self, name: str, options: dict, lexeme: dict, line: int) -> None:
        """``[lazy, capture, stop=..., suffix=..., ...]``: ``lexeme`` takes ``stop`` (a string) and ``suffix``
        (a string, a regex or a terminal's name)."""
        t = self.t
        while True:
            kind, key, _ = t.next()
            if kind != "name":
                raise _error(f"expected an attribute of '{name}', found {key!r}", line)
            value = self.attribute_value(name, key, line) if t.accept("=") else None
            if key == "lazy":
                lexeme["lazy"] = True
            elif key in ("capture", "stop_capture"):
                pass  # name capture groups for the caller; the language is the same
            elif key == "suffix":
                if value is None or value[0] not in ("literal", "regex", "name") or value == ("literal", "", False):
                    raise _error(f"suffix= on '{name}' takes a string, a /regex/ or a TERMINAL", line)
                lexeme["suffix"] = value
            elif key == "stop":
                if value is None or value[0] != "literal" or value[2]:
                    raise _error(f"stop= on '{name}' takes a string here: the stop's text is read again as the "
                                 "start of what follows, so it must be fixed (suffix= takes a regex)", line)
                if not value[1]:
                    raise _error(f'stop="" on \'{name}\' (the end of sequence as the stop) is not supported: a '
                                 "sampled end of sequence cannot be taken back; use [lazy] or suffix=", line)
                lexeme["stop"] = value[1]
            elif key == "temperature":
                self.b.notes.append(f"temperature= on '{name}' (line {line}) is ignored: the request's sampling "
                                    "settings apply inside it")
            elif key == "max_tokens":
                raise _error(f"max_tokens= on '{name}' is not supported: it bounds tokens, not text (bound the "
                             "regex instead, as in /.{0,200}/)", line)
            else:
                raise _error(f"unknown attribute '{key}' on '{name}'", line)
            if "stop" in lexeme and "suffix" in lexeme:
                raise _error(f"'{name}' has both stop= and suffix=; it takes one of them", line)
            if t.accept("]"):
                return
            t.expect(",", "between attributes")

    def attribute_value(self, name: str, key: str, line: int):
        kind, text, _ = self.t.next()
        if kind == "string":
            return ("literal", _string_value(text, line), text.endswith("i"))
        if kind == "regex":
            return ("regex", _regex_node(text, line))
        if kind == "name":
            return ("name", text, line)
        if kind == "number":  # 10, or 0.7 (which the tokens split at the dot)
            if self.t.accept("."):
                fraction = self.t.next()
                if fraction[0] != "number":
                    raise _error(f"expected a number for {key}= on '{name}'", line)
            return ("number", text)
        raise _error(f"expected a value for {key}= on '{name}', found {text!r}", line)

    def directive(self) -> None:
        t = self.t
        _, directive, line = t.next()
        if directive == "%ignore":
            self.b.ignore.append((self.expansions(), line))
        elif directive == "%import":
            self.import_(line)
        elif directive == "%declare":
            while t.peek()[0] == "name":
                _, name, _ = t.next()  # a terminal nothing produces: no text matches it
                self.b.add_terminal(name, ("chars", CharSet(())), line)
        elif directive == "%llguidance":
            t.next()  # the options object: none of them changes the language
        elif directive in ("%override", "%extend"):
            raise _error(f"{directive} is not supported", line)
        else:
            raise _error(f"unknown directive {directive}", line)

    def import_(self, line: int) -> None:
        t = self.t
        kind, path, _ = t.next()
        parts = [path]
        while t.accept("."):
            kind, part, _ = t.next()
            if kind != "name":
                raise _error("expected a name in the %import path", line)
            parts.append(part)
        if parts[0] != "common":
            raise _error(f"%import from '{parts[0]}': only the 'common' grammar is bundled", line)
        if len(parts) == 1:
            t.expect("(", "after '%import common'")
            names = []
            while True:
                kind, name, _ = t.next()
                names.append(name)
                if t.accept(")"):
                    break
                t.expect(",", "between imported names")
            for name in names:
                _import_common(self.b, name, name, line)
            return
        if len(parts) != 2:
            raise _error(f"cannot import {'.'.join(parts)}", line)
        alias = parts[1]
        if t.accept("->"):
            alias = t.next()[1]
        _import_common(self.b, parts[1], alias, line)

    def expansions(self) -> Expr:
        t = self.t
        options = [self.alias()]
        while True:
            if t.peek()[0] == "nl" and t.peek(1)[1] == "|":
                t.next()
            if t.peek()[0] == "nl":  # a continuation line may follow blank or comment lines
                ahead = 0
                while t.peek(ahead)[0] == "nl":
                    ahead += 1
                if t.peek(ahead)[1] == "|" and t.peek(ahead)[0] == "op":
                    t.pos += ahead
            if not t.accept("|"):
                break
            options.append(self.alias())
        return options[0] if len(options) == 1 else ("alt", tuple(options))

    def alias(self) -> Expr:
        expr = self.expansion()
        if self.t.accept("->"):
            self.t.next()  # names the tree node: same language
        return expr

    def expansion(self) -> Expr:
        items = []
        while True:
            kind, text, _ = self.t.peek()
            if kind in ("nl", "end") or (kind == "op" and text in ("|", ")", "]", "->", ",", "}")):
                break
            items.append(self.expr())
        if not items:
            return ("empty",)
        return items[0] if len(items) == 1 else ("seq", tuple(items))

    def expr(self) -> Expr:
        t = self.t
        atom = self.atom()
        while True:
            kind, text, line = t.peek()
            if kind == "op" and text in ("*", "+", "?"):
                t.next()
                atom = ("repeat", atom, 0 if text != "+" else 1, 1 if text == "?" else None)
            elif kind == "op" and text == "~":
                t.next()
                low = self.number(line)
                high = self.number(line) if t.accept("..") else low
                if high < low:
                    raise _error(f"the repetition ~ {low}..{high}: the maximum is below the minimum", line)
                atom = ("repeat", atom, low, high)
            elif kind == "op" and text == "{":
                t.next()
                if t.peek()[0] != "number" and t.peek()[1] != ",":
                    name = atom[1] if atom[0] == "name" else "a group"
                    raise _error(f"'{name}{{...}}' uses a template; templates are not supported", line)
                low = 0 if t.peek()[1] == "," else self.number(line)
                high = low
                if t.accept(","):
                    high = None if t.peek()[1] == "}" else self.number(line)
                t.expect("}", "after a repetition count")
                if high is not None and high < low:
                    raise _error(f"the repetition {{{low},{high}}}: the maximum is below the minimum", line)
                atom = ("repeat", atom, low, high)
            else:
                return atom

    def number(self, line: int) -> int:
        kind, text, _ = self.t.next()
        if kind != "number" or not (text.isascii() and text.isdigit()):
            raise _error(f"expected a repetition count, found {text!r}", line)
        count = repeat_count(text)
        if count is None:
            raise _error(f"a repetition count of {count_text(text)} is past the limit of {MAX_REPEAT_COUNT}", line)
        return count

    def atom(self) -> Expr:
        t = self.t
        kind, text, line = t.next()
        if kind == "op" and text in ("(", "["):
            inner = self.expansions()
            t.expect(")" if text == "(" else "]", "to close the group")
            return inner if text == "(" else ("repeat", inner, 0, 1)
        if kind == "string":
            literal = _string_value(text, line)
            if t.accept(".."):
                kind2, text2, _ = t.next()
                if kind2 != "string":
                    raise _error("expected a string after '..'", line)
                return ("chars", _char_range(literal, _string_value(text2, line), line))
            return ("literal", literal, text.endswith("i"))
        if kind == "regex":
            return ("regex", _regex_node(text, line))
        if kind == "name":
            return ("name", text.lstrip("!?"), line)
        if kind == "special":
            if text.startswith("<["):
                body = text[2:-2]
                low, _, high = body.partition("-")
                return ("special", (int(low), int(high or low)))
            return ("special", text)
        if kind == "directive" and text == "%json":
            _, schema, _ = t.next()
            return ("json", schema, line)
        raise _error(f"unexpected {text or kind!r}", line)


def _string_value(token: str, line: int) -> str:
    body = token[1:-2] if token.endswith("i") else token[1:-1]
    try:
        return json.loads('"' + body.replace("\t", "\\t") + '"') if "\\" in body else body
    except ValueError:
        raise _error(f"bad escape in string {token}", line) from None


def _char_range(low: str, high: str, line: int) -> CharSet:
    if len(low) != 1 or len(high) != 1 or ord(low) > ord(high):
        raise _error(f"a range needs two single characters in order, got {low!r}..{high!r}", line)
    return CharSet.of((ord(low), ord(high)))


def _regex_node(token: str, line: int) -> Node:
    end = token.rindex("/")
    pattern, flags = token[1:end], token[end + 1:]
    if "x" in flags:
        raise _error(f"regex flag 'x' (verbose) is not supported in {token}", line)
    pattern = pattern.replace("\\/", "/")
    try:
        node = parse_regex(pattern, flavor="python", dotall="s" in flags)
    except InvalidRegexError as exc:
        raise _error(str(exc), line) from None
    return fold_node(node) if "i" in flags else node


def fold_node(node: Node) -> Node:
    """``node`` matching case-insensitively."""
    if isinstance(node, CharSet):
        return case_folded(node)
    if isinstance(node, Concat):
        return Concat(tuple(fold_node(p) for p in node.parts))
    if isinstance(node, Alt):
        return Alt(tuple(fold_node(o) for o in node.options))
    if isinstance(node, Repeat):
        return Repeat(fold_node(node.node), node.min, node.max)
    if isinstance(node, Intersect):
        return Intersect(tuple(fold_node(p) for p in node.parts))
    raise TypeError(type(node).__name__)


# Corral's definitions of the terminals of lark's `common` grammar (same languages).
_COMMON = r"""
DIGIT: "0".."9"
HEXDIGIT: "a".."f" | "A".."F" | DIGIT
INT: DIGIT+
SIGNED_INT: ["+" | "-"] INT
DECIMAL: INT "." INT? | "." INT
_EXP: ("e" | "E") SIGNED_INT
FLOAT: INT _EXP | DECIMAL _EXP?
SIGNED_FLOAT: ["+" | "-"] FLOAT
NUMBER: FLOAT | INT
SIGNED_NUMBER: ["+" | "-"] NUMBER
ESCAPED_STRING: "\"" /([^"\\\n]|\\[^\n])*/ "\""
LCASE_LETTER: "a".."z"
UCASE_LETTER: "A".."Z"
LETTER: UCASE_LETTER | LCASE_LETTER
WORD: LETTER+
CNAME: ("_" | LETTER) ("_" | LETTER | DIGIT)*
WS_INLINE: (" " | /\t/)+
WS: /[ \t\f\r\n]/+
CR: /\r/
LF: /\n/
NEWLINE: (CR? LF)+
SH_COMMENT: /#[^\n]*/
CPP_COMMENT: /\/\/[^\n]*/
C_COMMENT: /\/\*([^*]|\*+[^*\/])*\*+\//
SQL_COMMENT: /--[^\n]*/
"""
_common_builder: GrammarBuilder | None = None


def _import_common(builder: GrammarBuilder, name: str, alias: str, line: int) -> None:
    global _common_builder
    if _common_builder is None:
        common = GrammarBuilder(kind="Lark common grammar")
        _LarkParser(_COMMON, common, module="common").parse()
        _common_builder = common
    common = _common_builder
    if name not in common.terminal_defs:
        raise _error(f"common.{name} does not exist", line)
    # the imported terminal under its alias, and the terminals it uses under private names (a user's own DIGIT
    # must not change common.INT)
    pending, renames = [name], {name: alias}
    while pending:
        current = pending.pop()
        definition = common.terminal_defs[current]
        target = renames[current]
        if target in builder.terminal_defs:
            continue
        used = _names_in(definition.expr)
        for used_name in used:
            renames.setdefault(used_name, f"common.{used_name}")
        builder.add_terminal(target, _renamed(definition.expr, renames), line)
        pending.extend(used)


def _names_in(expr: Expr) -> list[str]:
    if expr[0] == "name":
        return [expr[1]]
    if expr[0] in ("seq", "alt"):
        return [n for part in expr[1] for n in _names_in(part)]
    if expr[0] == "repeat":
        return _names_in(expr[1])
    return []


def _renamed(expr: Expr, renames: dict[str, str]) -> Expr:
    if expr[0] == "name":
        return ("name", renames[expr[1]], expr[2])
    if expr[0] in ("seq", "alt"):
        return (expr[0], tuple(_renamed(part, renames) for part in expr[1]))
    if expr[0] == "repeat":
        return ("repeat", _renamed(expr[1], renames), expr[2], expr[3])
    return expr


def parse_lark(text: str, *, start: str = "start", json_node=None) -> Grammar:
    """The grammar of Lark text (llguidance's dialect). ``json_node(schema)`` gives the regex AST of a
    ``%json`` schema (None: ``%json`` is refused)."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise _error(f"the grammar is longer than {MAX_GRAMMAR_CHARS} characters", 1)
    builder = GrammarBuilder(kind="Lark grammar", json_node=json_node)
    _LarkParser(text, builder).parse()
    return builder.build(start)


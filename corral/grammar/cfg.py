"""The context-free grammar IR: terminals (regex ASTs, or special tokens) and productions over them.

Both front-ends (``lark_grammar.py``, ``gbnf_grammar.py``) describe rules as :data:`Expr` trees (sequences,
alternatives, repeats, literals, regexes, names); :class:`GrammarBuilder` lowers them to plain productions
``lhs -> symbols`` (a repeat becomes a left-recursive helper rule, which Earley parses in linear time) and checks
what would make a grammar unusable, each failure an :class:`InvalidGrammarError` naming the rule and its line:
an undefined name, a terminal defined through itself, a start rule that derives no finite text. A terminal that
matches the empty string (llguidance allows them) is "nothing, or the terminal without its empty string" where a
rule uses it. Rules that derive no finite text are dropped (with their alternatives that use
them), so that no prefix the parser allows is a dead end.

Symbols: a nonterminal is its index ``k >= 0``; terminal ``j`` is ``~j`` (negative). What is left out here: trees,
aliases and ``?``/``!``/``_`` rule modifiers (they shape lark's parse tree, not the language).
"""

import _sre
import json
from dataclasses import dataclass, field

from corral.errors import InvalidGrammarError, UnsupportedSchemaError
from corral.grammar.regex_ast import EMPTY, Alt, CharSet, Concat, Intersect, Node, Ref, Repeat
from corral.grammar.regex_parser import nullable

MAX_SYMBOLS = 200_000  # symbols over all productions after lowering (bounds a{1000}{1000} and the like)

# Expr: ("name", text, line) | ("literal", text, ignore_case) | ("regex", Node) | ("chars", CharSet)
#       | ("lexeme", Node): an exact lexeme (Terminal.exact) | ("json", schema)
#       | ("seq", (Expr, ...)) | ("alt", (Expr, ...)) | ("repeat", Expr, min, max | None)
#       | ("special", token text or id range) | ("empty",)
Expr = tuple


@dataclass(frozen=True)
class Terminal:
    """A lexeme: text matching ``node`` (``special``: a special token the vocabulary names, ``node`` None).
    ``lazy``: it ends at its shortest match instead of its longest. ``exact``: in a greedy grammar, it may also
    end where it matches while a longer match could go on (the parts of an inline ``%json`` schema, whose
    lexemes are cut from a language that has no lexer). ``replay``: the text of a hidden stop (llguidance's
    ``stop=``): the lexeme ends lazily on it, the parser takes it as ending before it, and those bytes are then
    read again as the start of what follows."""

    name: str
    node: Node | None
    special: str | tuple[int, int] | None = None
    lazy: bool = False
    priority: int = 0
    exact: bool = False
    replay: bytes = b""


@dataclass(frozen=True)
class Grammar:
    terminals: tuple[Terminal, ...]
    nonterminals: tuple[str, ...]
    productions: tuple[tuple[int, tuple[int, ...]], ...]  # (lhs, rhs symbols)
    start: int
    ignore: tuple[int, ...] = ()  # terminal ids skipped between any two lexemes
    warnings: tuple[str, ...] = ()
    # Greedy lexing (Lark, llguidance): a lexeme runs as long as it can. Else every way of cutting the text into
    # lexemes is kept (GBNF and JSON Schema grammars, whose language has no lexer).
    greedy: bool = True

    def symbol_name(self, symbol: int) -> str:
        return self.nonterminals[symbol] if symbol >= 0 else self.terminals[~symbol].name


@dataclass
class RuleDef:
    name: str
    expr: Expr
    line: int


@dataclass
class GrammarBuilder:
    """Collects rule and terminal definitions (as :data:`Expr`), then :meth:`build` lowers and checks them."""

    rules: dict[str, RuleDef] = field(default_factory=dict)
    terminal_defs: dict[str, RuleDef] = field(default_factory=dict)
    terminal_options: dict[str, dict] = field(default_factory=dict)  # lazy, priority
    ignore: list[tuple[Expr, int]] = field(default_factory=list)
    kind: str = "grammar"  # "Lark grammar" / "GBNF grammar", for messages
    greedy: bool = True  # see Grammar.greedy
    check_time: object = None  # called every few thousand symbols while lowering (a compile budget's clock)
    json_node: object = None  # schema -> regex AST, or (AST, rules) when it recurses, for %json (None: refused)
    notes: list[str] = field(default_factory=list)  # warnings the front-end found (options it ignores)

    def error(self, message: str, line: int | None = None) -> InvalidGrammarError:
        return InvalidGrammarError(f"{self.kind}: {message}" + (f" (line {line})" if line else ""))

    def add_rule(self, name: str, expr: Expr, line: int) -> None:
        if name in self.rules or name in self.terminal_defs:
            raise self.error(f"'{name}' is defined twice", line)
        self.rules[name] = RuleDef(name, expr, line)

    def add_terminal(self, name: str, expr: Expr, line: int, **options) -> None:
        if name in self.rules or name in self.terminal_defs:
            raise self.error(f"'{name}' is defined twice", line)
        self.terminal_defs[name] = RuleDef(name, expr, line)
        self.terminal_options[name] = options

    def build(self, start: str) -> Grammar:
        return _Lowering(self).run(start)


class _Lowering:
    def __init__(self, builder: GrammarBuilder):
        self.b = builder
        self.nonterminals: list[str] = []
        self.nt_ids: dict[str, int] = {}
        self.terminals: list[Terminal] = []
        self.terminal_ids: dict[object, int] = {}  # name or anonymous key -> terminal id
        self.productions: list[tuple[int, tuple[int, ...]]] = []
        self.line_of: dict[int, int] = {}  # nonterminal -> line of its rule
        self.node_cache: dict[str, Node] = {}
        self.num_symbols = 0
        self.num_helpers = 0
        # id of a compound Expr -> its helper rule (an Expr DAG lowers once); ("optional", terminal) -> the rule of a
        # terminal that matches the empty string
        self.helper_of: dict[object, int] = {}
        self.json_cache: dict[str, tuple[Node | None, Expr | None]] = {}  # see json_parts

    def run(self, start: str) -> Grammar:
        b = self.b
        if start not in b.rules:
            raise b.error(f"no start rule '{start}'")
        start_id = self.nonterminal(start)
        done: set[str] = set()
        pending = [start]
        while pending:  # only rules reachable from the start are lowered (lark ignores the others too)
            name = pending.pop()
            if name in done:
                continue
            done.add(name)
            rule = b.rules[name]
            for alternative in _alternatives(rule.expr):
                self.production(self.nt_ids[name], alternative, rule, pending)
        ignore = tuple(sorted({self.terminal_of(expr, line, nonempty=True) for expr, line in b.ignore}))
        return self.checked(Grammar(tuple(self.terminals), tuple(self.nonterminals), tuple(self.productions),
                                    start_id, ignore, greedy=b.greedy))

    def nonterminal(self, name: str, line: int | None = None) -> int:
        k = self.nt_ids.get(name)
        if k is None:
            k = self.nt_ids[name] = len(self.nonterminals)
            self.nonterminals.append(name)
            if line is not None:
                self.line_of[k] = line
            elif name in self.b.rules:
                self.line_of[k] = self.b.rules[name].line
        return k

    def helper(self, owner: RuleDef) -> int:
        self.num_helpers += 1
        return self.nonterminal(f"{owner.name}#{self.num_helpers}", owner.line)

    def add(self, lhs: int, rhs: tuple[int, ...], owner: RuleDef) -> None:
        if self.b.check_time is not None and self.num_symbols >> 12 != (self.num_symbols + len(rhs) + 1) >> 12:
            self.b.check_time()
        self.num_symbols += len(rhs) + 1
        if self.num_symbols > MAX_SYMBOLS:
            raise self.b.error(f"the grammar lowers to more than {MAX_SYMBOLS} symbols (rule '{owner.name}': "
                               "repetition counts multiply)", owner.line)
        self.productions.append((lhs, rhs))

    def production(self, lhs: int, expr: Expr, owner: RuleDef, pending: list[str]) -> None:
        parts = expr[1] if expr[0] == "seq" else (() if expr[0] == "empty" else (expr,))
        self.add(lhs, tuple(self.symbol(part, owner, pending) for part in parts), owner)

    def symbol(self, expr: Expr, owner: RuleDef, pending: list[str]) -> int:
        """One symbol standing for ``expr`` (a helper rule when it is compound)."""
        kind = expr[0]
        if kind == "name":
            name, line = expr[1], expr[2]
            if name in self.b.rules:
                pending.append(name)
                return self.nonterminal(name)
            if name in self.b.terminal_defs:
                return self.lexeme_symbol(expr, line, owner)
            raise self.b.error(f"rule '{owner.name}' uses '{name}', which is not defined", line)
        if kind == "json":
            expansion = self.json_parts(expr, owner.line)[1]
            return ~self.terminal_of(expr, owner.line) if expansion is None else \
                self.symbol(expansion, owner, pending)
        if kind in ("literal", "regex", "chars"):
            return self.lexeme_symbol(expr, owner.line, owner)
        if kind in ("special", "lexeme"):
            return ~self.terminal_of(expr, owner.line)
        shared = self.helper_of.get(id(expr))
        if shared is not None:
            return shared
        helper = self.helper_of[id(expr)] = self.helper(owner)
        if kind in ("seq", "alt", "empty"):
            for alternative in _alternatives(expr):
                self.production(helper, alternative, owner, pending)
            return helper
        assert kind == "repeat", expr
        item = self.symbol(expr[1], owner, pending)
        low, high = expr[2], expr[3]
        if high is not None and high < low:
            raise self.b.error(f"rule '{owner.name}' repeats {{{low},{high}}}: the maximum is below the minimum",
                               owner.line)
        if low > MAX_SYMBOLS:
            raise self.b.error(f"rule '{owner.name}' repeats at least {low} times", owner.line)
        if high is None:  # helper -> item{low} tail, tail -> empty | tail item
            tail = self.helper(owner)
            self.add(tail, (), owner)
            self.add(tail, (tail, item), owner)
            self.add(helper, (item,) * low + (tail,), owner)
            return helper
        # helper -> item{low} opt_{high-low}; opt_k -> empty | item opt_{k-1}
        rest = None
        for _ in range(high - low):
            step = self.helper(owner)
            self.add(step, (), owner)
            self.add(step, (item,) if rest is None else (item, rest), owner)
            rest = step
        self.add(helper, (item,) * low + (() if rest is None else (rest,)), owner)
        return helper

    def lexeme_symbol(self, expr: Expr, line: int, owner: RuleDef) -> int:
        """The symbol of a terminal used in a rule. One that matches the empty string (llguidance allows
        ``TEXT: /(.|\\n)*/``; the lexer never reads an empty lexeme) is a helper rule: nothing, or the terminal
        without its empty string; a lazy one, which ends as soon as it matches, only nothing."""
        node = self.terminal_node(expr[1], []) if expr[0] == "name" else self.lexeme_node(expr, [], line)
        if not nullable(node):
            return ~self.terminal_of(expr, line)
        key = ("optional", expr[1] if expr[0] == "name" else id(expr))
        helper = self.helper_of.get(key)
        if helper is None:
            helper = self.helper_of[key] = self.helper(owner)
            self.add(helper, (), owner)
            lazy = expr[0] == "name" and self.b.terminal_options.get(expr[1], {}).get("lazy", False)
            if not lazy and node != EMPTY:
                self.add(helper, (~self.terminal_of(expr, line, nonempty=True),), owner)
        return helper

    def terminal_of(self, expr: Expr, line: int, nonempty: bool = False) -> int:
        """The terminal id of a lexeme expression: a terminal's name, or an anonymous literal/regex/class;
        ``nonempty``: of its text without the empty string (see :meth:`lexeme_symbol`)."""
        kind = expr[0]
        if kind == "name":
            name = expr[1]
            if name not in self.b.terminal_defs:
                what = "a rule" if name in self.b.rules else "not defined"
                raise self.b.error(f"'{name}' is used as a terminal but is {what}", line)
            key, node = name, self.terminal_node(name, [])
            options = self.b.terminal_options.get(name, {})
        elif kind == "special":
            key, node, options = ("special", expr[1]), None, {}
            name = expr[1] if isinstance(expr[1], str) else f"<[{expr[1][0]}-{expr[1][1]}]>"
        elif kind == "json":
            key = ("json", json.dumps(expr[1], sort_keys=True))
            node, options, name = self.json_parts(expr, line)[0], {}, "%json"
        else:
            # subtle: a regex AST is a DAG whose dataclass hash unfolds it as a tree (exponential for real schemas):
            # anonymous lexemes are keyed by the identity of their AST (kept alive by the terminal)
            key = (kind, id(expr[1])) if kind in ("regex", "lexeme") else (kind, expr[1:])
            node, options, name = self.lexeme_node(expr, [], line), {}, _display(expr)
        if nonempty and node is not None and nullable(node):
            key, node = ("nonempty", key), Intersect((node, _NONEMPTY))
        j = self.terminal_ids.get(key)
        if j is None:
            if node is not None and nullable(node):
                raise self.b.error(f"terminal {name} matches the empty string", line)
            j = self.terminal_ids[key] = len(self.terminals)
            special = expr[1] if kind == "special" else None
            self.terminals.append(Terminal(name, node, special, options.get("lazy", False),
                                           options.get("priority", 0), exact=kind == "lexeme",
                                           replay=options.get("replay", b"")))
        return j

    def json_parts(self, expr: Expr, line: int) -> tuple[Node | None, Expr | None]:
        """An inline ``%json`` schema: its regex AST (one lexeme), or, when it nests without a limit (a recursive
        ``$ref``, any-value), the Expr of its tree, whose rules join the grammar as ``%jsonK.name``."""
        key = json.dumps(expr[1], sort_keys=True)
        found = self.json_cache.get(key)
        if found is None:
            if self.b.json_node is None:
                raise self.b.error("%json is not available here", line)
            result = self.b.json_node(expr[1])
            root, rules = result if isinstance(result, tuple) else (result, {})
            if not rules:
                found = (root, None)
            else:
                prefix = f"%json{len(self.json_cache)}."
                exprs = RefTreeExprs(lambda name: prefix + name, line)
                for name, node in rules.items():
                    self.b.rules[prefix + name] = RuleDef(prefix + name, exprs.expr(node), line)
                found = (None, exprs.expr(root))
            self.json_cache[key] = found
        return found

    def terminal_node(self, name: str, stack: list[str]) -> Node:
        node = self.node_cache.get(name)
        if node is None:
            definition = self.b.terminal_defs[name]
            if name in stack:
                raise self.b.error(f"terminal {name} is defined through itself ({' -> '.join(stack + [name])}); "
                                   "a recursive structure must be a rule", definition.line)
            node = self.node_cache[name] = self.lexeme_node(definition.expr, stack + [name], definition.line)
        return node

    def lexeme_node(self, expr: Expr, stack: list[str], line: int) -> Node:
        """The regex AST of a terminal expression (names of other terminals are inlined)."""
        kind = expr[0]
        if kind == "literal":
            return _literal_node(expr[1], expr[2])
        if kind in ("regex", "chars", "lexeme"):
            return expr[1]
        if kind == "empty":
            return EMPTY
        if kind == "name":
            if expr[1] not in self.b.terminal_defs:
                where = f"terminal {stack[-1]}" if stack else "a terminal"
                what = "a rule (terminals cannot use rules)" if expr[1] in self.b.rules else "not defined"
                if stack and stack[-1].endswith("[lexeme]") and expr[1] in self.b.rules:
                    where, what = (f"rule '{stack[-1][:-len('[lexeme]')]}' has lexeme options (lazy, stop=, suffix=), "
                                   "so its body must be terminals, but it", "a rule")
                raise self.b.error(f"{where} uses '{expr[1]}', which is {what}", expr[2])
            return self.terminal_node(expr[1], stack)
        if kind == "seq":
            return Concat(tuple(self.lexeme_node(part, stack, line) for part in expr[1]))
        if kind == "alt":
            return Alt(tuple(self.lexeme_node(part, stack, line) for part in expr[1]))
        if kind == "repeat":
            return Repeat(self.lexeme_node(expr[1], stack, line), expr[2], expr[3])
        raise self.b.error(f"{kind} cannot appear inside a terminal", line)

    def checked(self, grammar: Grammar) -> Grammar:
        """Drop the productions that use a rule deriving no finite text; refuse a start rule that is one."""
        productive: set[int] = set()
        changed = True
        while changed:
            changed = False
            for lhs, rhs in grammar.productions:
                if lhs not in productive and all(s < 0 or s in productive for s in rhs):
                    productive.add(lhs)
                    changed = True
        if grammar.start not in productive:
            raise self.b.error(f"rule '{grammar.nonterminals[grammar.start]}' can never finish: every alternative "
                               "needs a rule that derives no finite text", self.line_of.get(grammar.start))
        kept = tuple((lhs, rhs) for lhs, rhs in grammar.productions
                     if lhs in productive and all(s < 0 or s in productive for s in rhs))
        dropped = sorted({grammar.nonterminals[lhs].split("#")[0] for lhs, _ in grammar.productions
                          if lhs not in productive})
        warnings = tuple(self.b.notes) + tuple(f"rule '{name}' derives no finite text; the alternatives that use "
                                               "it are dropped" for name in dropped)
        return Grammar(grammar.terminals, grammar.nonterminals, kept, grammar.start, grammar.ignore, warnings,
                       grammar.greedy)


_NONEMPTY = Repeat(CharSet.of((0, 0x10FFFF)), 1, None)


def merged_lexemes(expr: Expr) -> Expr:
    """``expr`` with each part that names no rule made one regex lexeme (consecutive ones in a sequence joined).
    Exact only without greedy lexing (``Grammar.greedy`` False), where a lexeme may end wherever it matches: then
    fewer, longer lexemes mean fewer parser steps and the same language. A lexeme that could be empty becomes
    "nothing, or the lexeme without its empty string"."""
    if not _names_rule(expr):
        return lexeme_expr(regex_of(expr))
    kind = expr[0]
    if kind in ("name", "special", "json"):
        return expr
    if kind == "alt":
        return ("alt", tuple(merged_lexemes(option) for option in expr[1]))
    if kind == "repeat":
        return ("repeat", merged_lexemes(expr[1]), expr[2], expr[3])
    assert kind == "seq", expr
    items, run = [], []
    for part in expr[1]:
        if _names_rule(part):
            if run:
                items.append(lexeme_expr(Concat(tuple(regex_of(p) for p in run))))
                run = []
            items.append(merged_lexemes(part))
        else:
            run.append(part)
    if run:
        items.append(lexeme_expr(Concat(tuple(regex_of(p) for p in run))))
    return items[0] if len(items) == 1 else ("seq", tuple(items))


def lexeme_expr(node: Node, exact: bool = False) -> Expr:
    """One lexeme of ``node`` (``exact``: a :attr:`Terminal.exact` one); "nothing, or the lexeme without its empty
    string" when ``node`` matches the empty string (the lexer never reads an empty lexeme)."""
    kind = "lexeme" if exact else "regex"
    if node == EMPTY or node == Concat(()):
        return ("empty",)
    if not nullable(node):
        return (kind, node)
    return ("alt", (("empty",), (kind, Intersect((node, _NONEMPTY)))))


class RefTreeExprs:
    """Regex ASTs that name rules (:class:`Ref`, the JSON Schema compiler's recursive mode) as :data:`Expr`:
    each ``Ref`` becomes the name ``rename(name)``, and each part that holds none stays one exact lexeme
    (consecutive ones in a sequence joined), so only the recursive skeleton is parsed. The trees are DAGs and
    stay DAGs (one Expr per node)."""

    def __init__(self, rename=lambda name: name, line: int = 0):
        self.rename, self.line = rename, line
        self.holds_ref: dict[int, bool] = {}
        self.exprs: dict[int, Expr] = {}

    def expr(self, node: Node) -> Expr:
        found = self.exprs.get(id(node))
        if found is None:
            found = self.exprs[id(node)] = self._expr_of(node)
        return found

    def has_ref(self, node: Node) -> bool:
        memo = self.holds_ref
        found = memo.get(id(node))
        if found is None:
            if isinstance(node, Ref):
                found = True
            elif isinstance(node, CharSet):
                found = False
            elif isinstance(node, Repeat):
                found = self.has_ref(node.node)
            else:  # a DAG: most parts are known already, so they are looked up here rather than called
                found = False
                for part in node.options if isinstance(node, Alt) else node.parts:
                    holds = memo.get(id(part))
                    if holds is None:
                        holds = self.has_ref(part)
                    if holds:
                        found = True
                        break
            memo[id(node)] = found
        return found

    def _expr_of(self, node: Node) -> Expr:
        if not self.has_ref(node):
            return lexeme_expr(node, exact=True)
        if isinstance(node, Ref):
            return ("name", self.rename(node.name), self.line)
        if isinstance(node, Alt):
            return ("alt", tuple(self.expr(option) for option in node.options))
        if isinstance(node, Repeat):
            return ("repeat", self.expr(node.node), node.min, node.max)
        if isinstance(node, Concat):
            items, run = [], []
            for part in node.parts:
                if self.has_ref(part):
                    if run:
                        items.append(lexeme_expr(Concat(tuple(run)) if len(run) > 1 else run[0], exact=True))
                        run = []
                    items.append(self.expr(part))
                else:
                    run.append(part)
            if run:
                items.append(lexeme_expr(Concat(tuple(run)) if len(run) > 1 else run[0], exact=True))
            return items[0] if len(items) == 1 else ("seq", tuple(items))
        raise UnsupportedSchemaError("a recursive $ref (or an unbounded any-value) inside an intersection (allOf "
                                     "with a pattern or a length, or a not) cannot compile", keyword="$ref")


def regex_of(expr: Expr) -> Node:
    """The regex AST of an expression that names no rule."""
    kind = expr[0]
    if kind in ("chars", "regex", "lexeme"):
        return expr[1]
    if kind == "literal":
        return _literal_node(expr[1], expr[2])
    if kind == "empty":
        return EMPTY
    if kind == "seq":
        return Concat(tuple(regex_of(part) for part in expr[1]))
    if kind == "alt":
        return Alt(tuple(regex_of(part) for part in expr[1]))
    assert kind == "repeat", expr
    return Repeat(regex_of(expr[1]), expr[2], expr[3])


def _names_rule(expr: Expr) -> bool:
    kind = expr[0]
    if kind in ("name", "special", "json"):
        return True
    if kind in ("seq", "alt"):
        return any(_names_rule(part) for part in expr[1])
    return kind == "repeat" and _names_rule(expr[1])


def _alternatives(expr: Expr) -> tuple[Expr, ...]:
    return expr[1] if expr[0] == "alt" else (expr,)


def _display(expr: Expr) -> str:
    if expr[0] == "literal":
        return repr(expr[1])
    return f"<{expr[0]}>"


def _literal_node(text: str, ignore_case: bool) -> Node:
    if not ignore_case:
        return Concat(tuple(CharSet.of((ord(c), ord(c))) for c in text))
    return Concat(tuple(case_folded(CharSet.of((ord(c), ord(c)))) for c in text))


def case_folded(chars: CharSet) -> CharSet:
    """``chars`` with every character that matches one of them case-insensitively, as Python's ``re`` (and so
    lark) reads the ``i`` flag: the classes that one-to-one lower/upper mappings join, so ``s`` also matches ``S``
    and ``ſ``, and ``k`` the Kelvin sign."""
    if sum(high - low + 1 for low, high in chars.ranges) <= 256:  # a literal's characters: look each one up
        class_of = _case_class_of()
        extra = [(other, other) for low, high in chars.ranges for cp in range(low, high + 1)
                 for other in class_of.get(cp, ())]
    else:
        extra = [(cp, cp) for members in _case_classes() if any(cp in chars for cp in members) for cp in members]
    return CharSet.of(*chars.ranges, *extra) if extra else chars


_CASE_CLASSES: list[tuple[int, ...]] = []
_CASE_CLASS_OF: dict[int, tuple[int, ...]] = {}


def _case_class_of() -> dict[int, tuple[int, ...]]:
    """Each code point of a case class -> its class."""
    if not _CASE_CLASS_OF:
        _CASE_CLASS_OF.update((cp, members) for members in _case_classes() for cp in members)
    return _CASE_CLASS_OF


def _case_classes() -> list[tuple[int, ...]]:
    """The code points that case mappings join, as classes of two or more (computed once, ~0.1 s)."""
    if not _CASE_CLASSES:
        parent = list(range(0x20000))

        def root(cp: int) -> int:
            while parent[cp] != cp:
                parent[cp] = parent[parent[cp]]
                cp = parent[cp]
            return cp

        simple_lower = getattr(_sre, "unicode_tolower", None)  # re's own one-to-one mapping (U+0130 -> i)
        for cp in range(0x20000):
            others = [ord(o) for o in (chr(cp).lower(), chr(cp).upper()) if len(o) == 1]
            if simple_lower is not None:
                others.append(simple_lower(cp))
            for other in others:
                if other != cp and other < 0x20000:
                    parent[root(cp)] = root(other)
        classes: dict[int, list[int]] = {}
        for cp in range(0x20000):
            classes.setdefault(root(cp), []).append(cp)
        _CASE_CLASSES.extend(tuple(members) for members in classes.values() if len(members) > 1)
    return _CASE_CLASSES

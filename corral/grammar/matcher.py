"""Matcher: whether one string is in the language of a regex AST, in time linear in the string.

The schema compiler asks this of values a request hands it: ``enum``/``const`` members against ``pattern`` and
``format``, declared property names against ``patternProperties`` and ``propertyNames``. Those patterns come from
strangers, so no backtracking engine (``re``) may see them: ``^(a+)+$`` against 30 ``a`` and a ``!`` takes
``re`` minutes, and holds the GIL all along.

The method is Brzozowski's: the string matches when the derivative of the language by its characters, one after
the other, contains the empty string. Terms are hash-consed (equal terms are one int), alternations and
intersections are sets (so derivatives stay finitely many, Brzozowski's theorem), and each derivative is
memoized by (term, code point), so checking many strings against one pattern builds a small lazy DFA over code
points. Counted repeats stay counters (``a{1000}`` is one term per count reached, not a thousand states).

Work is bounded by :class:`Fuel`: every new term, every derivative computed and every member of a set built or
derived spends one unit, whatever the machine's speed (about 0.3 us a unit here); past the limit,
:class:`GrammarTooComplexError` names it. Left out: anything the byte-level automaton (``corral.fsm``) does for
masks; this one works on code points and answers one question. The test oracle is ``regex_match.fullmatch``
(exact, polynomial, far slower).
"""

from bisect import bisect_right

from corral.errors import GrammarTooComplexError
from corral.grammar.regex_ast import Alt, CharSet, Concat, Intersect, Node, Repeat

DEFAULT_FUEL = 2_000_000

_NOTHING, _EMPTY = 0, 1  # the first two terms of every matcher
_CHARS, _CAT, _ALT, _AND, _REP = range(5)


class Fuel:
    """Deterministic work units for checking request values against a schema (matching here, and the value
    checks of ``schema_check``): past ``limit`` units, :class:`GrammarTooComplexError`. ``check_time`` (the
    caller's wall-clock budget and cancellation) is called every 4096 units."""

    def __init__(self, limit: int = DEFAULT_FUEL, check_time=None):
        assert limit > 0
        self.limit, self.check_time = limit, check_time
        self.spent = 0

    def spend(self, units: int = 1) -> None:
        before = self.spent
        self.spent += units
        if self.spent > self.limit:
            raise GrammarTooComplexError(f"checking the schema's own values (enum, const, property names) against "
                                         f"its patterns and keywords needs more than {self.limit} steps")
        if self.check_time is not None and self.spent >> 12 != before >> 12:
            self.check_time()


class Matcher:
    """Membership tests against regex ASTs, sharing one term table (and its fuel) across every AST asked about."""

    def __init__(self, fuel: Fuel | None = None):
        self.fuel = fuel or Fuel()
        self._spend = self.fuel.spend
        self._terms: list[tuple] = [("nothing",), ("empty",)]
        self._ids: dict[tuple, int] = {}
        self._nullable: list[bool] = [False, True]
        self._roots: dict[int, tuple[Node, int]] = {}  # id(node) -> (node kept alive, term)
        self._derivatives: dict[int, int] = {}  # term << 21 | code point -> term

    def fullmatch(self, node: Node, text: str) -> bool:
        """True when ``text`` (all of it) is in the language of ``node``."""
        term = self._root(node)
        derivatives = self._derivatives
        for char in text:
            if term == _NOTHING:
                return False
            key = term << 21 | ord(char)
            following = derivatives.get(key)
            if following is None:
                following = derivatives[key] = self._derive(term, ord(char))
            term = following
        return self._nullable[term]

    # ---- terms -------------------------------------------------------------------------------------------------
    def _intern(self, key: tuple, nullable: bool) -> int:
        term = self._ids.get(key)
        if term is None:
            self._spend()
            term = self._ids[key] = len(self._terms)
            self._terms.append(key)
            self._nullable.append(nullable)
        return term

    def _chars(self, chars: CharSet) -> int:
        if not chars.ranges:
            return _NOTHING
        return self._intern((_CHARS, tuple(lo for lo, _ in chars.ranges), tuple(hi for _, hi in chars.ranges)),
                            False)

    def _cat(self, head: int, tail: int) -> int:
        if head == _NOTHING or tail == _NOTHING:
            return _NOTHING
        if head == _EMPTY:
            return tail
        if tail == _EMPTY:
            return head
        entry = self._terms[head]
        if entry[0] == _CAT:  # right-nested, so equal sequences are one term
            return self._cat(entry[1], self._cat(entry[2], tail))
        return self._intern((_CAT, head, tail), self._nullable[head] and self._nullable[tail])

    def _set(self, kind: int, terms) -> int:
        members: set[int] = set()
        self._spend(len(terms))
        for term in terms:
            entry = self._terms[term]
            members.update(entry[1] if entry[0] == kind else (term,))
        if kind == _ALT:
            members.discard(_NOTHING)
            if not members:
                return _NOTHING
        elif _NOTHING in members:
            return _NOTHING
        if len(members) == 1:
            return members.pop()
        key = tuple(sorted(members))
        nullable = any if kind == _ALT else all
        return self._intern((kind, key), nullable(self._nullable[m] for m in key))

    def _rep(self, body: int, low: int, high: int | None) -> int:
        if high == 0 or body == _EMPTY:
            return _EMPTY
        if body == _NOTHING:
            return _EMPTY if low == 0 else _NOTHING
        if low == high == 1:
            return body
        return self._intern((_REP, body, low, high), low == 0 or self._nullable[body])

    def _root(self, node: Node) -> int:
        cached = self._roots.get(id(node))
        if cached is None:
            cached = self._roots[id(node)] = (node, self._convert(node))
        return cached[1]

    def _convert(self, node: Node) -> int:
        if isinstance(node, CharSet):
            return self._chars(node)
        if isinstance(node, Concat):
            term = _EMPTY
            for part in reversed(node.parts):
                term = self._cat(self._root(part), term)
            return term
        if isinstance(node, Alt):
            return self._set(_ALT, [self._root(option) for option in node.options])
        if isinstance(node, Intersect):
            return self._set(_AND, [self._root(part) for part in node.parts])
        if isinstance(node, Repeat):
            return self._rep(self._root(node.node), node.min, node.max)
        raise TypeError(f"not a regex AST node: {type(node).__name__}")

    # ---- derivatives -------------------------------------------------------------------------------------------
    def _derive(self, term: int, char: int) -> int:
        """The derivative of ``term`` by ``char``, memoized below the root by the same table."""
        key = term << 21 | char
        cached = self._derivatives.get(key)
        if cached is not None:
            return cached
        self._spend()
        entry = self._terms[term]
        kind = entry[0]
        if term <= _EMPTY:
            out = _NOTHING
        elif kind == _CHARS:
            index = bisect_right(entry[1], char) - 1
            out = _EMPTY if index >= 0 and char <= entry[2][index] else _NOTHING
        elif kind == _CAT:
            head, tail = entry[1], entry[2]
            out = self._cat(self._derive(head, char), tail)
            if self._nullable[head]:
                out = self._set(_ALT, (out, self._derive(tail, char)))
        elif kind in (_ALT, _AND):
            self._spend(len(entry[1]))
            out = self._set(kind, [self._derive(member, char) for member in entry[1]])
        else:  # _REP: d(r{lo,hi}) = d(r) r{lo-1,hi-1}, which holds for a nullable r too
            body, low, high = entry[1], entry[2], entry[3]
            rest = self._rep(body, max(low - 1, 0), None if high is None else high - 1)
            out = self._cat(self._derive(body, char), rest)
        self._derivatives[key] = out
        return out

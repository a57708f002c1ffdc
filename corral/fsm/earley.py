"""Earley parsing over lexemes, with Earley sets interned so that a parse state is one integer.

An Earley set is the list of items ``(production, dot, origin)`` alive after some prefix; ``origin`` is the set
where the item's production began. Here ``origin`` is not a position but the *id* of that set, and sets are
interned by their kernel (the items that scanning made): two prefixes whose sets hold the same items over the
same origin sets have the same future, so they get the same id. A parse state is therefore the id of its last
set; ``copy()`` and ``rollback()`` of a guide copy and truncate a list of ints, and a repeated structure (the
members of an object, the elements of a list) comes back to a set seen before, whose masks are cached.

Nullable rules are handled as Aycock and Horspool do: predicting a nullable symbol also moves the dot past it,
so a completion never has to look inside the set being built. Work is counted in items: every new set adds its
items to ``work``, which the caller compares with its fuel; ``num_items`` bounds the table's memory.

What this leaves out: parse trees (the guide needs only whether a prefix can continue).
"""

import threading

from corral.errors import GrammarTooComplexError
from corral.grammar.cfg import Grammar

MAX_TABLE_ITEMS = 4_000_000  # items over all interned sets of one table (about 100 bytes each)


class EarleySet:
    __slots__ = ("id", "items", "waiting", "scans", "is_accepting", "expected")

    def __init__(self, set_id: int):
        self.id = set_id
        self.items: list[tuple[int, int, int]] = []
        self.waiting: dict[int, list[tuple[int, int, int]]] = {}  # nonterminal -> items with the dot before it
        self.scans: dict[int, list[tuple[int, int, int]]] = {}  # terminal -> items with the dot before it
        self.is_accepting = False
        self.expected: frozenset[int] = frozenset()  # terminals some item can scan next


class EarleyTables:
    """The grammar's productions in the shapes the parser walks (shared by every table of the grammar)."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        lhs_rhs = list(grammar.productions)
        self.start_production = len(lhs_rhs)
        lhs_rhs.append((-1, (grammar.start,)))  # the augmented start: accept once it is complete
        self.lhs = [lhs for lhs, _ in lhs_rhs]
        self.rhs = [rhs for _, rhs in lhs_rhs]
        self.by_lhs: dict[int, list[int]] = {}
        for p, lhs in enumerate(self.lhs):
            self.by_lhs.setdefault(lhs, []).append(p)
        self.nullable = _nullable(grammar)


class EarleyTable:
    """Interned Earley sets of one grammar, grown as guides parse. Set 0 is the start. Not shared across
    requests: the sets one document reaches are its own (origins differ), so each request's guides (and their
    copies) share one table, and it goes away with them."""

    def __init__(self, tables: EarleyTables, max_items: int = MAX_TABLE_ITEMS, max_closure_work: int = 1 << 62):
        self.t = tables
        self.sets: list[EarleySet] = []
        self.kernels: dict[frozenset, int] = {}
        self.scan_memo: dict[tuple[int, frozenset[int]], int] = {}
        self.num_items = 0
        self.max_items = max_items
        self.work = 0  # items considered so far: callers bound a mask or a step by its growth
        self.max_closure_work = max_closure_work  # one set's completions (an ambiguous grammar's are quadratic)
        self.lock = threading.RLock()
        self._intern(frozenset({(tables.start_production, 0, -1)}))

    def scan(self, set_id: int, terminals: frozenset[int]) -> int:
        """The set after a lexeme matching every terminal in ``terminals`` (an ambiguous lexeme is all of its
        readings at once), or -1 when none can be scanned."""
        key = (set_id, terminals)
        found = self.scan_memo.get(key)
        if found is None:
            scans = self.sets[set_id].scans
            kernel = frozenset((p, dot + 1, origin) for t in terminals for p, dot, origin in scans.get(t, ()))
            found = self._intern(kernel) if kernel else -1
            self.scan_memo[key] = found
        return found

    def _intern(self, kernel: frozenset) -> int:
        set_id = self.kernels.get(kernel)
        if set_id is None:
            set_id = len(self.sets)
            self.sets.append(self._closure(set_id, kernel))  # registered only once it is whole
            self.kernels[kernel] = set_id
        return set_id

    def _closure(self, set_id: int, kernel: frozenset) -> EarleySet:
        t, sets = self.t, self.sets
        lhs_of, rhs_of, by_lhs, nullable = t.lhs, t.rhs, t.by_lhs, t.nullable
        out = EarleySet(set_id)
        items = sorted((p, d, set_id if o < 0 else o) for p, d, o in kernel)  # -1: the start set itself
        seen = set(items)
        waiting, scans, predicted = out.waiting, out.scans, set()
        i = work = 0
        limit = self.max_closure_work
        while i < len(items):
            p, dot, origin = items[i]
            i += 1
            rhs = rhs_of[p]
            if dot == len(rhs):
                if origin != set_id:  # completions in this very set were made at prediction (nullable)
                    advanced = sets[origin].waiting.get(lhs_of[p], ())
                    work += len(advanced)
                    if work > limit:
                        raise GrammarTooComplexError(f"one Earley set needed more than {limit} completions (the "
                                                     "grammar is too ambiguous for this input)")
                    for q, qdot, qorigin in advanced:
                        item = (q, qdot + 1, qorigin)
                        if item not in seen:
                            seen.add(item)
                            items.append(item)
                continue
            symbol = rhs[dot]
            if symbol < 0:
                scans.setdefault(~symbol, []).append((p, dot, origin))
                continue
            waiting.setdefault(symbol, []).append((p, dot, origin))
            if symbol not in predicted:
                predicted.add(symbol)
                for q in by_lhs.get(symbol, ()):
                    item = (q, 0, set_id)
                    if item not in seen:
                        seen.add(item)
                        items.append(item)
            if symbol in nullable:
                item = (p, dot + 1, origin)
                if item not in seen:
                    seen.add(item)
                    items.append(item)
        out.items = items
        out.expected = frozenset(scans)
        start = t.start_production
        out.is_accepting = any(p == start and dot == 1 for p, dot, _ in items)
        self.num_items += len(items)
        self.work += len(items) + work
        if self.num_items > self.max_items:
            raise GrammarTooComplexError(f"the parse reached its cap of {self.max_items} Earley items")
        return out


def _nullable(grammar: Grammar) -> frozenset[int]:
    nullable: set[int] = set()
    changed = True
    while changed:
        changed = False
        for lhs, rhs in grammar.productions:
            if lhs not in nullable and all(s >= 0 and s in nullable for s in rhs):
                nullable.add(lhs)
                changed = True
    return frozenset(nullable)

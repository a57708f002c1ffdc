"""ByteDFA: a trimmed deterministic automaton over bytes, built from a regex AST.

Construction: Thompson NFA (``nfa.py``) → subset construction over byte equivalence classes (bytes that every
NFA edge treats alike move together, so a DFA state is expanded once per class, not per byte) → trimming of
every state from which no accepting state is reachable. After trimming, ``trans[s, b] == -1`` means "dead",
and every live state can still reach acceptance: that is what guarantees no token mask is ever empty.
``Intersect`` is the product of the parts' DFAs. Left out: minimization (states that differ only in name are
kept apart; masks are cached per state, so the cost is mask computations, not correctness).
"""

from dataclasses import dataclass

import numpy as np

from corral.fsm.budget import Budget
from corral.fsm.nfa import NFA
from corral.grammar.regex_ast import Node

DEAD = -1


@dataclass(frozen=True, eq=False)
class ByteDFA:
    """State 0 is the start. ``trans``: int32 [num_states, 256], ``DEAD`` for no move; ``accepting``: bool."""

    trans: np.ndarray
    accepting: np.ndarray

    @property
    def num_states(self) -> int:
        return len(self.accepting)

    @property
    def is_empty(self) -> bool:
        """The language is empty (nothing at all matches)."""
        return self.num_states == 0

    def byte_ranges(self, state: int) -> list[tuple[int, int, int]]:
        """The live moves of ``state`` as ``(lo, hi, target)`` runs of consecutive bytes."""
        row = self.trans[state]
        cuts = np.flatnonzero(np.diff(row)) + 1
        starts = np.concatenate(([0], cuts))
        ends = np.concatenate((cuts, [256])) - 1
        return [(int(lo), int(hi), int(row[lo])) for lo, hi in zip(starts, ends) if row[lo] != DEAD]

    def matches(self, data: bytes) -> bool:
        state = 0 if self.num_states else DEAD
        for byte in data:
            if state == DEAD:
                return False
            state = int(self.trans[state, byte])
        return state != DEAD and bool(self.accepting[state])


def build_dfa(node: Node, budget: Budget | None = None) -> ByteDFA:
    """The trimmed byte DFA of ``node``. Raises :class:`GrammarTooComplexError` past the budget."""
    budget = budget or Budget()
    nfa = NFA(budget)
    start, end = nfa.build(node)
    return _trim(*_determinize(nfa, start, end, budget), budget)


def _byte_classes(nfa: NFA) -> np.ndarray:
    """uint8-ish [256] class id per byte: bytes no NFA edge tells apart share a class."""
    boundaries = np.zeros(257, dtype=bool)
    boundaries[0] = True
    for edges in nfa.edges:
        for lo, hi, _ in edges:
            boundaries[lo] = boundaries[hi + 1] = True
    return np.cumsum(boundaries[:256]).astype(np.int32) - 1


def _determinize(nfa: NFA, start: int, end: int, budget: Budget) -> tuple[np.ndarray, np.ndarray]:
    classes = _byte_classes(nfa)
    num_classes = int(classes.max()) + 1
    class_edges = [[(int(classes[lo]), int(classes[hi]), t) for lo, hi, t in edges] for edges in nfa.edges]
    closures: dict[int, frozenset[int]] = {}

    def closure_of(states) -> frozenset[int]:
        out: set[int] = set()
        for state in states:
            known = closures.get(state)
            if known is None:
                seen, stack = {state}, [state]
                while stack:
                    for target in nfa.epsilon[stack.pop()]:
                        if target not in seen:
                            seen.add(target)
                            stack.append(target)
                known = closures[state] = frozenset(seen)
            out |= known
        return frozenset(out)

    ids = {closure_of([start]): 0}
    order = list(ids)
    rows: list[list[int]] = []
    for index, subset in enumerate(order):
        if index % 256 == 0:
            budget.check_time()
            budget.check_states(len(order), "DFA")
        moves: list[set[int] | None] = [None] * num_classes
        for nfa_state in subset:
            for lo, hi, target in class_edges[nfa_state]:
                for c in range(lo, hi + 1):
                    if moves[c] is None:
                        moves[c] = {target}
                    else:
                        moves[c].add(target)
        row, by_targets = [DEAD] * num_classes, {}
        for c, targets in enumerate(moves):
            if targets is None:
                continue
            key = frozenset(targets)
            if key not in by_targets:
                closed = closure_of(key)
                if closed not in ids:
                    ids[closed] = len(order)
                    order.append(closed)
                by_targets[key] = ids[closed]
            row[c] = by_targets[key]
        rows.append(row)
    trans = np.asarray(rows, dtype=np.int32).reshape(len(rows), num_classes)[:, classes]
    accepting = np.fromiter((end in subset for subset in order), dtype=bool, count=len(order))
    return trans, accepting


def _trim(trans: np.ndarray, accepting: np.ndarray, budget: Budget) -> ByteDFA:
    """Drop every state that cannot reach acceptance and renumber the rest (start stays 0)."""
    sources, _ = np.nonzero(trans >= 0)
    targets = trans[trans >= 0]
    order = np.argsort(targets, kind="stable")
    sources, targets = sources[order], targets[order]
    starts = np.searchsorted(targets, np.arange(len(accepting) + 1))
    live = accepting.copy()
    stack = list(np.flatnonzero(accepting))
    while stack:
        state = stack.pop()
        for source in sources[starts[state]:starts[state + 1]]:
            if not live[source]:
                live[source] = True
                stack.append(int(source))
    if not live[0]:
        return ByteDFA(np.zeros((0, 256), dtype=np.int32), np.zeros(0, dtype=bool))
    budget.check_time()
    renumber = np.full(len(accepting) + 1, DEAD, dtype=np.int32)  # index -1 (DEAD) maps to DEAD
    renumber[np.flatnonzero(live)] = np.arange(int(live.sum()), dtype=np.int32)
    new_trans = renumber[trans[live]]
    return ByteDFA(np.ascontiguousarray(new_trans), accepting[live].copy())


def intersect_dfas(dfas: list[ByteDFA], budget: Budget) -> ByteDFA:
    """The product automaton: strings every DFA accepts. Only pairs reachable from the start are built."""
    result = dfas[0]
    for other in dfas[1:]:
        result = _product(result, other, budget)
    return result


def _product(left: ByteDFA, right: ByteDFA, budget: Budget) -> ByteDFA:
    if left.is_empty or right.is_empty:
        return ByteDFA(np.zeros((0, 256), dtype=np.int32), np.zeros(0, dtype=bool))
    ids, order, rows = {(0, 0): 0}, [(0, 0)], []
    for index, (a, b) in enumerate(order):
        if index % 256 == 0:
            budget.check_time()
            budget.check_states(len(order), "product DFA")
        targets_a, targets_b = left.trans[a], right.trans[b]
        both = (targets_a >= 0) & (targets_b >= 0)
        row = np.full(256, DEAD, dtype=np.int32)
        pairs = targets_a.astype(np.int64) * right.num_states + targets_b
        for pair in np.unique(pairs[both]):
            key = (int(pair // right.num_states), int(pair % right.num_states))
            if key not in ids:
                ids[key] = len(order)
                order.append(key)
            row[both & (pairs == pair)] = ids[key]
        rows.append(row)
    accepting = np.fromiter((left.accepting[a] and right.accepting[b] for a, b in order), dtype=bool,
                            count=len(order))
    return _trim(np.stack(rows), accepting, budget)

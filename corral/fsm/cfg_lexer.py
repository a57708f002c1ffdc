"""Lexer: the grammar's terminals as byte DFAs, run together as one lazily built, interned automaton.

A lexer state is the set of terminals still alive with their DFA states, ``((terminal, state), ...)``, interned
to an int. A lexeme starts from the terminals the parser allows next (plus ``%ignore``); each byte moves every
live terminal, and terminals whose DFA dies drop out. Lexing is greedy, as in lark's contextual lexer and
llguidance: a lexeme goes on while any allowed terminal can still extend it, and ends at the first byte that no
terminal takes, which then starts the next lexeme. A ``lazy`` terminal ends as soon as it matches. When several
terminals match the same lexeme, the parser takes all of them (Earley keeps every reading), after keeping only
those of the highest priority.

Each terminal's automaton is a :class:`LazyDFA` (the same derivative machinery as the regex path), so a
terminal regex never reaches a backtracking engine.
"""

import numpy as np

from corral.budget import Budget
from corral.errors import GrammarTooComplexError
from corral.fsm.derivatives import new_table
from corral.fsm.lazy_dfa import DEAD, LazyDFA
from corral.grammar.cfg import Grammar

MAX_LEXER_STATES = 200_000
_UNBUILT = -3


class Lexer:
    def __init__(self, grammar: Grammar, budget: Budget):
        self.terminals = grammar.terminals
        # One term table for every terminal: their regexes share most of their parts (a JSON Schema grammar's
        # lexemes are pieces of one document), which are converted and derived once. Its term cap is the
        # grammar's; every use of it holds the grammar's lock (CFGIndex.lock), or the native table's own.
        terms = new_table(budget)
        self.dfas = [None if t.node is None else LazyDFA(t.node, budget, terms=terms) for t in grammar.terminals]
        terms.forget_nodes()
        self.dead_terminals = frozenset(j for j, dfa in enumerate(self.dfas) if dfa is not None and dfa.is_empty)
        self.special_terminals = frozenset(j for j, t in enumerate(grammar.terminals) if t.node is None)
        self.ignore = frozenset(grammar.ignore) - self.dead_terminals
        self.states: list[tuple[tuple[int, int], ...]] = []
        self.ids: dict[tuple, int] = {}
        self.accepts: list[frozenset[int]] = []  # per state: the terminals a lexeme ending here matches
        self.is_lazy_end: list[bool] = []  # a lazy terminal matches: the lexeme ends here
        self.is_start: list[bool] = []  # nothing consumed yet
        self.moves: dict[int, int] = {}  # state << 8 | byte -> state or DEAD
        self._starts: dict[frozenset[int], int] = {}
        # The same moves as a table for vectorised walks (rows grow with the states; _UNBUILT until looked up),
        # and per state: a lexeme ending here matches something; it may end here while it could go on (exact
        # lexing); a lazy terminal ends it here.
        self.greedy, self.exact = grammar.greedy, frozenset(j for j, t in enumerate(grammar.terminals) if t.exact)
        self.table = np.full((64, 256), _UNBUILT, dtype=np.int32)
        self.accepting = np.zeros(64, dtype=bool)
        self.forks = np.zeros(64, dtype=bool)
        self.lazy_ends = np.zeros(64, dtype=bool)

    def start(self, allowed: frozenset[int]) -> int:
        """The state before the first byte of a lexeme that may match any of ``allowed``."""
        state = self._starts.get(allowed)
        if state is None:
            members = tuple(sorted((j, 0) for j in allowed
                                   if j not in self.special_terminals and j not in self.dead_terminals))
            state = self._starts[allowed] = self._intern(members, is_start=True)
        return state

    def move(self, state: int, byte: int) -> int:
        key = state << 8 | byte
        found = self.moves.get(key)
        if found is None:
            members = []
            for j, q in self.states[state]:
                q2 = self.dfas[j].next_state(q, byte)
                if q2 >= 0:
                    members.append((j, q2))
            found = self.moves[key] = self._intern(tuple(members), is_start=False) if members else DEAD
        return found

    def gather(self, states: np.ndarray, bytes_: np.ndarray) -> np.ndarray:
        """``move`` over arrays (DEAD where the lexeme cannot go on)."""
        out = self.table[states, bytes_]
        missing = out == _UNBUILT
        if missing.any():
            for pair in np.unique((states[missing].astype(np.int64) << 8) | bytes_[missing]).tolist():
                self.table[pair >> 8, pair & 255] = self.move(pair >> 8, pair & 255)
            out = self.table[states, bytes_]
        return out

    def _intern(self, members: tuple[tuple[int, int], ...], is_start: bool) -> int:
        key = (members, is_start)
        state = self.ids.get(key)
        if state is None:
            if len(self.states) >= MAX_LEXER_STATES:
                raise GrammarTooComplexError(f"the grammar's lexer reached its cap of {MAX_LEXER_STATES} states")
            state = self.ids[key] = len(self.states)
            self.states.append(members)
            self.is_start.append(is_start)
            matched = [j for j, q in members if self.dfas[j].accepting[q]] if not is_start else []
            if matched:
                top = max(self.terminals[j].priority for j in matched)
                matched = [j for j in matched if self.terminals[j].priority == top]
            self.accepts.append(frozenset(matched))
            self.is_lazy_end.append(any(self.terminals[j].lazy for j in matched))
            if state >= len(self.accepting):
                self._grow()
            self.accepting[state] = bool(matched)
            self.forks[state] = bool(matched) and (not self.greedy or bool(self.exact.intersection(matched)))
            self.lazy_ends[state] = self.greedy and self.is_lazy_end[-1]
        return state

    def replays(self, state: int) -> list[tuple[frozenset[int], bytes]]:
        """How a lazy lexeme that ends at ``state`` ends: (the terminals it matches, the text read again after
        it), one pair per hidden stop text. Only the lazy terminals match: a greedy one that matches here too
        would go on, so the lexeme is not its (llguidance: text, then a lazy ``<function`` head, is no text)."""
        by_replay: dict[bytes, set[int]] = {}
        for j in self.accepts[state]:
            if self.terminals[j].lazy:
                by_replay.setdefault(self.terminals[j].replay, set()).add(j)
        return [(frozenset(terminals), replay) for replay, terminals in sorted(by_replay.items())]

    def _grow(self) -> None:
        size = 2 * len(self.accepting)
        table = np.full((size, 256), _UNBUILT, dtype=np.int32)
        table[:len(self.table)] = self.table
        self.table = table
        for name in ("accepting", "forks", "lazy_ends"):
            grown = np.zeros(size, dtype=bool)
            grown[:len(getattr(self, name))] = getattr(self, name)
            setattr(self, name, grown)

    def nbytes(self) -> int:
        return self.table.nbytes + 3 * len(self.accepting) + 200 * len(self.states)

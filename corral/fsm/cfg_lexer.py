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

from corral.budget import Budget
from corral.errors import GrammarTooComplexError
from corral.fsm.lazy_dfa import DEAD, LazyDFA
from corral.grammar.cfg import Grammar

MAX_LEXER_STATES = 200_000


class Lexer:
    def __init__(self, grammar: Grammar, budget: Budget):
        self.terminals = grammar.terminals
        self.dfas = [None if t.node is None else LazyDFA(t.node, budget) for t in grammar.terminals]
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
        return state

"""Budget: the limits one request's compilation runs under, checked inside every loop that can grow.

One budget covers the whole constraint of a request (a schema, or every tool's ``parameters`` and the call
envelope together): its wall-clock time, the states of its automata, and cancellation (the client left, or the
server is shutting down). Past the time or state limit compilation raises :class:`GrammarTooComplexError`; once
cancelled, :class:`CompileCancelledError`. The checks sit in the AST builders, the value checks and the
automaton's term table, so a budget is honoured within milliseconds wherever compilation is.
"""

import threading
import time
from dataclasses import dataclass, field

from corral.errors import CompileCancelledError, GrammarTooComplexError

DEFAULT_TIME_BUDGET_S = 10.0
DEFAULT_MAX_STATES = 200_000
# A grammar's derivative terms, its memory (the native table holds about 100 bytes a term, memos included): the
# cap holds for the grammar's whole life, since terms are derived lazily while decoding too.
DEFAULT_MAX_TERMS = 4_000_000
# The new terms one token mask met while decoding may derive (the native walk's fuel; the start mask is bounded
# by the compile budget instead): work, not time, so a mask passes or fails alike on a busy machine. Over random walks of every 25th MaskBench dev schema the largest first-visit mask
# derived 698 new terms; a nested not/allOf schema derived more than 1,000,000 (14 s) for one mask.
DEFAULT_MASK_FUEL = 100_000


@dataclass(eq=False)  # compared and hashed by identity: one per request
class Budget:
    time_s: float = DEFAULT_TIME_BUDGET_S
    max_states: int = DEFAULT_MAX_STATES
    max_terms: int = DEFAULT_MAX_TERMS
    mask_fuel: int = DEFAULT_MASK_FUEL
    deadline: float = field(init=False)
    cancelled: threading.Event = field(default_factory=threading.Event, repr=False)

    def __post_init__(self):
        self.start()

    def start(self) -> None:
        """Start the clock now (a request's compile counts from when a worker takes it, not from its queueing)."""
        self.deadline = time.perf_counter() + self.time_s

    def cancel(self) -> None:
        """End the compilation at its next check (from any thread)."""
        self.cancelled.set()

    def check_time(self) -> None:
        if self.cancelled.is_set():
            raise CompileCancelledError("compilation was cancelled")
        if time.perf_counter() > self.deadline:
            raise GrammarTooComplexError(f"compilation ran past its time budget of {self.time_s:g} s")

    def check_states(self, num_states: int) -> None:
        """The state cap, as the native automaton words it."""
        if num_states >= self.max_states:
            raise GrammarTooComplexError(f"the grammar's automaton reached its cap of {self.max_states} states")

    def check_terms(self, num_terms: int) -> None:
        """The memory cap, as the native table words it."""
        if num_terms >= self.max_terms:
            raise GrammarTooComplexError(f"the grammar's automaton reached its memory cap of {self.max_terms} terms")

    def for_decoding(self) -> "Budget":
        """The limits that outlive compilation: the caps and the fuel, with no clock (rows built while decoding
        must not fail on time; they fail on work)."""
        return Budget(float("inf"), self.max_states, self.max_terms, self.mask_fuel)

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


@dataclass(eq=False)  # compared and hashed by identity: one per request
class Budget:
    time_s: float = DEFAULT_TIME_BUDGET_S
    max_states: int = DEFAULT_MAX_STATES
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

    def check_states(self, num_states: int, what: str = "automaton") -> None:
        if num_states > self.max_states:
            raise GrammarTooComplexError(f"the {what} grew past the state budget of {self.max_states} states")

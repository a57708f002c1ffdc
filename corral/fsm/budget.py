"""Budget: the time and state limits one compilation runs under, checked inside every loop that can grow.

Past either limit compilation raises :class:`GrammarTooComplexError` instead of hanging a worker.
"""

import time
from dataclasses import dataclass, field

from corral.errors import GrammarTooComplexError

DEFAULT_TIME_BUDGET_S = 10.0
DEFAULT_MAX_STATES = 200_000


@dataclass
class Budget:
    time_s: float = DEFAULT_TIME_BUDGET_S
    max_states: int = DEFAULT_MAX_STATES
    deadline: float = field(init=False)

    def __post_init__(self):
        self.deadline = time.perf_counter() + self.time_s

    def check_time(self) -> None:
        if time.perf_counter() > self.deadline:
            raise GrammarTooComplexError(f"compilation ran past its time budget of {self.time_s:g} s")

    def check_states(self, num_states: int, what: str = "automaton") -> None:
        if num_states > self.max_states:
            raise GrammarTooComplexError(f"the {what} grew past the state budget of {self.max_states} states")

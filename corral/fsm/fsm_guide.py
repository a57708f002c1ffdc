"""FSMGuide: the per-sequence cursor over a :class:`TokenIndex` — a list of states, cheap to copy and roll back.

A grammar grows while it is decoded (rows and masks are built when first needed), under its state cap, memory cap
and per-mask fuel. A guide whose next row or mask would pass one goes into the error state with the limit's
message (:attr:`FSMGuide.error`) instead of raising, so its sequence ends with ``finish_reason: "error"`` and the
rest of the batch goes on.
"""

import numpy as np

from corral.errors import GrammarTooComplexError
from corral.fsm.lazy_dfa import DEAD
from corral.fsm.guide import Guide
from corral.fsm.token_index import TokenIndex

ENDED = -2  # after EOS: only EOS may follow
_MAX_FORCED_BYTES = 4096


class FSMGuide(Guide):
    """State history ``[start, after token 1, ...]``; ``DEAD`` marks the error state, ``ENDED`` an EOS."""

    __slots__ = ("index", "states", "error")

    def __init__(self, index: TokenIndex, states: list[int] | None = None, error: str | None = None):
        self.index = index
        self.states = states if states is not None else [0]
        self.error = error  # the limit that stopped this guide, when one did

    @property
    def state(self) -> int:
        return self.states[-1]

    def fill_mask(self, row: np.ndarray) -> None:
        state = self.state
        if state == DEAD or self.error is not None:
            row[:] = 0
        elif state == ENDED:
            row[:] = self.index.tables.eos_words
        else:
            try:
                row[:] = self.index.mask(state)
            except GrammarTooComplexError as exc:
                self.error = str(exc)
                row[:] = 0

    def advance(self, token_id: int) -> bool:
        state = self.state
        if state == DEAD:
            self.states.append(DEAD)  # every advance is one history entry, so rollback(n) counts alike
            return False
        if token_id in self.index.vocab.eos_token_ids and self.is_accepting():
            self.states.append(ENDED)
            return True
        try:
            next_state = DEAD if state == ENDED else self.index.next_state(state, token_id)
        except GrammarTooComplexError as exc:
            self.error, next_state = str(exc), DEAD
        self.states.append(next_state)
        return next_state != DEAD

    def advance_as(self, token_id: int, probe: Guide, index: int) -> bool:
        states = probe.states if type(probe) is FSMGuide and probe.index is self.index else ()
        if self.error is None and index + 1 < len(states) and states[index] == self.states[-1] \
                and states[index + 1] != DEAD:
            self.states.append(states[index + 1])
            return True
        return self.advance(token_id)

    def is_accepting(self) -> bool:
        state = self.state
        return state == ENDED or (state >= 0 and self.index.is_accepting(state))

    def is_finished(self) -> bool:
        state = self.state
        if state in (DEAD, ENDED):
            return True
        if not self.index.is_accepting(state):
            return False
        try:
            return not (self.index.row(state) >= 0).any()
        except GrammarTooComplexError as exc:
            self.error = str(exc)  # the next mask is empty: the sequence ends with this error
            return False

    def is_error(self) -> bool:
        return self.state == DEAD or self.error is not None

    def rollback(self, num_tokens: int) -> None:
        assert 0 <= num_tokens < len(self.states), (num_tokens, len(self.states))
        if num_tokens:
            del self.states[-num_tokens:]

    def copy(self) -> "FSMGuide":
        return FSMGuide(self.index, list(self.states), self.error)

    def probe(self) -> "FSMGuide":
        return FSMGuide(self.index, [self.state], self.error)

    def forced_bytes(self) -> bytes:
        """Follow the states with exactly one live byte that are not accepting (an accepting state may stop).
        A row past a limit of the grammar ends the span there: the bytes found are still forced, and the guide
        meets that limit where its sequence would without a draft."""
        state = self.state
        return self.index.forced_bytes(state, _MAX_FORCED_BYTES) if state >= 0 else b""

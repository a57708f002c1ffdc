"""Guide: the per-sequence cursor over a compiled, immutable, shared grammar.

The engine holds one guide per constrained sequence. Guides are small and cheap to ``copy()`` (beam search,
``n > 1``, speculation), and never raise on a bad token: ``advance`` returns False and the guide enters an
error state, so that sequence ends with an error while the rest of the batch goes on.
"""

from abc import ABC, abstractmethod

import numpy as np


class Guide(ABC):
    @abstractmethod
    def fill_mask(self, row: np.ndarray) -> None:
        """Write the allowed-token bitmask into ``row``: int32, ``ceil(vocab_size / 32)`` words, bit ``j`` of word
        ``w`` is token ``32*w + j``, 1 = allowed. EOS bits are set exactly in accepting states; special tokens are
        never set. Never all zero unless the guide is in the error state."""

    @abstractmethod
    def advance(self, token_id: int) -> bool:
        """Commit ``token_id``. False (and the error state) when the token was not allowed."""

    def advance_as(self, token_id: int, probe: "Guide", index: int) -> bool:
        """:meth:`advance` by ``token_id``, which ``probe`` (one of this guide's probes, or a probe's) took as its
        ``index``-th advance (from 0) and accepted: where this guide stands where the probe stood before that
        advance, the probe's state after it is this guide's next one, and the grammar is not asked again (the
        same state and the same token give the same next state). The caller vouches for the token; the state
        is checked here, and anything else (a state that differs, a refusal, an error) takes :meth:`advance`."""
        return self.advance(token_id)

    @abstractmethod
    def is_accepting(self) -> bool:
        """The text so far is a complete match (EOS is allowed now)."""

    @abstractmethod
    def is_finished(self) -> bool:
        """Nothing but EOS can follow (accepting, no continuation), or the guide is in the error state."""

    @abstractmethod
    def is_error(self) -> bool:
        """An invalid token was committed."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` advances (speculative decoding, jump-forward verification)."""

    @abstractmethod
    def copy(self) -> "Guide":
        """An independent cursor at the same position, sharing the compiled grammar."""

    def probe(self) -> "Guide":
        """A cursor to look ahead with and throw away: :meth:`copy` without the history before this position
        (it cannot roll back past where it starts), so that asking costs the same at the ten-thousandth token
        as at the tenth. A limit met while probing stays with the probe."""
        return self.copy()

    @abstractmethod
    def forced_bytes(self) -> bytes:
        """The deterministic continuation from here: bytes that every accepted completion starts with. Never
        raises: a limit of the grammar met while following them ends the span there (drafts must not end a
        sequence that the same tokens without drafts would not)."""

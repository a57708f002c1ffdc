"""The context-free parse in native code: :class:`NativeParseSession` is :class:`ParseSession` with its lexer,
Earley table, configurations and token walk in C++ (``corral/csrc/cfg.cpp``).

Each call is coarse (a whole mask, a whole token's advance, the bytes that may follow), releases the GIL for its
whole length and never calls back into Python, so a grammar's mask is computed while the model runs. It computes
the masks, advances and acceptance ``ParseSession`` computes (the same algorithm, errors and bounds; its walk is
depth first, so Earley set and lexer state ids are numbered in another order);
``ParseSession`` stays as the oracle the tests compare it with, and as the path ``CORRAL_NATIVE=off`` runs.

What the native side holds per compiled grammar (``CFGIndex.native_index``): the terminals' automata (the lexer's
``NativeLazyDFA`` objects, shared), the lexer's states and moves, the productions, the special tokens' rows and
the sub-walks per (trie node, lexer state) (``ROOT_WALK_CACHE_BYTES`` of them); per session: the Earley sets,
configurations, moves and masks.
"""

import numpy as np

from corral import native
from corral.fsm.cfg_guide import MAX_CONFIGS, CFGIndex, ParseSession
from corral.fsm.earley import MAX_TABLE_ITEMS
from corral.fsm.lazy_dfa import DEAD


def new_session(index: CFGIndex, max_configs: int = MAX_CONFIGS):
    """A native session where the native module has the grammar's automata, else the Python one."""
    if index.native_index() is not None:
        return NativeParseSession(index, max_configs)
    return ParseSession(index, max_configs)


class NativeParseSession:
    """One request's parse (shared by the copies of its guides), in native code; the interface CFGGuide uses."""

    def __init__(self, index: CFGIndex, max_configs: int = MAX_CONFIGS):
        self.index, self.lock = index, index.lock
        with self.lock:
            self.native = native.module().CfgSession(index.native_index(), max_configs, MAX_TABLE_ITEMS,
                                                     index.mask_fuel)
        self.start = self.native.start
        self._words = index.tables.num_words

    def fill_mask(self, config: int, row: np.ndarray) -> None:
        index = self.index
        if config == self.start and index.start_mask is not None:
            row[:] = index.start_mask
        else:
            self.native.fill_mask(config, row, index.mask_fuel)

    def mask(self, config: int) -> np.ndarray:
        row = np.zeros(self._words, dtype=np.int32)
        self.fill_mask(config, row)
        row.setflags(write=False)
        return row

    def advance(self, config: int, token_id: int) -> int:
        index = self.index
        specials = index.special_of_token.get(token_id)
        if specials is not None:
            terminals = np.asarray(sorted(specials), dtype=np.int32)
            return self.native.advance_special(config, terminals, index.mask_fuel)
        if token_id in index.vocab.special_ids:
            return DEAD
        return self.native.advance(config, index.vocab.token_bytes[token_id], index.mask_fuel)

    def move(self, config: int, byte: int) -> int:
        return self.native.move(config, byte, self.index.mask_fuel)

    def is_accepting(self, config: int) -> bool:
        return self.native.is_accepting(config, self.index.mask_fuel)

    def specials_allowed(self, config: int) -> frozenset[int]:
        return frozenset(self.native.specials_allowed(config, self.index.mask_fuel))

    def live_bytes(self, config: int) -> np.ndarray:
        return np.asarray(self.native.live_bytes(config, self.index.mask_fuel), dtype=np.int64)

    def readings(self, config: int) -> tuple[tuple[int, int], ...]:
        with self.lock:
            return self.native.readings(config)

    def sets_between_lexemes(self, config: int) -> list[int]:
        return list(self.native.sets_between_lexemes(config, self.index.mask_fuel))

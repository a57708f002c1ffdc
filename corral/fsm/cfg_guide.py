"""The context-free path: a grammar's lexer and Earley parser lifted to tokens, behind the same Guide contract.

A *configuration* is (Earley set, lexer state): where the parser is and how much of the current lexeme has been
read. Configurations are interned per :class:`ParseSession` (one request and its copies) and their byte moves
are cached in a table that grows like a lazy DFA's, so a token mask is the same vectorised trie walk the regex
path does (``TokenTrie.walk_levels``): tokens sharing a prefix take each move once, and a move that ends a
lexeme is where the parser is consulted (one ``scan`` of the interned Earley table). A token is allowed exactly
when its bytes can be lexed from here into terminals the parser accepts, across as many lexemes and ``%ignore``
runs as it spans. EOS is allowed where the text so far is a complete parse; a special token the grammar names,
where the parser expects it between lexemes.

Bounds: every mask and every advance may build at most the budget's ``mask_fuel`` Earley items (an ambiguous
grammar over a long input ends its sequence with the fuel's error, never a stall); a session holds at most
``MAX_CONFIGS`` configurations and the Earley table its own item cap.
"""

import dataclasses
import threading

import numpy as np

from corral.budget import Budget
from corral.errors import GrammarTooComplexError, InvalidGrammarError
from corral.fsm.cfg_lexer import MAX_LEXER_STATES, Lexer
from corral.fsm.earley import EarleyTable, EarleyTables
from corral.fsm.guide import Guide
from corral.fsm.derivatives import native_module
from corral.fsm.lazy_dfa import DEAD
from corral.fsm.token_index import vocab_tables
from corral.fsm.token_trie import _runs
from corral.fsm.vocabulary import Vocabulary
from corral.grammar.cfg import Grammar

ENDED = -2  # after EOS
_UNBUILT = -3
MAX_CONFIGS = 32_768  # per session: the move table is 1 kB a configuration
ROOT_WALK_CACHE_BYTES = 64 << 20  # per compiled grammar: CFGIndex.root_walk's answers kept
_SCALAR_ROWS, _SCALAR_NODES = 24, 512  # a mask's walk goes on depth first in Python below so many rows and nodes
_MAX_FORCED_BYTES = 256


class CFGIndex:
    """What every guide of one compiled grammar shares: the lexer, the parser's tables, the special tokens."""

    def __init__(self, grammar: Grammar, vocab: Vocabulary, budget: Budget):
        self.grammar, self.vocab, self.tables = grammar, vocab, vocab_tables(vocab)
        self.lexer = Lexer(grammar, budget)
        self.earley = EarleyTables(_without_dead_terminals(grammar, self.lexer.dead_terminals))
        self.mask_fuel = budget.mask_fuel
        self.special_of_token, self.special_words = _special_tokens(grammar, vocab)
        self.lock = threading.RLock()
        self.piece_tokens_ids: dict[int, tuple] = {}  # id(PieceTokens) -> (it, its id in the native index)
        self.on_growth = None  # the compile cache's hook (this index does not grow after compilation)
        self.start_mask: np.ndarray | None = None
        self._root_walks: dict[int, tuple] = {}  # lexer state -> root_walk's answer
        self._root_walk_bytes = 0
        self._native = None
        self._native_checked = False

    def nbytes(self) -> int:
        dfas = [d for d in self.lexer.dfas if d is not None]
        native_bytes = 0 if self._native is None else self._native.nbytes()
        return sum(d.trans.nbytes + d.terms.nbytes() for d in dfas) + self.lexer.nbytes() + native_bytes + \
            self._root_walk_bytes + (0 if self.start_mask is None else self.start_mask.nbytes)

    @property
    def num_lexer_states(self) -> int:
        return len(self.lexer.states) if self._native is None else self._native.num_lexer_states

    def native_index(self):
        """The grammar's tables in the native core's layout (``native_cfg.py``), built once; None where the
        native module is off or a terminal's automaton is the Python one."""
        if not self._native_checked:
            with self.lock:
                if not self._native_checked:
                    self._native = self._build_native()
                    self._native_checked = True
        return self._native

    def _build_native(self):
        module = native_module()
        if module is None:
            return None
        lexer, grammar, earley = self.lexer, self.grammar, self.earley
        dfas = []
        for j, dfa in enumerate(lexer.dfas):
            if dfa is None or j in lexer.dead_terminals:
                dfas.append(None)  # a special token, or a terminal no text matches: never in a lexer state
            elif not hasattr(dfa, "native"):
                return None
            else:
                dfas.append(dfa.native)
        terminals = grammar.terminals
        flags = [np.asarray([getattr(t, name) for t in terminals], dtype=dtype)
                 for name, dtype in (("priority", np.int32), ("lazy", np.uint8), ("exact", np.uint8))]
        offsets = np.cumsum([0, *(len(rhs) for rhs in earley.rhs)], dtype=np.int64)
        rhs = np.asarray([s for symbols in earley.rhs for s in symbols], dtype=np.int32)
        nullable = np.zeros(len(grammar.nonterminals), dtype=np.uint8)
        nullable[sorted(earley.nullable)] = 1
        specials = sorted(self.special_words)
        special_rows = (np.stack([self.special_words[j] for j in specials]) if specials
                        else np.zeros((0, self.tables.num_words), dtype=np.int32))
        return module.CfgIndex(
            self.tables.native_trie.native, dfas, *flags, grammar.greedy,
            np.asarray(sorted(lexer.ignore), dtype=np.int32), np.asarray(earley.lhs, dtype=np.int32), offsets, rhs,
            len(grammar.nonterminals), nullable, earley.start_production,
            np.ascontiguousarray(self.tables.eos_words, dtype=np.int32), np.asarray(specials, dtype=np.int32),
            np.ascontiguousarray(special_rows, dtype=np.int32), MAX_LEXER_STATES, ROOT_WALK_CACHE_BYTES,
            [t.replay for t in terminals])

    def root_walk(self, lex_state: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The tokens whose bytes all stay inside the current lexeme from ``lex_state`` (a bitmask row: allowed
        whatever the parser's state, since the lexer state holds only terminals the parser allows), and the
        *exits*: each trie node where the lexeme may end inside a token, as (node, lexer state before its byte,
        byte). Found by the lexer alone, once per lexer state for every session of the grammar (at most
        ``ROOT_WALK_CACHE_BYTES`` of them are kept)."""
        found = self._root_walks.get(lex_state)
        if found is not None:
            return found
        trie, lexer = self.tables.trie, self.lexer
        nodes, states = np.zeros(1, dtype=np.int64), np.asarray([lex_state], dtype=np.int32)
        inside, exits = [], []
        while len(nodes):
            children, parents, bytes_, following = _children(trie, lexer, nodes, states)
            plain, ending = _plain_and_ending(lexer, parents, following)
            exits.append((children[ending], parents[ending], bytes_[ending]))
            children, states = children[plain], following[plain]
            inside.append(children)
            keep = trie.has_children[children]
            nodes, states = children[keep], states[keep]
        reached = np.concatenate(inside) if inside else np.zeros(0, dtype=np.int64)
        words = self.tables.words_of(trie.token_ids_at(reached))
        words.setflags(write=False)
        found = (words, *(np.concatenate(column) for column in zip(*exits)))
        size = words.nbytes + sum(column.nbytes for column in found[1:])
        if self._root_walk_bytes + size <= ROOT_WALK_CACHE_BYTES:
            self._root_walks[lex_state] = found
            self._root_walk_bytes += size
        return found


class ParseSession:
    """One request's configurations, their moves and masks (shared by the copies of its guides).

    A configuration is a set of readings ``(Earley set, lexer state)``. With greedy lexing (Lark) there is
    one. With exact lexing (GBNF, JSON Schema grammars: ``Grammar.greedy`` False; in a Lark grammar, the
    ``Terminal.exact`` lexemes of an inline ``%json``) a lexeme that matches may also end where a longer one
    could go on, so each such point adds the reading where it ended: the language is then exactly the grammar's
    over its terminals' languages, whatever the lexemes' overlaps."""

    def __init__(self, index: CFGIndex, max_configs: int = MAX_CONFIGS):
        self.index, self.lexer, self.max_configs = index, index.lexer, max_configs
        self.greedy = index.grammar.greedy
        self.exact = frozenset(j for j, t in enumerate(index.grammar.terminals) if t.exact)  # (greedy grammars)
        self.table = EarleyTable(index.earley, max_closure_work=index.mask_fuel)
        self.configs: list[frozenset[tuple[int, int]]] = []
        self.config_ids: dict[frozenset[tuple[int, int]], int] = {}
        self.trans = np.full((64, 256), _UNBUILT, dtype=np.int32)
        self.masks: dict[int, np.ndarray] = {}
        self._allowed: dict[int, frozenset[int]] = {}
        self._ends: dict[int, tuple[tuple[int, int], ...]] = {}  # see _ended
        self._starts: dict[int, tuple[int, int]] = {}  # see _finish_start
        self._replaying = False  # reading a hidden stop's text again (see _lazy_end)
        self.lock = index.lock
        self.fuel_start = 0
        with self.lock:
            self.start = self.intern({self.after_lexeme(0)})

    # -- configurations and their byte moves
    def allowed(self, set_id: int) -> frozenset[int]:
        allowed = self._allowed.get(set_id)
        if allowed is None:
            allowed = self._allowed[set_id] = self.table.sets[set_id].expected | self.lexer.ignore
        return allowed

    def intern(self, readings: set[tuple[int, int]]) -> int:
        key = frozenset(readings)
        config = self.config_ids.get(key)
        if config is None:
            config = len(self.configs)
            if config >= self.max_configs:
                raise GrammarTooComplexError(f"the parse reached its cap of {self.max_configs} states")
            self.config_ids[key] = config
            self.configs.append(key)
            if config >= len(self.trans):
                grown = np.full((2 * len(self.trans), 256), _UNBUILT, dtype=np.int32)
                grown[:len(self.trans)] = self.trans
                self.trans = grown
        return config

    def finish_lexeme(self, set_id: int, lex_state: int, matched: frozenset[int] | None = None) -> int:
        """The Earley set after the lexeme read so far ends here as one of ``matched`` (by default every terminal
        it matches; -1 when none)."""
        if matched is None:
            matched = self.lexer.accepts[lex_state]
        if not matched:
            return -1
        scanned = matched & self.table.sets[set_id].expected
        if not scanned:
            return set_id  # an %ignore lexeme: the parser does not move
        return self.table.scan(set_id, scanned)

    def after_lexeme(self, set_id: int) -> tuple[int, int]:
        return set_id, self.lexer.start(self.allowed(set_id))

    def move(self, config: int, byte: int) -> int:
        found = int(self.trans[config, byte])
        if found == _UNBUILT:
            readings: set[tuple[int, int]] = set()
            for set_id, lex_state in self.configs[config]:
                self._read(set_id, lex_state, byte, readings)
            found = self.intern(readings) if readings else DEAD
            self.trans[config, byte] = found
            self.check_fuel()
        return found

    def _read(self, set_id: int, lex_state: int, byte: int, out: set) -> None:
        """The readings after ``byte`` from one reading."""
        lexer = self.lexer
        following, matched = lexer.move(lex_state, byte), None
        if following >= 0:
            self._add(set_id, following, out)
            if self.greedy:  # the lexeme goes on: it cannot end here, unless as an exact terminal
                matched = lexer.accepts[lex_state] & self.exact if self.exact else None
                if not matched:
                    return
        ended = self.finish_lexeme(set_id, lex_state, matched)  # the byte starts the next lexeme
        if ended >= 0:
            following = lexer.move(lexer.start(self.allowed(ended)), byte)
            if following >= 0:
                self._add(ended, following, out)

    def _add(self, set_id: int, lex_state: int, out: set) -> None:
        if self.greedy and self.lexer.is_lazy_end[lex_state]:  # a lazy lexeme ends as soon as it matches
            self._lazy_end(set_id, lex_state, out)
            return
        out.add((set_id, lex_state))

    def _lazy_end(self, set_id: int, lex_state: int, out: set) -> None:
        """The readings after a lazy lexeme that ends at ``lex_state`` (as its lazy terminals: ``Lexer.replays``).
        A terminal with a hidden stop (``Terminal.replay``) ends before its stop's text, which is then read again
        from the next lexeme."""
        for matched, replay in self.lexer.replays(lex_state):
            if replay and self._replaying:
                # a hidden stop inside the text read again would take that text as its own stop as well (with
                # an empty body, again and again: `line[stop="\n"]` in `line*`): bytes are read once as a stop
                continue
            ended = self.finish_lexeme(set_id, lex_state, matched)
            if ended < 0:
                continue
            readings = {self.after_lexeme(ended)}
            self._replaying = True
            try:
                for byte in replay:
                    following: set[tuple[int, int]] = set()
                    for reading in readings:
                        self._read(*reading, byte, following)
                    readings = following
            finally:
                self._replaying = False
            out |= readings

    def gather(self, configs: np.ndarray, bytes_: np.ndarray) -> np.ndarray:
        out = self.trans[configs, bytes_]
        missing = out == _UNBUILT
        if missing.any():
            for pair in np.unique((configs[missing].astype(np.int64) << 8) | bytes_[missing]).tolist():
                self.move(pair >> 8, pair & 255)
            out = self.trans[configs, bytes_]
        return out

    def check_fuel(self) -> None:
        if self.table.work - self.fuel_start > self.index.mask_fuel:
            raise GrammarTooComplexError(f"one step of the parse built more than {self.index.mask_fuel} Earley "
                                         "items (the grammar is too ambiguous for this input)")

    # -- what a configuration allows
    def sets_between_lexemes(self, config: int) -> list[int]:
        """The Earley sets of the readings whose current lexeme may end here."""
        out = []
        for set_id, lex_state in self.configs[config]:
            between = set_id if self.lexer.is_start[lex_state] else self.finish_lexeme(set_id, lex_state)
            if between >= 0:
                out.append(between)
        return out

    def is_accepting(self, config: int) -> bool:
        self.fuel_start = self.table.work
        return any(self.table.sets[s].is_accepting for s in self.sets_between_lexemes(config))

    def specials_allowed(self, config: int) -> frozenset[int]:
        """The special terminals some reading expects here."""
        specials = self.index.special_words.keys()
        if not specials:
            return frozenset()
        return frozenset(j for s in self.sets_between_lexemes(config) for j in self.table.sets[s].expected & specials)

    def fill_mask(self, config: int, row: np.ndarray) -> None:
        row[:] = self.mask(config)

    def readings(self, config: int) -> tuple[tuple[int, int], ...]:
        return tuple(sorted(self.configs[config]))

    def mask(self, config: int) -> np.ndarray:
        mask = self.masks.get(config)
        if mask is None:
            index = self.index
            if config == self.start and index.start_mask is not None:
                return index.start_mask
            self.fuel_start = self.table.work
            words = self._walk(config)
            if self.is_accepting(config):
                words |= index.tables.eos_words
            for j in self.specials_allowed(config):
                words |= index.special_words[j]
            words.setflags(write=False)
            mask = self.masks[config] = words
        return mask

    def _walk(self, config: int) -> np.ndarray:
        """The bitmask row of the tokens allowed from ``config``: for each reading, the tokens inside its lexeme
        (``CFGIndex.root_walk``), and below each exit, where the parser moves, the trie walked on with one row
        per (node, Earley set, lexer state)."""
        index = self.index
        words = np.zeros(index.tables.num_words, dtype=np.int32)
        rows = []
        for set_id, lex_state in self.configs[config]:
            inside, nodes, states, bytes_ = index.root_walk(lex_state)
            words |= inside
            if len(nodes):
                rows.append(self._resolve(nodes, np.full(len(nodes), set_id, dtype=np.int32), states, bytes_))
        if rows:
            nodes, sets, states = (np.concatenate(column) for column in zip(*rows))
            reached = self._walk_rows(nodes, sets, states, many=len(self.configs[config]) > 1)
            words |= index.tables.words_of(index.tables.trie.token_ids_at(np.concatenate([nodes, *reached])))
        return words

    def _walk_rows(self, nodes: np.ndarray, sets: np.ndarray, states: np.ndarray, many: bool) -> list[np.ndarray]:
        """The nodes below ``nodes`` that the rows (node, Earley set, lexer state) reach, level by level: a byte
        inside the lexeme is one lookup in the lexer's table, a lexeme's end one ``_ended`` per distinct
        (set, state, byte). ``many``: a node may hold several rows (they are then deduplicated)."""
        trie, lexer, reached = self.index.tables.trie, self.lexer, []
        keep = trie.has_children[nodes]
        nodes, sets, states = nodes[keep], sets[keep], states[keep]
        while len(nodes):
            if len(nodes) <= _SCALAR_ROWS and int((trie.subtree_end_node[nodes] - nodes).sum()) <= _SCALAR_NODES:
                # a narrow subtree (long runs of one byte, comments): numpy's per-call cost would dominate
                reached.append(self._walk_scalar(nodes.tolist(), sets.tolist(), states.tolist()))
                break
            children, parents, bytes_, following = _children(trie, lexer, nodes, states)
            parent_sets = np.repeat(sets, trie.child_start[nodes + 1] - trie.child_start[nodes])
            plain, ending = _plain_and_ending(lexer, parents, following)
            nodes, sets, states = children[plain], parent_sets[plain], following[plain]
            if ending.any():
                ended = self._resolve(children[ending], parent_sets[ending], parents[ending], bytes_[ending])
                many = many or len(ended[0]) > int(ending.sum()) or bool((plain & ending).any())
                nodes, sets, states = (np.concatenate(pair) for pair in zip((nodes, sets, states), ended))
                self.check_fuel()
            if many and len(nodes) > 1:
                keys = np.unique((nodes << 40) | (sets.astype(np.int64) << 18) | states)
                nodes, sets, states = keys >> 40, ((keys >> 18) & 0x3FFFFF).astype(np.int32), \
                    (keys & 0x3FFFF).astype(np.int32)
            reached.append(nodes)
            keep = trie.has_children[nodes]
            nodes, sets, states = nodes[keep], sets[keep], states[keep]
        return reached

    def _walk_scalar(self, nodes: list[int], sets: list[int], states: list[int]) -> np.ndarray:
        """``_walk_rows`` depth first in plain Python, for a few rows."""
        trie, lexer = self.index.tables.trie, self.lexer
        child_start, child_byte, child_node = trie._child_start_list, trie._child_byte_list, trie._child_node_list
        has_children, moves, accepts, lazy = trie._has_children_list, lexer.moves, lexer.accepts, lexer.is_lazy_end
        greedy, exact, seen, out = self.greedy, self.exact, set(), []
        stack = list(zip(nodes, sets, states))
        while stack:
            node, set_id, lex_state = stack.pop()
            matched = accepts[lex_state]
            may_end = bool(matched) and (not greedy or not exact.isdisjoint(matched))
            for k in range(child_start[node], child_start[node + 1]):
                byte, child = child_byte[k], child_node[k]
                following = moves.get(lex_state << 8 | byte)
                if following is None:
                    following = lexer.move(lex_state, byte)
                rows = []
                if following >= 0 and not (greedy and lazy[following]):
                    rows.append((set_id, following))
                if (following < 0 and matched) or may_end or (following >= 0 and greedy and lazy[following]):
                    rows.extend(self._ended(set_id, lex_state, byte))
                if rows:
                    out.append(child)
                    if has_children[child]:
                        for row in rows:
                            key = (child, *row)
                            if key not in seen:
                                seen.add(key)
                                stack.append(key)
        self.check_fuel()
        return np.asarray(out, dtype=np.int64)

    def _resolve(self, nodes: np.ndarray, sets: np.ndarray, states: np.ndarray, bytes_: np.ndarray):
        """The rows after lexemes end at ``nodes`` (one per reading; none where the parser refuses). Where the
        byte cannot go on in the lexeme (the common case) the lexeme's end is one parser step per distinct
        (Earley set, lexer state) and the byte one lookup; the rest (exact or lazy lexemes) goes through
        ``_ended``."""
        lexer = self.lexer
        pairs = (sets.astype(np.int64) << 18) | states
        common = lexer.table[states, bytes_] == DEAD  # (every move here was just looked up)
        slow = ~common
        out_nodes, out_sets, out_states = [], [], []
        if common.any():
            rows = np.flatnonzero(common)
            unique, inverse = np.unique(pairs[rows], return_inverse=True)
            after = np.asarray([self._finish_start(k >> 18, k & 0x3FFFF) for k in unique.tolist()],
                               dtype=np.int32).reshape(-1, 2)[inverse]
            ok = after[:, 0] >= 0
            rows, after = rows[ok], after[ok]
            following = lexer.gather(after[:, 1], bytes_[rows])
            live = following >= 0
            lazy = np.zeros(len(following), dtype=bool)
            lazy[live] = lexer.lazy_ends[following[live]]
            plain = live & ~lazy
            out_nodes.append(nodes[rows[plain]])
            out_sets.append(after[plain, 0])
            out_states.append(following[plain])
            slow[rows[lazy]] = True  # a lazy lexeme that ends on the byte that starts it
        if slow.any():
            keys = (pairs[slow] << 8) | bytes_[slow]
            unique, inverse = np.unique(keys, return_inverse=True)
            results = [self._ended(k >> 26, (k >> 8) & 0x3FFFF, k & 255) for k in unique.tolist()]
            sizes = np.asarray([len(r) for r in results], dtype=np.int64)
            flat = np.asarray([reading for r in results for reading in r], dtype=np.int32).reshape(-1, 2)
            counts = sizes[inverse]
            firsts = (np.cumsum(sizes) - sizes)[inverse]
            picks = _runs(firsts, firsts + counts)
            out_nodes.append(np.repeat(nodes[slow], counts))
            out_sets.append(flat[picks, 0])
            out_states.append(flat[picks, 1])
        if not out_nodes:
            return nodes[:0], sets[:0], states[:0]
        return np.concatenate(out_nodes), np.concatenate(out_sets), np.concatenate(out_states)

    def _finish_start(self, set_id: int, lex_state: int) -> tuple[int, int]:
        """(the Earley set after the lexeme at ``lex_state`` ends, the lexer state that starts the next one);
        (-1, -1) when the parser refuses the lexeme."""
        key = (set_id << 18) | lex_state
        found = self._starts.get(key)
        if found is None:
            ended = self.finish_lexeme(set_id, lex_state)
            found = self._starts[key] = (ended, self.lexer.start(self.allowed(ended))) if ended >= 0 else (-1, -1)
        return found

    def _ended(self, set_id: int, lex_state: int, byte: int) -> tuple[tuple[int, int], ...]:
        """The readings after ``byte`` where the lexeme read so far ends (before ``byte``, which starts the next
        one, or on it, a lazy one): ``_read`` without the reading that goes on inside the lexeme."""
        key = (set_id << 26) | (lex_state << 8) | byte
        found = self._ends.get(key)
        if found is None:
            lexer, out = self.lexer, set()
            following = lexer.move(lex_state, byte)
            if following >= 0 and lexer.lazy_ends[following]:
                self._lazy_end(set_id, following, out)
            if lexer.accepting[lex_state] and (following < 0 or lexer.forks[lex_state]):
                matched = None if following < 0 or not self.greedy else lexer.accepts[lex_state] & self.exact
                ended = self.finish_lexeme(set_id, lex_state, matched)
                if ended >= 0:
                    after = lexer.move(lexer.start(self.allowed(ended)), byte)
                    if after >= 0:
                        self._add(ended, after, out)
            found = self._ends[key] = tuple(sorted(out))
        return found

    def advance(self, config: int, token_id: int) -> int:
        self.fuel_start = self.table.work
        specials = self.index.special_of_token.get(token_id)
        if specials is not None:
            readings = set()
            for between in self.sets_between_lexemes(config):
                scanned = specials & self.table.sets[between].expected
                if scanned:
                    set_id = self.table.scan(between, scanned)
                    if set_id >= 0:
                        readings.add(self.after_lexeme(set_id))
            return self.intern(readings) if readings else DEAD
        vocab = self.index.vocab
        # an id past the vocabulary (a model's padding rows, which a prompt may hold) spells nothing
        if token_id in vocab.special_ids or not 0 <= token_id < len(vocab.token_bytes):
            return DEAD
        for byte in vocab.token_bytes[token_id]:
            config = self.move(config, byte)
            if config < 0:
                return DEAD
        return config

    def forced_bytes(self, config: int, limit: int) -> bytes:
        """The bytes every continuation of ``config`` starts with: while the text is not a complete parse,
        exactly one byte can follow and no special token may come instead, that byte, at most ``limit`` of them.
        A limit met on the way ends the span there (the bytes found are forced all the same)."""
        out = bytearray()
        try:
            while config >= 0 and len(out) < limit and not self.is_accepting(config):
                live = self.live_bytes(config)
                if len(live) != 1 or self.specials_allowed(config):
                    break  # several bytes, or a special token may come here instead
                out.append(int(live[0]))
                config = self.move(config, int(live[0]))
        except GrammarTooComplexError:
            pass
        return bytes(out)

    def live_bytes(self, config: int) -> np.ndarray:
        self.fuel_start = self.table.work
        row = self.gather(np.full(256, config, dtype=np.int32), np.arange(256))
        return np.flatnonzero(row >= 0)


class CFGGuide(Guide):
    """Configuration history ``[start, after token 1, ...]`` over a shared :class:`ParseSession`."""

    __slots__ = ("session", "configs", "error")

    def __init__(self, session: ParseSession, configs: list[int] | None = None, error: str | None = None):
        self.session = session
        self.configs = configs if configs is not None else [session.start]
        self.error = error

    @property
    def config(self) -> int:
        return self.configs[-1]

    def fill_mask(self, row: np.ndarray) -> None:
        config = self.config
        if config == DEAD or self.error is not None:
            row[:] = 0
        elif config == ENDED:
            row[:] = self.session.index.tables.eos_words
        else:
            try:
                with self.session.lock:
                    self.session.fill_mask(config, row)
            except GrammarTooComplexError as exc:
                self.error = str(exc)
                row[:] = 0

    def advance(self, token_id: int) -> bool:
        config = self.config
        if config == DEAD or self.error is not None:
            self.configs.append(DEAD)
            return False
        session = self.session
        try:
            with session.lock:
                if token_id in session.index.vocab.eos_token_ids and config != ENDED:
                    following = ENDED if session.is_accepting(config) else DEAD
                else:
                    following = DEAD if config == ENDED else session.advance(config, token_id)
        except GrammarTooComplexError as exc:
            self.error, following = str(exc), DEAD
        self.configs.append(following)
        return following != DEAD

    def advance_as(self, token_id: int, probe: Guide, index: int) -> bool:
        configs = probe.configs if type(probe) is CFGGuide and probe.session is self.session else ()
        if self.error is None and index + 1 < len(configs) and configs[index] == self.configs[-1] \
                and configs[index + 1] != DEAD:
            self.configs.append(configs[index + 1])
            return True
        return self.advance(token_id)

    def is_accepting(self) -> bool:
        config = self.config
        if config == ENDED:
            return True
        if config < 0:
            return False
        with self.session.lock:
            return self.session.is_accepting(config)

    def is_finished(self) -> bool:
        config = self.config
        if config in (DEAD, ENDED) or self.error is not None:
            return True
        session = self.session
        try:
            with session.lock:
                if not session.is_accepting(config) or len(session.live_bytes(config)):
                    return False
                return not session.specials_allowed(config)
        except GrammarTooComplexError as exc:
            self.error = str(exc)
            return False

    def is_error(self) -> bool:
        return self.config == DEAD or self.error is not None

    def rollback(self, num_tokens: int) -> None:
        assert 0 <= num_tokens < len(self.configs), (num_tokens, len(self.configs))
        if num_tokens:
            del self.configs[-num_tokens:]

    def copy(self) -> "CFGGuide":
        return CFGGuide(self.session, list(self.configs), self.error)

    def probe(self) -> "CFGGuide":
        return CFGGuide(self.session, [self.config], self.error)

    def forced_bytes(self) -> bytes:
        """Bytes while exactly one can follow and the text so far is not a complete parse."""
        config = self.config
        if config < 0:
            return b""
        with self.session.lock:
            return self.session.forced_bytes(config, _MAX_FORCED_BYTES)


def _children(trie, lexer, nodes: np.ndarray, states: np.ndarray):
    """Every child of ``nodes``: the child, its parent's lexer state, the byte into it, the lexer state after."""
    starts, ends = trie.child_start[nodes], trie.child_start[nodes + 1]
    offsets = _runs(starts, ends)
    parents, bytes_ = np.repeat(states, ends - starts), trie.child_byte[offsets]
    return trie.child_node[offsets], parents, bytes_, lexer.gather(parents, bytes_)


def _plain_and_ending(lexer, parents: np.ndarray, following: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per move: it stays inside the lexeme (and it is no lazy end); the lexeme may end there."""
    live = following >= 0
    lazy = np.zeros(len(following), dtype=bool)
    lazy[live] = lexer.lazy_ends[following[live]]
    plain = live & ~lazy
    return plain, lazy | (lexer.accepting[parents] & (~live | lexer.forks[parents]))


def _without_dead_terminals(grammar: Grammar, dead: frozenset[int]) -> Grammar:
    """``grammar`` without the productions that need a terminal no text matches (``%declare``d, empty classes);
    refused when the start rule is left with nothing."""
    if not dead:
        return grammar
    productions = list(grammar.productions)
    while True:
        productive = _productive(productions, dead)
        kept = [(lhs, rhs) for lhs, rhs in productions
                if lhs in productive and all((s >= 0 and s in productive) or (s < 0 and ~s not in dead)
                                             for s in rhs)]
        if len(kept) == len(productions):
            break
        productions = kept
    if grammar.start not in _productive(productions, dead):
        raise InvalidGrammarError(f"rule '{grammar.nonterminals[grammar.start]}' can never finish: every "
                                  "alternative needs a terminal that matches no text")
    return dataclasses.replace(grammar, productions=tuple(productions))


def _productive(productions, dead) -> set[int]:
    productive: set[int] = set()
    changed = True
    while changed:
        changed = False
        for lhs, rhs in productions:
            if lhs not in productive and all((s >= 0 and s in productive) or (s < 0 and ~s not in dead)
                                             for s in rhs):
                productive.add(lhs)
                changed = True
    return productive


def _special_tokens(grammar: Grammar, vocab: Vocabulary):
    """token id -> the special terminals it is, and each special terminal's bitmask row."""
    of_token: dict[int, set[int]] = {}
    tables = vocab_tables(vocab)
    words: dict[int, np.ndarray] = {}
    by_bytes: dict[bytes, list[int]] | None = None
    for j, terminal in enumerate(grammar.terminals):
        if terminal.special is None:
            continue
        if isinstance(terminal.special, str):
            if by_bytes is None:
                by_bytes = {}
                for token_id, data in enumerate(vocab.token_bytes):
                    by_bytes.setdefault(data, []).append(token_id)
            ids = [i for i in by_bytes.get(terminal.special.encode(), ()) if i not in vocab.eos_token_ids]
            if not ids:
                raise InvalidGrammarError(f"the grammar names the special token {terminal.special}, which this "
                                          "model's vocabulary does not have")
        else:
            low, high = terminal.special
            if high < low or high >= vocab.size:
                raise InvalidGrammarError(f"the grammar names token ids <[{low}-{high}]>; this vocabulary has "
                                          f"{vocab.size}")
            ids = list(range(low, high + 1))
        for token_id in ids:
            of_token.setdefault(token_id, set()).add(j)
        words[j] = tables.words_of(np.asarray(ids, dtype=np.int64))
    return {k: frozenset(v) for k, v in of_token.items()}, words

"""Byte-level regex terms and their Brzozowski derivatives: the states of Corral's lazy DFA.

A regex AST over code points is turned into interned byte-level terms (UTF-8 sequences of byte sets, with
shared tails), and a DFA state *is* a term: the language of what may still follow. The derivative by a byte is
the next state. Terms are normalized as they are built (∅ absorbs, ε vanishes, concatenation is right-nested,
alternation is flattened, deduplicated, sorted and its byte sets merged), which is what keeps the number of
distinct derivatives finite (Brzozowski). Why derivatives rather than Thompson + subset construction: counted
repeats (``maxLength: 5000``) and recurring pieces (any-value, string bodies) cost nothing until explored, and
``Intersect`` is just the intersection of the parts' derivatives.

The table exists twice with the same normal forms: this pure-Python one (the oracle), and a native one
(``corral/csrc/terms.cpp``, in the native module built at install time) that :func:`new_table` gives wherever the
module loads; deriving in Python was most of the cost of a mask met for the first time. The conversions from the AST
and between tables by structure (:class:`_Conversions`) are shared Python code over either.

Left out: complement. Emptiness is syntactic (a normalized term other than ∅ is non-empty) except under
``Intersect``, where it is decided by exploring the product's derivatives, under a step limit; an intersection
still undecided at the limit is treated as empty (sound: it can only forbid strings, never allow one).
"""

import functools
import threading
from collections import deque

from corral import native
from corral.budget import Budget
from corral.errors import GrammarTooComplexError
from corral.fsm.utf8 import utf8_sequences
from corral.grammar.node_builder import SHARED_NODES, children_of
from corral.grammar.regex_ast import Alt, CharSet, Concat, Intersect, Node, Repeat

EMPTYSET, EPSILON = 0, 1
_BYTES, _CAT, _ALT, _REP, _AND, _CONST = range(6)
ALL_BYTES = (1 << 256) - 1
_LIVENESS_STEP_LIMIT = 5000
# Alternations of at least this many members are derived through an index of their members by first byte; a
# member starting with more than this many bytes is tested by its mask instead of listed under each.
_INDEXED_ALT_MEMBERS = 8
_INDEXED_MEMBER_BYTES = 16


_CANONICAL: dict[tuple, int] = {}  # structure key -> process-wide id (see TermTable.structure)
_CANONICAL_KEYS: list[tuple] = []
_CANONICAL_LOCK = threading.Lock()
# Structure ids the process holds (each about 200 bytes). Past the cap a new structure gets no id: its piece
# walks plainly and its shared node converts from the AST, so the memo stays bounded however many schemas come.
MAX_STRUCTURES = 250_000
_SHARED_STRUCTURES: dict[int, tuple[Node, int]] = {}  # id of a shared node -> (node, its structure id)


def _canonical_id(key: tuple) -> int | None:
    known = _CANONICAL.get(key)
    if known is None:
        with _CANONICAL_LOCK:
            known = _CANONICAL.get(key)
            if known is None:
                if len(_CANONICAL_KEYS) >= MAX_STRUCTURES:
                    return None
                known = _CANONICAL[key] = len(_CANONICAL_KEYS)
                _CANONICAL_KEYS.append(key)
    return known


@functools.lru_cache(maxsize=65536)
def _partition(masks: frozenset[int]) -> list[int]:
    """The coarsest partition of the union of ``masks`` that each mask is a union of (shared: the same first-byte
    sets recur in every state of a string body or a pattern). Callers must not modify the list."""
    classes = []
    for mask in masks:
        remaining, refined = mask, []
        for cls in classes:
            inside, outside = cls & mask, cls & ~mask
            refined += [c for c in (inside, outside) if c]
            remaining &= ~cls
        classes = refined + ([remaining] if remaining else [])
    return classes


class _Conversions:
    """Terms from the code-point AST, and between tables by structure: shared by the pure-Python table and the
    native one (``corral/csrc/terms.cpp``), which give the constructors and the ``kind``/``args`` views they use."""

    def _init_conversions(self) -> None:
        self._from_nodes: dict[int, tuple[Node, int]] = {}
        self._charsets: dict[CharSet, int] = {}
        self._structures: dict[int, int] = {}
        self._from_structures: dict[int, int] = {}

    def forget_nodes(self) -> None:
        """Drop the memos by AST node (done converting): they hold the whole AST, which the garbage collector would
        otherwise walk in every full collection for as long as the grammar is cached."""
        self._from_nodes.clear()
        self._charsets.clear()

    # ---- from the code-point AST ---------------------------------------------------------------------------
    def from_node(self, node: Node) -> int:
        """The term of ``node``. Schema ASTs share node objects, so the memo is by identity. A walk with a stack of
        its own, not a recursion: a schema's AST may nest thousands deep (an object's optional members)."""
        memo = self._from_nodes
        known = memo.get(id(node))
        if known is not None:
            return known[1]
        stack: list[tuple[Node, bool]] = [(node, False)]
        while stack:
            item, ready = stack.pop()
            if id(item) in memo:
                continue
            if len(memo) % 1024 == 0:
                self.budget.check_time()
            if isinstance(item, CharSet) or id(item) in SHARED_NODES:
                term = self._from_charset(item) if isinstance(item, CharSet) else self._from_shared(item)
            elif not ready:
                stack.append((item, True))
                stack.extend((child, False) for child in children_of(item) if id(child) not in memo)
                continue
            else:
                term = self._combine(item)
            memo[id(item)] = (item, term)
        return memo[id(node)][1]

    def _from_ast(self, node: Node) -> int:
        return self._from_charset(node) if isinstance(node, CharSet) else self._combine(node)

    def _combine(self, node: Node) -> int:
        """The term of a compound ``node`` whose parts are converted already (or shallow enough to recurse)."""
        if isinstance(node, Concat):
            term = EPSILON
            for part in reversed(node.parts):
                term = self.cat(self.from_node(part), term)
        elif isinstance(node, Alt):
            term = self.alt([self.from_node(option) for option in node.options])
        elif isinstance(node, Repeat):
            term = self.repeat(self.from_node(node.node), node.min, node.max)
        elif isinstance(node, Intersect):
            term = self.intersect([self.from_node(part) for part in node.parts])
        else:
            raise TypeError(f"not a regex node: {node!r}")
        return term

    def _from_shared(self, node: Node) -> int:
        """A node the grammar layer shares between grammars (string spellings, any-value): converted once per
        process, then rebuilt in each table from its structure id, about three times faster than from the AST."""
        structure = _SHARED_STRUCTURES.get(id(node))
        if structure is not None:
            return self.from_structure(structure[1])
        term = self._from_ast(node)
        structure = self.structure(term)
        if structure is not None:
            _SHARED_STRUCTURES[id(node)] = (node, structure)
        return term

    def _from_charset(self, chars: CharSet) -> int:
        term = self._charsets.get(chars)
        if term is None and chars.ranges and chars.ranges[0][0] < 0x80 < chars.ranges[-1][1]:
            # ASCII and beyond apart: classes that differ in a few ASCII characters (the escape hatch at each
            # node of a property-name trie) share the multi-byte part, most of the conversion
            low = CharSet(tuple((lo, min(hi, 0x7F)) for lo, hi in chars.ranges if lo < 0x80))
            high = CharSet(tuple((max(lo, 0x80), hi) for lo, hi in chars.ranges if hi >= 0x80))
            term = self._charsets[chars] = self.alt([self._from_charset(low), self._from_charset(high)])
        if term is None:
            tails: dict[tuple, int] = {}  # sequences that end alike share their tail terms

            def sequence_term(seq) -> int:
                if seq not in tails:
                    (lo, hi), rest = seq[0], seq[1:]
                    head = self.byte_set(((1 << (hi + 1)) - 1) ^ ((1 << lo) - 1))
                    tails[seq] = self.cat(head, sequence_term(rest) if rest else EPSILON)
                return tails[seq]

            term = self.alt([sequence_term(seq) for lo, hi in chars.ranges for seq in utf8_sequences(lo, hi)])
            self._charsets[chars] = term
        return term

    # ---- structure: the same language in another table -------------------------------------------------------
    def structure(self, term: int) -> int:
        """A table-independent id of ``term``: equal for the same term built in any table (memoized). Ids are
        hash-consed process-wide, so a key is a small int however large and shared the term is. None once the
        process holds :data:`MAX_STRUCTURES` and ``term`` (or a part of it) is new."""
        known = self._structures.get(term)
        if known is None:
            kind, args = self.kind[term], self.args[term]
            if kind in (_BYTES, _CONST):
                key = (kind, args if kind == _BYTES else term)
            elif kind == _CAT:
                key = (kind, self.structure(args[0]), self.structure(args[1]))
            elif kind == _REP:
                key = (kind, self.structure(args[0]), args[1], args[2])
            else:  # members are sorted by id, which differs between tables
                key = (kind, frozenset(self.structure(member) for member in args))
            parts = key[1] if kind in (_ALT, _AND) else key[1:3] if kind == _CAT else key[1:2] if kind == _REP else ()
            known = None if None in parts else _canonical_id(key)
            self._structures[term] = -1 if known is None else known
        return None if known == -1 else known

    def from_structure(self, structure: int) -> int:
        """The term of a :meth:`structure` id, built in this table."""
        known = self._from_structures.get(structure)
        if known is None:
            key = _CANONICAL_KEYS[structure]
            kind = key[0]
            if kind == _CONST:
                known = key[1]
            elif kind == _BYTES:
                known = self.byte_set(key[1])
            elif kind == _CAT:
                known = self.cat(self.from_structure(key[1]), self.from_structure(key[2]))
            elif kind == _REP:
                known = self.repeat(self.from_structure(key[1]), key[2], key[3])
            else:
                members = [self.from_structure(member) for member in key[1]]
                known = self.alt(members) if kind == _ALT else self.intersect(members)
            self._from_structures[structure] = known
            # built from normal forms by the normalizing constructors, the term is in the same normal form, so
            # its structure is this one: kept, a piece's unit then needs no walk of its terms to find its facts
            self._structures.setdefault(known, structure)
        return known


class TermTable(_Conversions):
    """Interned terms: ``kind[t]``, ``args[t]``, ``nullable[t]``; derivatives and first-byte sets memoized. The
    pure-Python table; :func:`new_table` gives the native one where it can be built."""

    def __init__(self, budget: Budget | None = None):
        self.budget = budget or Budget()
        self.kind, self.args = [_CONST, _CONST], [None, None]
        self.nullable, self.has_and = [False, True], [False, False]
        self._ids: dict[tuple, int] = {}
        # Memo keys are ints, not tuples: no tuple is made per lookup, and a dict of ints is not tracked by the
        # garbage collector, so full collections never walk these (the largest maps of a compiled grammar).
        self._derivatives: dict[int, int] = {}  # term << 8 | byte -> derivative
        self._relinked: dict[int, int] = {}  # chain << 32 | tail -> chain re-linked onto tail
        self._starts: dict[int, tuple[dict[int, list[int]], list[tuple[int, int]]]] = {}  # see _starts_of
        self._firsts: dict[int, frozenset[int]] = {}
        self._first_masks: dict[int, int] = {}
        self._live: dict[int, bool] = {}
        self._live_boxes: dict[tuple, list[tuple[int, int]]] = {}  # see _intersection_is_live
        self.num_undecided = 0  # intersections whose emptiness the step limit left open (treated as empty)
        self.fuel = -1  # the new terms the mask being computed may still make (-1: no cap), as the native table's
        self.fuel_given = -1
        self._init_conversions()

    def __len__(self) -> int:
        return len(self.kind)

    def nbytes(self) -> int:
        """An upper-side estimate of the Python objects held (tracemalloc on ten dev schemas measured 0.75-0.85 of
        600 bytes per term plus 150 per memoized derivative). It keeps the compile cache's byte bound honest, and
        with it the size of the heap the garbage collector scans."""
        return 600 * len(self.kind) + 150 * (len(self._derivatives) + len(self._relinked))

    def _intern(self, key: tuple, kind: int, args, nullable: bool, has_and: bool) -> int:
        term = self._ids.get(key)
        if term is None:
            if self.fuel >= 0:
                if self.fuel == 0:
                    raise GrammarTooComplexError(f"a token mask ran out of its fuel of {self.fuel_given} new terms")
                self.fuel -= 1
            term = self._ids[key] = len(self.kind)
            self.kind.append(kind)
            self.args.append(args)
            self.nullable.append(nullable)
            self.has_and.append(has_and)
            if term % 4096 == 0:
                self.budget.check_time()
                self.budget.check_terms(term)
        return term

    # ---- constructors (normalizing) ------------------------------------------------------------------------
    def byte_set(self, mask: int) -> int:
        return EMPTYSET if mask == 0 else self._intern((_BYTES, mask), _BYTES, mask, False, False)

    def cat(self, head: int, tail: int) -> int:
        if head == EMPTYSET or tail == EMPTYSET:
            return EMPTYSET
        if head == EPSILON:
            return tail
        if tail == EPSILON:
            return head
        if self.kind[head] == _CAT:  # keep concatenation right-nested: (a b) c = a (b c)
            return self._relink(head, tail)
        return self._intern((_CAT, head, tail), _CAT, (head, tail), self.nullable[head] and self.nullable[tail],
                            self.has_and[head] or self.has_and[tail])

    def _relink(self, chain: int, tail: int) -> int:
        """``chain tail`` for a right-nested concatenation ``chain``: its elements linked onto ``tail`` from the
        last one back. Iterative and inlined: a derivative through an optional property or an array's items
        re-links the rest of that part onto what follows it, and those chains run to hundreds of terms."""
        key_in = chain << 32 | tail
        known = self._relinked.get(key_in)
        if known is not None:  # half of them recur: the same part meets the same tail from another state
            return known
        kind, args, nullable, has_and, ids = self.kind, self.args, self.nullable, self.has_and, self._ids
        heads = []
        while kind[chain] == _CAT:
            head, chain = args[chain]
            heads.append(head)
        result = self.cat(chain, tail)  # the chain's last element is not a concatenation
        for head in reversed(heads):  # heads of a chain are never concatenations, EPSILON or EMPTYSET
            key = (_CAT, head, result)
            term = ids.get(key)
            if term is None:
                term = self._intern(key, _CAT, (head, result), nullable[head] and nullable[result],
                                    has_and[head] or has_and[result])
            result = term
        self._relinked[key_in] = result
        return result

    def alt(self, terms) -> int:
        members, mask = set(), 0
        for term in terms:
            for member in (self.args[term] if self.kind[term] == _ALT else (term,)):
                if self.kind[member] == _BYTES:
                    mask |= self.args[member]
                elif member != EMPTYSET:
                    members.add(member)
        if mask:
            members.add(self.byte_set(mask))
        if not members:
            return EMPTYSET
        if len(members) == 1:
            return members.pop()
        ordered = tuple(sorted(members))
        return self._intern((_ALT, ordered), _ALT, ordered, any(self.nullable[m] for m in ordered),
                            any(self.has_and[m] for m in ordered))

    def repeat(self, term: int, low: int, high: int | None) -> int:
        if high == 0 or term == EPSILON:
            return EPSILON
        if term == EMPTYSET:
            return EPSILON if low == 0 else EMPTYSET
        if self.nullable[term]:
            low = 0  # empty iterations add nothing
        if (low, high) == (1, 1):
            return term
        return self._intern((_REP, term, low, high), _REP, (term, low, high), low == 0, self.has_and[term])

    def intersect(self, terms) -> int:
        members = set()
        for term in terms:
            if term == EMPTYSET:
                return EMPTYSET
            members.update(self.args[term] if self.kind[term] == _AND else (term,))
        if len(members) == 1:
            return members.pop()
        ordered = tuple(sorted(members))
        return self._intern((_AND, ordered), _AND, ordered, all(self.nullable[m] for m in ordered), True)

    def first_mask(self, term: int) -> int:
        """The 256-bit mask of every byte that can start ``term`` (memoized)."""
        mask = self._first_masks.get(term)
        if mask is None:
            mask = 0
            for part in self.first_bytes(term):
                mask |= part
            self._first_masks[term] = mask
        return mask

    # ---- derivatives -----------------------------------------------------------------------------------------
    def derivative(self, term: int, byte: int) -> int:
        key = term << 8 | byte
        known = self._derivatives.get(key)
        if known is not None:
            return known
        kind, args = self.kind[term], self.args[term]
        if kind == _BYTES:
            result = EPSILON if (args >> byte) & 1 else EMPTYSET
        elif kind == _CAT and self.kind[args[0]] == _BYTES:  # the common case (a literal, a spelled character)
            result = args[1] if (self.args[args[0]] >> byte) & 1 else EMPTYSET
        elif kind == _CAT:
            # walk the right-nested chain: d(a b) = d(a) b | (a nullable) d(b), iteratively
            options, current = [], term
            while self.kind[current] == _CAT:
                head, tail = self.args[current]
                options.append(self.cat(self.derivative(head, byte), tail))
                if not self.nullable[head]:
                    break
                current = tail
            else:
                options.append(self.derivative(current, byte))
            result = options[0] if len(options) == 1 else self.alt(options)  # alt of one term is that term
        elif kind == _ALT:  # members that cannot start with the byte derive to ∅: skip them unexplored
            derivative = self.derivative
            if len(args) < _INDEXED_ALT_MEMBERS:
                first_mask = self.first_mask
                result = self.alt([derivative(member, byte) for member in args if first_mask(member) >> byte & 1])
            else:
                by_byte, wide = self._starts_of(term)
                result = self.alt([derivative(member, byte) for member in by_byte.get(byte, ())] +
                                  [derivative(member, byte) for member, mask in wide if mask >> byte & 1])
        elif kind == _REP:
            inner, low, high = args
            rest = self.repeat(inner, max(low - 1, 0), None if high is None else high - 1)
            result = self.cat(self.derivative(inner, byte), rest)
        elif kind == _AND:
            result = self.intersect([self.derivative(member, byte) for member in args])
        else:
            result = EMPTYSET
        self._derivatives[key] = result
        return result

    def piece_shape(self, member: int, narrow_bytes: int):
        """``member`` read as ``X{lo,hi} R`` (``token_pieces.py``): ``(X, lo, hi, R)``, ``None`` when it is not
        one by its terms (``X`` nullable, under an intersection, starting with at most ``narrow_bytes`` bytes, or
        sharing a first byte with ``R``), ``False`` when ``R`` is empty. ``X X ... X{lo,hi} R`` (single units
        before the repeat, as ``minLength`` writes) is ``X{n+lo,n+hi} R``."""
        kind, args = self.kind, self.args
        if kind[member] == _REP:
            (unit, low, high), rest = args[member], EPSILON
        elif kind[member] == _CAT:
            unit, count, rest = args[member][0], 0, member
            if kind[unit] == _REP:
                unit = args[unit][0]
            while kind[rest] == _CAT and args[rest][0] == unit:
                count, rest = count + 1, args[rest][1]
            low = high = count
            if kind[rest] == _CAT and kind[args[rest][0]] == _REP:
                repeat, tail = args[rest]
                if args[repeat][0] == unit:
                    low, high = low + args[repeat][1], None if args[repeat][2] is None else high + args[repeat][2]
                    rest = tail
            elif rest == unit:  # the last unit is the whole tail
                low, high, rest = low + 1, high + 1, EPSILON
            if high == low <= 1:  # one unit, no repeat: its facts would serve once
                return None
        else:
            return None
        if self.has_and[unit] or self.nullable[unit]:
            return None
        unit_first = self.first_mask(unit)
        if unit_first.bit_count() <= narrow_bytes or unit_first & self.first_mask(rest):
            return None
        if not self.is_live(rest):
            return False
        return unit, low, high, rest

    def _starts_of(self, term: int) -> tuple[dict[int, list[int]], list[tuple[int, int]]]:
        """An alternation's members by the bytes they can start with (memoized): members starting with a few
        bytes (a property name's first letter) listed under each, the others with their first-byte masks. The
        walk derives a wide alternation by every byte class it has, and testing every member for every class
        was quadratic in its size."""
        known = self._starts.get(term)
        if known is None:
            by_byte, wide = {}, []
            for member in self.args[term]:
                mask = self.first_mask(member)
                if mask.bit_count() > _INDEXED_MEMBER_BYTES:
                    wide.append((member, mask))
                    continue
                while mask:
                    low = mask & -mask
                    by_byte.setdefault(low.bit_length() - 1, []).append(member)
                    mask ^= low
            known = self._starts[term] = (by_byte, wide)
        return known

    def first_bytes(self, term: int) -> frozenset[int]:
        """Byte-set masks that can start a string of ``term``; bytes outside them all lead to ∅."""
        known = self._firsts.get(term)
        if known is not None:
            return known
        kind, args = self.kind[term], self.args[term]
        if kind == _BYTES:
            result = frozenset((args,))
        elif kind == _CAT and not self.nullable[args[0]]:  # the head's own set: shared, hash already known
            result = self.first_bytes(args[0])
        elif kind == _CAT:
            masks, current = set(), term
            while self.kind[current] == _CAT:
                head, tail = self.args[current]
                masks |= self.first_bytes(head)
                if not self.nullable[head]:
                    break
                current = tail
            else:
                masks |= self.first_bytes(current)
            result = frozenset(masks)
        elif kind in (_ALT, _AND):
            masks = set()
            for member in args:
                masks.update(self.first_bytes(member))
            result = frozenset(masks)
        elif kind == _REP:
            result = self.first_bytes(args[0])
        else:
            result = frozenset()
        self._firsts[term] = result
        return result

    def byte_classes(self, term: int) -> list[int]:
        """A partition (as 256-bit masks) of the bytes that can start ``term``: one derivative per class."""
        return _partition(self.first_bytes(term))

    def is_live(self, term: int) -> bool:
        """The language of ``term`` is not empty. Compositional (a concatenation is live when every part is, an
        alternation when one member is); only an intersection itself is explored, so the cost is the size of the
        intersected piece (a string with a pattern and a length), never the rest of the document."""
        if term == EMPTYSET:
            return False
        if not self.has_and[term]:
            return True
        known = self._live.get(term)
        if known is None:
            kind, args = self.kind[term], self.args[term]
            if kind == _CAT:  # along the right-nested chain, iteratively: chains run to thousands of terms
                known, current = True, term
                while known and self.kind[current] == _CAT and self.has_and[current]:
                    head, current = self.args[current]
                    known = self.is_live(head)
                known = known and self.is_live(current)
            elif kind == _ALT:
                known = any(self.is_live(member) for member in args)
            elif kind == _REP:
                known = args[1] == 0 or self.is_live(args[0])
            else:
                known = self._intersection_is_live(term)
            self._live[term] = known
        return known

    def _intersection_is_live(self, term: int) -> bool:
        """Liveness of an intersection, with a shortcut for a counted member ``X{lo,hi}`` (a string's length
        bounds beside its pattern): a witness of ``d`` bytes found for ``X{lo,hi} & rest`` has at most ``d`` units
        of ``X`` (units are not empty) and at least ``lo``, so it also witnesses ``X{lo',hi'} & rest`` whenever
        ``lo' <= lo`` and ``hi' >= d``. Generating a long string under ``maxLength`` and a pattern meets the same
        ``rest`` at every remaining length; one search serves them all instead of one search per position."""
        key, low, high = self._counted_member(term)
        if key is not None:
            for known_low, depth in self._live_boxes.get(key, ()):
                if low <= known_low and (high is None or high >= depth):
                    return True
        live, depth = self._explore_for_acceptance(term)
        if live and key is not None and depth is not None:
            self._live_boxes.setdefault(key, []).append((low, depth))
        return live

    def _counted_member(self, term: int) -> tuple[tuple | None, int, int | None]:
        """(key, lo, hi) of an intersection's first member ``X{lo,hi}`` with ``X`` not nullable, the key being
        ``X`` and the other members; ``(None, 0, None)`` when it has none."""
        members = self.args[term]
        for index, member in enumerate(members):
            if self.kind[member] == _REP and not self.nullable[self.args[member][0]]:
                unit, low, high = self.args[member]
                return (unit, members[:index] + members[index + 1:]), low, high
        return None, 0, None

    def _explore_for_acceptance(self, term: int) -> tuple[bool, int | None]:
        """Breadth-first over the derivatives of an intersection until a nullable one appears: (live, the byte
        length of the witness found, or None when liveness was inherited from a term already known live)."""
        seen, frontier = {term}, deque([(term, 0)])
        while frontier and len(seen) < _LIVENESS_STEP_LIMIT:
            current, depth = frontier.popleft()
            if self.nullable[current]:
                return True, depth
            if self._live.get(current):
                return True, None
            for cls in self.byte_classes(current):
                following = self.derivative(current, (cls & -cls).bit_length() - 1)
                if following != EMPTYSET and following not in seen and self._live.get(following) is not False:
                    seen.add(following)
                    frontier.append((following, depth + 1))
        if not frontier:  # exhausted: every term reached is empty as well
            for dead in seen:
                self._live[dead] = False
            return False, None
        # subtle: past the step limit the term is treated as empty. Assuming it live (as this once did) let walks
        # reach states whose every continuation was empty: a mask with no token, mid-generation. Treating it as
        # empty can only forbid strings the language has (an intersection too big to explore), never allow one
        # it lacks, and every state made stays one from which acceptance was seen to be reachable.
        self.num_undecided += 1
        return False, None


_NATIVE_CLASS: list = []
_NATIVE_LOCK = threading.Lock()


def native_module():
    """The native module (``corral/csrc/terms.cpp`` holds the table), or None where it is off or missing."""
    return native.module()


def native_table_class():
    """The native table class (the extension's ``Table`` with the conversions), or None when it cannot be built."""
    if not _NATIVE_CLASS:
        with _NATIVE_LOCK:  # one class per process: automata check their table's type against it
            if not _NATIVE_CLASS:
                module = native_module()
                _NATIVE_CLASS.append(None if module is None else _define_native_class(module))
    return _NATIVE_CLASS[0]


def _define_native_class(module):
    class NativeTermTable(module.Table, _Conversions):
        """:class:`TermTable` in native memory (``corral/csrc/terms.cpp``): the same terms and derivatives."""

        def __init__(self, budget: Budget | None = None):
            super().__init__()  # the native table itself
            self.budget = budget or Budget()
            self.liveness_step_limit = _LIVENESS_STEP_LIMIT
            self._init_conversions()

    return NativeTermTable


def new_table(budget: Budget | None = None):
    """A term table: the native one when the extension builds (``CORRAL_NATIVE=off`` turns it off), else
    :class:`TermTable`. Both hold the same terms with the same normal forms; ids may differ."""
    native = native_table_class()
    return native(budget) if native is not None else TermTable(budget)

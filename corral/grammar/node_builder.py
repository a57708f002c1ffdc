"""NodeBuilder: smart constructors for the regex AST that simplify as they go and enforce a size budget.

Every JSON Schema construct is built through one builder, so a gigantic ``enum``, a ``maxLength`` of millions or a
``oneOf`` bomb is refused with :class:`GrammarTooComplexError` while it is being built, before any automaton work.

The budget counts *distinct* nodes (the AST is a DAG: a definition used twice is one subtree), because the
automaton layer interns nodes by identity and builds states lazily, so its cost follows the DAG and the states a
document visits, not the tree a DAG unfolds into. Counts are bounded separately: a ``Repeat`` count above
``MAX_REPEAT_COUNT`` is refused outright (``maxLength: 10000000``). A wall-clock budget backs both up (checked
every 4096 nodes and at every anyOf/oneOf/not expansion), so building never hangs a worker.

Simplifications: ``NOTHING`` absorbs a concatenation and drops out of an alternation, ``EMPTY`` drops out of a
concatenation, nested concatenations and alternations are flattened, character options of an alternation merge
into one ``CharSet``, and trivial repeats collapse. They keep the AST small and let unsatisfiable branches (a
recursion cut off at its depth limit, an empty ``enum`` intersection) vanish instead of reaching the compiler.
"""

import time
from collections.abc import Iterable

from corral.errors import GrammarTooComplexError
from corral.grammar.regex_ast import EMPTY, NOTHING, Alt, CharSet, Concat, Intersect, Node, Ref, Repeat

DEFAULT_MAX_NODES = 250_000
DEFAULT_TIME_BUDGET_S = 5.0
MAX_REPEAT_COUNT = 1_000_000


def repeat_count(digits: str, limit: int = MAX_REPEAT_COUNT) -> int | None:
    """The count an ASCII digit string writes, or None past ``limit`` (read without int() on long text: Python
    refuses to convert more than 4,300 digits)."""
    digits = digits.lstrip("0") or "0"
    if len(digits) > len(str(limit)):
        return None
    count = int(digits)
    return count if count <= limit else None


def count_text(count: str | int) -> str:
    """A count (its digits, or the integer) as an error message shows it: a long one cut. An integer is not
    written out in full: str() refuses past 4,300 digits."""
    if isinstance(count, int):
        if count.bit_length() <= 64:
            return str(count)
        return f"about 10^{int((count.bit_length() - 1) * 0.30103)}"
    return count if len(count) <= 24 else f"{count[:12]}...({len(count)} digits)"


MAX_SHARED_NODES = 16_384
SHARED_NODES: dict[int, Node] = {}  # id -> a node that lives as long as the process and serves many grammars


def share(node: Node) -> Node:
    """Mark ``node`` (immutable, kept alive here) as shared by every grammar that uses it, so the automaton layer
    may convert it once per process instead of once per grammar. Bounded: past ``MAX_SHARED_NODES`` a node is
    left unmarked (it still works; it is just converted per grammar)."""
    if len(SHARED_NODES) < MAX_SHARED_NODES:
        SHARED_NODES.setdefault(id(node), node)
    return node


class NodeBuilder:
    def __init__(self, max_nodes: int = DEFAULT_MAX_NODES, time_budget_s: float = DEFAULT_TIME_BUDGET_S,
                 budget=None):
        """``budget``: the request's ``corral.budget.Budget`` (its clock and cancellation), instead of a clock of
        ``time_budget_s`` of its own."""
        self.max_nodes = max_nodes
        self.time_budget_s = time_budget_s
        self.deadline = time.perf_counter() + time_budget_s
        self.budget = budget
        self.num_nodes = 0
        self._seen: dict[int, Node] = {}  # id -> node (kept alive so the id stays unique)
        self.cache: dict = {}  # shared sub-ASTs of the schema compiler (string units, any-value), by key

    def count(self, node: Node) -> None:
        """Count ``node`` and its not-yet-counted descendants; raise past the budget."""
        if id(node) not in self._seen:
            self._count_new(node, children_of(node))

    def _count_new(self, node: Node, children: tuple[Node, ...]) -> None:
        """Count a node not counted yet (one just made) and its not-yet-counted descendants. The children of a
        node made here are usually counted already, so most calls visit the node alone."""
        seen, before = self._seen, self.num_nodes
        seen[id(node)] = node
        stack = [child for child in children if id(child) not in seen]
        num_nodes = before + 1
        while stack:
            item = stack.pop()
            if id(item) in seen:
                continue
            seen[id(item)] = item
            num_nodes += 1
            if type(item) is not CharSet:
                stack.extend(child for child in children_of(item) if id(child) not in seen)
        self.num_nodes = num_nodes
        if num_nodes >> 12 != before >> 12:  # every 4096 nodes
            self.check_time()
        if num_nodes > self.max_nodes:
            raise GrammarTooComplexError(f"the grammar would need more than {self.max_nodes} automaton nodes "
                                         f"(a huge enum, or a oneOf/anyOf/$ref explosion)")

    def count_all(self, nodes: Iterable[Node]) -> None:
        """Count every node of ``nodes`` (and their descendants): what another builder made, used here."""
        for node in nodes:
            self.count(node)

    def check_time(self) -> None:
        if self.budget is not None:
            return self.budget.check_time()
        if time.perf_counter() > self.deadline:
            raise GrammarTooComplexError(f"building the grammar ran past its time budget of {self.time_budget_s:g} s")

    # ---- constructors ------------------------------------------------------------------------------------------
    def concat(self, *parts: Node) -> Node:
        flat: list[Node] = []
        for part in parts:
            if part == NOTHING:
                return NOTHING
            flat.extend(part.parts if isinstance(part, Concat) else (part,))
        if len(flat) == 1:
            return flat[0]
        node = Concat(tuple(flat))
        self._count_new(node, node.parts)
        return node

    def alt(self, options: Iterable[Node]) -> Node:
        chars, others, seen = [], [], set()
        for option in options:
            for item in option.options if isinstance(option, Alt) else (option,):
                if isinstance(item, CharSet):  # alternatives of characters merge into one set
                    chars.extend(item.ranges)
                    continue
                if id(item) in seen:
                    continue
                seen.add(id(item))
                others.append(item)
        merged = CharSet.of(*chars)
        if merged.ranges:
            others.insert(0, merged)
        if not others:
            return NOTHING
        if len(others) == 1:
            return others[0]
        node = Alt(tuple(others))
        self._count_new(node, node.options)
        return node

    def repeat(self, node: Node, low: int, high: int | None) -> Node:
        if high == 0 or node == EMPTY:
            return EMPTY
        if node == NOTHING:
            return EMPTY if low == 0 else NOTHING
        if low == 1 and high == 1:
            return node
        if max(low, high or 0) > MAX_REPEAT_COUNT:
            raise GrammarTooComplexError(f"a count of {count_text(max(low, high or 0))} (maxLength, minItems, "
                                         f"...) is past the limit of {MAX_REPEAT_COUNT}")
        out = Repeat(node, low, high)
        self._count_new(out, (node,))
        return out

    def optional(self, node: Node) -> Node:
        return self.repeat(node, 0, 1)

    def intersect(self, *parts: Node) -> Node:
        if any(p == NOTHING for p in parts):
            return NOTHING
        if len(parts) == 1:
            return parts[0]
        node = Intersect(tuple(parts))
        self._count_new(node, node.parts)
        return node

    def literal(self, text: str) -> Node:
        return self.concat(*(CharSet(((ord(c), ord(c)),)) for c in text)) if text else EMPTY


def children_of(node: Node) -> tuple[Node, ...]:
    if isinstance(node, Repeat):
        return (node.node,)
    if isinstance(node, Alt):
        return node.options
    return () if isinstance(node, (CharSet, Ref)) else node.parts

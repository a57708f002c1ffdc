"""NodeBuilder: smart constructors for the regex AST that simplify as they go and enforce a size budget.

Every JSON Schema construct is built through one builder, so a gigantic ``enum``, a ``maxLength`` of millions or a
``oneOf`` bomb is refused with :class:`GrammarTooComplexError` while it is being built, before any automaton work.

The budget counts the *expanded* size of a node: a ``Repeat`` costs its body times its largest count (a bounded
repeat unrolls into that many copies in an automaton), a ``Concat`` or ``Alt`` the sum of its parts. ``Intersect``
is counted as the sum of its parts, an underestimate of the product automaton that the compiler's own state budget
backs up. Shared sub-nodes are counted once per use, because an automaton construction copies them.

Simplifications: ``NOTHING`` absorbs a concatenation and drops out of an alternation, ``EMPTY`` drops out of a
concatenation, nested concatenations and alternations are flattened, single-character options of an alternation
merge into one ``CharSet``, and trivial repeats collapse. They keep the AST small and let unsatisfiable branches
(a recursion cut off at its depth limit, an empty ``enum`` intersection) vanish instead of reaching the compiler.
"""

from collections.abc import Iterable

from corral.errors import GrammarTooComplexError
from corral.grammar.regex_ast import EMPTY, NOTHING, Alt, CharSet, Concat, Intersect, Node, Repeat

DEFAULT_MAX_NODES = 250_000


class NodeBuilder:
    def __init__(self, max_nodes: int = DEFAULT_MAX_NODES):
        self.max_nodes = max_nodes
        self._weights: dict[int, tuple[Node, int]] = {}  # id -> (node kept alive so the id stays unique, weight)

    def weight(self, node: Node) -> int:
        """Expanded size of ``node`` (see the module docstring); nodes not built here are measured on demand."""
        hit = self._weights.get(id(node))
        if hit is not None:
            return hit[1]
        if isinstance(node, CharSet):
            total = 1
        elif isinstance(node, Repeat):
            total = self.weight(node.node) * max(1, node.max if node.max is not None else node.min + 1)
        else:
            total = 1 + sum(self.weight(p) for p in (node.parts if not isinstance(node, Alt) else node.options))
        return self._keep(node, total)

    def _keep(self, node: Node, total: int) -> int:
        if total > self.max_nodes:
            raise GrammarTooComplexError(f"the grammar would need more than {self.max_nodes} automaton nodes "
                                         f"(a huge enum, length or item count, or a oneOf/anyOf/$ref explosion)")
        self._weights[id(node)] = (node, total)
        return total

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
        self._keep(node, 1 + sum(self.weight(p) for p in flat))
        return node

    def alt(self, options: Iterable[Node]) -> Node:
        chars, others, seen, total = [], [], set(), 1
        for option in options:
            for item in option.options if isinstance(option, Alt) else (option,):
                if isinstance(item, CharSet):  # alternatives of characters merge into one set
                    chars.extend(item.ranges)
                    continue
                if id(item) in seen:
                    continue
                seen.add(id(item))
                others.append(item)
                total += self.weight(item)
                if total > self.max_nodes:
                    self._keep(item, total)  # raises with the budget message
        merged = CharSet.of(*chars)
        if merged.ranges:
            others.insert(0, merged)
        if not others:
            return NOTHING
        if len(others) == 1:
            return others[0]
        node = Alt(tuple(others))
        self._keep(node, total + 1)
        return node

    def repeat(self, node: Node, low: int, high: int | None) -> Node:
        if high == 0 or node == EMPTY:
            return EMPTY
        if node == NOTHING:
            return EMPTY if low == 0 else NOTHING
        if low == 1 and high == 1:
            return node
        out = Repeat(node, low, high)
        self.weight(out)
        return out

    def optional(self, node: Node) -> Node:
        return self.repeat(node, 0, 1)

    def intersect(self, *parts: Node) -> Node:
        if any(p == NOTHING for p in parts):
            return NOTHING
        if len(parts) == 1:
            return parts[0]
        node = Intersect(tuple(parts))
        self._keep(node, 1 + sum(self.weight(p) for p in parts))
        return node

    def literal(self, text: str) -> Node:
        return self.concat(*(CharSet(((ord(c), ord(c)),)) for c in text)) if text else EMPTY

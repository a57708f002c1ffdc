"""Thompson construction: regex AST → NFA over bytes, the step before subset construction.

Edges carry inclusive byte ranges; epsilon moves are separate lists. ``Intersect`` is the one node that is not
built here by plain Thompson rules: its parts are determinized, multiplied (product automaton) and the product is
embedded back as an NFA fragment. Large counted repeats are unrolled, so the state budget is checked as states
are made.
"""

from corral.fsm.budget import Budget
from corral.fsm.utf8 import utf8_sequences
from corral.grammar.regex_ast import Alt, CharSet, Concat, Intersect, Node, Repeat


class NFA:
    """States are ints; ``edges[s]`` is a list of ``(lo, hi, target)`` byte ranges, ``epsilon[s]`` of targets."""

    def __init__(self, budget: Budget):
        self.edges: list[list[tuple[int, int, int]]] = []
        self.epsilon: list[list[int]] = []
        self.budget = budget
        self._charset_cache: dict[CharSet, tuple[tuple[tuple[int, int], ...], ...]] = {}

    def new_state(self) -> int:
        self.edges.append([])
        self.epsilon.append([])
        if len(self.edges) % 1024 == 0:
            self.budget.check_states(len(self.edges) // 4, "NFA")
            self.budget.check_time()
        return len(self.edges) - 1

    def build(self, node: Node) -> tuple[int, int]:
        """Add a fragment for ``node``; returns its (start, end) states."""
        start, end = self.new_state(), self.new_state()
        self._add(node, start, end)
        return start, end

    def _add(self, node: Node, start: int, end: int) -> None:
        if isinstance(node, CharSet):
            self._add_charset(node, start, end)
        elif isinstance(node, Concat):
            current = start
            for i, part in enumerate(node.parts):
                following = end if i == len(node.parts) - 1 else self.new_state()
                self._add(part, current, following)
                current = following
            if not node.parts:
                self.epsilon[start].append(end)
        elif isinstance(node, Alt):
            for option in node.options:
                self._add(option, start, end)
        elif isinstance(node, Repeat):
            self._add_repeat(node, start, end)
        elif isinstance(node, Intersect):
            self._add_intersect(node, start, end)
        else:
            raise TypeError(f"not a regex node: {node!r}")

    def _add_charset(self, chars: CharSet, start: int, end: int) -> None:
        sequences = self._charset_cache.get(chars)
        if sequences is None:
            sequences = tuple(seq for lo, hi in chars.ranges for seq in utf8_sequences(lo, hi))
            self._charset_cache[chars] = sequences
        # Sequences that end alike share their tail states ("two continuation bytes to go"), which keeps both
        # the NFA and the DFA near minimal for big classes such as [^"].
        tails: dict[tuple[tuple[int, int], ...], int] = {}

        def tail_state(tail: tuple[tuple[int, int], ...]) -> int:
            if tail not in tails:
                state = tails[tail] = self.new_state()
                lo, hi = tail[0]
                self.edges[state].append((lo, hi, end if len(tail) == 1 else tail_state(tail[1:])))
            return tails[tail]

        for seq in sequences:
            lo, hi = seq[0]
            self.edges[start].append((lo, hi, end if len(seq) == 1 else tail_state(seq[1:])))

    def _add_repeat(self, node: Repeat, start: int, end: int) -> None:
        current = start
        for _ in range(node.min):
            following = self.new_state()
            self._add(node.node, current, following)
            current = following
        if node.max is None:
            loop = self.new_state()
            self.epsilon[current].append(loop)
            self._add(node.node, loop, loop)
            self.epsilon[loop].append(end)
            return
        self.epsilon[current].append(end)
        for _ in range(node.max - node.min):
            following = self.new_state()
            self._add(node.node, current, following)
            self.epsilon[following].append(end)
            current = following

    def _add_intersect(self, node: Intersect, start: int, end: int) -> None:
        from corral.fsm.byte_dfa import build_dfa, intersect_dfas  # the DFA layer builds on this module

        product = intersect_dfas([build_dfa(part, self.budget) for part in node.parts], self.budget)
        offset = len(self.edges)
        for _ in range(product.num_states):
            self.new_state()
        for state in range(product.num_states):
            for lo, hi, target in product.byte_ranges(state):
                self.edges[offset + state].append((lo, hi, offset + target))
            if product.accepting[state]:
                self.epsilon[offset + state].append(end)
        if product.num_states:
            self.epsilon[start].append(offset)

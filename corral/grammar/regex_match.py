"""A reference matcher for the regex AST, ``Intersect`` included: slow, exact, and used as a test oracle.

:func:`to_python_regex` cannot print ``Intersect``, and Python's backtracking ``re`` can take exponential time on
large generated patterns. This matcher computes, for each node and start offset, the set of offsets where a match
can end (memoized), so it runs in polynomial time on any AST. It is for tests and offline checks, not for
serving: the automata in ``corral.fsm`` are the production path.
"""

from corral.grammar.regex_ast import Alt, CharSet, Concat, Intersect, Node


def fullmatch(node: Node, text: str) -> bool:
    """True when ``node`` matches all of ``text`` (code points)."""
    memo: dict[tuple[int, int], frozenset[int]] = {}
    size = len(text)

    def ends(node: Node, start: int) -> frozenset[int]:
        key = (id(node), start)
        if key in memo:
            return memo[key]
        if isinstance(node, CharSet):
            out = frozenset((start + 1,)) if start < size and ord(text[start]) in node else frozenset()
        elif isinstance(node, Concat):
            positions = {start}
            for part in node.parts:
                positions = {end for middle in positions for end in ends(part, middle)}
                if not positions:
                    break
            out = frozenset(positions)
        elif isinstance(node, Alt):
            out = frozenset(end for option in node.options for end in ends(option, start))
        elif isinstance(node, Intersect):
            out = frozenset.intersection(*(ends(part, start) for part in node.parts))
        else:
            out = _repeat_ends(node, start, ends)
        memo[key] = out
        return out

    return size in ends(node, 0)


def _repeat_ends(node, start: int, ends) -> frozenset[int]:
    result = {start} if node.min == 0 else set()
    frontier, visited, count = {start}, set(), 0
    while frontier and (node.max is None or count < node.max):
        count += 1
        frontier = {end for middle in frontier for end in ends(node.node, middle)}
        if count >= node.min:
            result |= frontier
            if node.max is None:  # past the minimum only new offsets can extend the match set
                frontier -= visited
                visited |= frontier
    return frozenset(result)

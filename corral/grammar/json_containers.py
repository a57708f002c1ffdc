"""JSON arrays and objects as regex ASTs, from the nodes of their parts.

The whitespace policy is a :class:`Spacing`: what stands inside the brackets (before the first member and
before the closing bracket), between two members (the comma and its surroundings) and between a key and its
value. Flexible: one bounded whitespace run ``ws`` at each place, ``{ws m ws , ws m ws}``; compact: none;
``dumps``: exactly what ``json.dumps`` writes by default, ``", "`` and ``": "`` and nothing else.

Objects list their declared properties in schema order, each optional one may be left out, and the count of
present members is tracked only when ``minProperties``/``maxProperties`` ask for it. Extra members (keys not
declared, allowed by ``additionalProperties``/``patternProperties``) come after the declared ones. At most one
of them counts towards ``minProperties`` (see ``object_node``).
"""

from typing import NamedTuple

from corral.grammar.node_builder import NodeBuilder
from corral.grammar.regex_ast import EMPTY, NOTHING, CharSet, Node, literal

COMMA, COLON = CharSet.chars(","), CharSet.chars(":")


class Spacing(NamedTuple):
    """A whitespace policy: ``inner`` inside brackets, ``comma`` between members, ``colon`` after a key."""

    inner: Node
    comma: Node
    colon: Node

    @staticmethod
    def around(ws: Node) -> "Spacing":
        """``ws`` at every place between two tokens (EMPTY: compact)."""
        builder = NodeBuilder(max_nodes=1 << 40)
        return Spacing(ws, builder.concat(ws, COMMA, ws), builder.concat(ws, COLON, ws))

    @staticmethod
    def dumps() -> "Spacing":
        """``json.dumps``'s default separators: ``", "`` and ``": "``, no other whitespace."""
        return Spacing(EMPTY, literal(", "), literal(": "))


def member_node(b: NodeBuilder, sp: Spacing, key: Node, value: Node) -> Node:
    return b.concat(key, sp.colon, value)


def _run(b: NodeBuilder, sp: Spacing, item: Node, first: bool, low: int, high: int | None) -> Node:
    """``low..high`` comma-separated items, the first preceded by ``sp.inner`` when it opens the list."""
    if high is not None and high < low:
        return NOTHING
    sep = sp.comma
    if not first:
        return b.repeat(b.concat(sep, item), low, high)
    if high == 0:
        return EMPTY
    tail = b.repeat(b.concat(sep, item), max(low - 1, 0), None if high is None else high - 1)
    nonempty = b.concat(sp.inner, item, tail)
    return nonempty if low > 0 else b.alt([EMPTY, nonempty])


def array_node(b: NodeBuilder, sp: Spacing, prefix: list[Node], rest: Node, min_items: int,
               max_items: int | None) -> Node:
    """``[...]`` whose item ``i`` matches ``prefix[i]`` and later items match ``rest`` (NOTHING: none)."""
    sep = sp.comma

    def from_position(i: int) -> Node:
        if i == len(prefix):
            count_low = max(min_items - i, 0)
            count_high = None if max_items is None else max_items - i
            return _run(b, sp, rest, i == 0, count_low, count_high)
        if max_items is not None and i >= max_items:
            return EMPTY
        here = b.concat(sp.inner if i == 0 else sep, prefix[i], from_position(i + 1))
        return here if i < min_items else b.alt([EMPTY, here])

    return b.concat(CharSet.chars("["), from_position(0), sp.inner, CharSet.chars("]"))


def object_node(b: NodeBuilder, sp: Spacing, members: list[tuple[Node, bool]], extra: Node | None,
                min_properties: int, max_properties: int | None) -> Node:
    """``{...}`` with the declared ``members`` (node, required) in order, then extra members matching ``extra``."""
    sep = sp.comma
    cap = max_properties + 1 if max_properties is not None else min_properties  # counts past cap are alike

    def leaf(i: int, count: int, first: bool) -> Node | None:
        """The tail at a state that ends the walk, or None when members are still to come."""
        if max_properties is not None and count > max_properties:
            return NOTHING
        if i < len(members):
            return None
        low = max(min_properties - count, 0)
        high = None if max_properties is None else max_properties - count
        # subtle: two extra members may repeat a key, and a validator counts a repeated key once, so
        # extra members may make up at most one missing member of minProperties.
        if extra is None or low > 1:
            return EMPTY if low == 0 else NOTHING
        return _run(b, sp, extra, first, low, high)

    # A run of required members is always written whole, so it is one step: (state at its first member) → (state
    # after its last). run_end[i]: the index just past the run of required members that starts at i.
    run_end = list(range(len(members) + 1))
    for i in reversed(range(len(members))):
        if members[i][1]:
            run_end[i] = run_end[i + 1] if i + 1 < len(members) and members[i + 1][1] else i + 1

    def following(i: int, first: bool, count: int) -> list[tuple[int, bool, int]]:
        if members[i][1]:
            return [(run_end[i], False, min(count + run_end[i] - i, cap))]
        return [(i + 1, False, min(count + 1, cap)), (i + 1, first, count)]

    # The states (member index, nothing written yet, members written) reachable from the start, found forwards
    # and built backwards: loops, not a recursion, and no chain of partial concatenations, so an object may
    # declare thousands of members in linear time and memory.
    reachable, frontier = {(0, True, 0)}, [(0, True, 0)]
    while frontier:
        state = frontier.pop()
        if state[0] == len(members) or max_properties is not None and state[2] > max_properties:
            continue
        for after in following(*state):
            if after not in reachable:
                reachable.add(after)
                frontier.append(after)
    rest: dict[tuple[int, bool, int], Node] = {}
    for i, first, count in sorted(reachable, key=lambda state: -state[0]):
        tail = leaf(i, count, first)
        if tail is None and members[i][1]:
            parts = [sp.inner if first else sep, members[i][0]]
            for node, _ in members[i + 1:run_end[i]]:
                parts += [sep, node]
            tail = b.concat(*parts, rest[following(i, first, count)[0]])
        elif tail is None:
            present, absent = following(i, first, count)
            tail = b.alt([b.concat(sp.inner if first else sep, members[i][0], rest[present]), rest[absent]])
        rest[i, first, count] = tail
    return b.concat(CharSet.chars("{"), rest[0, True, 0], sp.inner, CharSet.chars("}"))


def contains_array_node(b: NodeBuilder, sp: Spacing, item: Node, contained: Node) -> Node:
    """``[...]`` of ``item``s of which at least one matches ``contained`` (``contains``; counts are intersected
    by the caller)."""
    before = b.repeat(b.concat(item, sp.comma), 0, None)
    after = b.repeat(b.concat(sp.comma, item), 0, None)
    return b.concat(CharSet.chars("["), sp.inner, before, contained, after, sp.inner, CharSet.chars("]"))

"""The grammar of any JSON value (or object), nested to a bounded depth, for the ``json_object`` constraint.

A regular language cannot nest without bound, so containers nest at most ``max_depth`` levels (default 6:
``{"a": [{"b": 1}]}`` is depth 3); deeper documents are rejected. Whitespace follows the constraint's policy:
none ('compact') or runs of at most ``max_whitespace`` JSON whitespace characters between tokens ('flexible').
Strings are any JSON strings (all escapes, any code point except the unescaped controls).
"""

from corral.grammar.regex_ast import EMPTY, Alt, CharSet, Concat, Node, Repeat, literal

DEFAULT_MAX_DEPTH = 6

_HEX = CharSet.of((48, 57), (65, 70), (97, 102))
_DIGIT = CharSet.of((48, 57))
_STRING_CHAR = CharSet.of((0, 31), (34, 34), (92, 92)).negate()
_ESCAPE = Concat((literal("\\"), Alt((CharSet.chars('"\\/bfnrt'), Concat((literal("u"),) + (_HEX,) * 4)))))

JSON_STRING = Concat((literal('"'), Repeat(Alt((_STRING_CHAR, _ESCAPE)), 0, None), literal('"')))
JSON_NUMBER = Concat((
    Repeat(literal("-"), 0, 1),
    Alt((literal("0"), Concat((CharSet.of((49, 57)), Repeat(_DIGIT, 0, None))))),
    Repeat(Concat((literal("."), Repeat(_DIGIT, 1, None))), 0, 1),
    Repeat(Concat((CharSet.chars("eE"), Repeat(CharSet.chars("+-"), 0, 1), Repeat(_DIGIT, 1, None))), 0, 1),
))
_SCALARS = (JSON_STRING, JSON_NUMBER, literal("true"), literal("false"), literal("null"))


def whitespace_node(whitespace: str, max_whitespace: int) -> Node:
    if whitespace == "compact":
        return EMPTY
    return Repeat(CharSet.chars(" \t\n\r"), 0, max_whitespace)


def json_value_node(max_depth: int = DEFAULT_MAX_DEPTH, whitespace: str = "compact", max_whitespace: int = 4,
                    *, object_only: bool = False) -> Node:
    """Any JSON value with containers nested at most ``max_depth`` deep (``object_only``: an object at the top)."""
    assert max_depth >= 1, max_depth
    ws = whitespace_node(whitespace, max_whitespace)
    value = Alt(_SCALARS)
    for _ in range(max_depth - 1):
        value = Alt(_SCALARS + (_object(value, ws), _array(value, ws)))
    return _object(value, ws) if object_only else Alt(_SCALARS + (_object(value, ws), _array(value, ws)))


def _separated(item: Node, ws: Node) -> Node:
    return Concat((item, Repeat(Concat((ws, literal(","), ws, item)), 0, None), ws))


def _object(value: Node, ws: Node) -> Node:
    member = Concat((JSON_STRING, ws, literal(":"), ws, value))
    return Concat((literal("{"), ws, Repeat(_separated(member, ws), 0, 1), literal("}")))


def _array(value: Node, ws: Node) -> Node:
    return Concat((literal("["), ws, Repeat(_separated(value, ws), 0, 1), literal("]")))

"""The grammar of any JSON value (or object), nested to a bounded depth, for the ``json_object`` constraint.

A regular language cannot nest without bound, so containers nest at most ``max_depth`` levels (default 6:
``{"a": [{"b": 1}]}`` is depth 3); deeper documents are rejected. Whitespace follows the constraint's policy
(``grammar.json_schema.spacing``): none ('compact'), runs of at most ``max_whitespace`` JSON whitespace
characters between tokens ('flexible'), pretty-printing's line breaks and indentation, bounded ('indented'), or
``json.dumps``'s separators ('dumps').
Strings are any JSON strings (all escapes, any code point except the unescaped controls).
"""

from corral.grammar.json_containers import Spacing
from corral.grammar.json_schema import spacing
from corral.grammar.regex_ast import Alt, CharSet, Concat, Node, Repeat, literal

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


def json_value_node(max_depth: int = DEFAULT_MAX_DEPTH, whitespace: str = "compact", max_whitespace: int = 4,
                    *, object_only: bool = False) -> Node:
    """Any JSON value with containers nested at most ``max_depth`` deep (``object_only``: an object at the top)."""
    assert max_depth >= 1, max_depth
    sp = spacing(whitespace, max_whitespace)
    value = Alt(_SCALARS)
    for _ in range(max_depth - 1):
        value = Alt(_SCALARS + (_object(value, sp), _array(value, sp)))
    return _object(value, sp) if object_only else Alt(_SCALARS + (_object(value, sp), _array(value, sp)))


def _separated(item: Node, sp: Spacing) -> Node:
    return Concat((item, Repeat(Concat((sp.comma, item)), 0, None), sp.inner))


def _object(value: Node, sp: Spacing) -> Node:
    member = Concat((JSON_STRING, sp.colon, value))
    return Concat((literal("{"), sp.inner, Repeat(_separated(member, sp), 0, 1), literal("}")))


def _array(value: Node, sp: Spacing) -> Node:
    return Concat((literal("["), sp.inner, Repeat(_separated(value, sp), 0, 1), literal("]")))

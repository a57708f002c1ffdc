"""A JSON Schema tree with recursive rules (:class:`Ref`) → a context-free :class:`Grammar`.

Each rule becomes a nonterminal; the parts of a tree that hold no ``Ref`` stay regex ASTs and become lexemes
(consecutive ones in a sequence join into one), so only the recursive skeleton (the brackets, commas and keys
around a recursive value) is parsed and everything else is lexed by the same DFAs as the regular path. A lexeme
that could be empty is split into "nothing" or "at least one character" (the lexer never reads empty lexemes).
The grammar accepts only concatenations of the tree's own parts, so it is as sound as the tree.
"""

from corral.errors import UnsupportedSchemaError
from corral.grammar.cfg import Expr, Grammar, GrammarBuilder
from corral.grammar.regex_ast import MAX_CODE_POINT, Alt, CharSet, Concat, Intersect, Node, Ref, Repeat
from corral.grammar.regex_parser import nullable

_NONEMPTY = Repeat(CharSet.of((0, MAX_CODE_POINT)), 1, None)


def rules_to_grammar(root: Node, rules: dict[str, Node], check_time=None) -> Grammar:
    """``check_time``: a compile budget's clock, called while lowering."""
    builder = GrammarBuilder(kind="JSON Schema grammar", greedy=False, check_time=check_time)
    holds_ref: dict[int, bool] = {}
    exprs: dict[int, Expr] = {}  # id of a node -> its Expr: the tree is a DAG and stays one
    builder.add_rule("start", _expr(root, holds_ref, exprs), 0)
    for name, node in rules.items():
        builder.add_rule(name, _expr(node, holds_ref, exprs), 0)
    return builder.build("start")


def _has_ref(node: Node, memo: dict[int, bool]) -> bool:
    found = memo.get(id(node))
    if found is None:
        if isinstance(node, Ref):
            found = True
        elif isinstance(node, CharSet):
            found = False
        elif isinstance(node, Repeat):
            found = _has_ref(node.node, memo)
        else:
            found = any(_has_ref(part, memo) for part in (node.options if isinstance(node, Alt) else node.parts))
        memo[id(node)] = found
    return found


def _lexeme(node: Node) -> Expr:
    if not nullable(node):
        return ("regex", node)
    if node == Concat(()):
        return ("empty",)
    return ("alt", (("empty",), ("regex", Intersect((node, _NONEMPTY)))))


def _expr(node: Node, memo: dict[int, bool], exprs: dict[int, Expr]) -> Expr:
    found = exprs.get(id(node))
    if found is None:
        found = exprs[id(node)] = _expr_of(node, memo, exprs)
    return found


def _expr_of(node: Node, memo: dict[int, bool], exprs: dict[int, Expr]) -> Expr:
    if not _has_ref(node, memo):
        return _lexeme(node)
    if isinstance(node, Ref):
        return ("name", node.name, 0)
    if isinstance(node, Alt):
        return ("alt", tuple(_expr(option, memo, exprs) for option in node.options))
    if isinstance(node, Repeat):
        return ("repeat", _expr(node.node, memo, exprs), node.min, node.max)
    if isinstance(node, Concat):
        items, run = [], []
        for part in node.parts:
            if _has_ref(part, memo):
                if run:
                    items.append(_lexeme(Concat(tuple(run)) if len(run) > 1 else run[0]))
                    run = []
                items.append(_expr(part, memo, exprs))
            else:
                run.append(part)
        if run:
            items.append(_lexeme(Concat(tuple(run)) if len(run) > 1 else run[0]))
        return items[0] if len(items) == 1 else ("seq", tuple(items))
    raise UnsupportedSchemaError("a recursive $ref inside an intersection (allOf with a pattern or a length, "
                                 "or a not) cannot compile", keyword="$ref")

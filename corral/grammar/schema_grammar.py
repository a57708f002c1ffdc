"""A JSON Schema tree with recursive rules (:class:`Ref`) → a context-free :class:`Grammar`.

Each rule becomes a nonterminal; the parts of a tree that hold no ``Ref`` stay regex ASTs and become lexemes
(consecutive ones in a sequence join into one: :class:`~corral.grammar.cfg.RefTreeExprs`), so only the recursive
skeleton (the brackets, commas and keys around a recursive value) is parsed and everything else is lexed by the
same DFAs as the regular path. The grammar accepts only concatenations of the tree's own parts, so it is as sound
as the tree.
"""

from corral.grammar.cfg import Grammar, GrammarBuilder, RefTreeExprs
from corral.grammar.regex_ast import Node


def rules_to_grammar(root: Node, rules: dict[str, Node], check_time=None,
                     exprs: RefTreeExprs | None = None) -> Grammar:
    """``check_time``: a compile budget's clock, called while lowering; ``exprs``: the trees' expressions when
    they were made already (a DAG's parts are lowered once)."""
    builder = GrammarBuilder(kind="JSON Schema grammar", greedy=False, check_time=check_time)
    exprs = exprs or RefTreeExprs()
    builder.add_rule("start", exprs.expr(root), 0)
    for name, node in rules.items():
        builder.add_rule(name, exprs.expr(node), 0)
    return builder.build("start")

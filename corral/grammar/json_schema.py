"""JSON Schema → regex AST: the language of JSON texts whose value the schema accepts (drafts 4 to 2020-12).

The AST is *sound*: every text it matches is valid under the schema, so a guide built from it never lets a model
write an invalid instance. It is exact wherever that costs nothing, and narrower on purpose where exactness would
be a context-free or non-regular language. The deliberate narrowings, each documented next to its code:

- Properties come in schema order; undeclared ones after the declared ones. ``additionalProperties`` absent
  means what the standard says (allowed): extra members are accepted, after the declared ones, with any key not
  declared and any value (nested at most ``ANY_VALUE_DEPTH`` containers deep). With ``patternProperties``
  present, undeclared keys must match one of the patterns. ``declared_only`` (the constraint's
  ``disable_additional_properties``, which generation may ask for) narrows this further: an object that declares
  properties, with neither ``additionalProperties`` nor ``patternProperties``, gets those only (a small model
  otherwise invents members and may not stop); where ``minProperties`` needs more than it declares, the
  undeclared ones stay allowed.
- Recursive ``$ref``: :func:`schema_to_rules` (what the compiler uses) makes each recursion a rule of a
  context-free grammar, with no depth limit; :func:`schema_to_node` (a regular language only) unrolls it
  ``MAX_REF_DEPTH`` times along any path, then cuts it (the deeper branch matches nothing).
- Numbers with bounds have no exponent (see ``json_numbers``); integers are canonical (no ``1.0``, no ``-0``).
- ``oneOf`` is exact: each branch also carries the negation of every branch it may overlap (pairs that are
  provably disjoint, by type, ``enum``/``const`` or a required discriminator, need none). It is refused when
  such a branch cannot be negated. ``not``, ``if``/``then``/``else`` and ``dependencies`` compile through the
  same negation (``schema_not``), which leaves out the non-integral numbers of ``not {type: integer}``.
- ``uniqueItems: true`` compiles only when at most one item is possible. ``multipleOf`` compiles for integral
  factors whose multiples a regex can say (factors of the form 2^a 5^b, or a small bounded range).
- ``enum``/``const`` members are spelled as ``json.dumps`` writes them (see ``json_strings.string_literal``).
- Extra members make up at most one missing member of ``minProperties`` (a repeated key counts once).
- Lone surrogate escapes are not accepted where the decoded length or a pattern matters.

Annotations are ignored; keywords that change the language and are not compiled (``schema_keywords.UNSUPPORTED``,
and the forms the modules above refuse: ``not`` over ``pattern``, fractional ``multipleOf``, ``format: regex``,
...) raise :class:`UnsupportedSchemaError` naming the keyword and its JSON pointer, or with ``lenient=True`` are
ignored and reported in ``warnings``. Budgets (``node_builder``): distinct AST nodes, repeat counts, and the
number of ``anyOf``/``oneOf``/``not`` alternatives; past one, :class:`GrammarTooComplexError`.
"""

import functools
import json

from corral.errors import GrammarTooComplexError, InvalidSchemaError
from corral.grammar.json_containers import Spacing
from corral.grammar.node_builder import DEFAULT_MAX_NODES, DEFAULT_TIME_BUDGET_S, NodeBuilder
from corral.grammar.regex_ast import EMPTY, NOTHING, CharSet, Node
from corral.grammar.schema_compiler import SchemaCompiler
from corral.grammar.schema_values import share_any_value

__all__ = ["schema_to_node"]


INDENT_LINE_BREAKS, INDENT_WIDTH = 2, 20  # 'indented': at most two line breaks, then 20 spaces or tabs


@functools.lru_cache(maxsize=64)
def spacing(whitespace: str, max_whitespace: int = 4) -> Spacing:
    """One :class:`Spacing` object per whitespace policy, so that every schema shares the any-value AST built for
    it: 'compact' (none), 'flexible' (JSON whitespace runs of at most ``max_whitespace`` characters between
    tokens), 'indented' (between tokens nothing, one space, or one or two line breaks then at most 20 spaces or
    tabs: pretty-printed JSON five levels of four spaces deep, as llama.cpp's JSON grammar allows) or 'dumps'
    (``json.dumps``'s default separators ``", "`` and ``": "``, nothing else)."""
    b = NodeBuilder(max_nodes=1 << 40)
    if whitespace == "compact":
        sp = Spacing.around(EMPTY)
    elif whitespace == "flexible":
        sp = Spacing.around(b.repeat(CharSet.chars(" \t\n\r"), 0, max_whitespace))
    elif whitespace == "indented":
        line = b.concat(b.repeat(CharSet.chars("\n"), 1, INDENT_LINE_BREAKS),
                        b.repeat(CharSet.chars(" \t"), 0, INDENT_WIDTH))
        sp = Spacing.around(b.alt([EMPTY, CharSet.chars(" "), line]))
    elif whitespace == "dumps":
        sp = Spacing.dumps()
    else:
        raise ValueError(f"whitespace must be 'compact', 'flexible', 'indented' or 'dumps', not {whitespace!r}")
    share_any_value(sp)
    return sp


def schema_to_node(schema: dict | bool, *, whitespace: str = "compact", max_whitespace: int = 4,
                   lenient: bool = False, warnings: list[str] | None = None, reject_unknown_keywords: bool = False,
                   max_nodes: int = DEFAULT_MAX_NODES, time_budget_s: float = DEFAULT_TIME_BUDGET_S,
                   budget=None, json_checked: bool = False, declared_only: bool = False) -> Node:
    return schema_to_rules(schema, whitespace=whitespace, max_whitespace=max_whitespace, lenient=lenient,
                           warnings=warnings, reject_unknown_keywords=reject_unknown_keywords, max_nodes=max_nodes,
                           time_budget_s=time_budget_s, budget=budget, json_checked=json_checked,
                           declared_only=declared_only)[0]


def schema_to_rules(schema: dict | bool, *, whitespace: str = "compact", max_whitespace: int = 4,
                    lenient: bool = False, warnings: list[str] | None = None, reject_unknown_keywords: bool = False,
                    max_nodes: int = DEFAULT_MAX_NODES, time_budget_s: float = DEFAULT_TIME_BUDGET_S,
                    budget=None, json_checked: bool = False,
                    recursive: bool = False, exact_any: bool = False,
                    declared_only: bool = False) -> tuple[Node, dict[str, Node]]:
    """The regex AST of the JSON texts that ``schema`` accepts.

    ``whitespace``: 'compact' writes none between tokens; 'flexible' allows JSON whitespace runs of at most
    ``max_whitespace`` characters between tokens (not before or after the value); 'indented' allows nothing, a
    space, or one or two line breaks and up to 20 spaces or tabs there (see :func:`spacing`); 'dumps' writes exactly the
    separators ``json.dumps`` writes by default (``", "``, ``": "``). ``lenient``: ignore
    unsupported keywords, appending a warning to ``warnings`` for each. Keywords that are no JSON Schema
    vocabulary (typos) are reported in ``warnings`` too, or refused with ``reject_unknown_keywords``.
    ``max_nodes`` and ``time_budget_s``: the size and wall-clock budgets of building the AST
    (:class:`GrammarTooComplexError` past either); ``budget``, a ``corral.budget.Budget``, replaces the clock.
    ``json_checked``: the caller has already proved ``schema`` is JSON (``Constraint.cache_key`` does), so the
    serialization that checks it is skipped (about 60 ms, holding the GIL, for a 2 MB schema). ``declared_only``:
    an object that declares properties and allows others only by the standard's default gets the declared ones
    (see the module's narrowings).

    ``recursive`` (:func:`schema_to_rules`): a recursive ``$ref`` becomes a :class:`~corral.grammar.regex_ast.Ref`
    to one of the returned rules instead of being unrolled ``MAX_REF_DEPTH`` times (no rules: no recursion).
    ``exact_any`` (with ``recursive``): "any JSON value" (``{}``, undeclared members) is the rule ``"any"``, with no
    depth limit, instead of being unrolled ``ANY_VALUE_DEPTH`` containers deep.

    Raises :class:`InvalidSchemaError` (not JSON, wrong keyword types, dangling ``$ref``, no value possible),
    :class:`UnsupportedSchemaError`, :class:`UnknownKeywordError` and :class:`GrammarTooComplexError`.
    """
    sp = spacing(whitespace, max_whitespace if whitespace == "flexible" else 4)
    if not isinstance(schema, (dict, bool)):
        raise InvalidSchemaError(f"a schema must be a JSON object or a boolean, not {type(schema).__name__}")
    try:
        if not json_checked:
            json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise InvalidSchemaError(f"the schema is not JSON: {error}") from None
    except RecursionError:
        raise GrammarTooComplexError("the schema is nested too deeply") from None
    compiler = SchemaCompiler(schema, NodeBuilder(max_nodes, time_budget_s, budget), sp, lenient=lenient,
                              warnings=warnings if warnings is not None else [],
                              reject_unknown=reject_unknown_keywords, recursive=recursive,
                              exact_any=exact_any, declared_only=declared_only)
    try:
        node = compiler.node(schema, "#")
        compiler.build_rules()
    except RecursionError:
        raise GrammarTooComplexError("the schema is nested too deeply") from None
    compiler.finish_warnings()
    if node == NOTHING:
        raise InvalidSchemaError("the schema accepts no value at all (its constraints contradict each other)"
                                 + compiler.contradiction_hint())
    return node, compiler.rules


"""From a request body to its one constraint: ``response_format``, ``structured_outputs`` or ``guided_*``.

The rule that matters: a request names at most one constraint, and everything it names is understood. Two at
once (``response_format`` plus ``guided_regex``, or ``structured_outputs`` with both ``regex`` and ``choice``) is
an :class:`InvalidRequestError`; unknown keys never reach here (the wire models forbid them). Nothing in this
module can turn a constrained request into an unconstrained one.
"""

import json
from typing import Any

from corral.errors import InvalidGrammarError, InvalidRequestError, InvalidSchemaError, UserInputError
from corral.grammar.constraint import Constraint
from corral.schemas.common import SamplingFields


def _json_value(value: Any, param: str) -> dict | bool:
    if isinstance(value, str):  # vLLM accepts the schema as JSON text too
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidSchemaError(f"'{param}' is not valid JSON: {e.msg} at offset {e.pos}") from None
        except RecursionError:
            raise InvalidSchemaError(f"'{param}' nests too deeply to parse") from None
        except ValueError as e:  # an integer past Python's digit limit
            raise InvalidSchemaError(f"'{param}' is not valid JSON: {e}") from None
    if not isinstance(value, (dict, bool)):
        raise InvalidSchemaError(f"'{param}' must be a JSON Schema (an object or a boolean)")
    return value


def _named_constraints(req: SamplingFields) -> list[tuple[str, str, Any]]:
    """Every constraint the request names, as (param, kind, value)."""
    found: list[tuple[str, str, Any]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", "json_object", None))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidRequestError("response_format of type 'json_schema' needs 'json_schema.schema'",
                                      param="response_format.json_schema.schema")
        found.append(("response_format", "json_schema", fmt.json_schema.schema_))
    elif fmt is not None and fmt.type == "grammar":
        if not fmt.grammar:
            raise InvalidRequestError("response_format of type 'grammar' needs 'grammar' (Lark or GBNF text)",
                                      param="response_format.grammar")
        found.append(("response_format", "grammar", fmt.grammar))
    so = req.structured_outputs
    if so is not None:
        for key, kind in (("json_", "json_schema"), ("regex", "regex"), ("choice", "choice"), ("grammar", "grammar")):
            if getattr(so, key) is not None:
                found.append((f"structured_outputs.{key.rstrip('_')}", kind, getattr(so, key)))
        if so.json_object:
            found.append(("structured_outputs.json_object", "json_object", None))
    for key, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if getattr(req, key) is not None:
            found.append((key, kind, getattr(req, key)))
    return found


def constraint_param(req: SamplingFields) -> str | None:
    """The request field its one constraint comes from (``guided_json``, ``structured_outputs.regex``, ...), which
    an error found in the constraint later (compiling it) names; None when it names none."""
    found = _named_constraints(req)
    return found[0][0] if len(found) == 1 else None


def _whitespace(req: SamplingFields) -> str:
    so = req.structured_outputs
    # pretty-printed JSON, bounded: a model indents as it learned to, where runs of 4 cut its indentation short
    return "indented" if so is not None and not so.disable_any_whitespace else "compact"


def disables_additional_properties(req: SamplingFields) -> bool:
    """``structured_outputs.disable_additional_properties`` (by default true): declared properties only, where a
    schema leaves undeclared ones to the standard's default."""
    so = req.structured_outputs
    return so is None or so.disable_additional_properties


def rejects_unknown_keywords(req: SamplingFields, default: bool) -> bool:
    """The request's own choice (``structured_outputs.reject_unknown_keywords``), else the server's ``default``."""
    so = req.structured_outputs
    return default if so is None or so.reject_unknown_keywords is None else so.reject_unknown_keywords


def request_constraint(req: SamplingFields, reject_unknown_keywords: bool = False) -> Constraint | None:
    """The request's one constraint in canonical form, or None when it names none. A schema's keywords that are
    no JSON Schema vocabulary are refused when the request (``structured_outputs.reject_unknown_keywords``) or,
    failing that, ``reject_unknown_keywords`` (the server's default) says so; else they are warnings.

    Raises :class:`InvalidRequestError` for two constraints at once and for options Corral cannot honour,
    and :class:`InvalidSchemaError` / :class:`InvalidGrammarError` for a constraint value of the wrong shape.
    """
    if req.guided_whitespace_pattern is not None:
        raise InvalidRequestError("'guided_whitespace_pattern' is not supported; use "
                                  "structured_outputs.disable_any_whitespace", param="guided_whitespace_pattern")
    found = _named_constraints(req)
    if len(found) > 1:
        names = " and ".join(f"'{param}'" for param, _, _ in found)
        raise InvalidRequestError(f"a request takes one constraint, this one names {len(found)}: {names}",
                                  param=found[1][0])
    if not found:
        return None
    param, kind, value = found[0]
    try:
        return _constraint(req, param, kind, value, reject_unknown_keywords)
    except UserInputError as err:
        err.param = err.param or param
        raise


def _constraint(req: SamplingFields, param: str, kind: str, value: Any, reject_unknown_keywords: bool) -> Constraint:
    reject = False
    if kind == "json_schema":
        value = _json_value(value, param)
        reject = rejects_unknown_keywords(req, reject_unknown_keywords)
    elif kind == "choice":
        if not value:
            raise InvalidGrammarError(f"'{param}' must list at least one choice")
        value = sorted(set(value))  # canonical: the language does not depend on order or repeats
    elif kind in ("regex", "grammar") and not value:
        raise InvalidGrammarError(f"'{param}' is empty")
    # objects only: a Lark grammar's inline %json keeps the standard's default, as llguidance's dialect has it
    return Constraint(kind, value, whitespace=_whitespace(req), reject_unknown_keywords=reject,
                      disable_additional_properties=kind == "json_schema" and disables_additional_properties(req))

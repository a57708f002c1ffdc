"""``not``: the negation of a schema, pushed down to positive schemas that the compiler already handles.

``not N`` holds when some keyword of ``N`` fails, so ``not N`` is the ``anyOf`` of each keyword's negation. A
keyword that constrains one type fails only on values of that type (``minimum`` holds for every string), so its
negation also fixes the type: ``not {minimum: 5}`` is ``{type: number, exclusiveMaximum: 5}``. Negated:

- ``type``, ``enum``/``const`` (values to exclude, through the private keyword ``EXCLUDE``), bounds and counts
  (``minimum`` … ``maxProperties``), ``required`` (some listed name absent), ``properties`` (some present
  property failing its schema), ``items`` (some item failing it: ``contains``), ``contains`` (every item
  failing it), ``not`` (double negation), ``anyOf`` (all branches fail), ``allOf`` (one member
  fails), ``$ref`` (the target negated), the schemas ``true``/``false``.
- Refused with :class:`UnsupportedSchemaError`: the others (``pattern``, ``format``, ``multipleOf``, tuple ``items``,
  ``oneOf``, ...), whose negation is no regular language of this AST or not worth one.
"""

from corral.errors import UnsupportedSchemaError
from corral.grammar.schema_keywords import ANNOTATIONS, check_keywords

EXCLUDE = "!exclude"  # private keyword: values the instance must not equal (never valid JSON Schema vocabulary)
_COUNTS = {"minLength": ("string", "maxLength", -1), "maxLength": ("string", "minLength", 1),
           "minItems": ("array", "maxItems", -1), "maxItems": ("array", "minItems", 1),
           "minProperties": ("object", "maxProperties", -1), "maxProperties": ("object", "minProperties", 1)}
_BOUNDS = {"minimum": "exclusiveMaximum", "maximum": "exclusiveMinimum", "exclusiveMinimum": "maximum",
           "exclusiveMaximum": "minimum"}
_IGNORED = ANNOTATIONS | {"minContains", "maxContains", "then", "else", "additionalItems"}


def negate(schema, pointer: str, resolve, depth: int = 0) -> list:
    """Schemas whose ``anyOf`` is ``not schema``; ``resolve(ref, pointer)`` gives a ``$ref`` target and its pointer.
    An empty list means nothing satisfies the negation."""
    if schema is True:
        return []
    if schema is False:
        return [True]
    if depth > 8:
        raise UnsupportedSchemaError("'not' nested too deeply through $ref", keyword="not", pointer=pointer)
    check_keywords(schema, pointer)  # a negated schema is never built itself, so its values are checked here
    options: list = []
    for keyword, value in schema.items():
        options += _negate_keyword(schema, keyword, value, pointer, resolve, depth)
    return options


def _negate_keyword(schema: dict, keyword: str, value, pointer: str, resolve, depth: int) -> list:
    if keyword in _IGNORED or keyword not in _KNOWN:
        return []
    if keyword == "type":
        names = set(value if isinstance(value, list) else [value])
        if "number" in names:
            names.add("integer")
        # subtle: 'not integer' also holds for 1.5; that part is left out, which only narrows the language
        rest = [t for t in ("null", "boolean", "object", "array", "string", "number") if t not in names
                and not (t == "number" and "integer" in names)]
        return [{"type": rest}] if rest else []
    if keyword in ("enum", "const"):
        return [{EXCLUDE: list(value) if keyword == "enum" else [value]}]
    if keyword in _COUNTS:
        type_name, other, step = _COUNTS[keyword]
        bound = int(value) + step
        return [{"type": type_name, other: bound}] if bound >= 0 else []
    if keyword in _BOUNDS:
        if isinstance(value, bool):
            return []  # draft 4's flag is negated together with its minimum/maximum
        draft4_strict = schema.get("exclusive" + keyword[0].upper() + keyword[1:]) is True
        flipped = _BOUNDS[keyword]
        if draft4_strict:  # draft 4's minimum with exclusiveMinimum: true means x > m, so its negation is x <= m
            flipped = "maximum" if keyword == "minimum" else "minimum"
        return [{"type": "number", flipped: value}]
    if keyword == "required":
        return [{"type": "object", "required": [], "properties": {name: False}} for name in value]
    if keyword == "properties":
        return [{"type": "object", "required": [name], "properties": {name: {"not": sub}}}
                for name, sub in value.items()]
    if keyword == "not":
        return [value]
    if keyword == "items" and not isinstance(value, list):
        return [{"type": "array", "contains": {"not": value}}]
    if keyword == "contains":
        return [{"type": "array", "items": {"not": value}}]
    if keyword == "anyOf":
        return [{"allOf": [{"not": branch} for branch in value]}]
    if keyword == "allOf":
        return [option for i, member in enumerate(value)
                for option in negate(member, f"{pointer}/allOf/{i}", resolve, depth + 1)]
    if keyword == "$ref":
        target, target_pointer = resolve(value, pointer)
        return negate(target, target_pointer, resolve, depth + 1)
    raise UnsupportedSchemaError(f"'not' over '{keyword}' is not supported", keyword="not", pointer=pointer)


# Keywords whose negation is refused; anything else unknown is no JSON Schema vocabulary and constrains nothing.
_REFUSED = {"pattern", "format", "multipleOf", "prefixItems", "oneOf", "uniqueItems",
            "patternProperties", "additionalProperties", "propertyNames", "dependencies", "dependentRequired",
            "dependentSchemas", "if", "unevaluatedProperties", "unevaluatedItems", EXCLUDE}
_KNOWN = {"type", "enum", "const", "required", "properties", "not", "anyOf", "allOf", "$ref", "items", "contains",
          *_COUNTS, *_BOUNDS,
          *_REFUSED}

"""MergedSchema: the conjunction of several schema objects (``allOf``, ``$ref`` with siblings), as one view.

A schema object is split into *atoms*: the object itself plus, recursively, every ``allOf`` member and ``$ref``
target. :func:`merge_atoms` folds the atoms' keywords into one :class:`MergedSchema` whose fields say exactly what
the conjunction allows: types intersect, bounds tighten, ``required`` unions, and sub-schemas (property values,
items) become lists of sources that are compiled together later, so nothing is lost by merging.

Object keywords merge exactly across atoms: a property named by one atom but not another is also subject to the
other's ``patternProperties``/``additionalProperties``. One conservative step: a ``patternProperties`` entry of
one atom also takes the other atom's ``additionalProperties`` (a key matching the pattern might fall under it);
that can only narrow the language. ``anyOf``/``oneOf`` groups are kept as choices, expanded by the compiler.
"""

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

from corral.grammar.schema_not import EXCLUDE
from corral.grammar.schema_refs import escape_pointer_token

Source = tuple[object, str]  # (schema, JSON pointer)
Atom = tuple[dict, str, frozenset]  # (schema object, pointer, keywords already expanded elsewhere)
Bound = tuple[Fraction, bool]  # (value, strict)
# (ECMA-262 pattern, name, pointer of the pattern's schema) -> whether the name holds a match (in linear time)
Matches = Callable[[str, str, str], bool]


@dataclass
class MergedSchema:
    is_unsatisfiable: bool = False
    types: set[str] | None = None
    enum: list | None = None
    low: Bound | None = None
    high: Bound | None = None
    multiple_of: list[tuple[float, str]] = field(default_factory=list)
    min_length: int = 0
    max_length: int | None = None
    patterns: list[tuple[str, str]] = field(default_factory=list)
    formats: list[tuple[str, str]] = field(default_factory=list)
    prefix_items: list[list[Source]] = field(default_factory=list)
    rest_items: list[Source] = field(default_factory=list)
    min_items: int = 0
    max_items: int | None = None
    unique_items: str | None = None  # pointer of a uniqueItems: true
    contains: list[Source] = field(default_factory=list)  # each needs an item that matches it
    properties: dict[str, list[Source]] = field(default_factory=dict)
    pattern_properties: dict[str, list[Source]] = field(default_factory=dict)
    additional_properties: list[Source] = field(default_factory=list)
    property_names: list[Source] = field(default_factory=list)
    required: list[str] = field(default_factory=list)
    min_properties: int = 0
    max_properties: int | None = None
    choices: list[tuple[str, list[Source], int]] = field(default_factory=list)  # (anyOf|oneOf, branches, atom)
    negations: list[tuple[object, str, int]] = field(default_factory=list)  # (schema under 'not', pointer, atom)
    excluded: list = field(default_factory=list)  # values the instance must not equal (negated enum/const)


def json_key(value) -> str:
    """Equal keys exactly for values that JSON Schema calls equal (``1 == 1.0``, but ``true != 1``)."""
    return json.dumps(_integral(value), sort_keys=True)


def _integral(value):
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    return value


def _tighter(a: Bound | None, b: Bound | None, lower: bool) -> Bound | None:
    if a is None or b is None:
        return a or b
    if a[0] != b[0]:
        return max(a, b) if lower else min(a, b)
    return (a[0], a[1] or b[1])


def _bounds(schema: dict, side: str) -> Bound | None:
    plain, exclusive = ("minimum", "exclusiveMinimum") if side == "low" else ("maximum", "exclusiveMaximum")
    out = None
    if plain in schema:
        out = (Fraction(schema[plain]), schema.get(exclusive) is True)  # draft 4's boolean form
    value = schema.get(exclusive)
    if not isinstance(value, bool) and value is not None:
        out = _tighter(out, (Fraction(value), True), side == "low")
    return out


def property_sources(merged: MergedSchema, name: str, matches: Matches) -> list[Source]:
    """Every schema a member ``name`` must satisfy: its ``properties`` entries and every ``patternProperties``
    entry whose pattern matches it (both apply), or ``additionalProperties`` when neither names it."""
    by_pattern = [s for p, sources in merged.pattern_properties.items() if matches(p, name, sources[-1][1])
                  for s in sources]
    if name in merged.properties:
        return merged.properties[name] + by_pattern
    matched = any(matches(p, name, sources[-1][1]) for p, sources in merged.pattern_properties.items())
    return by_pattern if matched else list(merged.additional_properties)


def _unlisted(patterns, additional: list[Source], name: str, matches: Matches) -> list[Source]:
    """What one schema object demands of a member it does not list, beyond its patterns (added when building)."""
    return [] if any(matches(p, name, sources[-1][1]) for p, sources in patterns.items()) else list(additional)


def _merge_types(merged: MergedSchema, value) -> None:
    names = set(value if isinstance(value, list) else [value])
    if "number" in names:
        names.add("integer")
    if merged.types is None:
        merged.types = names
    else:
        merged.types &= names


def _merge_objects(merged: MergedSchema, schema: dict, pointer: str, matches: Matches) -> None:
    props = {k: [(v, f"{pointer}/properties/{escape_pointer_token(k)}")]
             for k, v in schema.get("properties", {}).items()}
    patterns = {k: [(v, f"{pointer}/patternProperties/{escape_pointer_token(k)}")]
                for k, v in schema.get("patternProperties", {}).items()}
    additional = [(schema["additionalProperties"], f"{pointer}/additionalProperties")] \
        if "additionalProperties" in schema else []
    for name in list(merged.properties):
        merged.properties[name] += props.get(name) or _unlisted(patterns, additional, name, matches)
    for name, sources in props.items():
        if name not in merged.properties:
            merged.properties[name] = _unlisted(merged.pattern_properties, merged.additional_properties, name,
                                                matches) + sources
    for pattern, sources in patterns.items():
        merged.pattern_properties.setdefault(pattern, list(merged.additional_properties)).extend(sources)
    for pattern in merged.pattern_properties:
        if pattern not in patterns:
            merged.pattern_properties[pattern] += additional
    merged.additional_properties += additional


def _merge_arrays(merged: MergedSchema, schema: dict, pointer: str) -> None:
    items = schema.get("items")
    if isinstance(items, list):
        prefix = [[(s, f"{pointer}/items/{i}")] for i, s in enumerate(items)]
        rest = [(schema["additionalItems"], f"{pointer}/additionalItems")] if "additionalItems" in schema else []
    else:
        prefix = [[(s, f"{pointer}/prefixItems/{i}")] for i, s in enumerate(schema.get("prefixItems", []))]
        rest = [(items, f"{pointer}/items")] if items is not None else []
    if not prefix and not rest:
        return
    width = max(len(prefix), len(merged.prefix_items))
    merged.prefix_items = [(merged.prefix_items[i] if i < len(merged.prefix_items) else list(merged.rest_items))
                           + (prefix[i] if i < len(prefix) else rest) for i in range(width)]
    merged.rest_items += rest


def merge_atoms(atoms: list[Atom], matches: Matches) -> MergedSchema:
    """The conjunction of ``atoms``; ``matches`` decides which declared names fall under which patterns."""
    merged = MergedSchema()
    for index, (schema, pointer, skip) in enumerate(atoms):
        get = lambda k: None if k in skip else schema.get(k)  # noqa: E731
        if get("type") is not None:
            _merge_types(merged, schema["type"])
        for values in ([schema["const"]] if "const" in schema else None, get("enum")):
            if values is not None and merged.enum is None:
                merged.enum = values
            elif values is not None:
                keys = {json_key(v) for v in values}
                merged.enum = [v for v in merged.enum if json_key(v) in keys]
        merged.low = _tighter(merged.low, _bounds(schema, "low"), True)
        merged.high = _tighter(merged.high, _bounds(schema, "high"), False)
        if get("multipleOf") is not None:
            merged.multiple_of.append((schema["multipleOf"], pointer))
        merged.min_length = max(merged.min_length, int(schema.get("minLength", 0)))
        merged.min_items = max(merged.min_items, int(schema.get("minItems", 0)))
        merged.min_properties = max(merged.min_properties, int(schema.get("minProperties", 0)))
        for key, attr in (("maxLength", "max_length"), ("maxItems", "max_items"), ("maxProperties", "max_properties")):
            if key in schema:
                current = getattr(merged, attr)
                setattr(merged, attr, int(schema[key]) if current is None else min(current, int(schema[key])))
        if get("pattern") is not None:
            merged.patterns.append((schema["pattern"], pointer))
        if get("format") is not None:
            merged.formats.append((schema["format"], pointer))
        if schema.get("uniqueItems") is True:
            merged.unique_items = pointer
        if "contains" in schema:
            merged.contains.append((schema["contains"], f"{pointer}/contains"))
        if "propertyNames" in schema:
            merged.property_names.append((schema["propertyNames"], f"{pointer}/propertyNames"))
        merged.required += [name for name in schema.get("required", []) if name not in merged.required]
        _merge_objects(merged, schema, pointer, matches)
        _merge_arrays(merged, schema, pointer)
        if get("not") is not None:
            merged.negations.append((schema["not"], f"{pointer}/not", index))
        merged.excluded += schema.get(EXCLUDE, [])
        for kind in ("anyOf", "oneOf"):
            if get(kind) is not None:
                branches = [(s, f"{pointer}/{kind}/{i}") for i, s in enumerate(schema[kind])]
                merged.choices.append((kind, branches, index))
    if merged.types is not None and not merged.types:
        merged.is_unsatisfiable = True
    return merged


def integral_multiple(values: list[tuple[float, str]]) -> int | None:
    """The least common multiple of integral ``multipleOf`` values, or None when one is fractional."""
    if not all(isinstance(v, int) or v.is_integer() for v, _ in values):  # float(v) overflows past 1e308
        return None
    return math.lcm(*(int(v) for v, _ in values))


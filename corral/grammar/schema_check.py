"""ValueChecker: whether a JSON value satisfies a schema, for the values a schema itself holds.

The schema compiler keeps an ``enum``/``const`` member only when it satisfies every other keyword around it, and
lets a declared property name through only when ``propertyNames`` allows it. Both values and schema come from the
request, so the check is Corral's own and bounded: patterns and formats run on :class:`Matcher` (linear in the
string, never ``re``), each (schema, value) pair is judged once (an ``anyOf`` chain through ``$ref`` that a naive
validator walks 2^depth times costs its size here), ``uniqueItems`` hashes instead of comparing pairs, and every
judgement spends :class:`Fuel`. The test oracle is ``jsonschema``.

Semantics follow the keywords the compiler implements (``schema_keywords.IMPLEMENTED``), as the standard defines
them, with the compiler's reading where drafts differ: ``$ref`` siblings apply (2019-09 and later), an integral
float is an integer except under draft 4, and ``format`` is checked where Corral has the format's grammar
(``json_formats``); ``format: regex`` is checked by Corral's own regex parser. Every schema object reached is
first passed to the compiler's ``check`` (keyword types, unsupported keywords, unknown-keyword reports).
"""

from fractions import Fraction

from corral.errors import InvalidRegexError, UnsupportedRegexError
from corral.grammar.json_formats import STANDARD_FORMATS, format_node
from corral.grammar.matcher import Fuel, Matcher
from corral.grammar.regex_parser import parse_regex
from corral.grammar.schema_keywords import is_number
from corral.grammar.schema_merge import json_key
from corral.grammar.schema_not import EXCLUDE
from corral.grammar.schema_refs import escape_pointer_token

_IN_PROGRESS = object()
_MEMBERS = frozenset({"properties", "patternProperties", "additionalProperties"})


def json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


class ValueChecker:
    def __init__(self, compiler, matcher: Matcher, fuel: Fuel, *, draft4: bool):
        """``compiler``: the ``SchemaCompiler`` whose ``check``, ``pattern``, ``unsupported`` and ``refs`` this
        uses."""
        self.compiler, self.matcher, self.fuel, self.draft4 = compiler, matcher, fuel, draft4
        self._memo: dict[tuple, tuple] = {}  # (id(schema), skip, id(value)) -> (schema, value, verdict)
        self._keys: dict[int, tuple] = {}  # id(enum list or const schema) -> (it, its json_keys or json_key)

    def satisfies(self, value, schema, pointer: str, skip: frozenset = frozenset()) -> bool:
        """True when ``value`` satisfies ``schema`` (its keywords in ``skip`` left out)."""
        if schema is True or schema is False:
            return schema
        key = (id(schema), skip, id(value))
        hit = self._memo.get(key)
        if hit is not None:
            # subtle: a $ref cycle back to the same schema and value never consumes the value; no value satisfies it
            return False if hit[2] is _IN_PROGRESS else hit[2]
        self.fuel.spend(1 + len(schema))
        self._memo[key] = (schema, value, _IN_PROGRESS)
        self.compiler.check(schema, pointer)
        verdict = all(_CHECKS[keyword](self, value, schema, pointer, keyword)
                      for keyword in schema if keyword in _CHECKS and keyword not in skip)
        if verdict and isinstance(value, dict) and not _MEMBERS.isdisjoint(schema):
            verdict = _members(self, value, schema, pointer)
        self._memo[key] = (schema, value, verdict)
        return verdict

    def member_keys(self, values: list) -> frozenset:
        cached = self._keys.get(id(values))
        if cached is None:
            self.fuel.spend(len(values))
            cached = self._keys[id(values)] = (values, frozenset(json_key(v) for v in values))
        return cached[1]

    def pattern_matches(self, pattern: str, text: str, pointer: str) -> bool | None:
        """Whether ``text`` holds a match of the ECMA-262 ``pattern``; None when lenient mode ignores the pattern
        (an unsupported construct)."""
        node = self.compiler.pattern(pattern, pointer)
        return None if node is None else self.matcher.fullmatch(node, text)

    def const_key(self, schema: dict) -> str:
        cached = self._keys.get(id(schema))
        if cached is None:
            self.fuel.spend(1)
            cached = self._keys[id(schema)] = (schema, json_key(schema["const"]))
        return cached[1]

    def is_type(self, value, name: str) -> bool:
        kind = json_type(value)
        if kind == "float":
            return name == "number" or (name == "integer" and value.is_integer() and not self.draft4)
        return kind == name or (name == "number" and kind == "integer")


def _type(checker: ValueChecker, value, schema: dict, pointer: str, keyword: str) -> bool:
    names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    return any(checker.is_type(value, name) for name in names)


def _enum(checker, value, schema, pointer, keyword) -> bool:
    return json_key(value) in checker.member_keys(schema["enum"])


def _const(checker, value, schema, pointer, keyword) -> bool:
    return json_key(value) == checker.const_key(schema)


def _exclude(checker, value, schema, pointer, keyword) -> bool:
    return json_key(value) not in checker.member_keys(schema[EXCLUDE])


def _bound(checker, value, schema, pointer, keyword) -> bool:
    if not is_number(value) or isinstance(schema[keyword], bool):
        return True  # draft 4's boolean exclusive* is read with its minimum/maximum
    limit = schema[keyword]
    if keyword == "minimum":
        return value > limit if schema.get("exclusiveMinimum") is True else value >= limit
    if keyword == "maximum":
        return value < limit if schema.get("exclusiveMaximum") is True else value <= limit
    return value > limit if keyword == "exclusiveMinimum" else value < limit


def _multiple_of(checker, value, schema, pointer, keyword) -> bool:
    if not is_number(value):
        return True
    return (_decimal(value) / _decimal(schema["multipleOf"])).denominator == 1


def _decimal(number) -> Fraction:
    """The decimal a JSON number's text denotes (``0.1`` is 1/10, not the binary float nearest it)."""
    return Fraction(repr(number)) if isinstance(number, float) else Fraction(number)


def _length(checker, value, schema, pointer, keyword) -> bool:
    if not isinstance(value, str):
        return True
    return len(value) >= schema[keyword] if keyword == "minLength" else len(value) <= schema[keyword]


def _pattern(checker, value, schema, pointer, keyword) -> bool:
    return not isinstance(value, str) or checker.pattern_matches(schema["pattern"], value, pointer) is not False


def _format(checker, value, schema, pointer, keyword) -> bool:
    name = schema["format"]
    if not isinstance(value, str):
        return True
    node = format_node(name)
    if node is not None:
        return checker.matcher.fullmatch(node, value)
    if name == "regex":
        try:
            parse_regex(value, flavor="ecma")
        except UnsupportedRegexError:
            return True  # a valid ECMA-262 regex that Corral does not compile (lookaround, backreference)
        except (InvalidRegexError, RecursionError):
            return False
        return True
    if name in STANDARD_FORMATS:
        checker.compiler.unsupported(f"format {name!r} is not supported", "format", pointer)
    return True  # an annotation (or ignored, lenient)


def _items(checker, value, schema, pointer, keyword) -> bool:
    if not isinstance(value, list):
        return True
    items = schema.get("items")
    if keyword == "items" and isinstance(items, list):  # drafts 4-2019: tuple items, then additionalItems
        rest = schema.get("additionalItems", True)
        return all(checker.satisfies(v, items[i], f"{pointer}/items/{i}") if i < len(items)
                   else checker.satisfies(v, rest, f"{pointer}/additionalItems") for i, v in enumerate(value))
    if keyword == "items":
        start = len(schema.get("prefixItems", ()))
        return all(checker.satisfies(v, items, f"{pointer}/items") for v in value[start:])
    prefix = schema["prefixItems"]
    return all(checker.satisfies(v, prefix[i], f"{pointer}/prefixItems/{i}") for i, v in enumerate(value[:len(prefix)]))


def _count(checker, value, schema, pointer, keyword) -> bool:
    kind = "array" if keyword.endswith("Items") else "object"
    if json_type(value) != kind:
        return True
    return len(value) >= schema[keyword] if keyword.startswith("min") else len(value) <= schema[keyword]


def _unique(checker, value, schema, pointer, keyword) -> bool:
    if schema["uniqueItems"] is not True or not isinstance(value, list):
        return True
    checker.fuel.spend(len(value))
    return len({json_key(v) for v in value}) == len(value)


def _contains(checker, value, schema, pointer, keyword) -> bool:
    if not isinstance(value, list):
        return True
    low, high = schema.get("minContains", 1), schema.get("maxContains")
    found = sum(checker.satisfies(v, schema["contains"], f"{pointer}/contains") for v in value)
    return found >= low and (high is None or found <= high)


def _members(checker, value: dict, schema: dict, pointer: str) -> bool:
    """``properties``, ``patternProperties`` and ``additionalProperties``, read together as the standard does."""
    properties, patterns = schema.get("properties", {}), schema.get("patternProperties", {})
    rest = schema.get("additionalProperties", True)
    for name, member in value.items():
        listed = name in properties
        if listed and not checker.satisfies(member, properties[name],
                                            f"{pointer}/properties/{escape_pointer_token(name)}"):
            return False
        for pattern, sub in patterns.items():
            where = f"{pointer}/patternProperties/{escape_pointer_token(pattern)}"
            if checker.pattern_matches(pattern, name, where):  # an ignored pattern (None) names no member
                listed = True
                if not checker.satisfies(member, sub, where):
                    return False
        if not listed and not checker.satisfies(member, rest, f"{pointer}/additionalProperties"):
            return False
    return True


def _property_names(checker, value, schema, pointer, keyword) -> bool:
    return not isinstance(value, dict) or all(checker.satisfies(name, schema["propertyNames"],
                                                                f"{pointer}/propertyNames") for name in value)


def _required(checker, value, schema, pointer, keyword) -> bool:
    return not isinstance(value, dict) or all(name in value for name in schema["required"])


def _dependencies(checker, value, schema, pointer, keyword) -> bool:
    if not isinstance(value, dict):
        return True
    for name, dependency in schema[keyword].items():
        if name not in value:
            continue
        if isinstance(dependency, list):
            if not all(other in value for other in dependency):
                return False
        elif not checker.satisfies(value, dependency, f"{pointer}/{keyword}/{escape_pointer_token(name)}"):
            return False
    return True


def _all_of(checker, value, schema, pointer, keyword) -> bool:
    return all(checker.satisfies(value, s, f"{pointer}/allOf/{i}") for i, s in enumerate(schema["allOf"]))


def _any_of(checker, value, schema, pointer, keyword) -> bool:
    return any(checker.satisfies(value, s, f"{pointer}/anyOf/{i}") for i, s in enumerate(schema["anyOf"]))


def _one_of(checker, value, schema, pointer, keyword) -> bool:
    found = 0
    for i, branch in enumerate(schema["oneOf"]):
        found += checker.satisfies(value, branch, f"{pointer}/oneOf/{i}")
        if found > 1:
            return False
    return found == 1


def _not(checker, value, schema, pointer, keyword) -> bool:
    return not checker.satisfies(value, schema["not"], f"{pointer}/not")


def _if(checker, value, schema, pointer, keyword) -> bool:
    branch = "then" if checker.satisfies(value, schema["if"], f"{pointer}/if") else "else"
    return branch not in schema or checker.satisfies(value, schema[branch], f"{pointer}/{branch}")


def _ref(checker, value, schema, pointer, keyword) -> bool:
    target, target_pointer = checker.compiler.refs.resolve(schema["$ref"], pointer)
    return checker.satisfies(value, target, target_pointer)


_CHECKS = {
    "type": _type, "enum": _enum, "const": _const, EXCLUDE: _exclude,
    "minimum": _bound, "maximum": _bound, "exclusiveMinimum": _bound, "exclusiveMaximum": _bound,
    "multipleOf": _multiple_of, "minLength": _length, "maxLength": _length, "pattern": _pattern, "format": _format,
    "items": _items, "prefixItems": _items, "minItems": _count, "maxItems": _count, "uniqueItems": _unique,
    "contains": _contains, "propertyNames": _property_names, "required": _required, "minProperties": _count, "maxProperties": _count,
    "dependencies": _dependencies, "dependentRequired": _dependencies, "dependentSchemas": _dependencies,
    "allOf": _all_of, "anyOf": _any_of, "oneOf": _one_of, "not": _not, "if": _if, "$ref": _ref,
}

"""Which JSON Schema keywords Corral implements, ignores or refuses, and the type check of each keyword's value.

Drafts 4, 6, 7, 2019-09 and 2020-12 are read together: a keyword means what its draft says, and where drafts
disagree the form tells them apart (draft 4's boolean ``exclusiveMinimum`` against later drafts' number, an
``items`` array against ``prefixItems``).

Keywords that are no JSON Schema vocabulary at all (typos such as ``maxLenght``, draft 3's ``divisibleBy``,
``readonly``) constrain nothing, as the standard says of unknown keywords, so a misspelt bound would silently
leave a value unconstrained: each one is reported (:func:`unknown_keyword_reason`, a warning with its JSON
pointer) or, on request, refused. Not reported: extensions under ``x-``, and OpenAPI's annotations
(``nullable``, ``discriminator``, ``xml``, ``externalDocs``), which ride along in schemas taken from API
descriptions; ``nullable: true`` is read as JSON Schema reads it (it allows nothing more than ``type`` does).
"""

import difflib

from corral.errors import InvalidSchemaError

ANNOTATIONS = frozenset({
    "title", "description", "examples", "example", "default", "$comment", "$schema", "$id", "id", "deprecated",
    "readOnly", "writeOnly", "$anchor", "$vocabulary", "contentMediaType", "contentEncoding", "contentSchema",
    "definitions", "$defs", "$recursiveAnchor", "$dynamicAnchor",
})

IMPLEMENTED = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties", "patternProperties",
    "propertyNames", "minProperties", "maxProperties", "items", "prefixItems", "additionalItems", "minItems",
    "maxItems", "uniqueItems", "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "anyOf", "oneOf", "allOf", "$ref", "not",
    "dependencies", "dependentRequired", "dependentSchemas", "contains", "if", "then", "else",
})

# Keywords that change the language and that Corral does not compile: refused, never silently dropped.
# The anchors these refs aim at ($recursiveAnchor, $dynamicAnchor) are harmless without them.
UNSUPPORTED = frozenset({"unevaluatedProperties", "unevaluatedItems", "$recursiveRef", "$dynamicRef"})

OPENAPI_ANNOTATIONS = frozenset({"nullable", "discriminator", "xml", "externalDocs"})
_VOCABULARY = ANNOTATIONS | IMPLEMENTED | UNSUPPORTED | {"minContains", "maxContains"}
_SORTED_VOCABULARY = sorted(_VOCABULARY)


def is_unknown_keyword(keyword: str) -> bool:
    return keyword not in _VOCABULARY and keyword not in OPENAPI_ANNOTATIONS and not keyword.startswith("x-")


def unknown_keyword_reason(keyword: str) -> str:
    """Why a keyword that is no JSON Schema vocabulary matters, with the keyword likely meant."""
    close = difflib.get_close_matches(keyword, _SORTED_VOCABULARY, n=1, cutoff=0.8) if len(keyword) <= 64 else []
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"not JSON Schema vocabulary, so it constrains nothing{hint}"


TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")
_SCHEMA_MAPS = ("properties", "patternProperties", "definitions", "$defs")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SINGLE_SCHEMAS = ("not", "contains", "if", "then", "else", "additionalProperties", "propertyNames", "additionalItems")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
           "maxContains")
_NUMBERS = ("minimum", "maximum")


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_schema(value) -> bool:
    return isinstance(value, (dict, bool))


def check_keywords(schema: dict, pointer: str) -> None:
    """Raise :class:`InvalidSchemaError` naming the first implemented keyword whose value has the wrong type."""
    def bad(keyword: str, expected: str):
        return InvalidSchemaError(f"'{keyword}' must be {expected}", keyword=keyword, pointer=pointer)

    for keyword, value in schema.items():
        if keyword == "type":
            names = value if isinstance(value, list) else [value]
            if not names or any(name not in TYPES for name in names):
                raise bad(keyword, f"one of {', '.join(TYPES)} or a non-empty list of them")
        elif keyword in _SCHEMA_MAPS:
            if not isinstance(value, dict) or not all(_is_schema(v) for v in value.values()):
                raise bad(keyword, "an object whose values are schemas")
        elif keyword in _SCHEMA_LISTS:
            if not isinstance(value, list) or not value or not all(_is_schema(v) for v in value):
                raise bad(keyword, "a non-empty array of schemas")
        elif keyword in _SINGLE_SCHEMAS and not _is_schema(value):
            raise bad(keyword, "a schema (an object or a boolean)")
        elif keyword == "items" and not (_is_schema(value) or isinstance(value, list)
                                         and all(_is_schema(v) for v in value)):
            raise bad(keyword, "a schema or an array of schemas")
        elif keyword in _COUNTS and not (is_number(value) and value >= 0
                                         and (isinstance(value, int) or value.is_integer())):
            raise bad(keyword, "a non-negative integer")
        elif keyword in _NUMBERS and not is_number(value):
            raise bad(keyword, "a number")
        elif keyword in ("exclusiveMinimum", "exclusiveMaximum") and not (is_number(value)
                                                                          or isinstance(value, bool)):
            raise bad(keyword, "a number (or, in draft 4, a boolean)")
        elif keyword == "multipleOf" and not (is_number(value) and value > 0):
            raise bad(keyword, "a number greater than 0")
        elif keyword == "required" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise bad(keyword, "an array of strings")
        elif keyword == "enum" and not isinstance(value, list):
            raise bad(keyword, "an array")
        elif keyword in ("pattern", "format", "$ref") and not isinstance(value, str):
            raise bad(keyword, "a string")
        elif keyword in ("dependencies", "dependentRequired", "dependentSchemas") and not (
                isinstance(value, dict) and all(_is_schema(v) or isinstance(v, list) and all(isinstance(n, str)
                                                                                             for n in v)
                                                for v in value.values())):
            raise bad(keyword, "an object of schemas or arrays of property names")
        elif keyword == "uniqueItems" and not isinstance(value, bool):
            raise bad(keyword, "a boolean")

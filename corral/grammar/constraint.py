"""Constraint: what a request asks its output to match, in canonical, hashable form (the compile-cache key)."""

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

from corral.errors import InvalidSchemaError

ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar", "choice", "tools"]
Whitespace = Literal["compact", "flexible", "indented", "dumps"]


@dataclass(frozen=True)
class Constraint:
    """One constraint. ``value`` is a schema dict (json_schema), a pattern (regex), a Lark grammar text
    (grammar), a list of strings (choice), tool calls as ``grammar.tool_calls`` describes them (tools), or None
    (json_object: any JSON object).

    ``whitespace``: 'compact' writes no whitespace between JSON tokens; 'flexible' allows JSON whitespace runs
    of at most ``max_whitespace`` characters; 'indented' allows nothing, one space, or one or two line breaks
    then at most 20 spaces or tabs (pretty-printed JSON; what a request gets with ``disable_any_whitespace:
    false``); 'dumps' writes ``json.dumps``'s separators ``", "`` and ``": "``. ``lenient`` turns unsupported
    schema keywords into warnings.
    ``reject_unknown_keywords`` refuses schema keywords that are no JSON Schema vocabulary (else each is a warning).
    ``disable_additional_properties``: an object schema that declares properties and says nothing of
    ``additionalProperties`` (or ``patternProperties``) gets its declared properties only, as if
    ``additionalProperties`` were false (the standard allows undeclared ones there; llama.cpp, XGrammar and outlines
    generate none). Every output is still valid under the schema.
    """

    kind: ConstraintKind
    value: Any = None
    whitespace: Whitespace = "compact"
    max_whitespace: int = 4
    lenient: bool = False
    reject_unknown_keywords: bool = False
    disable_additional_properties: bool = False

    def cache_key(self) -> bytes:
        """The SHA-256 of the canonical text of the constraint and its options: equal constraints give equal keys,
        and a cached key costs 32 bytes whatever the schema's size. Made once (about 60 ms for a 2 MB schema, best
        spent off the event loop), and the one check that the value is JSON (no NaN, no Python-only types):
        :class:`InvalidSchemaError` if not."""
        key = self.__dict__.get("_key")
        if key is None:
            try:
                text = json.dumps([self.kind, self.value, self.whitespace, self.max_whitespace, self.lenient,
                                   self.reject_unknown_keywords, self.disable_additional_properties],
                                  sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError) as error:
                raise InvalidSchemaError(f"the constraint is not JSON: {error}") from None
            key = self.__dict__["_key"] = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
        return key

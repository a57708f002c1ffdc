"""Constraint: what a request asks its output to match, in canonical, hashable form (the compile-cache key)."""

import json
from dataclasses import dataclass
from typing import Any, Literal

ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]
Whitespace = Literal["compact", "flexible"]


@dataclass(frozen=True)
class Constraint:
    """One constraint. ``value`` is a schema dict (json_schema), a pattern (regex), a Lark grammar text
    (grammar), a list of strings (choice), or None (json_object: any JSON object).

    ``whitespace``: 'compact' writes no whitespace between JSON tokens; 'flexible' allows JSON whitespace runs
    of at most ``max_whitespace`` characters. ``lenient`` turns unsupported schema keywords into warnings.
    """

    kind: ConstraintKind
    value: Any = None
    whitespace: Whitespace = "compact"
    max_whitespace: int = 4
    lenient: bool = False

    def cache_key(self) -> str:
        """Canonical text of the constraint and its options: equal constraints give equal keys."""
        return json.dumps([self.kind, self.value, self.whitespace, self.max_whitespace, self.lenient],
                          sort_keys=True, separators=(",", ":"), ensure_ascii=False)

"""Constraints to languages: JSON Schema, regex and choice lists become a regex AST (no torch here)."""

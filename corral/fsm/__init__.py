"""Languages to tokens: byte automata, token-level masks and per-sequence guides (no torch here)."""

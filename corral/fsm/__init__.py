"""Languages to tokens: byte automata, token-level masks and per-sequence guides (no torch here).

The way through: a regex AST (``corral.grammar``) → derivative terms (``derivatives.py``) → a lazily built byte
DFA (``lazy_dfa.py``) → per-state token masks (``token_index.py`` with ``token_trie.py``) → a per-sequence
cursor (``fsm_guide.py``). ``compiler.py`` ties it together behind a byte-bounded LRU.
"""

from corral.fsm.compiler import CompiledGrammar, GrammarCompiler
from corral.fsm.fsm_guide import FSMGuide
from corral.fsm.guide import Guide
from corral.fsm.vocabulary import Vocabulary

__all__ = ["CompiledGrammar", "FSMGuide", "GrammarCompiler", "Guide", "Vocabulary"]

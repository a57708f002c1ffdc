"""GrammarCompiler: constraint → CompiledGrammar, under a time and state budget, behind an LRU bounded in bytes.

The cache key is (``constraint.cache_key()``, vocabulary hash); a repeat compile is a dictionary lookup. What each
constraint kind compiles to:

- ``json_schema``: :func:`corral.grammar.json_schema.schema_to_rules` with the constraint's whitespace options:
  the regular path when the schema does not recurse, else the context-free path over its rules (no depth limit);
- ``json_object``: any JSON object, nested without a limit: the schema ``{"type": "object"}`` with "any value" as
  a rule, on the context-free path (inside a ``tools`` answer, where the call envelope is regular, containers
  nest at most :data:`JSON_OBJECT_MAX_DEPTH` deep; see ``json_value.py``);
- ``regex``: a Python ``re`` pattern with ``fullmatch`` semantics;
- ``choice``: exactly one of the listed strings;
- ``tools``: tool calls whose arguments match each function's ``parameters`` (``grammar.tool_calls``), every
  schema compiled under the one budget of the request;
- ``grammar``: a Lark grammar (llguidance's dialect) or GBNF, told apart by ``::=``, compiled to the
  context-free path (``cfg_guide.py``): a lexer of byte DFAs under an Earley parser.

A compile ends with the start state's mask, computed under the same budget: a constraint that no token of this
vocabulary can begin to spell is refused here, as bad input, rather than inside a running batch.
"""

import functools
import logging
import threading
from collections import OrderedDict

import numpy as np

from corral.budget import DEFAULT_MAX_STATES, DEFAULT_TIME_BUDGET_S, Budget
from corral.errors import GrammarTooComplexError, InvalidGrammarError, InvalidSchemaError, UnsupportedSchemaError
from corral.fsm.cfg_guide import CFGGuide, CFGIndex
from corral.fsm.native_cfg import new_session
from corral.fsm.fsm_guide import FSMGuide
from corral.fsm.json_value import json_value_node
from corral.fsm.lazy_dfa import LazyDFA
from corral.fsm.token_index import TokenIndex
from corral.fsm.vocabulary import Vocabulary
from corral.grammar.constraint import Constraint
from corral.grammar.gbnf_grammar import looks_like_gbnf, parse_gbnf
from corral.grammar.cfg import Grammar, RefTreeExprs
from corral.grammar.lark_grammar import parse_lark
from corral.grammar.schema_grammar import rules_to_grammar
from corral.grammar.regex_ast import EMPTY, Alt, CharSet, Concat, Node
from corral.grammar.regex_parser import parse_regex
from corral.grammar.tool_calls import tool_calls_node

logger = logging.getLogger(__name__)
JSON_OBJECT_MAX_DEPTH = 6  # the DFA is determinized lazily, so depth costs NFA size only


class CompiledGrammar:
    """An immutable (in meaning) compiled constraint, shared by all its guides. Masks fill in lazily."""

    def __init__(self, index: TokenIndex, warnings: tuple[str, ...] = ()):
        self.index = index
        self.warnings = warnings
        self.accounted = 0  # its bytes as the compile cache last counted them (0: not cached)

    @property
    def num_states(self) -> int:
        return self.index.num_states

    def nbytes(self) -> int:
        return self.index.nbytes()

    def new_guide(self) -> FSMGuide:
        return FSMGuide(self.index)


class CompiledCFG:
    """A compiled context-free grammar: the shared lexer and parser tables; each guide gets its own session."""

    def __init__(self, index: CFGIndex, warnings: tuple[str, ...] = ()):
        self.index = index
        self.warnings = warnings
        self.accounted = 0

    @property
    def num_states(self) -> int:
        return self.index.num_lexer_states

    def nbytes(self) -> int:
        return self.index.nbytes()

    def new_guide(self) -> CFGGuide:
        return CFGGuide(new_session(self.index))


class GrammarCompiler:
    """Compiles constraints for one vocabulary. Thread-safe; compilation itself runs outside the lock."""

    def __init__(self, vocab: Vocabulary, *, cache_bytes: int = 256 << 20, time_budget_s: float = DEFAULT_TIME_BUDGET_S,
                 max_states: int = DEFAULT_MAX_STATES):
        assert cache_bytes >= 0 and time_budget_s > 0 and max_states > 0
        self.vocab, self.cache_bytes = vocab, cache_bytes
        self.time_budget_s, self.max_states = time_budget_s, max_states
        self._cache: OrderedDict[object, CompiledGrammar] = OrderedDict()
        self._keys: dict[int, object] = {}  # id of a cached grammar -> its key
        self._total = 0  # the cached grammars' bytes, kept current as they grow
        self._lock = threading.Lock()
        self.num_hits = self.num_misses = 0

    def new_budget(self) -> Budget:
        """A budget with this compiler's limits, for one request (hand it to :meth:`compile` to cancel it)."""
        return Budget(self.time_budget_s, self.max_states)

    def lookup(self, constraint: Constraint) -> CompiledGrammar | None:
        """The cached grammar of ``constraint``, or None: a dictionary lookup once its key is made."""
        try:
            return self._lookup(("constraint", constraint.cache_key(), self.vocab.hash))
        except RecursionError:
            raise GrammarTooComplexError("the constraint nests too deeply to compile") from None

    def compile(self, constraint: Constraint, budget: Budget | None = None) -> CompiledGrammar:
        """The compiled grammar of ``constraint`` (cached). Raises a ``UserInputError`` subclass on bad input,
        ``CompileCancelledError`` once ``budget`` is cancelled."""
        cached = self.lookup(constraint)
        if cached is not None:
            return cached
        key = ("constraint", constraint.cache_key(), self.vocab.hash)
        warnings: list[str] = []
        budget = budget or self.new_budget()
        try:
            if constraint.kind == "grammar":
                grammar = self._build_cfg(constraint, warnings, budget)
            elif constraint.kind in ("json_schema", "json_object"):
                schema = constraint.value if constraint.kind == "json_schema" else {"type": "object"}
                root, rules, exprs = self._schema_rules(schema, constraint, warnings, budget)
                grammar = (self._cfg_of(rules_to_grammar(root, rules, budget.check_time, exprs), warnings, budget)
                           if rules
                           else self._build(root, constraint.kind, tuple(warnings), budget))
            else:
                node = self._to_node(constraint, warnings, budget)
                grammar = self._build(node, constraint.kind, tuple(warnings), budget)
        except RecursionError:  # a structure nested past what the recursive passes can walk: refused, not a crash
            raise GrammarTooComplexError("the constraint nests too deeply to compile") from None
        if warnings:  # logged once per compile; each response that uses the grammar carries them too
            logger.warning("a %s constraint compiled with %d warnings: %s", constraint.kind, len(warnings),
                           "; ".join(warnings[:3]) + (" ..." if len(warnings) > 3 else ""))
        return self._store(key, grammar)

    def compile_node(self, node: Node) -> CompiledGrammar:
        """The compiled grammar of a regex AST (cached by the node)."""
        key = ("node", node, self.vocab.hash)
        cached = self._lookup(key)
        if cached is not None:
            return cached
        try:
            grammar = self._build(node, "node", (), self.new_budget())
        except RecursionError:
            raise GrammarTooComplexError("the constraint nests too deeply to compile") from None
        return self._store(key, grammar)

    def clear(self) -> None:
        """Forget every compiled grammar (benchmarks that give every engine the same, empty, cache)."""
        with self._lock:
            for grammar in self._cache.values():
                self._forget(grammar)
            self._cache.clear()

    def cache_nbytes(self) -> int:
        """The cached grammars' bytes, counted afresh (the bound holds for this count too)."""
        with self._lock:
            return sum(grammar.nbytes() for grammar in self._cache.values())

    def _lookup(self, key) -> CompiledGrammar | None:
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                self.num_hits += 1
            else:
                self.num_misses += 1
            return grammar

    def _store(self, key, grammar: CompiledGrammar) -> CompiledGrammar:
        """Cache ``grammar``, least recently used out first, so that the cached bytes stay within the bound. A
        grammar grows after compilation (rows and masks are built as decoding meets them): its index reports each
        new mask, and :meth:`_grew` re-counts it and evicts at once, so the bound holds at every moment. A grammar
        bigger than the whole bound is returned uncached."""
        with self._lock:
            old = self._cache.pop(key, None)
            if old is not None:
                self._forget(old)
            self._cache[key] = grammar
            self._keys[id(grammar)] = key
            grammar.accounted = grammar.nbytes()
            self._total += grammar.accounted
            grammar.index.on_growth = functools.partial(self._grew, grammar)
            self._evict()
        return grammar

    def _grew(self, grammar: CompiledGrammar) -> None:
        size = grammar.nbytes()  # outside the lock: lookups on the event loop take it
        with self._lock:
            if id(grammar) not in self._keys:
                return
            self._total += size - grammar.accounted
            grammar.accounted = size
            self._evict()

    def _evict(self) -> None:
        while self._total > self.cache_bytes and self._cache:
            _, evicted = self._cache.popitem(last=False)
            self._forget(evicted)

    def _forget(self, grammar: CompiledGrammar) -> None:
        self._keys.pop(id(grammar), None)
        self._total -= grammar.accounted
        grammar.accounted = 0
        grammar.index.on_growth = None

    def _build(self, node: Node, kind: str, warnings: tuple[str, ...], budget: Budget) -> CompiledGrammar:
        dfa = LazyDFA(node, budget)
        if dfa.is_empty:
            if kind == "json_schema":
                raise InvalidSchemaError("the schema admits no JSON value (its constraints contradict each other)")
            raise InvalidGrammarError(f"the {kind} constraint matches no string")
        index = TokenIndex(dfa, self.vocab)
        self._check_start(index, budget)
        return CompiledGrammar(index, warnings)

    def _check_start(self, index: TokenIndex, budget: Budget) -> None:
        """Compute the start mask under ``budget`` (the automaton is not shared yet); refuse an empty one. The
        compile's clock bounds this mask, not a mask's fuel: fuel bounds the masks met while decoding, inside an
        engine step, where no clock may run."""
        terms = index.dfa.terms
        decoding, fuel = terms.budget, index.mask_fuel
        terms.budget, index.mask_fuel = budget, -1
        try:
            start = index.mask(0)
        finally:
            terms.budget, index.mask_fuel = decoding, fuel
        if not np.any(start) and not (index.is_accepting(0) and not (index.row(0) >= 0).any()):
            raise InvalidGrammarError("no sequence of this model's tokens can spell the constraint's language")

    def _to_node(self, constraint: Constraint, warnings: list[str], budget: Budget) -> Node:
        kind, value = constraint.kind, constraint.value
        if kind == "json_schema":
            return self._schema_node(value, constraint, warnings, budget)
        if kind == "tools":
            answer = value.get("answer")
            answer_node = None if answer is None else self._to_node(
                Constraint(answer["kind"], answer["value"], whitespace=constraint.whitespace,
                           max_whitespace=constraint.max_whitespace,
                           reject_unknown_keywords=constraint.reject_unknown_keywords,
                           disable_additional_properties=constraint.disable_additional_properties), warnings, budget)
            arguments = Constraint("json_schema", None, reject_unknown_keywords=constraint.reject_unknown_keywords,
                                   disable_additional_properties=constraint.disable_additional_properties)
            return tool_calls_node(value, lambda schema: self._schema_node(schema, arguments, warnings, budget),
                                   answer_node)
        if kind == "json_object":
            return json_value_node(JSON_OBJECT_MAX_DEPTH, constraint.whitespace, constraint.max_whitespace,
                                   object_only=True)
        if kind == "regex":
            budget.check_time()
            return parse_regex(value, flavor="python")
        if kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) for v in value):
                raise InvalidGrammarError("a choice constraint needs a non-empty list of strings")
            return _choice_node(value, budget)
        raise InvalidGrammarError(f"unknown constraint kind {kind!r}")

    def _build_cfg(self, constraint: Constraint, warnings: list[str], budget: Budget) -> CompiledCFG:
        text = constraint.value
        if not isinstance(text, str) or not text.strip():
            raise InvalidGrammarError("a grammar constraint needs the grammar's text")
        if looks_like_gbnf(text):
            grammar = parse_gbnf(text)
        else:
            grammar = parse_lark(text, json_node=lambda schema: self._json_part(schema, constraint, warnings,
                                                                                budget))
        return self._cfg_of(grammar, warnings, budget)

    def _cfg_of(self, grammar: Grammar, warnings: list[str], budget: Budget) -> CompiledCFG:
        budget.check_time()
        warnings.extend(grammar.warnings)
        index = CFGIndex(grammar, self.vocab, budget)
        start = new_session(index)
        fuel, index.mask_fuel = index.mask_fuel, 1 << 62  # the compile's clock bounds the start mask
        try:
            index.start_mask = start.mask(start.start)
        finally:
            index.mask_fuel = fuel
        budget.check_time()
        if not np.any(index.start_mask):
            raise InvalidGrammarError("no sequence of this model's tokens can spell the grammar's language")
        return CompiledCFG(index, tuple(warnings))

    @staticmethod
    def _schema_rules(schema, options: Constraint, warnings: list[str], budget: Budget):
        """The schema's tree, its rules, and their expressions (``json_schema.schema_to_rules``), chosen per
        sub-schema: a recursive ``$ref`` and "any JSON value" (a ``{}`` value, an undeclared member's, the items
        of an array without ``items``) become rules that nest without a limit, and every part around them stays
        a regex tree, one lexeme on the context-free path. A schema with neither has no rules and keeps the
        regular path. Where any-value sits inside an intersection (``allOf`` of two open objects), no rule can
        stand for it and it is unrolled ``ANY_VALUE_DEPTH`` deep instead."""
        from corral.grammar.json_schema import schema_to_rules

        def rules(exact: bool, sink: list[str]):
            root, found = schema_to_rules(schema, whitespace=options.whitespace,
                                          max_whitespace=options.max_whitespace, lenient=options.lenient,
                                          warnings=sink, reject_unknown_keywords=options.reject_unknown_keywords,
                                          budget=budget, json_checked=True, recursive=True, exact_any=exact,
                                          declared_only=options.disable_additional_properties)
            exprs = None
            if exact and found:  # a rule inside an intersection cannot lower: raises UnsupportedSchemaError
                exprs = RefTreeExprs()
                for node in (root, *found.values()):
                    exprs.expr(node)
            return root, found, exprs

        sink: list[str] = []
        try:
            root, found, exprs = rules(True, sink)
        except UnsupportedSchemaError:
            sink = []
            root, found, exprs = rules(False, sink)
        warnings.extend(sink)
        return root, found, exprs

    def _json_part(self, schema, options: Constraint, warnings: list[str], budget: Budget):
        """An inline ``%json`` schema of a grammar: its tree, with its rules when it nests without a limit."""
        root, rules, _ = self._schema_rules(schema, options, warnings, budget)
        return (root, rules) if rules else root

    @staticmethod
    def _schema_node(schema, options: Constraint, warnings: list[str], budget: Budget) -> Node:
        from corral.grammar.json_schema import schema_to_node

        return schema_to_node(schema, whitespace=options.whitespace, max_whitespace=options.max_whitespace,
                              lenient=options.lenient, warnings=warnings,
                              reject_unknown_keywords=options.reject_unknown_keywords, budget=budget,
                              json_checked=True,  # by the cache key
                              declared_only=options.disable_additional_properties)


def _choice_node(values: list[str], budget: Budget) -> Node:
    """Exactly one of ``values``, as a prefix tree: shared prefixes are factored out, so the states after a common
    prefix do not carry every option along (20,000 options sharing "option " would otherwise)."""
    trie: dict = {}
    for i, value in enumerate(values):
        if i % 1024 == 0:
            budget.check_time()
        node = trie
        for char in value:
            node = node.setdefault(char, {})
        node[""] = True  # end of one option
    chars: dict[str, CharSet] = {}

    def char_set(c: str) -> CharSet:
        return chars.get(c) or chars.setdefault(c, CharSet(((ord(c), ord(c)),)))

    def build(node: dict) -> Node:
        options = [EMPTY] if "" in node else []
        for char, child in node.items():
            if char == "":
                continue
            run = [char_set(char)]
            while len(child) == 1 and "" not in child:  # a chain without branches: one Concat, no recursion
                (char, child), = child.items()
                run.append(char_set(char))
            options.append(Concat((*run, build(child))))
        return options[0] if len(options) == 1 else Alt(tuple(options))

    return build(trie)

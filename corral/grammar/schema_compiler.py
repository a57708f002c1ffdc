"""SchemaCompiler: walks one JSON Schema document and builds its regex AST (see ``json_schema`` for the policy).

The walk: a schema becomes a list of *atoms* (itself, its ``allOf`` members and ``$ref`` targets, recursively),
the atoms merge into one ``MergedSchema``, an ``anyOf``/``oneOf`` group expands into one alternative per branch
(each merged with the rest), and what is left dispatches on type to the builders in ``schema_values``.
``$ref`` expansions are counted along the current path; past ``MAX_REF_DEPTH`` a branch matches nothing. With
``recursive=True`` a ``$ref`` met again inside its own expansion becomes a :class:`Ref` to a rule instead (built
once, in :attr:`SchemaCompiler.rules`), so a recursive schema has no depth limit; the context-free path compiles
the result. A schema without recursion gives the same tree either way.
"""

import math

from corral.errors import GrammarTooComplexError, InvalidSchemaError, UnknownKeywordError, UnsupportedSchemaError
from corral.grammar.json_containers import Spacing
from corral.grammar.matcher import Fuel, Matcher
from corral.grammar.node_builder import NodeBuilder
from corral.grammar.regex_ast import NOTHING, Node, Ref
from corral.grammar.schema_check import ValueChecker
from corral.grammar.schema_keywords import (TYPES, UNSUPPORTED, check_keywords, is_unknown_keyword,
                                            unknown_keyword_reason)
from corral.grammar.schema_merge import Atom, MergedSchema, Source, json_key, merge_atoms, property_sources
from corral.grammar.schema_not import EXCLUDE, negate
from corral.grammar.schema_refs import RefResolver, escape_pointer_token
from corral.grammar.schema_values import ANY_RULE, ANY_VALUE_DEPTH, ValueBuilders

MAX_REF_DEPTH = 4
MAX_BRANCH_EXPANSIONS = 2000  # anyOf/oneOf/not alternatives built per schema: past it, an allOf of anyOfs explodes
MAX_WARNINGS = 50  # past it, one more line counts the rest


class SchemaCompiler(ValueBuilders):
    def __init__(self, root, builder: NodeBuilder, sp: Spacing, *, lenient: bool, warnings: list[str],
                 reject_unknown: bool = False, recursive: bool = False, exact_any: bool = False,
                 declared_only: bool = False):
        """``warnings`` collects what was ignored (at most ``MAX_WARNINGS`` lines, then a count); ``reject_unknown``
        refuses keywords that are no JSON Schema vocabulary instead of reporting them; ``recursive``: recursion
        becomes :class:`Ref` rules instead of a cut; ``exact_any`` (with it): "any JSON value" is the rule
        ``ANY_RULE`` too, which nests without a depth limit. ``declared_only``: objects that declare properties get
        those only where the standard's default alone would allow others (``json_schema``'s narrowings)."""
        super().__init__(builder, sp)
        self.declared_only = declared_only
        self.recursive, self.exact_any = recursive, exact_any and recursive
        self.rules: dict[str, Node] = {}  # rule name -> its tree (recursive mode)
        self._rule_names: dict[tuple, str] = {}
        self._pending_rules: list[tuple[str, list[Atom], list[str]]] = []
        self.root, self.lenient, self.warnings, self.reject_unknown = root, lenient, warnings, reject_unknown
        self.num_unshown_warnings = 0
        self.refs = RefResolver(root)
        self.active: dict[str, int] = {}  # $ref target -> expansions on the current path
        self.checked: set[int] = set()
        self.memo: dict[tuple, Node] = {}
        self.contradictions: list[str] = []
        fuel = Fuel(check_time=builder.check_time)
        self.matcher = Matcher(fuel)
        self.checker = ValueChecker(self, self.matcher, fuel, draft4=_is_draft4(root))
        self.num_branches = 0
        self._dependencies: dict[int, tuple[dict, list[Atom]]] = {}  # id -> (schema kept alive, its atoms)
        self._generated: list = []  # schemas made here (negations): kept alive, their ids key the memo

    # ---- errors ------------------------------------------------------------------------------------------------
    def unsupported(self, message: str, keyword: str, pointer: str) -> None:
        """Refuse, or in lenient mode record a warning and let the caller ignore the keyword."""
        if not self.lenient:
            raise UnsupportedSchemaError(message, keyword=keyword, pointer=pointer)
        self.warn(f"{message} (keyword '{keyword}' at '{pointer}'): ignored")

    def warn(self, message: str) -> None:
        if len(self.warnings) < MAX_WARNINGS:
            self.warnings.append(message)
        else:
            self.num_unshown_warnings += 1

    def finish_warnings(self) -> None:
        if self.num_unshown_warnings:
            self.warnings.append(f"... and {self.num_unshown_warnings} more warnings")

    def count_branches(self, num: int) -> None:
        self.b.check_time()
        self.num_branches += num
        if self.num_branches > MAX_BRANCH_EXPANSIONS:
            raise GrammarTooComplexError(f"anyOf/oneOf/not expand into more than {MAX_BRANCH_EXPANSIONS} "
                                         f"alternatives (each combined with the rest of its schema)")

    def contradiction(self, message: str, pointer: str) -> Node:
        self.contradictions.append(f"{message} at '{pointer}'")
        return NOTHING

    def contradiction_hint(self) -> str:
        return f": {self.contradictions[0]}" if self.contradictions else ""

    def check(self, schema: dict, pointer: str) -> None:
        if id(schema) in self.checked:
            return
        self.checked.add(id(schema))
        check_keywords(schema, pointer)
        if "contains" in schema and (schema.get("minContains", 1) != 1 or "maxContains" in schema):
            self.unsupported("'minContains'/'maxContains' are not supported", "minContains", pointer)
        for i, keyword in enumerate(schema):
            if keyword in UNSUPPORTED:
                self.unsupported(f"'{keyword}' is not supported", keyword, pointer)
            elif is_unknown_keyword(keyword) and keyword != EXCLUDE:
                self.unknown(keyword, pointer)
            if i & 1023 == 1023:  # a schema object of a hundred thousand keys
                self.b.check_time()

    def unknown(self, keyword: str, pointer: str) -> None:
        if self.reject_unknown:
            raise UnknownKeywordError(f"unknown keyword: {unknown_keyword_reason(keyword)}", keyword=keyword[:64],
                                      pointer=pointer)
        if len(self.warnings) < MAX_WARNINGS:  # the hint costs about 0.1 ms: only for warnings that are shown
            self.warn(f"unknown keyword {keyword[:64]!r} at '{pointer}' ignored: {unknown_keyword_reason(keyword)}")
        else:
            self.num_unshown_warnings += 1

    # ---- atoms -------------------------------------------------------------------------------------------------
    def atoms(self, schema, pointer: str, refs: list[str], chain: tuple[str, ...] = ()) -> list[Atom] | None:
        """The atoms whose conjunction is ``schema`` (None: the schema ``false``); ``$ref`` targets go to refs."""
        if schema is True:
            return []
        if schema is False:
            return None
        self.check(schema, pointer)
        out: list[Atom] = [(schema, pointer, frozenset())] + self.dependency_atoms(schema, pointer)
        if "$ref" in schema:
            target, target_pointer = self.refs.resolve(schema["$ref"], pointer)
            if target_pointer in chain:
                raise InvalidSchemaError("$ref cycle that no value can end", keyword="$ref", pointer=pointer)
            refs.append(target_pointer)
            inner = self.atoms(target, target_pointer, refs, chain + (target_pointer,))
            if inner is None:
                return None
            out += inner
        for i, member in enumerate(schema.get("allOf", ())):
            inner = self.atoms(member, f"{pointer}/allOf/{i}", refs, chain)
            if inner is None:
                return None
            out += inner
        return out

    def dependency_atoms(self, schema: dict, pointer: str) -> list[Atom]:
        """``dependencies``/``dependentRequired``/``dependentSchemas`` as ``anyOf`` atoms: either the trigger
        property is absent, or it is present and the dependency holds; ``if``/``then``/``else`` as
        ``anyOf(allOf(if, then), allOf(not if, else))``. Made once per schema object."""
        if id(schema) not in self._dependencies:
            atoms = []
            if "if" in schema and ("then" in schema or "else" in schema):
                condition = schema["if"]
                group = {"anyOf": [{"allOf": [condition, schema.get("then", True)]},
                                   {"allOf": [{"not": condition}, schema.get("else", True)]}]}
                atoms.append((group, f"{pointer}/if", frozenset()))
            for keyword in ("dependencies", "dependentRequired", "dependentSchemas"):
                for name, dependency in schema.get(keyword, {}).items():
                    present = {"required": [name]}
                    then = {"required": dependency} if isinstance(dependency, list) else dependency
                    group = {"anyOf": [{"not": present}, {"allOf": [present, then]}]}
                    atoms.append((group, f"{pointer}/{keyword}/{escape_pointer_token(name)}", frozenset()))
            self._dependencies[id(schema)] = (schema, atoms)
        return self._dependencies[id(schema)][1]

    def node(self, schema, pointer: str) -> Node:
        return self.node_of([(schema, pointer)])

    def node_of(self, sources: list[Source]) -> Node:
        """The AST of the conjunction of ``sources`` (an empty list is the schema ``true``)."""
        atoms, refs = [], []
        for schema, pointer in sources:
            inner = self.atoms(schema, pointer, refs)
            if inner is None:
                return NOTHING
            atoms += inner
        return self.build(atoms, refs)

    def merged_of(self, sources: list[Source]) -> MergedSchema | None:
        atoms = []
        for schema, pointer in sources:
            inner = self.atoms(schema, pointer, [])
            if inner is None:
                return None
            atoms += inner
        return self.merge(atoms)

    def merge(self, atoms: list[Atom]) -> MergedSchema:
        return merge_atoms(atoms, self.name_matches)

    def name_matches(self, pattern: str, name: str, pointer: str) -> bool:
        """``name`` holds a match of the ECMA-262 ``pattern`` (``patternProperties``), decided in linear time. A
        pattern lenient mode ignores names no member, as in :meth:`extra_member`."""
        return bool(self.checker.pattern_matches(pattern, name, pointer))

    def build(self, atoms: list[Atom], refs: list[str]) -> Node:
        if self.recursive and any(self.active.get(ref, 0) for ref in refs):
            return self.rule_ref(atoms, refs)
        if any(self.active.get(ref, 0) >= MAX_REF_DEPTH for ref in refs):
            return NOTHING  # recursion cut: this branch nests too deep
        key = (tuple((id(s), skip) for s, _, skip in atoms), tuple(sorted(self.active.items())))
        if key in self.memo:
            return self.memo[key]
        for ref in refs:
            self.active[ref] = self.active.get(ref, 0) + 1
        try:
            node = self.build_merged(atoms)
        finally:
            for ref in refs:
                self.active[ref] -= 1
        self.memo[key] = node
        return node

    def rule_ref(self, atoms: list[Atom], refs: list[str]) -> Ref:
        """The rule for ``atoms`` (made on first use, built by :meth:`build_rules`)."""
        key = tuple((id(s), skip) for s, _, skip in atoms)
        name = self._rule_names.get(key)
        if name is None:
            name = self._rule_names[key] = f"ref{len(self._rule_names)}:{atoms[0][1]}"
            self._pending_rules.append((name, atoms, refs))
        return Ref(name)

    def any_value(self, depth: int = ANY_VALUE_DEPTH) -> Node:
        if not self.exact_any:
            return super().any_value(depth)
        if ANY_RULE not in self.rules:
            self.rules[ANY_RULE] = self.exact_any_value(Ref(ANY_RULE))
        return Ref(ANY_RULE)

    def build_rules(self) -> None:
        """Build every rule a :class:`Ref` names (rules can name further rules)."""
        while self._pending_rules:
            name, atoms, refs = self._pending_rules.pop()
            saved, self.active = self.active, {ref: 1 for ref in refs}
            try:
                self.rules[name] = self.build_merged(atoms)
            finally:
                self.active = saved

    def build_merged(self, atoms: list[Atom]) -> Node:
        if not atoms:
            return self.any_value()
        merged = self.merge(atoms)
        if merged.enum is not None:  # the value checker judges each member against every atom: not, anyOf, oneOf exactly
            return self.enum_node(merged, atoms, atoms[0][1])
        if merged.negations:
            return self.build_negation(atoms, merged)
        if merged.choices:
            return self.build_choice(atoms, merged)
        pointer = atoms[0][1]
        if merged.is_unsatisfiable:
            return self.contradiction("the 'type' keywords have no type in common", pointer)
        types = [t for t in TYPES if merged.types is None or t in merged.types]
        if "number" in types:
            types.remove("integer")  # number's grammar already holds every integer
        return self.b.alt([self.type_node(t, merged, pointer) for t in types])

    def build_choice(self, atoms: list[Atom], merged: MergedSchema) -> Node:
        combinations = math.prod(len(group[1]) for group in merged.choices)
        if combinations > MAX_BRANCH_EXPANSIONS:  # an allOf of anyOfs: refuse before building any of them
            self.count_branches(combinations)
        kind, branches, owner = merged.choices[0]
        schema, pointer, skip = atoms[owner]
        base = atoms[:owner] + [(schema, pointer, skip | {kind})] + atoms[owner + 1:]
        self.count_branches(len(branches))
        alternatives = []
        for index, (branch, branch_pointer) in enumerate(branches):
            refs: list[str] = []
            inner = self.atoms(branch, branch_pointer, refs)
            if inner is not None:
                alternatives.append((index, base + inner, refs))
        if kind == "oneOf":
            alternatives = self.exclusive(alternatives, branches, pointer)
        return self.b.alt([self.build(a, refs) for _, a, refs in alternatives])

    def exclusive(self, alternatives: list, branches: list[Source], pointer: str) -> list:
        """``oneOf``: each branch must also fail every other branch that it may overlap, so the negations of those
        join its atoms. Provably disjoint pairs (see :meth:`disjoint`) need none."""
        merged = [self.merge(a) for _, a, _ in alternatives]
        out = []
        for i, (index, atoms, refs) in enumerate(alternatives):
            negations = []
            for j, (other, _, _) in enumerate(alternatives):
                if j == i or self.disjoint(merged[i], merged[j], 2):
                    continue
                branch, branch_pointer = branches[other]
                try:
                    negate(branch, branch_pointer, self.refs.resolve)
                except UnsupportedSchemaError as error:
                    self.unsupported(f"oneOf branches {index} and {other} may both match one value, and branch "
                                     f"{other} cannot be negated ({error})", "oneOf", pointer)
                    return alternatives  # lenient: compiled as anyOf
                negation = {"not": branch}
                self._generated.append(negation)
                negations.append((negation, branch_pointer, frozenset()))
            out.append((index, atoms + negations, refs))
        return out

    def build_negation(self, atoms: list[Atom], merged: MergedSchema) -> Node:
        negated, pointer, owner = merged.negations[0]
        schema, owner_pointer, skip = atoms[owner]
        base = atoms[:owner] + [(schema, owner_pointer, skip | {"not"})] + atoms[owner + 1:]
        try:
            options = negate(negated, pointer, self.refs.resolve)
        except UnsupportedSchemaError as error:
            if not self.lenient:
                raise
            self.warn(f"{error}: ignored")
            return self.build(base, [])
        self._generated.append(options)
        self.count_branches(len(options))
        alternatives = []
        for option in options:
            refs: list[str] = []
            inner = self.atoms(option, pointer, refs)
            if inner is not None:
                alternatives.append(self.build(base + inner, refs))
        return self.b.alt(alternatives)

    # ---- oneOf -------------------------------------------------------------------------------------------------
    def disjoint(self, a: MergedSchema | None, b: MergedSchema | None, depth: int) -> bool:
        """True only when no value can satisfy both ``a`` and ``b`` (None is the schema ``false``)."""
        if a is None or b is None or a.is_unsatisfiable or b.is_unsatisfiable:
            return True
        common = set(a.types or TYPES) & set(b.types or TYPES)
        if not common:
            return True
        if a.enum is not None and b.enum is not None:
            keys = {json_key(v) for v in a.enum}
            if not any(json_key(v) in keys for v in b.enum):
                return True
        if common != {"object"} or depth == 0:
            return False
        return self._objects_disjoint(a, b, depth) or self._objects_disjoint(b, a, depth)

    def _objects_disjoint(self, a: MergedSchema, b: MergedSchema, depth: int) -> bool:
        for name in a.required:
            if name in b.required:
                if self.disjoint(self.merged_of(property_sources(a, name, self.name_matches)),
                                 self.merged_of(property_sources(b, name, self.name_matches)), depth - 1):
                    return True
            elif False in [s for s, _ in property_sources(b, name, self.name_matches)]:
                return True  # b forbids the property a requires
        return False

    # ---- the schema's own values (enum members, property names) ---------------------------------------------------
    def validates(self, value, atoms: list[Atom]) -> bool:
        """``value`` satisfies every atom (Corral's own checker: linear-time patterns, bounded work)."""
        return all(self.checker.satisfies(value, schema, pointer, skip) for schema, pointer, skip in atoms)


def _is_draft4(root) -> bool:
    """Drafts 3 and 4 do not count ``1.0`` as an integer; later drafts do."""
    uri = root.get("$schema") if isinstance(root, dict) else None
    return isinstance(uri, str) and ("draft-04" in uri or "draft-03" in uri)

"""ValueBuilders: the type-by-type builders of ``SchemaCompiler`` (null, boolean, numbers, strings, arrays,
objects, ``enum`` literals and the "any JSON value" of the schema ``true``).

"Any value" is a context-free language (containers nest without bound): a rule that names itself
(``exact_any_value``), which sends a schema that holds it down the context-free path, with no depth limit. Only
where no rule can stand (inside an intersection) is it unrolled ``ANY_VALUE_DEPTH`` containers deep instead.
"""

import json
import math

from corral.errors import GrammarTooComplexError, InvalidRegexError, InvalidSchemaError, UnsupportedRegexError
from corral.grammar.json_containers import Spacing, array_node, contains_array_node, member_node, object_node
from corral.grammar.json_formats import STANDARD_FORMATS, format_node
from corral.grammar.json_numbers import (DIGIT, NONZERO_DIGIT, integer_bounds, integer_range, number_node,
                                         number_range)
from corral.grammar.json_strings import (ANY_CHAR, QUOTE, intersect_chars, length_node, loose_string_node,
                                         register_stable, spell, spell_chars, string_literal, string_node)
from corral.grammar.node_builder import NodeBuilder, count_text, share
from corral.grammar.regex_ast import EMPTY, NOTHING, CharSet, Node
from corral.grammar.regex_parser import parse_regex
from corral.grammar.schema_merge import MergedSchema, integral_multiple, json_key, property_sources

ANY_VALUE_DEPTH = 5
ANY_RULE = "any"  # the rule of "any JSON value" when it nests without a limit (SchemaCompiler's exact_any)
MAX_ENUMERATED_MULTIPLES = 256
# Declared properties of one object: beyond this a schema would not compile inside the default budget anyway
# (3,000 required take about 3 s on a slow core, optional ones cost more), so it is refused at once instead of
# spending the whole budget and leaving millions of nodes for the collector.
MAX_DECLARED_PROPERTIES = 5_000
MAX_MULTIPLE_SUFFIXES = 1024


class ValueBuilders:
    declared_only = False  # objects get only their declared properties where the standard's default allows more

    def __init__(self, builder: NodeBuilder, sp: Spacing):
        self.b, self.sp = builder, sp
        self._any: dict[int, Node] = {}

    # ---- literals ----------------------------------------------------------------------------------------------
    def any_value(self, depth: int = ANY_VALUE_DEPTH) -> Node:
        if depth not in self._any:
            shared = _SHARED_ANY.get((self.sp, depth))
            if shared is not None and shared[0] is self.sp:  # the same whitespace policy object: the same AST
                self.b.count_all(shared[2])  # what building it here would have counted
                self._any[depth] = shared[1]
                return shared[1]
        return self.build_any_value(depth)

    def build_any_value(self, depth: int) -> Node:
        if depth not in self._any:
            b = self.b
            options = [b.literal("null"), b.literal("true"), b.literal("false"), number_node(b),
                       self.any_string()]
            if depth > 0:
                inner = self.build_any_value(depth - 1)
                options.append(array_node(b, self.sp, [], inner, 0, None))
                options.append(object_node(b, self.sp, [], member_node(b, self.sp, self.any_string(), inner), 0,
                                           None))
            self._any[depth] = b.alt(options)
        return self._any[depth]

    def exact_any_value(self, inner: Node) -> Node:
        """Any JSON value whose members and items are ``inner`` (a :class:`Ref` to this very value)."""
        b = self.b
        return b.alt([b.literal("null"), b.literal("true"), b.literal("false"), number_node(b), self.any_string(),
                      array_node(b, self.sp, [], inner, 0, None),
                      object_node(b, self.sp, [], member_node(b, self.sp, self.any_string(), inner), 0, None)])

    def any_string(self) -> Node:
        if "string" not in self._any:
            self._any["string"] = loose_string_node(self.b, None)
        return self._any["string"]

    def value_literal(self, value) -> Node:
        """The JSON text of one value (``enum``/``const``), with the whitespace policy between its tokens."""
        b, sp = self.b, self.sp
        if isinstance(value, str):
            return string_literal(b, value)
        if isinstance(value, list):
            return array_node(b, sp, [self.value_literal(v) for v in value], NOTHING, len(value), len(value))
        if isinstance(value, dict):
            members = [(member_node(b, sp, string_literal(b, k), self.value_literal(v)), True)
                       for k, v in value.items()]
            return object_node(b, sp, members, None, 0, None)
        if isinstance(value, float) and not math.isfinite(value):
            return NOTHING
        return b.literal(json.dumps(value))

    def enum_node(self, merged: MergedSchema, atoms, pointer: str) -> Node:
        """The ``enum``/``const`` members that also satisfy every other keyword (``schema_check``)."""
        size = 2 * len(merged.enum) + sum(len(json.dumps(v)) for v in merged.enum[:self.b.max_nodes])
        if size > self.b.max_nodes:  # refuse before validating them one by one
            raise GrammarTooComplexError(f"the enum would need more than {self.b.max_nodes} automaton nodes")
        excluded = {json_key(v) for v in merged.excluded}
        kept = [v for v in merged.enum if json_key(v) not in excluded and self.validates(v, atoms)]
        if not kept:
            return self.contradiction("no 'enum'/'const' value satisfies the other keywords", pointer)
        return self.b.alt([self.value_literal(v) for v in kept])

    def type_node(self, name: str, merged: MergedSchema, pointer: str) -> Node:
        excluded = {json_key(v) for v in merged.excluded}
        if name in ("null", "boolean"):
            return self.b.alt([self.b.literal(v) for v in ("null", "true", "false")
                               if v not in excluded and (v == "null") == (name == "null")])
        if name in ("integer", "number"):
            node = self.number_node(merged, name == "integer", pointer)
            numbers = [json_key(v) for v in merged.excluded if isinstance(v, (int, float)) and not isinstance(v, bool)]
            if numbers and name == "number":
                self.unsupported("'not' over a number 'enum'/'const' is not supported for type number", "not",
                                 pointer)
            return self.b.intersect(node, self.names_except(numbers)) if numbers and name == "integer" else node
        if name == "string":
            return self.string_node(merged, pointer)
        if any(isinstance(v, list if name == "array" else dict) for v in merged.excluded):
            self.unsupported(f"'not' over an {name} 'enum'/'const' is not supported", "not", pointer)
        if name == "array":
            return self.array_node(merged, pointer)
        return self.object_node(merged, pointer)

    # ---- numbers -----------------------------------------------------------------------------------------------
    def number_node(self, merged: MergedSchema, integer_only: bool, pointer: str) -> Node:
        b, low, high = self.b, merged.low, merged.high
        factor = integral_multiple(merged.multiple_of) if merged.multiple_of else None
        if merged.multiple_of and factor is None:
            self.unsupported("a fractional 'multipleOf' is not supported", "multipleOf", merged.multiple_of[0][1])
        if integer_only or factor is not None:  # an integral multipleOf admits only integral values
            lo, hi = integer_bounds(*(low or (None, False)), *(high or (None, False)))
            if lo is not None and hi is not None and lo > hi:
                return self.contradiction("the bounds leave no integer", pointer)
            if factor is not None and factor > 1:
                return self.multiples(factor, lo, hi, merged.multiple_of[0][1])
            return integer_range(b, lo, hi)
        if low is None and high is None:
            return number_node(b)
        try:
            return number_range(b, *(low or (None, False)), *(high or (None, False)))
        except OverflowError:
            keyword = "minimum" if low is not None and not _fits_float(low[0]) else "maximum"
            self.unsupported("a numeric bound beyond the float range is not supported", keyword, pointer)
            return number_node(b)

    def multiples(self, factor: int, lo: int | None, hi: int | None, pointer: str) -> Node:
        b = self.b
        if lo is not None and hi is not None and hi // factor - -(-lo // factor) < MAX_ENUMERATED_MULTIPLES:
            first = -(-lo // factor)
            return b.alt([b.literal(str(k * factor)) for k in range(first, hi // factor + 1)])
        rest, twos, fives = factor, 0, 0
        while rest % 2 == 0:
            rest, twos = rest // 2, twos + 1
        while rest % 5 == 0:
            rest, fives = rest // 5, fives + 1
        width = max(twos, fives)
        if rest != 1 or 10 ** width // factor > MAX_MULTIPLE_SUFFIXES:
            self.unsupported(f"'multipleOf: {count_text(factor)}' without tight bounds is not supported (only factors "
                             f"2^a*5^b, or ranges of at most {MAX_ENUMERATED_MULTIPLES} multiples)",
                             "multipleOf", pointer)
            return integer_range(b, lo, hi)
        # n is a multiple of 2^a*5^b exactly when its last max(a, b) digits are.
        short = [str(k * factor) for k in range(10 ** width // factor)]
        suffixes = b.alt([b.literal(s.zfill(width)) for s in short])
        longer = b.concat(NONZERO_DIGIT, b.repeat(DIGIT, 0, None), suffixes)
        natural = b.alt([*(b.literal(s) for s in short), longer])
        positive = b.alt([*(b.literal(s) for s in short if s != "0"), longer])
        signed = b.alt([natural, b.concat(CharSet.chars("-"), positive)])
        return signed if lo is None and hi is None else b.intersect(integer_range(b, lo, hi), signed)

    # ---- strings -----------------------------------------------------------------------------------------------
    def decoded_string(self, merged: MergedSchema, pointer: str) -> Node:
        """The decoded-string language of the string keywords (length, patterns, formats)."""
        b, parts = self.b, []
        if merged.max_length is not None and merged.max_length < merged.min_length:
            return self.contradiction("minLength exceeds maxLength", pointer)
        if merged.min_length or merged.max_length is not None:
            parts.append(length_node(b, merged.min_length, merged.max_length))
        for pattern, where in merged.patterns:
            node = self.pattern(pattern, where)
            if node is not None:
                parts.append(node)
        for name, where in merged.formats:
            node = format_node(name)
            if node is None and name in STANDARD_FORMATS:
                self.unsupported(f"format {name!r} is not supported", "format", where)
            elif node is None:
                self.warn(f"format {name!r} at '{where}' is not checked (an annotation)")
            else:
                parts.append(register_stable(node))
        return b.intersect(*parts) if parts else b.repeat(ANY_CHAR, 0, None)

    def pattern(self, pattern: str, pointer: str) -> Node | None:
        """The AST of a JSON Schema ``pattern`` (the strings holding a match), or None when lenient mode ignores
        it (an unsupported construct, reported once)."""
        key = ("pattern", pattern)
        if key in self.b.cache:
            return self.b.cache[key]
        try:
            self.b.cache[key] = parse_regex(pattern, flavor="ecma", search=True)
        except UnsupportedRegexError as error:
            self.unsupported(f"pattern: {error}", "pattern", pointer)
            self.b.cache[key] = None
        except InvalidRegexError as error:
            raise InvalidSchemaError(f"pattern: {error}", keyword="pattern", pointer=pointer) from None
        return self.b.cache[key]

    def string_node(self, merged: MergedSchema, pointer: str) -> Node:
        strings = [v for v in merged.excluded if isinstance(v, str)]
        if strings:
            return string_node(self.b, self.b.intersect(self.decoded_string(merged, pointer),
                                                        self.names_except(strings)))
        if not merged.patterns and not merged.formats and merged.min_length == 0:
            return loose_string_node(self.b, merged.max_length)
        return string_node(self.b, self.decoded_string(merged, pointer))

    # ---- containers --------------------------------------------------------------------------------------------
    def array_node(self, merged: MergedSchema, pointer: str) -> Node:
        low, high = merged.min_items, merged.max_items
        if high is not None and high < low:
            return self.contradiction("minItems exceeds maxItems", pointer)
        prefix = merged.prefix_items[:high] if high is not None else merged.prefix_items
        needs_rest = high is None or high > len(prefix)
        rest = self.node_of(merged.rest_items) if needs_rest else NOTHING
        effective_high = len(prefix) if rest == NOTHING and (high is None or high > len(prefix)) else high
        if merged.unique_items is not None and (effective_high is None or effective_high > 1):
            self.unsupported("'uniqueItems: true' is not supported unless at most one item is allowed",
                             "uniqueItems", merged.unique_items)
        node = array_node(self.b, self.sp, [self.node_of(s) for s in prefix], rest, low, high)
        for source in merged.contains:
            if prefix:
                self.unsupported("'contains' together with tuple items is not supported", "contains", source[1])
                continue
            contained = self.node_of(merged.rest_items + [source])
            node = self.b.intersect(node, contains_array_node(self.b, self.sp, rest, contained))
        return node

    def object_node(self, merged: MergedSchema, pointer: str) -> Node:
        b, sp = self.b, self.sp
        if merged.max_properties is not None and merged.max_properties < merged.min_properties:
            return self.contradiction("minProperties exceeds maxProperties", pointer)
        declared = list(merged.properties) + [n for n in merged.required if n not in merged.properties]
        if len(declared) > MAX_DECLARED_PROPERTIES:
            raise GrammarTooComplexError(f"the object at '{pointer or '#'}' declares {len(declared)} properties; "
                                         f"at most {MAX_DECLARED_PROPERTIES} are supported")
        members = []
        for name in declared:
            allowed = not merged.property_names or self.name_allowed(name, merged.property_names)
            value = self.node_of(property_sources(merged, name, self.name_matches)) if allowed else NOTHING
            required = name in merged.required
            if value == NOTHING:
                if required:
                    return self.contradiction(f"required property {name!r} can have no value", pointer)
                continue
            members.append((member_node(b, sp, string_literal(b, name), value), required))
        extra = self.extra_member(merged, declared)
        if self.declared_only and members and not merged.additional_properties and not merged.pattern_properties \
                and len(members) >= merged.min_properties:
            extra = None  # undeclared members only by the standard's default: generation asked for none
        return object_node(b, sp, members, extra, merged.min_properties, merged.max_properties)

    def extra_member(self, merged: MergedSchema, declared: list[str]) -> Node | None:
        """An undeclared member, or None when none is allowed (see the policy in ``json_schema``)."""
        b = self.b
        if merged.pattern_properties:
            keys = b.alt([self.pattern(p, sources[-1][1]) or NOTHING
                          for p, sources in merged.pattern_properties.items()])
            value_sources = [s for sources in merged.pattern_properties.values() for s in sources]
        else:
            if any(s is False for s, _ in merged.additional_properties):
                return None
            keys, value_sources = b.repeat(ANY_CHAR, 0, None), merged.additional_properties
        # only "not a declared name" (the common case): the trie is built spelled, not spelled afterwards
        spelled_trie = bool(declared) and not merged.pattern_properties and not merged.property_names
        key_parts = [keys] if merged.pattern_properties else []  # any key at all needs no intersection
        if declared and not spelled_trie:
            key_parts.append(self.names_except(declared))
        if merged.property_names:
            key_parts.append(self.property_name_language(merged.property_names))
        value = self.node_of(value_sources)
        if value == NOTHING:
            return None
        if spelled_trie:
            key_node = b.concat(QUOTE, self.names_except(declared, spelled=True), QUOTE)
            return member_node(b, self.sp, key_node, value)
        key = b.intersect(*key_parts) if key_parts else keys
        if key == NOTHING:
            return None
        return member_node(b, self.sp, string_node(b, key), value)

    def names_except(self, names: list[str], spelled: bool = False) -> Node:
        """Decoded strings other than ``names``: a trie with an escape hatch at every node. ``spelled``: the JSON
        string bodies of those strings instead (what ``json_strings.spell`` of the trie would give)."""
        trie: dict = {}
        for name in names:
            node = trie
            for char in name:
                node = node.setdefault(char, {})
            node[None] = {}
        tail = self.b.repeat(ANY_CHAR, 0, None)
        # one tail node for the whole trie: spelled and turned into automaton terms once, not once per node
        return self._not_in_trie(trie, spell(self.b, tail) if spelled else tail, spelled)

    def _not_in_trie(self, trie: dict, tail: Node, spelled: bool) -> Node:
        b = self.b
        chars = (lambda cs: spell_chars(b, cs)) if spelled else (lambda cs: cs)  # noqa: E731
        children = [c for c in trie if c is not None]
        options = [] if None in trie else [EMPTY]
        options += [b.concat(chars(CharSet.chars(c)), self._not_in_trie(trie[c], tail, spelled)) for c in children]
        others = intersect_chars(CharSet.chars("".join(children)).negate(), ANY_CHAR)  # minus surrogates
        options.append(b.concat(chars(others), tail))
        return b.alt(options)

    def property_name_language(self, sources) -> Node:
        merged = self.merged_of(sources)
        if merged is None:
            return NOTHING
        if merged.choices:
            self.unsupported("'propertyNames' with anyOf/oneOf is not supported", "propertyNames", sources[0][1])
            return self.b.repeat(ANY_CHAR, 0, None)
        if merged.types is not None and "string" not in merged.types:
            return NOTHING
        if merged.enum is not None:
            return self.b.alt([self.b.literal(v) for v in merged.enum if isinstance(v, str)])
        return self.decoded_string(merged, sources[0][1])

    def name_allowed(self, name: str, sources) -> bool:
        atoms = []
        for schema, pointer in sources:
            inner = self.atoms(schema, pointer, [])
            if inner is None:
                return False
            atoms += inner
        return self.validates(name, atoms)


# (spacing, depth) -> (spacing, AST, nodes)
_SHARED_ANY: dict[tuple[Spacing, int], tuple[Spacing, Node, tuple[Node, ...]]] = {}


def share_any_value(sp: Spacing, depth: int = ANY_VALUE_DEPTH) -> None:
    """Build the any-value AST for the whitespace policy ``sp`` once per process (about 3 ms per schema
    otherwise), for every schema compiled with this very ``sp`` object. It keeps every node its builder counted,
    so that a schema using it counts exactly what building it in place would have."""
    if (sp, depth) not in _SHARED_ANY:
        values = ValueBuilders(NodeBuilder(max_nodes=1 << 40), sp)
        node = share(values.build_any_value(depth))
        _SHARED_ANY[(sp, depth)] = (sp, node, tuple(values.b._seen.values()))


def _fits_float(value) -> bool:
    try:
        float(value)
    except OverflowError:
        return False
    return True

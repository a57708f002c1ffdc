"""The language of tool calls: ``<tool_call>{"name": "NAME", "arguments": ARGS}</tool_call>``, one or several.

``ARGS`` is the function's ``parameters`` schema (compact JSON; no ``parameters`` means an empty object). Parallel
calls are separated by one newline. The output's language, by mode:

- ``required`` (a named function is ``required`` over that one tool): one call, or with ``parallel`` several,
  and nothing else;
- ``auto``: free text that never spells ``<tool_call>``, optionally followed by calls, so a call is constrained
  from its first byte; with an answer constraint (a ``response_format``), that answer or calls.

A tools constraint's value (``Constraint(kind="tools")``) is plain data, so it is compiled, cached and budgeted
like any other constraint: ``{"tools": [{"index", "name", "parameters"}], "mode", "parallel", "answer"}``
(``index``: the tool's place in the request, for error messages), where
``answer`` is ``None`` or ``{"kind", "value"}`` of another constraint. How calls reach the prompt and are read
back is ``corral.schemas.tools``.
"""

from collections.abc import Callable

from corral.errors import UserInputError
from corral.grammar.regex_ast import CharSet, Node, Repeat, alt, literal, optional, seq

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_SUFFIX = "}" + CALL_CLOSE
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def call_prefix(name: str) -> str:
    return f'{CALL_OPEN}{{"name": "{name}", "arguments": '


def text_without(word: str) -> Node:
    """Any text (Unicode scalar values) in which ``word`` never occurs.

    subtle: this closed form needs ``word[0]`` to occur nowhere else in ``word`` (true of ``<tool_call>``): then a
    partial match can only restart at that character. With ``B_k = word[:k+1]`` (k < len(word) - 1) the proper
    prefixes, the language is ``([^w0] | B* Z)* B*`` where ``Z = B_k`` followed by a character that is neither
    ``w0`` nor the one that would extend it.
    """
    first, rest = word[0], word[1:]
    assert first not in rest, word
    not_first = _subtract(_SCALARS, first)
    broken = [literal(first + rest[:k]) for k in range(len(rest))]
    z = alt(*(seq(b, _subtract(not_first, rest[k])) for k, b in enumerate(broken)))
    any_broken = Repeat(alt(*broken), 0, None)
    return seq(Repeat(alt(not_first, seq(any_broken, z)), 0, None), any_broken)


_SCALARS = CharSet.of((0, 0xD7FF), (0xE000, 0x10FFFF))  # code points that UTF-8 can spell (no surrogates)


def _subtract(chars: CharSet, text: str) -> CharSet:
    return chars.negate().union(CharSet.chars(text)).negate()


def tool_calls_node(value: dict, schema_node: Callable[[object], Node], answer: Node | None) -> Node:
    """The output language of a tools constraint's ``value``. ``schema_node(schema)`` compiles one function's
    ``parameters`` (the caller's compiler, under the request's budget); ``answer`` is the compiled answer
    constraint of ``auto`` mode, or None."""
    calls = []
    for tool in value["tools"]:
        schema = tool["parameters"] if tool["parameters"] is not None else NO_PARAMETERS
        try:
            arguments = schema_node(schema)
        except UserInputError as err:
            err.args = (f"tools[{tool['index']}] ('{tool['name']}') parameters: {err}",)
            err.param = f"tools[{tool['index']}].function.parameters"
            raise
        calls.append(seq(literal(call_prefix(tool["name"])), arguments, literal(CALL_SUFFIX)))
    one = alt(*calls)
    many = seq(one, Repeat(seq(literal("\n"), one), 0, None)) if value["parallel"] else one
    if value["mode"] == "required":
        return many
    if answer is not None:
        return alt(answer, many)
    return seq(text_without(CALL_OPEN), optional(many))

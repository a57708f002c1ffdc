"""Tools: the constraint a tool call must match, how tools reach the prompt, and how calls are read back.

A call is written ``<tool_call>{"name": "NAME", "arguments": ARGS}</tool_call>``, where ``ARGS`` is constrained by
the function's ``parameters`` schema (compact JSON). Parallel calls are separated by one newline. The whole
output's language is a regex AST, compiled with ``GrammarCompiler.compile_node``:

- ``required`` or a named function: one call (or, with ``parallel_tool_calls``, several) and nothing else;
- ``auto``: free text that never spells ``<tool_call>``, optionally followed by calls; the call is therefore
  constrained from its first byte. With a ``response_format`` too, ``auto`` is that format or calls.

Templates that know tools (they mention ``tools``) get them natively. Others, like SmolLM2's, get the tool list
written into the system message by :func:`tools_system_text`, and past calls are written back in the exact form
the model is constrained to produce, so a multi-turn prompt repeats its own prefix (prefix-cache hits).
"""

import json
import re

from corral.errors import InvalidRequestError, UserInputError
from corral.grammar.regex_ast import CharSet, Node, Repeat, alt, literal, optional, seq
from corral.schemas.chat import ChatMessage, NamedToolChoice, Tool

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


def call_prefix(name: str) -> str:
    return f'{CALL_OPEN}{{"name": "{name}", "arguments": '


CALL_SUFFIX = "}" + CALL_CLOSE


def text_without(word: str) -> Node:
    """Any text (Unicode scalar values) in which ``word`` never occurs.

    subtle: this closed form needs ``word[0]`` to occur nowhere else in ``word`` (true of ``<tool_call>``): then a
    partial match can only restart at that character. With ``B_k = word[:k+1]`` (k < len(word) - 1) the proper
    prefixes,
    the language is ``([^w0] | B* Z)* B*`` where ``Z = B_k`` followed by a character that is neither ``w0`` nor
    the one that would extend it.
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


def _arguments_node(tool: Tool, index: int) -> Node:
    from corral.grammar.json_schema import schema_to_node

    schema = tool.function.parameters if tool.function.parameters is not None else _NO_PARAMETERS
    try:
        return schema_to_node(schema, whitespace="compact")
    except UserInputError as err:
        err.args = (f"tools[{index}] ('{tool.function.name}') parameters: {err}",)
        err.param = f"tools[{index}].function.parameters"
        raise


def calls_node(tools: list[Tool], *, parallel: bool) -> Node:
    """One call to any of ``tools`` or, with ``parallel``, one or more separated by newlines."""
    one = alt(*(seq(literal(call_prefix(t.function.name)), _arguments_node(t, i), literal(CALL_SUFFIX))
                for i, t in enumerate(tools)))
    return seq(one, Repeat(seq(literal("\n"), one), 0, None)) if parallel else one


def tool_choice_mode(tools: list[Tool] | None, choice) -> str:
    """'none', 'auto', 'required' or 'named'. OpenAI's default is 'auto' when tools are given."""
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("'tool_choice' needs 'tools'", param="tool_choice")
        return "none"
    if choice is None:
        return "auto"
    return "named" if isinstance(choice, NamedToolChoice) else choice


def tools_node(tools: list[Tool], choice, *, parallel: bool, answer: Node | None) -> Node | None:
    """The output language for a request with tools (None for ``tool_choice='none'``)."""
    mode = tool_choice_mode(tools, choice)
    if mode == "none":
        return answer
    if mode == "named":
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise InvalidRequestError(f"tool_choice names '{choice.function.name}', which is not in 'tools'",
                                      param="tool_choice")
        return calls_node(chosen, parallel=parallel)
    if mode == "required":
        return calls_node(tools, parallel=parallel)
    calls = calls_node(tools, parallel=parallel)
    if answer is not None:
        return alt(answer, calls)
    return seq(text_without(CALL_OPEN), optional(calls))


def tools_system_text(tools: list[Tool]) -> str:
    lines = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    return ("You can call functions. Their signatures, as JSON Schema, are inside <tools></tools>:\n"
            f"<tools>\n{lines}\n</tools>\n"
            "To call one, answer with a JSON object holding its name and arguments inside <tool_call></tool_call>:\n"
            f'{CALL_OPEN}{{"name": "function_name", "arguments": {{...}}}}{CALL_CLOSE}')


def write_call(name: str, arguments: str) -> str:
    return f"{call_prefix(name)}{arguments}{CALL_SUFFIX}"


def template_messages(messages: list[ChatMessage], tools: list[Tool] | None, native: bool) -> list[dict]:
    """Messages as dicts for the chat template. ``native``: the template renders tools and tool calls itself."""
    out: list[dict] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        item: dict = {"role": role, "content": m.text()}
        if m.tool_calls and native:
            item["tool_calls"] = [{"type": "function", "id": c.id, "function": {
                "name": c.function.name, "arguments": _loads_or_text(c.function.arguments)}} for c in m.tool_calls]
        elif m.tool_calls:
            calls = "\n".join(write_call(c.function.name, c.function.arguments) for c in m.tool_calls)
            item["content"] = f"{item['content']}{calls}"
        if role == "tool":
            item["tool_call_id"] = m.tool_call_id
            if not native:
                item["content"] = f"<tool_response>{item['content']}</tool_response>"
        out.append(item)
    if tools and not native:
        text = tools_system_text(tools)
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _loads_or_text(arguments: str):
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def split_tool_calls(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The text before the first call (None when empty) and each complete call's (name, arguments text)."""
    calls = []
    for match in _CALL_RE.finditer(text):
        body = match.group(1)
        try:
            name = json.loads(body)["name"]
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # only a truncated or errored output can hold a malformed call
        head = f'{{"name": "{name}", "arguments": '
        arguments = body[len(head):-1] if body.startswith(head) else json.dumps(json.loads(body).get("arguments"))
        calls.append((name, arguments))
    start = text.find(CALL_OPEN)
    content = text if start < 0 else text[:start]
    return (content or None), calls

"""Tools: the constraint a request with tools compiles to, how tools reach the prompt, and how calls are read back.

The calls' language (``<tool_call>{"name": "NAME", "arguments": ARGS}</tool_call>``, ``ARGS`` constrained by the
function's ``parameters``) is ``corral.grammar.tool_calls``; here a request's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` become that constraint's value, checked against the request limits, and compiled like
any other constraint (in the compile pool, under the request's one budget).

Templates that know tools (they mention ``tools``) get them natively. Others, like SmolLM2's, get the tool list
written into the system message by :func:`tools_system_text`, and past calls are written back in the exact form
the model is constrained to produce, so a multi-turn prompt repeats its own prefix (prefix-cache hits).
"""

import json
import re

from corral.errors import InvalidRequestError
from corral.grammar.constraint import Constraint
from corral.grammar.tool_calls import CALL_CLOSE, CALL_OPEN, CALL_SUFFIX, call_prefix
from corral.schemas.chat import ChatMessage, NamedToolChoice, Tool
from corral.schemas.limits import RequestLimits

_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


def tool_choice_mode(tools: list[Tool] | None, choice) -> str:
    """'none', 'auto', 'required' or 'named'. OpenAI's default is 'auto' when tools are given."""
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("'tool_choice' needs 'tools'", param="tool_choice")
        return "none"
    if choice is None:
        return "auto"
    return "named" if isinstance(choice, NamedToolChoice) else choice


def check_tool_limits(tools: list[Tool] | None, limits: RequestLimits) -> None:
    """A 400 naming the limit when a request brings more tools, or more tool text, than the server takes."""
    if not tools:
        return
    if len(tools) > limits.max_tools:
        raise InvalidRequestError(f"at most {limits.max_tools} tools are allowed, this request has {len(tools)}",
                                  param="tools")
    size = len(json.dumps([t.model_dump(exclude_none=True) for t in tools], ensure_ascii=False))
    if size > limits.max_tools_bytes:
        raise InvalidRequestError(f"the tools take {size} bytes of JSON, past the limit of {limits.max_tools_bytes}",
                                  param="tools")
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):  # a call names its tool: two of one name would leave its arguments' schema open
        first = seen.setdefault(tool.function.name, i)
        if first != i:
            raise InvalidRequestError(f"tools[{i}] is named '{tool.function.name}', as tools[{first}] is: a call "
                                      "names its tool, so names must differ", param=f"tools[{i}].function.name")


def tools_constraint(tools: list[Tool] | None, choice, *, parallel: bool, answer: Constraint | None,
                     reject_unknown_keywords: bool = False,
                     disable_additional_properties: bool = False) -> Constraint | None:
    """The output constraint of a request with tools: its calls (and, with 'auto', free text or ``answer``).
    ``tool_choice='none'`` leaves ``answer`` (or nothing) as the constraint. ``disable_additional_properties``
    holds for the calls' arguments too."""
    mode = tool_choice_mode(tools, choice)
    if mode == "none":
        return answer
    chosen = list(enumerate(tools))
    if mode == "named":
        chosen = [(i, t) for i, t in chosen if t.function.name == choice.function.name]
        if not chosen:
            raise InvalidRequestError(f"tool_choice names '{choice.function.name}', which is not in 'tools'",
                                      param="tool_choice")
    # With 'required' or a named tool the output is the call, so a response_format describes a later turn's
    # answer, not this one; with 'auto' it is the alternative to a call.
    if answer is not None and answer.kind == "grammar" and mode == "auto":
        raise InvalidRequestError("a Lark grammar cannot be combined with tools; use tool_choice 'none' or drop the "
                                  "grammar", param="tool_choice")
    value = {"tools": [{"index": i, "name": t.function.name, "parameters": t.function.parameters} for i, t in chosen],
             "mode": "auto" if mode == "auto" else "required", "parallel": parallel,
             "answer": {"kind": answer.kind, "value": answer.value} if answer is not None and mode == "auto"
             else None}
    whitespace = answer.whitespace if value["answer"] is not None else "compact"  # the answer's; calls are compact
    return Constraint("tools", value, whitespace=whitespace, reject_unknown_keywords=reject_unknown_keywords,
                      disable_additional_properties=disable_additional_properties)


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
    except (ValueError, RecursionError):  # not JSON, an integer past Python's digit limit, or nested too deep
        return arguments


def split_tool_calls(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The text before the first call (None when empty) and each complete call's (name, arguments text)."""
    calls = []
    for match in _CALL_RE.finditer(text):
        body = match.group(1)
        try:
            name = json.loads(body)["name"]
        except (ValueError, RecursionError, KeyError, TypeError):  # (ValueError: JSON's, or past the digit limit)
            continue  # only a truncated or errored output can hold a malformed call
        head = f'{{"name": "{name}", "arguments": '
        arguments = body[len(head):-1] if body.startswith(head) else json.dumps(json.loads(body).get("arguments"))
        calls.append((name, arguments))
    start = text.find(CALL_OPEN)
    content = text if start < 0 else text[:start]
    return (content or None), calls

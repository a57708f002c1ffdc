"""ToolCallStream: cuts a growing tool-mode output into OpenAI stream deltas, text and tool-call pieces.

The output is ``text<tool_call>{"name": "N", "arguments": ARGS}</tool_call>\\n<tool_call>...`` (see
``corral.schemas.tools``). Text is passed on as soon as it cannot be the start of ``<tool_call>``; a call's
first delta carries its id and name once the name is complete; its arguments then stream as they grow, holding
back only what could be the closing ``}</tool_call>``. Concatenating the deltas gives exactly what
:func:`split_tool_calls` reads from the whole text.
"""

import re
import secrets
from typing import NamedTuple

from corral.schemas.tools import CALL_OPEN, CALL_SUFFIX

_HEAD = re.compile(r'\{"name": "([a-zA-Z0-9_-]{1,64})", "arguments": ')


class Delta(NamedTuple):
    """``content`` text, or a piece of call number ``call_index`` (``call_id``/``name`` only on its first piece)."""

    content: str | None = None
    call_index: int | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolCallStream:
    def __init__(self):
        self.state, self.buffer, self.num_calls = "text", "", 0

    def feed(self, text: str) -> list[Delta]:
        self.buffer += text
        out: list[Delta] = []
        while True:
            step = getattr(self, f"_{self.state}")(out)
            if not step:
                return out

    def finish(self) -> list[Delta]:
        """What is still held back once the output ended (a truncated call keeps its partial arguments)."""
        rest, self.buffer = self.buffer, ""
        if not rest or self.state == "head":
            return []
        if self.state == "args":
            return [Delta(call_index=self.num_calls - 1, arguments=rest)]
        return [Delta(content=rest)] if self.state == "text" else []

    def _text(self, out: list[Delta]) -> bool:
        start = self.buffer.find(CALL_OPEN)
        if start < 0:
            keep = _held_back(self.buffer, CALL_OPEN)
            if len(self.buffer) > keep:
                out.append(Delta(content=self.buffer[:len(self.buffer) - keep]))
                self.buffer = self.buffer[len(self.buffer) - keep:]
            return False
        if start > 0:
            out.append(Delta(content=self.buffer[:start]))
        self.buffer, self.state = self.buffer[start + len(CALL_OPEN):], "head"
        return True

    def _head(self, out: list[Delta]) -> bool:
        match = _HEAD.match(self.buffer)
        if match is None:
            return False
        out.append(Delta(call_index=self.num_calls, call_id=new_call_id(), name=match.group(1), arguments=""))
        self.num_calls += 1
        self.buffer, self.state = self.buffer[match.end():], "args"
        return True

    def _args(self, out: list[Delta]) -> bool:
        end = self.buffer.find(CALL_SUFFIX)
        if end < 0:
            keep = _held_back(self.buffer, CALL_SUFFIX)
            if len(self.buffer) > keep:
                out.append(Delta(call_index=self.num_calls - 1, arguments=self.buffer[:len(self.buffer) - keep]))
                self.buffer = self.buffer[len(self.buffer) - keep:]
            return False
        if end > 0:
            out.append(Delta(call_index=self.num_calls - 1, arguments=self.buffer[:end]))
        self.buffer, self.state = self.buffer[end + len(CALL_SUFFIX):], "between"
        return True

    def _between(self, out: list[Delta]) -> bool:
        # Between parallel calls the grammar allows only the newline separator.
        start = self.buffer.find(CALL_OPEN)
        if start < 0:
            return False
        self.buffer, self.state = self.buffer[start + len(CALL_OPEN):], "head"
        return True



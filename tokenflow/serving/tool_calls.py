"""A forced tool call's text -> OpenAI `tool_calls`, whole or as stream deltas.

The grammar (see `structured.py`) makes the output exactly `{"name": "<function>",
"arguments": <JSON>}` in compact form, so the call's name is known once the text passes the
prefix, and the arguments are everything after it but the closing brace.  Streaming, the first
delta carries the call's `index`, `id`, `type` and name (with empty arguments); each later one
the next fragment of the arguments; the last character seen is held back until the next text or
the finish shows whether it is the closing brace (a "stop" finish: the grammar completed the
call; any other finish cut it short, so all of the text is arguments).
"""

from __future__ import annotations

import json
import re

from tokenflow.serving.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall

_PREFIX = re.compile(r'\{"name": ("[A-Za-z0-9_-]+"), "arguments": ')


class ToolCallText:
    """The text of one forced call as it grows."""

    def __init__(self, call_id: str) -> None:
        self.call_id = call_id
        self.name: str | None = None  # known once the prefix is complete
        self.arguments = ""  # sent so far
        self._text = ""
        self._arguments_start = 0

    def feed(self, text: str, finish_reason: str | None) -> list[DeltaToolCall]:
        """The deltas `text` adds (the call's opening delta first, once the name is known); at
        the finish, the rest of the arguments without the closing brace."""
        self._text += text
        deltas: list[DeltaToolCall] = []
        if self.name is None:
            match = _PREFIX.match(self._text)
            if match is None:
                return deltas
            self.name = json.loads(match.group(1))
            self._arguments_start = match.end()
            function = DeltaFunctionCall(name=self.name, arguments="")
            deltas.append(
                DeltaToolCall(index=0, id=self.call_id, type="function", function=function)
            )
        fragment = self._next_fragment(finish_reason)
        if fragment:
            self.arguments += fragment
            deltas.append(DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=fragment)))
        return deltas

    def call(self) -> ToolCall | None:
        """The whole call (after the finish), or None if the output never named one."""
        if self.name is None:
            return None
        return ToolCall(
            id=self.call_id, function=FunctionCall(name=self.name, arguments=self.arguments)
        )

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """The answer's finish: "tool_calls" when the grammar completed a call."""
        if finish_reason == "stop" and self.name is not None:
            return "tool_calls"
        return finish_reason

    def _next_fragment(self, finish_reason: str | None) -> str:
        end = len(self._text)
        if finish_reason in (None, "stop"):
            end -= 1  # possibly (at a stop: surely) the wrapper's closing brace
        start = self._arguments_start + len(self.arguments)
        return self._text[start:end] if end > start else ""

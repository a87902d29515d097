"""A tool call's text -> OpenAI `tool_calls`, whole or as stream deltas: a forced call
(`ToolCallText`), or the calls a model writes in its own format under tool_choice "auto"
(`HermesToolCalls`, below).

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
from collections.abc import Callable, Collection
from dataclasses import dataclass

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


# -- free-form calls (tool_choice "auto"), read by a parser of the model's own format ------------
HERMES = "hermes"
TOOL_CALL_PARSERS = (HERMES,)  # what `--tool-call-parser` accepts
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ParsedText:
    """What one piece of a free-form answer adds: text for `content`, and the calls it closed."""

    content: str
    tool_calls: list[DeltaToolCall]


class HermesToolCalls:
    """The Hermes / Qwen2.5 tool-call format: the answer's text, with each call written as
    `<tool_call>{"name": "<function>", "arguments": {...}}</tool_call>` among it (what Qwen2.5's
    and Hermes' chat templates teach the model, and vLLM's `hermes` parser reads).

    Text outside the blocks is content, sent as it comes except a tail that may be the start of
    `<tool_call>` (held until the next text or the finish tells).  A block is sent as one call
    delta (index, id, type, name and the arguments whole) when its closing tag arrives; a block
    that is not a JSON object with a string `name` stays content, as the model wrote it, and so
    does a block the finish cuts off.  So does a call of a function not among `tool_names`
    (the request's tools): a client runs what comes back as a tool call, so only what it
    offered may come back as one, and the text lets it see what the model wrote (as vLLM's
    parser leaves a block it cannot read); an answer with no other call then finishes "stop"."""

    def __init__(self, new_call_id: Callable[[], str], tool_names: Collection[str]) -> None:
        self._new_call_id = new_call_id
        self._tool_names = frozenset(tool_names)
        self._pending = ""  # text not sent yet: a possible opening tag's start, or an open block
        self._in_block = False
        self.content = ""  # sent as content so far
        self.calls: list[ToolCall] = []

    def feed(self, text: str, finish_reason: str | None) -> ParsedText:
        """The content and the calls `text` completes; at the finish, everything held."""
        self._pending += text
        is_last = finish_reason is not None
        content: list[str] = []
        deltas: list[DeltaToolCall] = []
        while True:
            if not self._in_block:
                at = self._pending.find(_OPEN)
                if at < 0:
                    cut = len(self._pending) - (0 if is_last else _open_tag_tail(self._pending))
                    content.append(self._pending[:cut])
                    self._pending = self._pending[cut:]
                    break
                content.append(self._pending[:at])
                self._pending = self._pending[at + len(_OPEN) :]
                self._in_block = True
                continue
            end = self._pending.find(_CLOSE)
            if end < 0:
                if is_last:  # cut off inside a block: the model's text, as written
                    content.append(_OPEN + self._pending)
                    self._pending, self._in_block = "", False
                break
            block = self._pending[:end]
            self._pending = self._pending[end + len(_CLOSE) :]
            self._in_block = False
            call = self._call_of(block)
            if call is None:
                content.append(_OPEN + block + _CLOSE)
                continue
            function = DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments)
            index = len(self.calls)
            deltas.append(
                DeltaToolCall(index=index, id=call.id, type="function", function=function)
            )
            self.calls.append(call)
        added = "".join(content)
        self.content += added
        return ParsedText(added, deltas)

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """The answer's finish: "tool_calls" when it stopped after writing a call."""
        if finish_reason == "stop" and self.calls:
            return "tool_calls"
        return finish_reason

    def _call_of(self, block: str) -> ToolCall | None:
        try:
            written = json.loads(block)
        except ValueError:
            return None
        name = written.get("name") if isinstance(written, dict) else None
        if not isinstance(name, str) or name not in self._tool_names:
            return None  # not a call, or a call of a function the request did not offer
        arguments = written.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        return ToolCall(
            id=self._new_call_id(),
            function=FunctionCall(name=name, arguments=arguments),
        )


def _open_tag_tail(text: str) -> int:
    """The length of the longest end of `text` that begins `<tool_call>` (0 if none)."""
    for size in range(min(len(text), len(_OPEN) - 1), 0, -1):
        if _OPEN.startswith(text[-size:]):
            return size
    return 0

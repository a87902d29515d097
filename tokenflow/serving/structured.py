"""What a request's output must be: `response_format`, vLLM's constraints, or a forced tool call.

Each becomes one `StructuredOutput` (a JSON Schema, a regular expression or an EBNF grammar the
engine compiles into a token grammar, off the event loop and within `schema_limits`' bounds):

- `response_format: {"type": "json_object"}` or `structured_outputs.json_object`: any JSON
  object;
- `response_format: {"type": "json_schema", "json_schema": {"schema": ...}}`,
  `structured_outputs.json` or `guided_json`: that schema;
- `structured_outputs.regex` or `guided_regex`: text the whole of which matches it;
- `structured_outputs.choice` or `guided_choice`: exactly one of the strings (a grammar of
  their alternatives);
- `structured_outputs.grammar` or `guided_grammar`: an EBNF grammar (start rule `root`);
- `tools` with `tool_choice: "required"` or a named function: one call, written as
  `{"name": "<function>", "arguments": <its parameters>}` (for "required", any of the tools,
  each with its own parameters), which `tool_calls.py` turns into `tool_calls`.

`tool_choice: "auto"` with tools (OpenAI's default when tools are given) leaves the answer free
and needs a parser for the model's own tool-call format: `serve --enable-auto-tool-choice
--tool-call-parser hermes` (vLLM's flags; `tool_calls.HermesToolCalls`), and a chat template
with a tools section to show the model its tools; without either it is a 400 that says which.
`"none"`, or "auto" without tools, is plain chat.
"""

from __future__ import annotations

import json
from typing import Any

from tokenflow.core.request import StructuredOutput
from tokenflow.serving.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    NamedToolChoice,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    ToolCall,
    ToolDefinition,
)
from tokenflow.serving.validation import ApiError, shortened

AUTO_TOOL_FLAGS = "--enable-auto-tool-choice --tool-call-parser hermes"
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


def structured_output_of(
    body: CompletionRequest | ChatCompletionRequest,
) -> StructuredOutput | None:
    """The request's one constraint, or None; a 400 naming the fields when it gives several."""
    found = _constraints(body)
    if len(found) > 1:
        names = ", ".join(spec.origin for spec in found)
        raise ApiError(
            400,
            f"give at most one structured output constraint; this request gives {names}",
            param=found[1].origin.split(".")[0],
        )
    return found[0] if found else None


def _constraints(body: CompletionRequest | ChatCompletionRequest) -> list[StructuredOutput]:
    """Every constraint the request gives, each named by its field."""
    fmt, spec = body.response_format, body.structured_outputs
    found = []
    if isinstance(fmt, ResponseFormatJsonObject):
        found.append(StructuredOutput(json.dumps(_ANY_OBJECT), origin="response_format"))
    if isinstance(fmt, ResponseFormatJsonSchema):
        schema = fmt.json_schema.schema_ or _ANY_OBJECT
        origin = "response_format.json_schema.schema"
        found.append(StructuredOutput(json.dumps(schema), origin=origin))
    if spec is not None:
        found += _vllm_constraints("structured_outputs.", spec.json_, spec.regex, spec.choice)
        found += _vllm_grammar("structured_outputs.grammar", spec.grammar)
        if spec.json_object:
            origin = "structured_outputs.json_object"
            found.append(StructuredOutput(json.dumps(_ANY_OBJECT), origin=origin))
    found += _vllm_constraints("guided_", body.guided_json, body.guided_regex, body.guided_choice)
    return found + _vllm_grammar("guided_grammar", body.guided_grammar)


def _vllm_constraints(
    prefix: str, schema: dict[str, Any] | str | None, regex: str | None, choice: list[str] | None
) -> list[StructuredOutput]:
    """vLLM's json, regex and choice constraints under their field names (`prefix` + name)."""
    found = []
    if schema is not None:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        found.append(StructuredOutput(text, origin=prefix + "json"))
    if regex is not None:
        found.append(StructuredOutput(regex, origin=prefix + "regex", kind="regex"))
    if choice is not None:
        found += _vllm_grammar(prefix + "choice", choice_grammar(choice))
    return found


def _vllm_grammar(origin: str, grammar: str | None) -> list[StructuredOutput]:
    return [] if grammar is None else [StructuredOutput(grammar, origin=origin, kind="grammar")]


def choice_grammar(choices: list[str]) -> str:
    """The EBNF grammar whose texts are exactly `choices` (JSON string literals are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def tool_choice_of(body: ChatCompletionRequest) -> str | NamedToolChoice:
    """The request's tool_choice; when it gives none, OpenAI's (and vLLM's) default: "auto" with
    tools, "none" without."""
    if body.tool_choice is not None:
        return body.tool_choice
    return "auto" if body.tools else "none"


def is_auto_tool_call(
    body: ChatCompletionRequest, tool_call_parser: str | None, template_renders_tools: bool
) -> bool:
    """Whether the answer is free with tools offered (tool_choice "auto" with tools), for the
    server's tool-call parser to read; a 400 when there is no parser or the chat template
    cannot show the model its tools."""
    if tool_choice_of(body) != "auto" or not body.tools:
        return False
    if tool_call_parser is None:
        raise ApiError(
            400,
            'tool_choice="auto" with tools (the default when tools are given) needs a parser '
            f"for the model's tool-call format: start the server with {AUTO_TOOL_FLAGS}, or use "
            'tool_choice="required" or a named function',
            param="tool_choice",
            code="unsupported_parameter",
        )
    if not template_renders_tools:
        raise ApiError(
            400,
            'tool_choice="auto": this model\'s chat template has no tools section, so the '
            'model cannot be shown its tools; use tool_choice="required" or a named function',
            param="tool_choice",
        )
    return True


def forced_tool_call(body: ChatCompletionRequest) -> StructuredOutput | None:
    """The constraint of a forced tool call, or None when the answer is free (plain chat, or
    "auto" for the tool-call parser: `is_auto_tool_call`)."""
    choice, tools = tool_choice_of(body), body.tools or []
    if choice in ("none", "auto"):
        return None
    if not tools:
        raise ApiError(400, f"tool_choice={_shown(choice)} needs tools", param="tool_choice")
    if body.response_format is not None and body.response_format.type != "text":
        raise ApiError(
            400, "response_format cannot be combined with a forced tool call", param="tool_choice"
        )
    if isinstance(choice, NamedToolChoice):
        tools = [_named_tool(tools, choice.function.name)]
    return StructuredOutput(json.dumps(call_schema(tools)), origin="tools")


def call_schema(tools: list[ToolDefinition]) -> dict[str, Any]:
    """The schema of one call to any of `tools`: `{"name": ..., "arguments": ...}`, the name
    first (so a stream can name the call before its arguments come)."""
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.function.name},
                "arguments": tool.function.parameters or _NO_ARGUMENTS,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def check_tool_messages(body: ChatCompletionRequest, template_renders_tools: bool) -> None:
    """Tool results and assistant tool calls in the history need a chat template that renders
    them; otherwise a 400 (the conversation cannot be shown to the model faithfully)."""
    for index, message in enumerate(body.messages):
        if message.role == "tool" or message.tool_calls:
            if not template_renders_tools:
                raise ApiError(
                    400,
                    f"messages[{index}]: this model's chat template has no tools section, so "
                    "tool messages and assistant tool_calls cannot be rendered",
                    param="messages",
                )
            if message.role == "tool" and message.tool_call_id is None:
                raise ApiError(
                    400, f"messages[{index}]: a tool message needs tool_call_id", param="messages"
                )


def template_message(message: ChatMessage) -> dict[str, Any]:
    """One message as chat templates read it: `role` and `content` text, and for tool use
    `tool_calls` (their arguments as objects, as Hugging Face templates expect) and
    `tool_call_id`."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type,
                "function": {"name": call.function.name, "arguments": _arguments(call)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _arguments(call: ToolCall) -> object:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments  # not JSON: the template gets the text


def _named_tool(tools: list[ToolDefinition], name: str) -> ToolDefinition:
    for tool in tools:
        if tool.function.name == name:
            return tool
    names = ", ".join(t.function.name for t in tools)
    raise ApiError(
        400,
        f"tool_choice names the function {shortened(name, 100)!r}, which is not in tools "
        f"({shortened(names)})",
        param="tool_choice",
    )


def _shown(choice: object) -> str:
    if isinstance(choice, NamedToolChoice):
        return f"function {shortened(choice.function.name, 100)!r}"
    return shortened(repr(choice), 100)

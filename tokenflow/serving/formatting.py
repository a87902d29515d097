"""Response bodies and stream chunks of the two endpoints, exactly as OpenAI shapes them.

A stream is one Server-Sent Event per chunk, whose data is the chunk's compact JSON, and a last
event whose data is `DONE` (`[DONE]`); the SSE framing and keep-alives are sse-starlette's (see
`app.py`).  Finish reasons always come from the engine's delta.
"""

from __future__ import annotations

from typing import Protocol

from pydantic import BaseModel

from tokenflow.serving.prepared import PreparedRequest
from tokenflow.serving.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    DeltaMessage,
    UsageInfo,
)
from tokenflow.serving.tool_calls import ToolCallText

DONE = "[DONE]"  # the data of a stream's last event


class ResponseFormat(Protocol):
    """How one endpoint renders its chunks and its full response."""

    def opening_chunks(self, request: PreparedRequest) -> list[BaseModel]:
        """Chunks sent before the first delta's (the chat role chunk)."""
        ...

    def delta_chunk(
        self,
        request: PreparedRequest,
        text: str,
        finish_reason: str | None,
        usage: UsageInfo | None,
    ) -> BaseModel:
        """The chunk of one engine delta (usage only with continuous_usage_stats)."""
        ...

    def usage_chunk(self, request: PreparedRequest, usage: UsageInfo) -> BaseModel:
        """The `stream_options.include_usage` chunk: no choices, only usage."""
        ...

    def response(
        self, request: PreparedRequest, text: str, finish_reason: str | None, usage: UsageInfo
    ) -> CompletionResponse | ChatCompletionResponse:
        """The non-streaming body."""
        ...


class CompletionFormat:
    """/v1/completions: `text_completion` objects whose choices carry `text`."""

    def opening_chunks(self, request: PreparedRequest) -> list[BaseModel]:
        return []

    def delta_chunk(
        self,
        request: PreparedRequest,
        text: str,
        finish_reason: str | None,
        usage: UsageInfo | None,
    ) -> CompletionChunk:
        choice = CompletionChoice(text=text, finish_reason=finish_reason)
        return CompletionChunk(
            id=request.request_id,
            created=request.created_s,
            model=request.model,
            choices=[choice],
            usage=usage,
        )

    def usage_chunk(self, request: PreparedRequest, usage: UsageInfo) -> CompletionChunk:
        return CompletionChunk(
            id=request.request_id,
            created=request.created_s,
            model=request.model,
            choices=[],
            usage=usage,
        )

    def response(
        self, request: PreparedRequest, text: str, finish_reason: str | None, usage: UsageInfo
    ) -> CompletionResponse:
        return CompletionResponse(
            id=request.request_id,
            created=request.created_s,
            model=request.model,
            choices=[CompletionChoice(text=text, finish_reason=finish_reason)],
            usage=usage,
        )


class ChatFormat:
    """/v1/chat/completions: `chat.completion.chunk` deltas; the first one carries the role."""

    def _chunk(
        self, request: PreparedRequest, choices: list[ChatChunkChoice], usage: UsageInfo | None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=request.request_id,
            created=request.created_s,
            model=request.model,
            choices=choices,
            usage=usage,
        )

    def opening_chunks(self, request: PreparedRequest) -> list[BaseModel]:
        delta = DeltaMessage(role="assistant", content="")
        return [self._chunk(request, [ChatChunkChoice(delta=delta, finish_reason=None)], None)]

    def delta_chunk(
        self,
        request: PreparedRequest,
        text: str,
        finish_reason: str | None,
        usage: UsageInfo | None,
    ) -> ChatCompletionChunk:
        # The closing chunk of OpenAI has an empty delta; text and finish may share a chunk.
        has_content = bool(text) or finish_reason is None
        delta = DeltaMessage(content=text) if has_content else DeltaMessage()
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
        return self._chunk(request, [choice], usage)

    def usage_chunk(self, request: PreparedRequest, usage: UsageInfo) -> ChatCompletionChunk:
        return self._chunk(request, [], usage)

    def response(
        self, request: PreparedRequest, text: str, finish_reason: str | None, usage: UsageInfo
    ) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=request.request_id,
            created=request.created_s,
            model=request.model,
            choices=[
                ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)
            ],
            usage=usage,
        )


class ToolCallFormat(ChatFormat):
    """/v1/chat/completions answered by one forced tool call (`tool_calls.py` reads its text):
    its deltas carry `tool_calls`, its message `tool_calls` and no content."""

    def __init__(self, call_id: str) -> None:
        self._call = ToolCallText(call_id)

    def opening_chunks(self, request: PreparedRequest) -> list[BaseModel]:
        delta = DeltaMessage(role="assistant")
        return [self._chunk(request, [ChatChunkChoice(delta=delta, finish_reason=None)], None)]

    def delta_chunk(
        self,
        request: PreparedRequest,
        text: str,
        finish_reason: str | None,
        usage: UsageInfo | None,
    ) -> ChatCompletionChunk:
        delta = DeltaMessage(tool_calls=self._call.feed(text, finish_reason) or None)
        choice = ChatChunkChoice(delta=delta, finish_reason=self._call.finish_reason(finish_reason))
        return self._chunk(request, [choice], usage)

    def response(
        self, request: PreparedRequest, text: str, finish_reason: str | None, usage: UsageInfo
    ) -> ChatCompletionResponse:
        self._call.feed(text, finish_reason)
        call = self._call.call()
        message = (
            AssistantMessage(content=text)
            if call is None
            else AssistantMessage(content=None, tool_calls=[call])
        )
        choice = ChatChoice(message=message, finish_reason=self._call.finish_reason(finish_reason))
        return ChatCompletionResponse(
            id=request.request_id,
            created=request.created_s,
            model=request.model,
            choices=[choice],
            usage=usage,
        )

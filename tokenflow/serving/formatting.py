"""Response bodies and stream chunks of the two endpoints, exactly as OpenAI shapes them.

A stream is one Server-Sent Event per chunk, whose data is the chunk's compact JSON, and a last
event whose data is `DONE` (`[DONE]`); the SSE framing and keep-alives are sse-starlette's (see
`app.py`).  Each chunk carries one choice, named by its `index`.  Finish reasons always come
from the engine's delta.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Protocol

from pydantic import BaseModel

from tokenflow.serving.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from tokenflow.serving.prepared import Piece, PreparedRequest
from tokenflow.serving.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    UsageInfo,
)
from tokenflow.serving.tool_calls import HermesToolCalls, ToolCallText

DONE = "[DONE]"  # the data of a stream's last event


class ResponseFormat(Protocol):
    """How one endpoint renders its chunks and its full response."""

    def opening_chunks(self, request: PreparedRequest, index: int) -> list[BaseModel]:
        """Chunks sent before choice `index`'s first delta's (the chat role chunk)."""
        ...

    def delta_chunk(
        self, request: PreparedRequest, index: int, piece: Piece, usage: UsageInfo | None
    ) -> BaseModel:
        """The chunk of one engine delta (usage only with continuous_usage_stats)."""
        ...

    def usage_chunk(self, request: PreparedRequest, usage: UsageInfo) -> BaseModel:
        """The `stream_options.include_usage` chunk: no choices, only usage."""
        ...

    def response(
        self, request: PreparedRequest, pieces: list[Piece], usage: UsageInfo
    ) -> CompletionResponse | ChatCompletionResponse:
        """The non-streaming body: one piece per choice, in index order."""
        ...


class CompletionFormat:
    """/v1/completions: `text_completion` objects whose choices carry `text`."""

    def __init__(self, texts: TokenTexts) -> None:
        self._texts = texts

    def _logprobs(self, piece: Piece) -> CompletionLogprobs | None:
        if piece.tokens is None:
            return None
        return completion_logprobs(piece.tokens, self._texts, piece.text_offset)

    def _choice(self, index: int, piece: Piece) -> CompletionChoice:
        return CompletionChoice(
            index=index,
            text=piece.text,
            logprobs=self._logprobs(piece),
            finish_reason=piece.finish_reason,
        )

    def opening_chunks(self, request: PreparedRequest, index: int) -> list[BaseModel]:
        return []

    def delta_chunk(
        self, request: PreparedRequest, index: int, piece: Piece, usage: UsageInfo | None
    ) -> CompletionChunk:
        return CompletionChunk(
            id=request.request_id,
            created=request.created_s,
            model=request.model,
            choices=[self._choice(index, piece)],
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
        self, request: PreparedRequest, pieces: list[Piece], usage: UsageInfo
    ) -> CompletionResponse:
        return CompletionResponse(
            id=request.request_id,
            created=request.created_s,
            model=request.model,
            choices=[self._choice(i, piece) for i, piece in enumerate(pieces)],
            usage=usage,
        )


class ChatFormat:
    """/v1/chat/completions: `chat.completion.chunk` deltas; a choice's first carries the role.
    The formats of tool calls below change only a choice's delta and message."""

    def __init__(self, texts: TokenTexts) -> None:
        self._texts = texts

    def _logprobs(self, piece: Piece) -> ChatLogprobs | None:
        return None if piece.tokens is None else chat_logprobs(piece.tokens, self._texts)

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

    def _choice_chunk(
        self,
        request: PreparedRequest,
        index: int,
        piece: Piece,
        delta: DeltaMessage,
        finish_reason: str | None,
        usage: UsageInfo | None,
    ) -> ChatCompletionChunk:
        choice = ChatChunkChoice(
            index=index, delta=delta, logprobs=self._logprobs(piece), finish_reason=finish_reason
        )
        return self._chunk(request, [choice], usage)

    def opening_chunks(self, request: PreparedRequest, index: int) -> list[BaseModel]:
        delta = DeltaMessage(role="assistant", content="")
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=None)
        return [self._chunk(request, [choice], None)]

    def delta_chunk(
        self, request: PreparedRequest, index: int, piece: Piece, usage: UsageInfo | None
    ) -> ChatCompletionChunk:
        # The closing chunk of OpenAI has an empty delta; text and finish may share a chunk.
        has_content = bool(piece.text) or piece.finish_reason is None
        delta = DeltaMessage(content=piece.text) if has_content else DeltaMessage()
        return self._choice_chunk(request, index, piece, delta, piece.finish_reason, usage)

    def usage_chunk(self, request: PreparedRequest, usage: UsageInfo) -> ChatCompletionChunk:
        return self._chunk(request, [], usage)

    def _message(self, index: int, piece: Piece) -> tuple[AssistantMessage, str | None]:
        """Choice `index`'s whole message and finish reason (the non-streaming answer)."""
        return AssistantMessage(content=piece.text), piece.finish_reason

    def response(
        self, request: PreparedRequest, pieces: list[Piece], usage: UsageInfo
    ) -> ChatCompletionResponse:
        choices = []
        for index, piece in enumerate(pieces):
            message, finish_reason = self._message(index, piece)
            logprobs = self._logprobs(piece)
            choices.append(
                ChatChoice(
                    index=index, message=message, logprobs=logprobs, finish_reason=finish_reason
                )
            )
        return ChatCompletionResponse(
            id=request.request_id,
            created=request.created_s,
            model=request.model,
            choices=choices,
            usage=usage,
        )


class ToolCallFormat(ChatFormat):
    """/v1/chat/completions answered by one forced tool call per choice (`tool_calls.py` reads
    its text): its deltas carry `tool_calls`, its message `tool_calls` and no content."""

    def __init__(self, texts: TokenTexts, new_call_id: Callable[[], str]) -> None:
        super().__init__(texts)
        self._new_call_id = new_call_id
        self._calls: dict[int, ToolCallText] = {}  # by choice index

    def _call(self, index: int) -> ToolCallText:
        if index not in self._calls:
            self._calls[index] = ToolCallText(self._new_call_id())
        return self._calls[index]

    def opening_chunks(self, request: PreparedRequest, index: int) -> list[BaseModel]:
        choice = ChatChunkChoice(
            index=index, delta=DeltaMessage(role="assistant"), finish_reason=None
        )
        return [self._chunk(request, [choice], None)]

    def delta_chunk(
        self, request: PreparedRequest, index: int, piece: Piece, usage: UsageInfo | None
    ) -> ChatCompletionChunk:
        call = self._call(index)
        delta = DeltaMessage(tool_calls=call.feed(piece.text, piece.finish_reason) or None)
        finish_reason = call.finish_reason(piece.finish_reason)
        return self._choice_chunk(request, index, piece, delta, finish_reason, usage)

    def _message(self, index: int, piece: Piece) -> tuple[AssistantMessage, str | None]:
        text = self._call(index)
        text.feed(piece.text, piece.finish_reason)
        call = text.call()
        message = (
            AssistantMessage(content=piece.text)
            if call is None
            else AssistantMessage(content=None, tool_calls=[call])
        )
        return message, text.finish_reason(piece.finish_reason)


class AutoToolCallFormat(ChatFormat):
    """/v1/chat/completions under tool_choice "auto" with a tool-call parser: each choice's text
    is read by its parser (`tool_calls.HermesToolCalls`), so its deltas carry `content` and, as
    each call closes, `tool_calls`; its message both (content None when only whitespace is left
    beside the calls)."""

    def __init__(
        self, texts: TokenTexts, new_call_id: Callable[[], str], tool_names: Collection[str]
    ) -> None:
        super().__init__(texts)
        self._new_call_id = new_call_id
        self._tool_names = tool_names  # the request's tools: a call of another stays text
        self._parsers: dict[int, HermesToolCalls] = {}  # by choice index

    def _parser(self, index: int) -> HermesToolCalls:
        if index not in self._parsers:
            self._parsers[index] = HermesToolCalls(self._new_call_id, self._tool_names)
        return self._parsers[index]

    def delta_chunk(
        self, request: PreparedRequest, index: int, piece: Piece, usage: UsageInfo | None
    ) -> ChatCompletionChunk:
        parser = self._parser(index)
        parsed = parser.feed(piece.text, piece.finish_reason)
        # As ChatFormat: text and finish may share a chunk; the closing chunk's delta is empty.
        has_content = bool(parsed.content) or (
            piece.finish_reason is None and not parsed.tool_calls
        )
        delta = DeltaMessage(
            content=parsed.content if has_content else None, tool_calls=parsed.tool_calls or None
        )
        finish_reason = parser.finish_reason(piece.finish_reason)
        return self._choice_chunk(request, index, piece, delta, finish_reason, usage)

    def _message(self, index: int, piece: Piece) -> tuple[AssistantMessage, str | None]:
        parser = self._parser(index)
        parser.feed(piece.text, piece.finish_reason)
        content: str | None = parser.content
        if parser.calls and not parser.content.strip():
            content = None
        message = AssistantMessage(content=content, tool_calls=parser.calls or None)
        return message, parser.finish_reason(piece.finish_reason)

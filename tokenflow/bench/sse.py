"""Incremental Server-Sent Events parser: bytes in (split anywhere), events out.

Follows the WHATWG event-stream rules that matter for LLM streams: lines end in LF, CRLF or a
lone CR; a blank line dispatches the event; `:` starts a comment (keep-alive); `data` lines of
one event are joined by LF; one space after the colon is dropped; an event without data is not
dispatched; an unterminated event at the end of the stream is discarded.

Bytes are split into lines before decoding, so a multi-byte UTF-8 character cut across network
reads is never mangled.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SSEEvent:
    """One dispatched event."""

    data: str
    event: str = "message"
    event_id: str | None = None


class SSEParser:
    """Feed it network reads with `feed()`; it returns the events those bytes completed."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._data_lines: list[str] = []
        self._event = ""
        self._event_id: str | None = None
        self._has_bom_check = False

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Consume `chunk` and return every event completed by it, in order."""
        self._buffer += chunk
        if not self._has_bom_check:
            if len(self._buffer) < 3 and b"\xef\xbb\xbf".startswith(bytes(self._buffer)):
                return []  # maybe a BOM still arriving
            if self._buffer.startswith(b"\xef\xbb\xbf"):
                del self._buffer[:3]
            self._has_bom_check = True
        events: list[SSEEvent] = []
        for line in self._complete_lines():
            event = self._process_line(line)
            if event is not None:
                events.append(event)
        return events

    def _complete_lines(self) -> list[bytes]:
        """Pop every terminated line from the buffer (terminator removed).

        A CR as the last buffered byte might be the first half of CRLF, so it waits for the next
        byte before its line is released.
        """
        lines: list[bytes] = []
        start = 0
        buffer = self._buffer
        size = len(buffer)
        index = 0
        while index < size:
            byte = buffer[index]
            if byte == 0x0A:  # LF
                lines.append(bytes(buffer[start:index]))
                start = index = index + 1
            elif byte == 0x0D:  # CR, alone or as CRLF
                if index + 1 == size:
                    break
                lines.append(bytes(buffer[start:index]))
                index += 2 if buffer[index + 1] == 0x0A else 1
                start = index
            else:
                index += 1
        del buffer[:start]
        return lines

    def _process_line(self, raw: bytes) -> SSEEvent | None:
        line = raw.decode("utf-8", errors="replace")
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None  # comment / keep-alive
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data_lines.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._event_id = value
        # "retry" and unknown fields are ignored.
        return None

    def _dispatch(self) -> SSEEvent | None:
        data_lines, event = self._data_lines, self._event
        self._data_lines, self._event = [], ""
        if not data_lines:
            return None
        return SSEEvent(
            data="\n".join(data_lines), event=event or "message", event_id=self._event_id
        )

    def close(self) -> list[SSEEvent]:
        """End of stream: returns an event completed by a final lone CR; an event without its
        blank line is discarded (the spec's rule)."""
        events: list[SSEEvent] = []
        if self._buffer.endswith(b"\r"):
            event = self._process_line(bytes(self._buffer[:-1]))
            if event is not None:
                events.append(event)
        self._buffer.clear()
        self._data_lines, self._event = [], ""
        return events

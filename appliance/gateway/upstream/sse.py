"""Server-sent events as vLLM writes them: framing a byte stream into whole events, and writing one.

The relay works on whole events whenever a hook must read or rewrite them (hidden usage, migration): an event can
be split across two reads, and a rewrite must never cut one in half.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

DONE = b"data: [DONE]\n\n"


class SSEEvents:
    """Splits an upstream byte stream into whole server-sent events (``data: ...\n\n``)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        """Each whole event the buffer now holds, one at a time."""
        self._buffer += chunk
        while (end := self._buffer.find(b"\n\n")) >= 0:
            event, self._buffer = self._buffer[:end + 2], self._buffer[end + 2:]
            yield event

    def feed_block(self, chunk: bytes) -> bytes:
        """Every whole event the buffer now holds, as one block: one search from the end instead of a slice per
        event, for a relay that needs whole events but not one at a time."""
        buffer = self._buffer + chunk
        end = buffer.rfind(b"\n\n")
        if end < 0:
            self._buffer = buffer
            return b""
        self._buffer = buffer[end + 2:]
        return buffer[:end + 2]

    @property
    def pending(self) -> bytes:
        """An incomplete event the stream ended on."""
        return self._buffer


def split_events(data: bytes) -> Iterator[bytes]:
    """Whole events (``...\n\n``) of bytes made of whole events."""
    start = 0
    while (end := data.find(b"\n\n", start)) >= 0:
        yield data[start:end + 2]
        start = end + 2
    if start < len(data):
        yield data[start:]


def payload(event: bytes) -> bytes | None:
    """The data of one event (its ``data:`` lines joined); None for a comment or an empty event."""
    lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def sse(obj: dict[str, Any]) -> bytes:
    """One event as vLLM writes it: compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"

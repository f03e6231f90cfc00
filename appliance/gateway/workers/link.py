"""The connection between the decider and one worker: length-prefixed msgpack frames over a Unix socket.

Writes are gathered: every frame sent during one turn of the event loop goes out in one write when the turn ends,
so a worker relaying many streams pays one system call for all the releases and charges of that moment, not one
each. Questions carry a number; ``ask`` waits for the answer with that number, ``send`` waits for nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

FRAME = struct.Struct("!I")
MAX_FRAME_BYTES = 64 * 1024 * 1024  # a prompt the intake let through fits; a length past this is a broken peer


class LinkClosed(ConnectionError):
    """The other side went away (or sent something that is not a frame)."""


class Link:
    """One side of the connection. ``decoder``: what this side receives (``messages.to_decider`` or
    ``to_worker``)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 decoder: msgspec.msgpack.Decoder[Any]) -> None:
        self._reader = reader
        self._writer = writer
        self._decoder = decoder
        self._encoder = msgspec.msgpack.Encoder()
        self._pending: list[bytes] = []
        self._asked: dict[int, asyncio.Future[Any]] = {}
        self._numbers = itertools.count(1)
        self._loop = asyncio.get_running_loop()  # the link's own: a send from another thread is handed to it
        self._thread = threading.get_ident()
        self.closed = False

    def number(self) -> int:
        """A number for the next question."""
        return next(self._numbers)

    def send(self, message: msgspec.Struct) -> None:
        """Queue ``message``; it goes out with the others of this turn of the loop. Dropped once closed. From
        another thread (a reload applied in a worker thread), handed to the link's loop."""
        if threading.get_ident() != self._thread:
            self._loop.call_soon_threadsafe(self.send, message)
            return
        if self.closed:
            return
        payload = self._encoder.encode(message)
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending += (FRAME.pack(len(payload)), payload)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self.closed:
            self._writer.write(b"".join(pending))

    async def ask(self, message: Any, *, unwanted: Callable[[Any], None]) -> Any:
        """Send a question (a struct with an ``id`` from ``number()``) and wait for its answer. Raises
        ``LinkClosed`` when the link closes first. ``unwanted``: what to do with an answer that came as the asker
        was cancelled (a slot to give back); an answer that comes later still reaches ``answered`` as not
        awaited, and its receiver does the same."""
        if self.closed:
            raise LinkClosed("the decider's link is closed")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._asked[message.id] = future
        try:
            self.send(message)
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                unwanted(future.result())
            raise
        finally:
            self._asked.pop(message.id, None)

    def answered(self, answer: Any) -> bool:
        """Hand an answer to the question that waits for it; False if it is not an answer to a question asked
        here (or its asker stopped waiting)."""
        future = self._asked.get(getattr(answer, "id", -1))
        if future is None or future.done():
            return False
        future.set_result(answer)
        return True

    async def messages(self) -> AsyncIterator[Any]:
        """Every message received, in order, until the other side closes; then every question still waiting gets
        ``LinkClosed``."""
        try:
            while True:
                try:
                    head = await self._reader.readexactly(FRAME.size)
                    size = FRAME.unpack(head)[0]
                    if size > MAX_FRAME_BYTES:
                        raise LinkClosed(f"a frame of {size} bytes")
                    payload = await self._reader.readexactly(size)
                except (asyncio.IncompleteReadError, ConnectionError) as exc:
                    raise LinkClosed(str(exc)) from None
                try:
                    message = self._decoder.decode(payload)
                except msgspec.DecodeError as exc:
                    raise LinkClosed(f"an undecodable frame: {exc}") from None
                yield message
        except LinkClosed:
            return
        finally:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self._flush()
        self.closed = True
        for future in self._asked.values():
            if not future.done():
                future.set_exception(LinkClosed("the link closed before the answer came"))
        self._writer.close()

    async def drain(self) -> None:
        """Wait until what was sent has left (before closing on purpose)."""
        self._flush()
        if not self.closed:
            await self._writer.drain()

"""The client's side of an exchange: a streamed answer that owns its exchange once the transport hands it over, and
the watch that stops work nobody will read when the client hangs up."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from appliance.gateway.intake.connections import SERVER_SEND
from appliance.gateway.upstream.exchange import Exchange

T = TypeVar("T")


class RelayedStream(StreamingResponse):
    """A streamed answer that owns its exchange's lease and upstream connection once ``forward`` hands it over, and
    settles them when it has been served, however that ended: the relay settles them itself when it ran; a body
    that was never iterated (the client left before the first byte) or a relay left suspended at a ``yield``
    (closed here, so its own cleanup runs now, not whenever the garbage collector gets to it) is settled here."""

    def __init__(self, content: AsyncIterator[bytes], exchange: Exchange, *,
                 on_served: Callable[[Exchange], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.exchange = exchange
        self._on_served = on_served
        self._body_send: Send | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._body_send = scope.get(SERVER_SEND)
        try:
            await self._stream_until_disconnect(receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                self._on_served(self.exchange)  # settles and counts it, unless the relay did

    async def _stream_until_disconnect(self, receive: Receive, send: Send) -> None:
        """Starlette's ``StreamingResponse.__call__`` for uvicorn (ASGI spec < 2.4, whose ``send`` drops what a gone
        client is sent without a word): stream, and stop as soon as the client disconnects, so that the relay
        closes the upstream connection and the engine aborts the request. Starlette runs the two in an anyio task
        group (a cancel scope, a second task, a task repr per cancel), which cost every stream more CPU than the
        relay of its first token, on the path of every other request's first token too. Here the
        stream runs in this task and one plain watcher task cancels it when the client leaves."""
        streaming = asyncio.current_task()
        assert streaming is not None
        done = left = False

        async def watch() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":
                pass
            if not done:
                left = True
                streaming.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not left or streaming.uncancel() > 0:  # not (only) the watcher's cancel: someone else's
                raise
        finally:
            done = True
            watcher.cancel()


    async def stream_response(self, send: Send) -> None:
        """Starlette's, with the body's chunks sent by the server's own ``send`` where the intake left it in the
        scope: the start goes through every middleware (each wraps ``send`` to see the response start), the
        chunks skip the wrappers, whose one check would cost each chunk a coroutine per layer."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body_send = self._body_send or send
        async for chunk in self.body_iterator:
            await body_send({"type": "http.response.body", "body": chunk, "more_body": True})
        await body_send({"type": "http.response.body", "body": b"", "more_body": False})


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def unless_client_leaves(work: Awaitable[T], receive: Receive) -> T:
    """Run ``work`` (queue wait, upstream request, non-streaming body) while watching the client; if it hangs up
    first, cancel the work and raise ClientGone. Cancelling closes the upstream connection, which makes vLLM abort
    the request, and takes a queued request out of the queue, so work nobody will read is neither done nor
    dispatched. Once a stream starts, Starlette's response notices the disconnect instead.

    The request body is already read, so the only ASGI message that can arrive now is the disconnect.

    The work runs in the caller's task and the watcher cancels it: no task of its own for the work and no
    ``asyncio.wait`` (a request's path to its first token is short; each task and wait on it costs the first token
    of every request queued behind it on the event loop)."""
    task = asyncio.current_task()
    assert task is not None
    done = left = False

    async def watch() -> None:
        nonlocal left
        await receive()
        if not done:  # the work is still running (it cannot have finished: it would have set done)
            left = True
            task.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if left and task.uncancel() == 0:  # only the watcher's cancel: the client left, the work is cancelled
            raise ClientGone from None
        raise  # this handler itself was cancelled
    finally:
        done = True
        watcher.cancel()



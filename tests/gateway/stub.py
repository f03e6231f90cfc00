"""A stub OpenAI upstream for unit tests of the gateway's own logic (routing, errors, streaming relay).

It is never what a test claims to verify about serving: those tests run against real vLLM engines.
"""

from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web


class StubUpstream:
    """An aiohttp server in its own thread; records what it received; can be told to delay or fail."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.received: list[dict] = []
        self.headers: list[dict] = []
        self.delay = 0.0
        self.fail_status: int | None = None
        self.chunks = 3
        self.stall = 0.0  # streams: silence after the first chunk, like a hung engine
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self.port = port
        self.aborted = 0  # requests whose client (the gateway) hung up before the answer was complete
        self.answered = 0  # non-streaming requests answered in full
        self.reset_next = 0  # the next N requests: their connection is closed unanswered (a stale keep-alive)

    def start(self) -> StubUpstream:
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), daemon=True).start()
        ready.wait(10)
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        if not self._loop.is_running():
            return

        async def shutdown() -> None:
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        while self._loop.is_running():
            threading.Event().wait(0.01)

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_get("/health", lambda _r: web.Response(text="ok"))
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, self.host, self.port)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        ready.set()
        self._loop.run_forever()

    async def _wait_unless_abandoned(self, request: web.Request) -> bool:
        """Sleep ``delay`` like an engine generating; False as soon as the client's connection is gone (vLLM
        aborts such a request)."""
        deadline = self._loop.time() + self.delay
        while self._loop.time() < deadline:
            if request.transport is None or request.transport.is_closing():
                return False
            await asyncio.sleep(min(0.02, max(0.0, deadline - self._loop.time())))
        return not (request.transport is None or request.transport.is_closing())

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        self.received.append({"raw": raw, "body": body})
        self.headers.append(dict(request.headers))
        if self.reset_next > 0:
            self.reset_next -= 1
            assert request.transport is not None
            request.transport.abort()  # no status line: the client sees the connection dropped
            return web.Response()
        if self.fail_status:
            return web.json_response({"error": {"message": "stub failure"}}, status=self.fail_status)
        if not body.get("stream"):
            if not await self._wait_unless_abandoned(request):
                self.aborted += 1
                return web.Response(status=499)
            self.answered += 1
            return web.json_response({"object": "text_completion", "choices": [{"text": "hello"}]})
        await asyncio.sleep(self.delay)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i in range(self.chunks):
                await response.write(f"data: {json.dumps({'choices': [{'text': str(i)}]})}\n\n".encode())
                await asyncio.sleep(self.stall if i == 0 and self.stall else self.delay)
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.aborted += 1
            raise
        return response

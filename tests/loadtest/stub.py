"""A stub OpenAI-compatible streaming server with scripted timing, for the load tester's own tests.

It streams like vLLM (``data: {...}`` events, ``data: [DONE]``, a usage chunk when asked) with delays the test
controls: time to first token, time between chunks, a latency that grows with requests in flight (a known
capacity knee), a one-off stall of the whole server, injected errors. It runs on 127.0.0.1 in its own
thread and event loop, so the client under test measures real sockets and real time.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import ClientConnectionResetError, web


@dataclass
class StubServer:
    model: str = "stub"
    ttft_s: float = 0.01
    itl_s: float = 0.002
    chunks: int | None = None  # default: the request's max_tokens
    ttft_fn: Callable[[int], float] | None = None  # in-flight count at arrival -> TTFT
    stall_at: int | None = None  # the request with this arrival number holds the whole server...
    stall_s: float = 0.0  # ...for this long
    fail_every: int | None = None  # every n-th request answers 500
    tokenize: bool = False
    raw_stream: bytes | None = None  # when set, every completion streams exactly these bytes
    memory_fn: Callable[[float], float] | None = None  # seconds since start -> bytes
    kv_fn: Callable[[float], float] | None = None
    received: list[dict] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    port: int = 0
    inflight: int = 0
    max_inflight: int = 0

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._gate: asyncio.Lock | None = None
        self._started = time.monotonic()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> StubServer:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("stub server did not start")
        return self

    def stop(self) -> None:
        async def shutdown() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._gate = asyncio.Lock()
        app = web.Application()
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/metrics", self._metrics)
        # Like vLLM, abort a request whose client went away (cancelled cool-down requests must not linger).
        self._runner = web.AppRunner(app, handler_cancellation=True)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        ready.set()
        self._loop.run_forever()

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        if not self.tokenize:
            return web.json_response({"error": {"message": "not found"}}, status=404)
        body = await request.json()
        count = 1 + len(body["prompt"].split())  # a BOS token plus one per word
        return web.json_response({"count": count, "max_model_len": 4096, "tokens": list(range(count))})

    async def _metrics(self, _request: web.Request) -> web.Response:
        t = time.monotonic() - self._started
        lines = ["# TYPE process_resident_memory_bytes gauge",
                 f"process_resident_memory_bytes {self.memory_fn(t) if self.memory_fn else 1e9}",
                 "# TYPE vllm:kv_cache_usage_perc gauge",
                 f'vllm:kv_cache_usage_perc{{engine="0"}} {self.kv_fn(t) if self.kv_fn else 0.2}',
                 "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running {self.inflight}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.arrivals.append(time.monotonic())
        number = len(self.received)
        if self.fail_every and number % self.fail_every == 0:
            return web.json_response({"error": {"message": "injected failure", "type": "server_error"}}, status=500)
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            return await self._stream(request, body, number)
        except (ConnectionResetError, ClientConnectionResetError):  # the client cancelled (cool-down requests)
            return web.Response(status=499)
        finally:
            self.inflight -= 1

    async def _stream(self, request: web.Request, body: dict, number: int) -> web.StreamResponse:
        if self.raw_stream is not None:
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(self.raw_stream)
            return resp
        ttft = self.ttft_fn(self.inflight) if self.ttft_fn else self.ttft_s
        if self.stall_at is not None and number == self.stall_at:
            async with self._gate:
                await asyncio.sleep(self.stall_s)
        else:
            async with self._gate:  # waits while a stall holds the server
                pass
        chat = request.path.endswith("/chat/completions")
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        if chat:  # vLLM's first chat chunk carries the role only: not a token
            await self._event(resp, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        n = self.chunks if self.chunks is not None else int(body.get("max_tokens", 16))
        await asyncio.sleep(ttft)
        for i in range(n):
            if i:
                await asyncio.sleep(self.itl_s)
            piece = {"index": 0, "delta": {"content": f" t{i}"}} if chat else {"index": 0, "text": f" t{i}"}
            await self._event(resp, {"choices": [piece]})
        if (body.get("stream_options") or {}).get("include_usage"):
            prompt = body.get("prompt") or " ".join(m["content"] for m in body.get("messages", []))
            usage = {"prompt_tokens": 1 + len(prompt.split()), "completion_tokens": n,
                     "total_tokens": 1 + len(prompt.split()) + n}
            await self._event(resp, {"choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        return resp

    @staticmethod
    async def _event(resp: web.StreamResponse, data: dict) -> None:
        await resp.write(f"data: {json.dumps(data)}\n\n".encode())

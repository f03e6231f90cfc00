"""A fake engine that speaks vLLM's streaming protocol with ``return_token_ids``, for unit tests of the gateway's
stream migration (its own bookkeeping: which tokens were sent, how a continuation is built and rewritten).

Its "model" is greedy and a pure function of the context (the last tokens of prompt + output), like a greedy
engine: a continuation from the right token ids must produce exactly what an undisturbed run produces, and any
off-by-one in what the gateway thinks was sent shows up as different text. Tests tell it to die after a number of
tokens in several ways (reset, a clean close before [DONE], a 5xx error event, silence). What the gateway claims
about real engines is tested against vLLM in tests/integration/test_migration.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web

VOCAB = 997


def tokenize(text: str) -> list[int]:
    return [ord(c) % VOCAB for c in text]


def render_chat(messages: list[dict]) -> list[int]:
    return tokenize("".join(f"<{m['role']}>{m.get('content') or ''}\n" for m in messages) + "<assistant>")


def next_token(context: list[int]) -> int:
    a, b, c = ([0, 0, 0] + context)[-3:]
    return (a * 31 + b * 17 + c * 7 + len(context)) % VOCAB


def detok(token: int) -> str:
    return f" w{token}"


def greedy(prompt: list[int], count: int) -> list[int]:
    context = list(prompt)
    out = []
    for _ in range(count):
        token = next_token(context)
        context.append(token)
        out.append(token)
    return out


@dataclass
class Failure:
    """Die after ``after`` tokens of the next stream: ``how`` is reset | eof | error | stall | abort (the last
    token's chunk finishes with "abort", then [DONE]; ``after`` >= 1) | refuse (hang up before any answer)."""

    after: int
    how: str = "reset"


@dataclass
class TokenEngine:
    host: str = "127.0.0.1"
    port: int = 0
    delay: float = 0.0  # seconds per token
    failures: list[Failure] = field(default_factory=list)  # one is used per stream, in order
    received: list[tuple[str, dict]] = field(default_factory=list)
    streams_done: int = 0

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None

    def start(self) -> TokenEngine:
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
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        while self._loop.is_running():
            time.sleep(0.01)

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/health", lambda _r: web.Response(text="ok"))
        app.router.add_get("/metrics", lambda _r: web.Response(text="vllm:num_requests_running 0\n"))
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, self.host, self.port)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        ready.set()
        self._loop.run_forever()

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(("/v1/completions", body))
        prompt = body["prompt"]
        ids = list(prompt) if isinstance(prompt, list) else tokenize(prompt)
        limit = body.get("max_tokens") or 16
        return await self._answer(request, body, ids, limit, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(("/v1/chat/completions", body))
        ids = render_chat(body["messages"])
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or 1024 - len(ids)
        return await self._answer(request, body, ids, limit, chat=True)

    async def _answer(self, request: web.Request, body: dict, prompt: list[int], limit: int, *, chat: bool
                      ) -> web.StreamResponse:
        tokens = greedy(prompt, limit)
        with_ids = bool(body.get("return_token_ids"))
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{len(self.received)}-{self.port}", int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": body.get("model") or "demo"}
        failure = self.failures.pop(0) if self.failures else None
        if failure is not None and failure.how == "refuse":  # hangs up before answering (a stale connection)
            request.transport.abort()
            return web.Response(status=499)
        if not body.get("stream"):
            if failure is not None:  # headers, then the body breaks off
                response = web.StreamResponse(headers={"content-type": "application/json",
                                                       "content-length": "4096"})
                await response.prepare(request)
                await response.write(b'{"id": "')
                request.transport.abort()
                return response
            text = "".join(detok(t) for t in tokens)
            choice = {"index": 0, "finish_reason": "length"}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return web.json_response({**head, "object": "chat.completion" if chat else "text_completion",
                                      "choices": [choice], "usage": usage(prompt, tokens)})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        async def send(obj) -> None:
            await response.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        if chat:
            await send({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}],
                        **({"prompt_token_ids": prompt} if with_ids else {})})
        for i, token in enumerate(tokens):
            if failure is not None and i == failure.after:
                return await self._fail(request, response, failure)
            last = i == len(tokens) - 1
            aborted = failure is not None and failure.how == "abort" and i == failure.after - 1
            choice = {"index": 0, "logprobs": None, "finish_reason": "abort" if aborted else
                      "length" if last else None}
            choice.update({"delta": {"content": detok(token)}} if chat else {"text": detok(token)})
            if with_ids:
                choice["token_ids"] = [token]
                if not chat and i == 0:
                    choice["prompt_token_ids"] = prompt
            await send({**head, "choices": [choice]})
            if aborted:  # vLLM aborting a request it was running (its shutdown): a last chunk, then [DONE]
                await response.write(b"data: [DONE]\n\n")
                return response
            if self.delay:
                await asyncio.sleep(self.delay)
        if failure is not None and failure.after >= len(tokens):
            return await self._fail(request, response, failure)
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({**head, "choices": [], "usage": usage(prompt, tokens)})
        await response.write(b"data: [DONE]\n\n")
        self.streams_done += 1
        return response

    async def _fail(self, request: web.Request, response: web.StreamResponse, failure: Failure
                    ) -> web.StreamResponse:
        await asyncio.sleep(0.1)  # what was written reaches the gateway first, as with an engine that dies later
        if failure.how == "reset":
            request.transport.abort()
        elif failure.how == "error":
            await response.write(b'data: {"error": {"message": "EngineCore died", "type": "InternalServerError", '
                                 b'"param": null, "code": 500}}\n\ndata: [DONE]\n\n')
            await response.write_eof()
        elif failure.how == "stall":  # silent until the gateway gives up and hangs up
            for _ in range(600):
                if request.transport is None or request.transport.is_closing():
                    break
                await asyncio.sleep(0.05)
        else:  # eof: a clean end of the HTTP body, no [DONE]
            await response.write_eof()
        return response


def usage(prompt: list[int], tokens: list[int]) -> dict:
    return {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
            "total_tokens": len(prompt) + len(tokens)}

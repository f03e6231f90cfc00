# ruff: noqa: E402  (sys.path is mended before the imports: see below)
"""A fake vLLM engine: vLLM 0.32's OpenAI-compatible server as a client sees it, without a model or a GPU.

The gateway's own logic (relay, retries, migration, tenant accounting, admission, maintenance), the load tester and
the benches need an engine that behaves like vLLM on the wire and can be told to be slow, to hang or to die at a
chosen moment. Real engines take minutes to start and cannot be told when to fail; those tests run against them in
tests/integration. This module is the one stand-in for everything else, so that what "like vLLM" means is decided
in one place.

What it models:

- The wire format, byte for byte as vLLM 0.32's stream generators write it (read off
  ``vllm/entrypoints/openai/{completion,chat_completion}/serving.py``; tests/test_fake_engine.py compares the bytes
  with those of vLLM's own pydantic models wherever vLLM is installed): compact JSON,
  one ``data: {...}\\n\\n`` event per token, the fields vLLM sets explicitly even when null (``stop_reason``,
  ``prompt_token_ids``/``token_ids`` on completion chunks, ``prompt_token_ids``/``prompt_text`` on chat's first,
  role-only chunk), ``token_ids`` (and the prompt's ids on the first chunk) when ``return_token_ids`` is set,
  ``system_fingerprint`` on the finishing chunk when no usage follows and on the final usage event
  (``"choices":[]``) when ``stream_options.include_usage`` asks for one, usage in every chunk with
  ``continuous_usage_stats``, ``data: [DONE]\\n\\n`` last, an engine failure as ``data: {"error": {...}}`` (vLLM
  writes that one with ``json.dumps``' default separators) followed by ``[DONE]``, and whole (non-streamed)
  answers as FastAPI's ``JSONResponse(model.model_dump())`` writes them.
- A model: ``GreedyModel`` by default, greedy and a pure function of the context, so a continuation from the right
  token ids gives exactly what an undisturbed answer gives (any off-by-one in what the gateway believes was sent
  shows as different text); ``CountingModel`` for tests that want to read the answer (" t0", " t1", ...).
- Time: a stream's headers at once (vLLM's StreamingResponse), its first token (chat: the role chunk with it) after
  ``first_token_delay`` (a number, or a function of the requests in flight: a load knee), then one token every
  ``token_delay``; a whole answer after the time all its tokens take. A hung engine (``stall_seconds`` of silence
  after ``stall_after`` tokens, every stream), an engine that freezes as a whole (``freeze_at``), one whose
  ``/health`` is slow or failing, one that runs at most ``max_num_seqs`` requests and queues the rest
  (``vllm:num_requests_waiting``).
- Failure: per stream, in order (``failures``, a list that several engines may share): a reset, a clean end
  without ``[DONE]``, a 5xx error event, silence, an ``abort`` finish, a connection dropped unanswered; per request:
  an error status (``fail_status``, ``fail_every``); per input (``poisons``): an input vLLM raises on, answered 500
  whole, or streamed up to a 5xx error event, on every engine and in every continuation of it.
- vLLM's side of a disconnect: a request whose client hangs up is aborted (the handler is cancelled) and counted.
- vLLM's ``--api-key`` (``api_key``, or ``$VLLM_API_KEY`` as a process): 401 on its guarded prefixes (``/v1`` ...)
  without the key, every other path open, as vLLM 0.32's AuthenticationMiddleware does.
- Its own ``/metrics`` as vLLM exports it (what appliance/engine/load.py and maintenance read: requests running
  and waiting, KV-cache usage, prompt and generation token counters, finished requests, ``cache_config_info``'s
  block size and count) plus the process's resident memory; ``/health``, ``/v1/models``, ``/tokenize``.
- What it received: every request (path, raw bytes, parsed body, headers, arrival time: ``cache_salt`` and
  ``priority`` as the gateway sent them), answers completed, aborts, health probes, metrics reads, the most
  requests it ever ran at once.
- Optionally (``prefix_caching``) vLLM's prefix cache as ``cached_tokens`` shows it: whole blocks of the prompt
  prefilled before under the same ``cache_salt`` (the salt enters the first block's hash, as in vLLM).

Not modelled: several choices (``n``), logprobs, echo, tools, stop strings; answers always finish by ``length``.

Three ways to run it: in a thread of the test process (``start()``/``stop()``, or ``with FakeEngine() as e``),
in the caller's running event loop (``async with FakeEngine() as e``), or as a process
(``python tests/fake_engine.py PORT [options]``, see ``main``): what bench/stream_overhead.py pins to a core and
the supervisor's life-cycle tests spawn, stop and kill. It imports nothing of the appliance or of the tests, so it
runs from its path alone.
"""

from __future__ import annotations

import os
import sys

# Run by path (a process of its own), Python puts this file's folder, tests/, first on sys.path, where tests/http
# would shadow the standard library's http: it comes off before the imports below.
if __name__ == "__main__":
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import argparse
import asyncio
import json
import math
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Literal, Protocol

from aiohttp import web

SERVED_MODEL = "demo"
FINGERPRINT = "vllm-0.32.0-5f0c9a1e"  # vLLM's default --fingerprint-mode full: version and a config hash
DONE = b"data: [DONE]\n\n"
GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")  # what vLLM's --api-key protects
VOCAB = 997
BOS = 1

Delay = float | Callable[[int], float]  # seconds, or in-flight requests (this one included) -> seconds
Gauge = float | Callable[[float], float]  # a value, or seconds since the engine started -> value
Writes = Literal["event", "split", "one"]
How = Literal["reset", "eof", "error", "stall", "abort", "refuse"]


# -- models -----------------------------------------------------------------------------------------------------


def tokenize(text: str) -> list[int]:
    """One token per character."""
    return [ord(c) % VOCAB for c in text]


def tokenize_words(text: str) -> list[int]:
    """A BOS token, then one token per whitespace-separated word (what a load tester can count without a
    tokenizer)."""
    return [BOS] + [2 + sum(map(ord, word)) % (VOCAB - 2) for word in text.split()]


def render_chat(messages: list[dict[str, Any]], encode: Callable[[str], list[int]] = tokenize) -> list[int]:
    """A chat template: every message as ``<role>content``, then the assistant's turn."""
    return encode("".join(f"<{m['role']}>{_text(m.get('content'))}\n" for m in messages) + "<assistant>")


def next_token(context: list[int]) -> int:
    a, b, c = ([0, 0, 0] + context)[-3:]
    return (a * 31 + b * 17 + c * 7 + len(context)) % VOCAB


def greedy(prompt: list[int], count: int) -> list[int]:
    """The ``count`` tokens greedy decoding gives after ``prompt``."""
    context = list(prompt)
    out = []
    for _ in range(count):
        token = next_token(context)
        context.append(token)
        out.append(token)
    return out


def detok(token: int) -> str:
    return f" w{token}"


def _text(content: Any) -> str:
    if isinstance(content, list):  # content parts
        return "".join(part.get("text") or "" for part in content if isinstance(part, dict))
    return content or ""


class Model(Protocol):
    """What the engine asks of a model: the prompt's token ids, the answer's ids, and their text."""

    def encode(self, text: str) -> list[int]: ...

    def render_chat(self, messages: list[dict[str, Any]]) -> list[int]: ...

    def generate(self, prompt: list[int], count: int) -> list[int]: ...

    def piece(self, position: int, token: int) -> str:
        """The text of the answer's ``position``-th token."""
        ...

    def whole(self, tokens: list[int]) -> str:
        """The text of a whole (non-streamed) answer."""
        ...


@dataclass(frozen=True)
class GreedyModel:
    """Greedy decoding of a fixed function of the last tokens: the same context always gives the same next token,
    so an answer continued from its prompt plus the tokens already sent is the undisturbed answer."""

    def encode(self, text: str) -> list[int]:
        return tokenize(text)

    def render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return render_chat(messages)

    def generate(self, prompt: list[int], count: int) -> list[int]:
        return greedy(prompt, count)

    def piece(self, position: int, token: int) -> str:
        return detok(token)

    def whole(self, tokens: list[int]) -> str:
        return "".join(detok(t) for t in tokens)


@dataclass(frozen=True)
class CountingModel:
    """The ``i``-th token of every answer is id ``first_id + i`` with text ``pieces[i]``, or ``prefix + str(i)``
    past the pieces given; a whole answer's text is ``whole`` when given, else the pieces joined. Answers depend
    on nothing but their length: for tests that read what was relayed, not for migration."""

    prefix: str = " t"
    pieces: tuple[str, ...] = ()
    whole_text: str | None = None
    first_id: int = 100
    words: bool = False  # the prompt's tokens: a BOS and one per word (tokenize_words), else one per character

    def encode(self, text: str) -> list[int]:
        return tokenize_words(text) if self.words else tokenize(text)

    def render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return render_chat(messages, self.encode)

    def generate(self, prompt: list[int], count: int) -> list[int]:
        return [self.first_id + i for i in range(count)]

    def piece(self, position: int, token: int) -> str:
        return self.pieces[position] if position < len(self.pieces) else f"{self.prefix}{position}"

    def whole(self, tokens: list[int]) -> str:
        if self.whole_text is not None:
            return self.whole_text
        return "".join(self.piece(i, t) for i, t in enumerate(tokens))


# -- what the engine is told and what it saw --------------------------------------------------------------------


@dataclass
class Failure:
    """How the next stream dies, after ``after`` tokens:

    - ``reset``: the connection is reset (the engine process died);
    - ``eof``: the HTTP body ends cleanly without ``[DONE]``;
    - ``error``: a 5xx error event, then ``[DONE]`` (EngineCore died: what vLLM's generator writes);
    - ``stall``: silence until the client hangs up (a hung engine);
    - ``abort``: the ``after``-th token's chunk finishes with ``"abort"``, then ``[DONE]`` (vLLM aborting a
      request it was running, as when it shuts down; ``after`` >= 1);
    - ``refuse``: the connection is dropped before any answer (a stale keep-alive connection).

    A whole (non-streamed) answer with a failure other than ``refuse`` sends its headers, then its body breaks
    off."""

    after: int
    how: How = "reset"
    message: str = "Internal server error"


@dataclass(frozen=True)
class Poison:
    """An input vLLM raises on, wherever it goes: a request whose prompt's token ids hold ``marker``'s (chat: the
    rendered chat's; a continuation's prompt of ids too) is answered, whole, with vLLM's 500 ``ErrorResponse``
    (JSONResponse's compact JSON); streamed, with ``after`` token chunks (chat: the role chunk first, as vLLM sends
    it with the engine's first output), then the 5xx error event (``json.dumps``' separators) and ``[DONE]``. That is
    vLLM 0.32's answer to a request its engine core finishes with an error (a structured-output grammar that fails
    to compile: "Internal server error") or to any unexpected exception in its stream generator."""

    marker: str
    after: int = 0
    message: str = "Internal server error"


@dataclass(frozen=True)
class Received:
    """One completion request as it arrived."""

    path: str
    raw: bytes
    body: dict[str, Any]
    headers: dict[str, str]
    at: float  # time.monotonic()


def vllm_error(message: str, status: int, err_type: str | None = None, param: str | None = None
               ) -> dict[str, Any]:
    """vLLM's ErrorResponse."""
    return {"error": {"message": message, "type": err_type or ERROR_TYPES.get(status, HTTPStatus(status).phrase),
                      "param": param, "code": status}}


ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 422: "UnprocessableEntityError",
               500: "InternalServerError", 501: "NotImplementedError", 503: "ServiceUnavailableError"}


def _compact(obj: Any) -> bytes:
    """JSON as pydantic's model_dump_json and Starlette's JSONResponse write it."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + _compact(obj) + b"\n\n"


def _value(gauge: Gauge, elapsed: float) -> float:
    return float(gauge(elapsed) if callable(gauge) else gauge)


# -- the engine -------------------------------------------------------------------------------------------------

_SERVING: dict[str, FakeEngine] = {}  # url -> the engine listening there, in this process


@dataclass(eq=False)
class FakeEngine:
    """A vLLM OpenAI server on ``host``:``port`` (0: a free port). Every knob may be changed while it runs."""

    host: str = "127.0.0.1"
    port: int = 0
    served_model_name: str = SERVED_MODEL
    max_model_len: int = 4096
    model: Model = field(default_factory=GreedyModel)
    tokens: int | None = None  # every answer this long; None: the request's max_tokens (vLLM's defaults without)
    first_token_delay: Delay = 0.0
    token_delay: float = 0.0
    stall_after: int = 1  # a stream falls silent after this many tokens...
    stall_seconds: float = 0.0  # ...for this long (every stream; 0: never)
    freeze_at: int | None = None  # the request with this arrival number freezes the whole engine...
    freeze_seconds: float = 0.0  # ...for this long: every request waits
    max_num_seqs: int | None = None  # requests run at once; the rest wait (None: no limit)
    failures: list[Failure] = field(default_factory=list)  # one per request, in order (a list engines may share)
    fail_status: int | None = None  # every request is answered with this error status
    fail_every: int | None = None  # every n-th request (by arrival) is answered 500
    fail_message: str = "injected failure"
    poisons: list[Poison] = field(default_factory=list)  # inputs every request of which fails (engines may share it)
    raw_stream: bytes | None = None  # every stream is exactly these bytes
    token_ids: bool = True  # honour return_token_ids (False: an engine that leaves them out: no migration)
    writes: Writes = "event"  # one write per event (vLLM); each event in two writes; the whole stream in one
    system_fingerprint: str | None = FINGERPRINT
    cached_tokens: int | None = None  # usage's prompt_tokens_details (vLLM --enable-prompt-tokens-details)
    prefix_caching: bool = False  # cached_tokens from a prefix cache of whole blocks, salted by cache_salt
    response_id: str | None = None  # every answer's id (default: a new one per request, like vLLM)
    created: int | None = None  # every answer's created (default: the time)
    tokenize_endpoint: bool = True  # serve /tokenize (404 otherwise)
    health_status: int = 200
    health_delay: float = 0.0
    kv_cache_usage: Gauge | None = None  # None: the tokens the running requests hold over the cache's capacity
    resident_memory_bytes: Gauge = 1e9
    block_size: int = 16
    num_gpu_blocks: int | None = 8192  # None: the cache is not sized yet (vLLM's label then reads "None")
    backlog: int = 128
    api_key: str | None = None  # vLLM's --api-key: /v1 (and its other guarded prefixes) answer 401 without it
    # Not vLLM's own: the header the appliance's engine guard (appliance/engine/guard.py) adds to /metrics answers,
    # saying the scheduling policy vLLM runs; None: an engine without the guard, which says nothing.
    scheduling_policy: str | None = None

    # What it saw, and its own metrics (a test may set the gauges and counters: load from elsewhere).
    received: list[Received] = field(default_factory=list)
    answered: int = 0  # whole answers sent in full
    streamed: int = 0  # streams that ended with [DONE]
    aborted: int = 0  # requests whose client hung up before the answer was complete
    poisoned: int = 0  # requests answered with a poison's error
    health_checks: int = 0
    refused: int = 0  # requests answered 401 for a missing or wrong API key
    metrics_reads: int = 0
    running: float = 0
    waiting: float = 0
    max_running: int = 0
    finished: float = 0  # vllm:request_success_total
    prompt_tokens_total: float = 0
    generation_tokens_total: float = 0

    def __post_init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._started = time.monotonic()
        self._held_tokens = 0  # KV cache: prompt and generated tokens of the running requests
        self._gate: asyncio.Lock | None = None
        self._slots: asyncio.Semaphore | None = None
        self._ids = 0
        self._blocks: set[int] = set()  # prefix_caching: the chained hashes of every block prefilled so far

    # -- running it -------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._authenticate])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        return app

    async def serve(self) -> None:
        """Listen, in the running event loop, until ``close``."""
        self._gate, self._slots = asyncio.Lock(), None
        # Like vLLM, abort a request whose client went away: the handler is cancelled.
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=self.backlog)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        _SERVING[self.url] = self

    async def close(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            _SERVING.pop(self.url, None)
            await runner.cleanup()

    @staticmethod
    def serving(url: str) -> FakeEngine | None:
        """The fake engine listening at ``url`` in this process, if any: for helpers that hold a replica, not the
        engine behind it."""
        return _SERVING.get(url.rstrip("/"))

    async def __aenter__(self) -> FakeEngine:
        await self.serve()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    def start(self) -> FakeEngine:
        """Serve from a thread of its own (its own event loop); returns once it listens."""
        ready = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.serve())
            except BaseException as exc:  # a port in use: raised in start()
                failed.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name=f"fake-engine-{self.host}", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the fake engine did not start")
        if failed:
            raise failed[0]
        return self

    def stop(self) -> None:
        """Close the listening socket and every connection (like a dead process: connections are refused after).
        Safe to call twice."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not loop.is_running():
            return
        asyncio.run_coroutine_threadsafe(self.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    def __enter__(self) -> FakeEngine:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    # -- what a request gets ------------------------------------------------------------------------------------

    def prompt_ids(self, body: dict[str, Any]) -> list[int]:
        """The prompt's token ids as the engine sees them (chat: the rendered template)."""
        if "messages" in body:
            return self.model.render_chat(body["messages"])
        prompt = body.get("prompt", "")
        if isinstance(prompt, list):
            first = prompt[0] if prompt else []
            if isinstance(first, list):
                return list(first)
            if isinstance(first, str):
                return self.model.encode(first)
            return list(prompt)
        return self.model.encode(prompt)

    def answer_length(self, body: dict[str, Any], prompt: list[int]) -> int:
        if self.tokens is not None:
            return self.tokens
        if "messages" in body:
            asked = body.get("max_completion_tokens") or body.get("max_tokens")
            return int(asked) if asked else max(0, self.max_model_len - len(prompt))
        asked = body.get("max_tokens")
        return 16 if asked is None else int(asked)  # vLLM's completions default

    def usage(self, body: dict[str, Any]) -> dict[str, Any]:
        """The usage the engine reports for a complete answer to ``body``."""
        prompt = self.prompt_ids(body)
        return self._usage(len(prompt), self.answer_length(body, prompt), final=True)

    def stream_events(self, body: dict[str, Any]) -> list[bytes]:
        """The events of an undisturbed stream answering ``body`` (a chat request when it has ``messages``), as
        the engine would write them: for code that needs vLLM's bytes without a server (benches of the relay)."""
        chat = "messages" in body
        prompt = self.prompt_ids(body)
        events = _Events(self, body, chat, prompt, self.cached_tokens)
        return events.all(self.model.generate(prompt, self.answer_length(body, prompt)))

    def _usage(self, prompt: int, completion: int, *, final: bool, cached: int | None = None) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                                 "completion_tokens": completion}
        cached = self.cached_tokens if cached is None else cached
        if final and cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def cache_lookup(self, body: dict[str, Any], prompt: list[int]) -> int | None:
        """With ``prefix_caching``: the prompt's tokens found in the cache (whole blocks, as vLLM's prefix cache
        holds them, the salt entering the first block's hash; never the block holding the prompt's last token,
        which vLLM computes again), and the prompt's blocks cached from now on. Else ``cached_tokens``."""
        if not self.prefix_caching:
            return self.cached_tokens
        salt, size = body.get("cache_salt"), self.block_size
        chain: int = hash(("salt", salt)) if salt else 0
        hits, missed = 0, False
        for end in range(size, len(prompt) + 1, size):
            chain = hash((chain, tuple(prompt[end - size:end])))
            if not missed and chain in self._blocks and end < len(prompt):
                hits += size
            else:
                missed = True
            self._blocks.add(chain)
        return hits

    def poison_in(self, body: dict[str, Any]) -> Poison | None:
        """The poison whose marker the prompt's token ids hold, if any."""
        if not self.poisons:
            return None
        prompt = self.prompt_ids(body)
        for poison in self.poisons:
            ids = self.model.encode(poison.marker)
            ids = ids[1:] if len(ids) > 1 and ids[0] == BOS else ids
            if any(prompt[i:i + len(ids)] == ids for i in range(len(prompt) - len(ids) + 1)):
                return poison
        return None

    def _next_id(self, chat: bool) -> str:
        self._ids += 1
        return self.response_id or f"{'chatcmpl' if chat else 'cmpl'}-{self.port:08x}{self._ids:024x}"

    # -- routes -------------------------------------------------------------------------------------------------

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """vLLM's AuthenticationMiddleware (vllm/entrypoints/serve/middleware/authenticate.py): with an API key,
        paths under its guarded prefixes need ``Authorization: Bearer <key>``, else 401 ``{"error":
        "Unauthorized"}``; every other path (/health, /metrics, /tokenize) stays open, as in vLLM."""
        if self.api_key and request.method != "OPTIONS" and request.path.startswith(GUARDED_PREFIX):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or token != self.api_key:
                self.refused += 1
                return self._json({"error": "Unauthorized"}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    async def _health(self, _request: web.Request) -> web.Response:
        self.health_checks += 1
        if self.health_delay:
            await asyncio.sleep(self.health_delay)
        return web.Response(status=self.health_status)

    async def _models(self, _request: web.Request) -> web.Response:
        created = int(time.time())
        card = {"id": self.served_model_name, "object": "model", "created": created, "owned_by": "vllm",
                "root": self.served_model_name, "parent": None, "max_model_len": self.max_model_len,
                "permission": [{"id": f"modelperm-{self.port:016x}", "object": "model_permission",
                                "created": created, "allow_create_engine": False, "allow_sampling": True,
                                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*", "group": None,
                                "is_blocking": False}]}
        return self._json({"object": "list", "data": [card]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        if not self.tokenize_endpoint:
            return web.Response(status=404, text="Not Found")
        body = await request.json()
        tokens = self.prompt_ids(body)
        return self._json({"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens,
                           "token_strs": None})

    async def _metrics(self, _request: web.Request) -> web.Response:
        self.metrics_reads += 1
        headers = {"x-appliance-scheduling-policy": self.scheduling_policy} if self.scheduling_policy else None
        return web.Response(body=self.metrics_page(), content_type="text/plain", charset="utf-8", headers=headers)

    def metrics_page(self) -> bytes:
        """The series of vLLM's /metrics the appliance reads, as prometheus_client exposes them."""
        elapsed = time.monotonic() - self._started
        capacity = self.block_size * (self.num_gpu_blocks or 0)
        if self.kv_cache_usage is not None:
            kv = _value(self.kv_cache_usage, elapsed)
        else:
            kv = min(1.0, self._held_tokens / capacity) if capacity else 0.0
        labels = f'engine="0",model_name="{self.served_model_name}"'
        created = f"{time.time() - elapsed:.9e}"
        lines = [
            "# HELP process_resident_memory_bytes Resident memory size in bytes.",
            "# TYPE process_resident_memory_bytes gauge",
            f"process_resident_memory_bytes {_number(_value(self.resident_memory_bytes, elapsed))}",
        ]
        for name, help_text, value in (
                ("num_requests_running", "Number of requests in model execution batches.", self.running),
                ("num_requests_waiting", "Number of requests waiting to be processed.", self.waiting),
                ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv)):
            lines += [f"# HELP vllm:{name} {help_text}", f"# TYPE vllm:{name} gauge",
                      f"vllm:{name}{{{labels}}} {_number(value)}"]
        for name, help_text, value in (
                ("prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens_total),
                ("generation_tokens", "Number of generation tokens processed.", self.generation_tokens_total)):
            lines += [f"# HELP vllm:{name}_total {help_text}", f"# TYPE vllm:{name}_total counter",
                      f"vllm:{name}_total{{{labels}}} {_number(value)}",
                      f"# HELP vllm:{name}_created {help_text}", f"# TYPE vllm:{name}_created gauge",
                      f"vllm:{name}_created{{{labels}}} {created}"]
        help_text = "Count of successfully processed requests."
        lines += [f"# HELP vllm:request_success_total {help_text}", "# TYPE vllm:request_success_total counter"]
        for reason in ("stop", "length", "abort", "error", "repetition"):
            value = self.finished if reason == "length" else 0.0  # every answer here finishes by length
            lines.append(f'vllm:request_success_total{{engine="0",finished_reason="{reason}",'
                         f'model_name="{self.served_model_name}"}} {_number(value)}')
        lines += ["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
                  "# TYPE vllm:cache_config_info gauge",
                  f'vllm:cache_config_info{{block_size="{self.block_size}",cache_dtype="auto",engine="0",'
                  f'gpu_memory_utilization="0.9",num_gpu_blocks="{self.num_gpu_blocks}",'
                  f'prefix_caching_hash_algo="sha256"}} 1.0']
        return ("\n".join(lines) + "\n").encode()

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            return self._json(vllm_error(f"Invalid JSON: {exc}", 400), status=400)
        if not isinstance(body, dict):
            return self._json(vllm_error("The request body must be a JSON object.", 400), status=400)
        self.received.append(Received(request.path, raw, body, dict(request.headers), time.monotonic()))
        number = len(self.received)
        poison = self.poison_in(body)
        failure = self.failures.pop(0) if self.failures and poison is None else None
        if failure is not None and failure.how == "refuse":  # hangs up before answering (a stale connection)
            assert request.transport is not None
            request.transport.abort()
            return web.Response(status=499)
        if self.fail_status is not None:
            return self._json(vllm_error(self.fail_message, self.fail_status), status=self.fail_status)
        if self.fail_every and number % self.fail_every == 0:
            return self._json(vllm_error(self.fail_message, 500), status=500)
        model = body.get("model")
        if model is not None and model != self.served_model_name:
            return self._json(vllm_error(f"The model `{model}` does not exist.", 404, param="model"), status=404)
        if poison is not None:
            self.poisoned += 1
            if not body.get("stream"):
                return self._json(vllm_error(poison.message, 500, "InternalServerError"), status=500)
            failure = Failure(after=poison.after, how="error", message=poison.message)
        try:
            return await self._run(request, body, number, failure)
        except asyncio.CancelledError:  # the client hung up: vLLM aborts the request
            self.aborted += 1
            raise
        except ConnectionResetError:  # ...noticed on a write
            self.aborted += 1
            return web.Response(status=499)

    async def _run(self, request: web.Request, body: dict[str, Any], number: int, failure: Failure | None
                   ) -> web.StreamResponse:
        chat = request.path == "/v1/chat/completions"
        prompt = self.prompt_ids(body)
        count = self.answer_length(body, prompt)
        cached = self.cache_lookup(body, prompt)
        slot = await self._wait_for_slot()
        self.running += 1
        self.max_running = max(self.max_running, int(self.running))
        self._held_tokens += len(prompt)
        stream: _Stream | None = None
        try:
            first_delay = (self.first_token_delay(int(self.running)) if callable(self.first_token_delay)
                           else self.first_token_delay)
            await self._pass_freeze(number)
            if not body.get("stream"):
                return await self._whole(request, body, chat, prompt, count, first_delay, failure, cached)
            response = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
            await response.prepare(request)
            if self.raw_stream is not None:
                await response.write(self.raw_stream)
                return response
            if first_delay:
                await asyncio.sleep(first_delay)
            self.prompt_tokens_total += len(prompt)
            stream = _Stream(self, request, response, body, chat, prompt, failure, cached)
            await stream.run(self.model.generate(prompt, count))
            return response
        finally:
            self.running -= 1
            self._held_tokens -= len(prompt) + (stream.generated if stream is not None else 0)
            if slot is not None:
                slot.release()

    async def _wait_for_slot(self) -> asyncio.Semaphore | None:
        """Waits while ``max_num_seqs`` requests run (counted as waiting); the slot to give back."""
        if self.max_num_seqs is None:
            return None
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_num_seqs)
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        return self._slots

    async def _pass_freeze(self, number: int) -> None:
        assert self._gate is not None
        if self.freeze_at is not None and number == self.freeze_at:
            async with self._gate:
                await asyncio.sleep(self.freeze_seconds)
        elif self._gate.locked():
            async with self._gate:  # waits while a freeze holds the engine
                pass

    async def _whole(self, request: web.Request, body: dict[str, Any], chat: bool, prompt: list[int], count: int,
                     first_delay: float, failure: Failure | None, cached: int | None) -> web.StreamResponse:
        """A non-streamed answer, after the time its tokens take."""
        if failure is not None:  # headers, then the body breaks off
            response = web.StreamResponse(headers={"content-type": "application/json", "content-length": "4096"})
            await response.prepare(request)
            await response.write(b'{"id":"')
            assert request.transport is not None
            request.transport.abort()
            return response
        await asyncio.sleep(first_delay + self.token_delay * max(0, count - 1))
        tokens = self.model.generate(prompt, count)
        with_ids = self.token_ids and bool(body.get("return_token_ids"))
        usage = self._usage(len(prompt), count, final=False)
        usage["prompt_tokens_details"] = (None if cached is None else  # a whole model_dump: every field
                                          {"cached_tokens": cached, "created_cache_tokens": None,
                                           "multimodal_tokens": None})
        usage["completion_tokens_details"] = None
        rid, created = self._next_id(chat), self.created or int(time.time())
        text = self.model.whole(tokens)
        if chat:
            message = {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
                       "function_call": None, "reasoning": None}
            answer = {"id": rid, "object": "chat.completion", "created": created, "model": self.served_model_name,
                      "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "length",
                                   "stop_reason": None, "token_ids": tokens if with_ids else None,
                                   "routed_experts": None}],
                      "service_tier": None, "system_fingerprint": self.system_fingerprint, "usage": usage,
                      "prompt_logprobs": None, "prompt_token_ids": prompt if with_ids else None,
                      "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
        else:
            answer = {"id": rid, "object": "text_completion", "created": created, "model": self.served_model_name,
                      "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                                   "stop_reason": None, "token_ids": tokens if with_ids else None,
                                   "prompt_logprobs": None, "prompt_token_ids": prompt if with_ids else None,
                                   "routed_experts": None}],
                      "service_tier": None, "system_fingerprint": self.system_fingerprint, "usage": usage,
                      "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
        self.prompt_tokens_total += len(prompt)
        self.generation_tokens_total += count
        self.finished += 1
        self.answered += 1
        return self._json(answer)

    @staticmethod
    def _json(obj: Any, status: int = 200) -> web.Response:
        return web.Response(body=_compact(obj), status=status, content_type="application/json")


class _Events:
    """The events of one streamed answer, as vLLM's stream generators write them."""

    def __init__(self, engine: FakeEngine, body: dict[str, Any], chat: bool, prompt: list[int],
                 cached: int | None) -> None:
        self.engine, self.body, self.chat, self.prompt, self.cached = engine, body, chat, prompt, cached
        options = body.get("stream_options") or {}
        self.include_usage = bool(options.get("include_usage"))
        self.continuous = self.include_usage and bool(options.get("continuous_usage_stats"))
        self.with_ids = engine.token_ids and bool(body.get("return_token_ids"))
        self.head = {"id": engine._next_id(chat), "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": engine.created or int(time.time()), "model": engine.served_model_name}

    def all(self, tokens: list[int]) -> list[bytes]:
        """A whole undisturbed stream of ``tokens``."""
        out = [event(self.first())] if self.chat else []
        out += [event(self.chunk(i, token, "length" if i == len(tokens) - 1 else None, i + 1))
                for i, token in enumerate(tokens)]
        if self.include_usage:
            out.append(event(self.final_usage(len(tokens))))
        return [*out, DONE]

    def first(self) -> dict[str, Any]:
        """Chat's first chunk: the role, with the prompt's ids when asked for."""
        first: dict[str, Any] = {**self.head, "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
        if self.continuous:
            first["usage"] = self.running_usage(0)
        first["prompt_token_ids"] = self.prompt if self.with_ids else None
        first["prompt_text"] = None
        return first

    def chunk(self, position: int, token: int, finish: str | None, generated: int) -> dict[str, Any]:
        text = self.engine.model.piece(position, token)
        ids = [token] if self.with_ids else None
        choice: dict[str, Any]
        if self.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = None
            choice["token_ids"] = ids
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                      "prompt_token_ids": self.prompt if self.with_ids and position == 0 else None,
                      "token_ids": ids}
        chunk: dict[str, Any] = {**self.head, "choices": [choice]}
        if self.continuous:
            chunk["usage"] = self.running_usage(generated)
        if finish is not None and not self.include_usage and self.engine.system_fingerprint is not None:
            chunk["system_fingerprint"] = self.engine.system_fingerprint
        return chunk

    def final_usage(self, generated: int) -> dict[str, Any]:
        """The usage event that ends a stream whose client asked for usage."""
        last: dict[str, Any] = {**self.head, "choices": [],
                                "usage": self.engine._usage(len(self.prompt), generated, final=True,
                                                            cached=self.cached)}
        if self.engine.system_fingerprint is not None:
            last["system_fingerprint"] = self.engine.system_fingerprint
        return last

    def running_usage(self, generated: int) -> dict[str, Any]:
        """continuous_usage_stats: the usage so far, in every chunk (chat passes completion_tokens_details)."""
        usage = self.engine._usage(len(self.prompt), generated, final=False)
        if self.chat:
            usage["completion_tokens_details"] = None
        return usage


class _Stream(_Events):
    """One streamed answer on the wire: its events in time, and its failure."""

    def __init__(self, engine: FakeEngine, request: web.Request, response: web.StreamResponse,
                 body: dict[str, Any], chat: bool, prompt: list[int], failure: Failure | None,
                 cached: int | None) -> None:
        super().__init__(engine, body, chat, prompt, cached)
        self.request, self.response, self.failure = request, response, failure
        self.pending: list[bytes] = []  # writes == "one": everything leaves at the end
        self.generated = 0  # tokens sent (they hold KV cache while the request runs)

    async def run(self, tokens: list[int]) -> None:
        engine, failure = self.engine, self.failure
        if self.chat:
            await self.send(event(self.first()))
        for i, token in enumerate(tokens):
            if failure is not None and i == failure.after:
                await self.fail(failure)
                return
            if i and engine.stall_seconds and i == engine.stall_after:
                await asyncio.sleep(engine.stall_seconds)  # hung, for a while
            elif i and engine.token_delay:
                await asyncio.sleep(engine.token_delay)
            aborted = failure is not None and failure.how == "abort" and i == failure.after - 1
            finish = "abort" if aborted else "length" if i == len(tokens) - 1 else None
            await self.send(event(self.chunk(i, token, finish, self.generated + 1)))
            self.generated += 1
            engine._held_tokens += 1
            engine.generation_tokens_total += 1
            if aborted:  # vLLM aborting a request it was running: that chunk, then [DONE]
                await self.send(DONE)
                await self.flush()
                return
        if failure is not None and failure.after >= len(tokens):
            await self.fail(failure)
            return
        if self.include_usage:
            await self.send(event(self.final_usage(self.generated)))
        await self.send(DONE)
        await self.flush()
        engine.finished += 1
        engine.streamed += 1

    async def send(self, data: bytes) -> None:
        writes = self.engine.writes
        if writes == "one":
            self.pending.append(data)
        elif writes == "split":  # in two pieces: whoever reads must put them back together
            middle = len(data) // 2
            await self.response.write(data[:middle])
            await asyncio.sleep(0.002)
            await self.response.write(data[middle:])
        else:
            await self.response.write(data)

    async def flush(self) -> None:
        if self.pending:
            data, self.pending = b"".join(self.pending), []
            await self.response.write(data)

    async def fail(self, failure: Failure) -> None:
        await self.flush()
        await asyncio.sleep(0.1)  # what was written reaches the client first, as with an engine that dies later
        if failure.how == "reset":
            assert self.request.transport is not None
            self.request.transport.abort()
        elif failure.how == "error":
            error = vllm_error(failure.message, 500, "InternalServerError")
            await self.response.write(b"data: " + json.dumps(error).encode() + b"\n\n" + DONE)
            await self.response.write_eof()
        elif failure.how == "stall":  # silent until the client gives up and hangs up
            await asyncio.sleep(30)
        else:  # eof: a clean end of the HTTP body, no [DONE]
            await self.response.write_eof()


def _number(value: float) -> str:
    """A sample value as prometheus_client writes it (Go's float formatting)."""
    value = float(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    text = repr(value)
    dot = text.find(".")
    if value > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return text


# -- as a process -----------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    """``python tests/fake_engine.py PORT [options]``: a fake engine process on 127.0.0.1:PORT.

    Life-cycle options, for the supervisor's tests: ``--no-listen`` (alive, never binds: a process that is not
    serving), ``--ignore-term`` (ignores SIGTERM), ``--exit-after SECONDS CODE`` (serves, then exits with CODE: a
    crash), ``--chatter LINES`` (prints LINES numbered lines, every tenth to stderr, before it listens: an engine's
    start-up output). SIGTERM ends it at once (the default disposition), like a process killed mid-request."""
    parser = argparse.ArgumentParser(prog="fake_engine.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("port", type=int)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--served-model-name", default=SERVED_MODEL)
    parser.add_argument("--model", choices=("greedy", "counting"), default="greedy")
    parser.add_argument("--tokens", type=int, help="every answer this long (default: the request's max_tokens)")
    parser.add_argument("--prefill-ms", type=float, default=0.0, help="time to the first token")
    parser.add_argument("--itl-ms", type=float, default=0.0, help="time between tokens")
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--backlog", type=int, default=1024)
    parser.add_argument("--uvloop", action="store_true", help="serve on uvloop (when installed), as vLLM does")
    parser.add_argument("--no-listen", action="store_true")
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--exit-after", nargs=2, metavar=("SECONDS", "CODE"))
    parser.add_argument("--chatter", type=int, metavar="LINES")
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                        help="vLLM's --api-key (default: $VLLM_API_KEY, as vLLM reads it)")
    args, _tags = parser.parse_known_args(argv)  # anything else only tags the command line (tests look for it)
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.chatter:
        for i in range(args.chatter):
            print(f"fake engine line {i:06d} " + "x" * 60, file=sys.stderr if i % 10 == 0 else sys.stdout)
        sys.stdout.flush()
        sys.stderr.flush()
    if args.no_listen:
        while True:
            time.sleep(1)
    engine = FakeEngine(host=args.host, port=args.port, served_model_name=args.served_model_name,
                        model=CountingModel(prefix=" w") if args.model == "counting" else GreedyModel(),
                        tokens=args.tokens, first_token_delay=args.prefill_ms / 1000, token_delay=args.itl_ms / 1000,
                        max_num_seqs=args.max_num_seqs, backlog=args.backlog, api_key=args.api_key)
    if args.exit_after:
        engine.start()
        time.sleep(float(args.exit_after[0]))
        sys.stdout.flush()
        os._exit(int(args.exit_after[1]))
    if args.uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(_serve_forever(engine))


async def _serve_forever(engine: FakeEngine) -> None:
    await engine.serve()
    await asyncio.Event().wait()


if __name__ == "__main__":
    main()

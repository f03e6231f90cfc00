"""A streaming OpenAI-compatible client that times every chunk.

One request = one ``RequestResult`` holding raw monotonic timestamps (seconds since the run's start): when it
was *meant* to be sent, when the scheduler got to it, when it went on the wire, each content chunk's arrival,
and the end. Every latency is derived from those, and latencies count from the intended send time, so time a
request spent waiting in the client (for a connection slot, for a late scheduler) is charged to the server
that caused the backlog instead of silently vanishing (coordinated omission).

vLLM's server streams ``data: {json}`` server-sent events ending with ``data: [DONE]``; completions carry text
in ``choices[0].text``, chat in ``choices[0].delta.content`` (its first chunk carries only the role, and does
not count as the first token). ``stream_options.include_usage`` makes the last chunk carry token usage.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

Clock = Callable[[], float]

# Bodies of failed responses are kept only this long in results: enough for OpenAI's error message.
ERROR_BODY_LIMIT = 300


@dataclass
class RequestResult:
    """Everything measured about one request; times are seconds since the run's start (monotonic)."""

    index: int
    phase: str  # warmup | measure | cooldown
    intended: float
    dispatched: float | None = None
    sent: float | None = None
    first_token: float | None = None
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    status: int | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    target_prompt_tokens: int | None = None
    max_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and self.first_token is not None

    @property
    def queue(self) -> float | None:
        """Client-side wait: intended send time to the moment the request went on the wire."""
        return None if self.sent is None else self.sent - self.intended

    @property
    def ttft(self) -> float | None:
        """Time to first content token, from the intended send time."""
        return None if self.first_token is None else self.first_token - self.intended

    @property
    def e2e(self) -> float | None:
        """End-to-end latency, from the intended send time to the end of the stream."""
        return None if self.end is None or not self.ok else self.end - self.intended

    @property
    def output_tokens(self) -> int:
        """Server-reported completion tokens when present, else the number of content chunks."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times)

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive content chunks (one token each in vLLM's default streaming)."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (tokens - 1)."""
        e2e, ttft, tokens = self.e2e, self.ttft, self.output_tokens
        if e2e is None or ttft is None or tokens < 2:
            return None
        return (e2e - ttft) / (tokens - 1)

    def as_row(self) -> dict[str, Any]:
        """The per-request JSONL row: raw times plus the derived latencies."""
        return {
            "index": self.index, "phase": self.phase, "ok": self.ok, "status": self.status, "error": self.error,
            "intended_s": self.intended, "dispatched_s": self.dispatched, "sent_s": self.sent,
            "first_token_s": self.first_token, "end_s": self.end,
            "queue_s": self.queue, "ttft_s": self.ttft, "tpot_s": self.tpot, "e2e_s": self.e2e,
            "target_prompt_tokens": self.target_prompt_tokens, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "max_tokens": self.max_tokens,
            "chunks": len(self.chunk_times), "chunk_times_s": self.chunk_times, "itl_s": self.itl,
        }


def endpoint_url(base_url: str, endpoint: str) -> str:
    return f"{base_url}/v1/chat/completions" if endpoint == "chat" else f"{base_url}/v1/completions"


def build_body(model: str, prompt_part: dict[str, Any], max_tokens: int | None, ignore_eos: bool) -> dict[str, Any]:
    """The streaming request body; ``ignore_eos`` (vLLM) makes the output exactly ``max_tokens`` long."""
    body: dict[str, Any] = {"model": model, **prompt_part, "stream": True,
                            "stream_options": {"include_usage": True}}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def chunk_text(event: dict[str, Any]) -> str:
    """The content carried by one streamed event (completions' ``text`` or chat's ``delta.content``)."""
    parts = []
    for choice in event.get("choices") or []:
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if text:
            parts.append(text)
    return "".join(parts)


async def stream_request(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    result: RequestResult,
    clock: Clock,
    timeout: float,
    headers: dict[str, str] | None = None,
) -> RequestResult:
    """Send one streaming request, filling ``result`` as chunks arrive. Never raises for server trouble."""
    result.sent = clock()
    try:
        limit = aiohttp.ClientTimeout(total=timeout)
        async with session.post(url, json=body, headers=headers, timeout=limit) as resp:
            result.status = resp.status
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {await _error_text(resp)}"
            else:
                await _read_stream(resp, result, clock)
    except TimeoutError:
        result.error = f"timeout after {timeout:g} s"
    except aiohttp.ClientError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    except ValueError as exc:  # a malformed event or an over-long line
        result.error = f"bad stream: {exc}"
    if result.end is None:
        result.end = clock()
    return result


async def _read_stream(resp: aiohttp.ClientResponse, result: RequestResult, clock: Clock) -> None:
    async for raw in resp.content:
        now = clock()
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            result.end = now  # the response is complete; reading on to EOF only lets the connection be reused
            continue
        event = json.loads(data)
        if not isinstance(event, dict):
            raise ValueError(f"event is not a JSON object: {data[:80]!r}")
        if "error" in event:
            err = event["error"]
            result.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
            return
        if chunk_text(event):
            result.chunk_times.append(now)
            if result.first_token is None:
                result.first_token = now
        usage = event.get("usage")
        if usage:
            result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
            result.completion_tokens = usage.get("completion_tokens", result.completion_tokens)
    if result.first_token is None:
        result.error = "stream ended without content"


async def _error_text(resp: aiohttp.ClientResponse) -> str:
    text = (await resp.text(errors="replace"))[:ERROR_BODY_LIMIT]
    try:
        err = json.loads(text).get("error", {})
        return str(err.get("message", text)) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        return text.strip()


def monotonic_clock(origin: float | None = None) -> Clock:
    """perf_counter (monotonic, sub-microsecond) shifted so the run starts at zero."""
    start = time.perf_counter() if origin is None else origin
    return lambda: time.perf_counter() - start

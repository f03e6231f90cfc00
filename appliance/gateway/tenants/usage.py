"""What an engine reported a request used, and the stream plumbing that gets that report without the client
seeing it: a stream whose client did not ask for usage asks the engine for it anyway (``ask_for_usage``) and the
relay hides the usage event (``HiddenUsage``), so the client's bytes are those it would have had."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from appliance.gateway.upstream.sse import DONE, payload, split_events


@dataclass
class Usage:
    """Tokens of one engine usage report."""

    prompt: int = 0
    completion: int = 0
    cached_prompt: int = 0

    @classmethod
    def of(cls, usage: Any) -> Usage | None:
        """From an OpenAI ``usage`` object; None when there is none."""
        if not isinstance(usage, dict):
            return None
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(_count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")), _count(cached))

    @property
    def total(self) -> int:
        return self.prompt + self.completion

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.prompt + other.prompt, self.completion + other.completion,
                     self.cached_prompt + other.cached_prompt)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


# -- usage on streams -----------------------------------------------------------------------------------------------

# A quote inside a JSON string is escaped, so neither can match inside generated text.
FINISH = re.compile(rb'"finish_reason": ?"')  # a chunk that ends a choice
USAGE = b'"usage"'  # a chunk that may carry usage (parsed to be sure)


def ask_for_usage(body: bytes, parsed: dict[str, Any]) -> bytes | None:
    """A streaming request's bytes asking the engine for the final usage event too; None when the client asked for
    it itself (nothing to change). Its other stream options are kept, except ``continuous_usage_stats`` (usage on
    every chunk, which the client did not ask for either); ``parsed`` is updated to match. The key is appended:
    the last one wins in vLLM's parser, as for ``migration.with_token_ids``."""
    options = parsed.get("stream_options")
    options = options if isinstance(options, dict) else {}
    if options.get("include_usage"):
        return None
    wanted = {**options, "include_usage": True, "continuous_usage_stats": False}
    parsed["stream_options"] = wanted  # the parsed body says what the engine will get
    end = body.rstrip().rfind(b"}")
    head = body[:end].rstrip()
    separator = b"" if head.endswith(b"{") else b","
    return head + separator + b'"stream_options":' + json.dumps(wanted, separators=(",", ":")).encode() + b"}"


def final_usage(event: bytes) -> dict[str, Any] | None:
    """The usage of a stream's final usage event (``"choices": []`` with ``usage``), None for any other event
    (continuous usage stats on content chunks are running totals, not counted)."""
    if USAGE not in event:
        return None
    data = payload(event)
    try:
        obj = json.loads(data) if data else None
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("choices") or not isinstance(obj.get("usage"), dict):
        return None
    return obj


class HiddenUsage:
    """Hides the usage event the gateway asked for, so the client's bytes are those it would have had without it.

    vLLM puts ``system_fingerprint`` on a stream's finishing chunk when no usage event follows, and on the usage
    event when one does. So a finishing chunk (and whatever follows it) is held until the usage event comes; the
    fingerprint moves onto the finishing chunks (as their last key, where vLLM writes it), the usage event is
    dropped. Fed whole events; returns the bytes to send now. ``flush`` gives back what is held (the stream ended
    or broke without a usage event)."""

    def __init__(self) -> None:
        self._held: list[bytes] = []
        self.usage: dict[str, Any] | None = None  # the last usage event's usage (the engine's report)

    def feed(self, events: bytes) -> bytes:
        if not self._held and USAGE not in events and FINISH.search(events) is None:
            return events  # token chunks, nothing to hold or hide: one scan of the block, no event-by-event work
        out = b""
        for event in split_events(events):
            final = final_usage(event)
            if final is not None:
                self.usage = final["usage"]
                fingerprint = final.get("system_fingerprint")
                out += b"".join(_with_fingerprint(held, fingerprint) for held in self._held)
                self._held = []
            elif self._held or FINISH.search(event):
                if event == DONE:
                    out += self.flush() + event
                else:
                    self._held.append(event)
            else:
                out += event
        return out

    def flush(self) -> bytes:
        held, self._held = self._held, []
        return b"".join(held)


def _with_fingerprint(event: bytes, fingerprint: Any) -> bytes:
    if not isinstance(fingerprint, str) or not FINISH.search(event) or b'"system_fingerprint"' in event:
        return event
    body = event.rstrip(b"\n")
    if not body.endswith(b"}"):
        return event
    return body[:-1] + b',"system_fingerprint":' + json.dumps(fingerprint).encode() + b"}\n\n"


def body_usage(content: bytes) -> dict[str, Any] | None:
    """The ``usage`` of a non-streaming answer's JSON body."""
    try:
        usage = json.loads(content).get("usage")
    except (ValueError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


def events_usage(events: bytes) -> dict[str, Any] | None:
    """The final usage event's usage among whole events (not a running total on a content chunk)."""
    for event in split_events(events):
        if (final := final_usage(event)) is not None:
            usage: dict[str, Any] = final["usage"]
            return usage
    return None

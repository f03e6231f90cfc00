"""What an engine reported a request used, and the stream plumbing that gets that report without the client
seeing it: a stream asks the engine for usage (``usage_options``: the final usage event, and the running usage on
every chunk, vLLM's ``continuous_usage_stats``) whether or not its client did, and the relay hides from the client
what it did not ask for (``strip_running_usage``, ``HiddenUsage``), so the client's bytes are those it would have
had. The running usage (``RunningUsage``) is what is known of a stream that never reaches its final usage event:
its client left, or its engine broke off."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from appliance.gateway.tenants.fingerprint import Fingerprint
from appliance.gateway.upstream.sse import payload, split_events


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

# A quote inside a JSON string is escaped, so none of these can match inside generated text.
FINISH = re.compile(rb'"finish_reason": ?"')  # a chunk that ends a choice
USAGE = b'"usage"'  # a chunk that may carry usage (parsed to be sure)
FINAL_USAGE = b'"choices":[],"usage":{'  # the final usage event, as vLLM writes it (compact, choices then usage)
# The running usage on a content chunk (vLLM's UsageInfo: prompt_tokens, total_tokens, completion_tokens, then the
# details: null or one level of numbers), never the final usage event's (which follows an empty choices list).
RUNNING_FIELD = b',"usage":{'
EMPTY_CHOICES = b'"choices":[]'
CHOICE_CHUNK = b'"choices":[{'  # a chunk of some choice (vLLM writes one choice a chunk)
DATA = b"data: "  # once an event (more only where generated text holds it: then the events are read one by one)
RUNNING = re.compile(rb'"usage":\{"prompt_tokens":(\d+),"total_tokens":\d+,"completion_tokens":(\d+)')
RUNNING_MARK = b'"usage":{"prompt_tokens":'
CHOICE_INDEX = re.compile(rb'"choices":\[\{"index":(\d+)')


@dataclass(frozen=True)
class UsagePlan:
    """What the gateway asks a stream's engine for beyond what its client asked, and so must hide: the final usage
    event (``hide_final``), the running usage on every chunk (``strip_running``)."""

    options: dict[str, Any]  # the stream_options the engine gets
    hide_final: bool
    strip_running: bool


def usage_options(options: Any) -> UsagePlan | None:
    """The stream options that make the engine report usage on every chunk and at the end, and what of it the
    client did not ask for; None when it asked for both itself (nothing to change). Its other options are kept.
    (vLLM sends running usage only with ``include_usage``: a client's ``continuous_usage_stats`` alone gets
    none.)"""
    options = options if isinstance(options, dict) else {}
    final = bool(options.get("include_usage"))
    running = final and bool(options.get("continuous_usage_stats"))
    if running:
        return None
    return UsagePlan({**options, "include_usage": True, "continuous_usage_stats": True}, not final, True)


def strip_running_usage(events: bytes) -> bytes:
    """Whole events without the running usage of their content chunks (the final usage event keeps its own):
    the bytes vLLM writes without ``continuous_usage_stats``. Substring searches, not a regular expression: this
    runs on every streamed block."""
    at = events.find(RUNNING_FIELD)
    if at < 0:
        return events
    parts, done = [], 0
    while at >= 0:
        end = _object_end(events, at + len(RUNNING_FIELD))
        if end < 0:
            break
        if events.endswith(EMPTY_CHOICES, 0, at):  # the final usage event's own: kept
            at = events.find(RUNNING_FIELD, end)
            continue
        parts.append(events[done:at])
        done = end
        at = events.find(RUNNING_FIELD, end)
    parts.append(events[done:])
    return b"".join(parts)


def _object_end(data: bytes, start: int) -> int:
    """Just past the ``}`` closing the JSON object whose ``{`` is at ``start - 1``, for an object of numbers, nulls
    and objects of those (vLLM's usage: no strings, so no brace inside one); -1 if it does not close."""
    depth = 1
    at = start
    while depth:
        close = data.find(b"}", at)
        if close < 0:
            return -1
        opened = data.count(b"{", at, close)
        depth += opened - 1
        at = close + 1
    return at


class RunningUsage:
    """The last running usage of one upstream leg, per sequence: what the engine had prefilled and generated by
    the last chunk the gateway read, and when the leg's reads came (its generation rate). One sequence (the common
    case) keeps only its first and last blocks with a report and reads them when asked: feeding costs a substring
    test a block; several sequences read every event (each choice reports its own)."""

    __slots__ = ("sequences", "prompts", "completions", "first_at", "last_at", "first_completion", "_first",
                 "_last")

    def __init__(self, sequences: int = 1) -> None:
        self.sequences = sequences  # choices the leg runs (prompts x n): one usage per choice index
        self.prompts: dict[int, int] = {}  # choice index -> its prompt's tokens
        self.completions: dict[int, int] = {}  # choice index -> tokens generated so far
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.first_completion = 0  # tokens generated by the first read (made before the rate's window opened)
        self._first: bytes | None = None  # one sequence: the first and the last block with a report, unread
        self._last: bytes | None = None

    def feed(self, raw: bytes, at: float) -> None:
        """Whole events as the engine sent them."""
        if RUNNING_MARK not in raw:
            return
        if self.first_at is None:
            self.first_at = at
            self._first = raw
        self.last_at = at
        if self.sequences == 1:
            self._last = raw
            return
        for event in split_events(raw):
            found, index = RUNNING.search(event), CHOICE_INDEX.search(event)
            if found is not None:
                choice = int(index.group(1)) if index is not None else 0
                self.prompts[choice], self.completions[choice] = int(found.group(1)), int(found.group(2))
        if self._first is raw:
            self.first_completion = sum(self.completions.values())

    def _read(self) -> None:
        """One sequence: its last report (and its first, for the rate), read now."""
        last, self._last = self._last, None
        if last is None:
            return
        found = RUNNING.search(last, last.rfind(RUNNING_MARK))
        if found is not None:
            self.prompts[0], self.completions[0] = int(found.group(1)), int(found.group(2))
        first, self._first = self._first, None
        if first is not None:
            found = RUNNING.search(first, first.rfind(RUNNING_MARK))
            self.first_completion = int(found.group(2)) if found is not None else 0

    @property
    def seen(self) -> bool:
        return self.first_at is not None

    def usage(self, n: int = 1) -> Usage:
        """The leg's usage so far: each prompt once (choice ``i`` answers prompt ``i // n``), every choice's
        completion tokens."""
        self._read()
        prompts: dict[int, int] = {}
        for choice, tokens in self.prompts.items():
            prompts.setdefault(choice // max(1, n), tokens)
        return Usage(sum(prompts.values()), sum(self.completions.values()))

    def rate(self) -> float | None:
        """Completion tokens per second between the leg's first and last reads (None: too few reads to tell)."""
        self._read()
        if self.first_at is None or self.last_at is None or self.last_at <= self.first_at:
            return None
        return (sum(self.completions.values()) - self.first_completion) / (self.last_at - self.first_at)


def final_usage(event: bytes) -> dict[str, Any] | None:
    """The usage of a stream's final usage event (``"choices": []`` with ``usage``), None for any other event
    (continuous usage stats on content chunks are running totals, not counted)."""
    if FINAL_USAGE not in event:
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

    vLLM puts ``system_fingerprint`` on a stream's finishing chunks when no usage event follows, and on the usage
    event when one does; the client must get it on the finishing chunks (as their last key, where vLLM writes it).
    When the engine's fingerprint is known beforehand (``expected``: the engine reported it before, see
    ``fingerprint``), every finishing chunk gets it as it comes and nothing is held. Otherwise a finishing chunk
    waits for the usage event, and only it: the other choices' chunks pass as they come (a client reassembles
    choices by ``index``, and each choice's finishing chunk is its last), so what is held is one event per choice
    at most, whatever the stream's length. A stream that ends without a usage event (an error event, ``[DONE]``)
    gets what is held first, as it came. Fed whole events; returns the bytes to send now. ``flush`` gives back
    what is held (the stream ended or broke)."""

    __slots__ = ("_held", "expected", "reported", "usage")

    def __init__(self, expected: Fingerprint | None = None) -> None:
        self._held: list[bytes] = []  # finishing chunks waiting for the usage event's fingerprint, in order
        self.expected = expected  # the leg's engine's fingerprint, when known before its usage event
        self.reported: Fingerprint | None = None  # the fingerprint the last usage event carried
        self.usage: dict[str, Any] | None = None  # the last usage event's usage (the engine's report)

    def feed(self, events: bytes) -> bytes:
        if FINAL_USAGE not in events and FINISH.search(events) is None and (
                not self._held or events.count(DATA) == events.count(CHOICE_CHUNK)):
            return events  # choices' tokens, nothing to hold or hide: a few scans of the block, no event-by-event work
        out: list[bytes] = []
        for event in split_events(events):
            final = final_usage(event) if FINAL_USAGE in event else None
            if final is not None:
                self.usage = final["usage"]
                self.reported = Fingerprint.of(final)
                out += (_with_fingerprint(held, self.reported.value) for held in self._held)
                self._held = []
            elif FINISH.search(event):
                if self.expected is None:
                    self._held.append(event)
                else:
                    out.append(_with_fingerprint(event, self.expected.value))
            elif self._held and CHOICE_CHUNK not in event:  # an error event, [DONE]: no usage event is coming
                out += (self.flush(), event)
            else:
                out.append(event)
        return b"".join(out)

    @property
    def held_bytes(self) -> int:
        return sum(len(held) for held in self._held)

    def flush(self) -> bytes:
        held, self._held = self._held, []
        return b"".join(held)


def _with_fingerprint(event: bytes, fingerprint: str | None) -> bytes:
    if fingerprint is None or not FINISH.search(event) or b'"system_fingerprint"' in event:
        return event
    body = event.rstrip(b"\n")
    if not body.endswith(b"}"):
        return event
    # As pydantic writes it (vLLM's models): UTF-8, not \u escapes
    return body[:-1] + b',"system_fingerprint":' + json.dumps(fingerprint, ensure_ascii=False).encode() + b"}\n\n"


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

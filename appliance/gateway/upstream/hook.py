"""The request path's extension point: hooks around one exchange's life, in the order the composition root gives.

The transport (``appliance.gateway.upstream.transport``) moves bytes: it takes a slot, opens the connection,
applies the retry rule and relays whole events. Everything else a request goes through (tenant metering,
migration, observation, the request record, and the next features) is a ``Hook``: built once per gateway, it looks
at each request as it arrives (``start``: check it, rewrite its body, refuse it) and returns the request's own
``RequestHook``, or None when the request is none of its business, so that a hook costs nothing on requests it
does not touch.

A ``RequestHook``'s methods fall in two groups, kept apart on purpose:

- **decisions** (``arrived``, ``queued``, ``admitted``, ``sending``, ``responding``, ``attempt_ended``,
  ``judge_error``, ``finished``): once per attempt or per request,
  where admission and routing run; all synchronous but ``arrived``, which may return an awaitable for a check
  that needs a round trip (the shared quota store), awaited in the hooks' order;
- **relay** (``relayed``, ``leg_closed``, ``held``, ``broke``): per block of whole events on their way to the
  client, and at a break.

The relay group reads and writes only its own state and the ``Block`` in hand; what it learns for the decision
group (tokens sent, usage, timings) it keeps in plain values read at ``finished``. So the relay could run in
another process than the decisions, exchanging plain data (a block's bytes in, a resolution or a placement request
out), which is the shape a multi-process gateway needs.

The order is declared once, in the composition root, as Envoy orders its filters: the request's side (``start``,
``arrived``, ``queued``, ``admitted``, ``sending``, ``responding``) runs the hooks in list order, the response's
side (``relayed``, ``leg_closed``, ``held``, ``broke``, ``finished``) in reverse, so the hook nearest the engine
sees its bytes first and the first hook sees what the client gets (and ends the request last); ``attempt_ended``
runs in list order. A block flows through the response side (each hook may rewrite ``block.out``), and bytes a
hook produces at a break (``Resolution.out``) flow through the hooks after it on that side.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

from appliance.gateway.routing.request import Decision
from appliance.gateway.routing.router import Outcome
from appliance.http.errors import APIError


class StreamBreak(Exception):
    """The upstream stream ended before it was whole (a hook saw it: an engine's error event, an abort, a stream
    closed before ``[DONE]``). ``status``: the code of the engine's error event, when it gave one."""

    def __init__(self, reason: str, detail: str, *, status: int | None = None) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.status = status


@dataclass(slots=True, eq=False)
class Attempt:
    """One replica's turn at a request: the first, a retry, a confirmation, a re-run or a stream's continuation."""

    replica: str
    started: float  # monotonic: when the replica was assigned (after any gateway queueing)
    queue_wait: float  # seconds waited for the slot
    decision: Decision | None  # why this replica (None: the router kept no explanation)
    kind: str = "first"  # first, retry, confirm (an engine's error answer tried elsewhere), rerun, continuation
    outcome: Outcome | None = None  # set when the attempt ended without an answer for the client
    reason: str | None = None
    sent_tokens: int = 0  # tokens the client had been sent when it ended (a stream that moves on)
    # Its connection dropped after the request was sent: an engine that died with it may have worked on it
    dropped: bool = False


@dataclass(slots=True)
class Block:
    """The bytes of one upstream read on their way to the client: whole events when a hook asked for framing, else
    the read as it came; for a non-streaming request, the whole body.

    ``raw`` is what the engine sent; ``out`` what the client will get (hooks rewrite it in order); ``events`` how
    many events ``raw`` holds (0 for bytes a hook produced); ``broke`` is set by a hook that found the stream
    broken after ``out``: the transport sends ``out`` first, then treats the stream as broken."""

    raw: bytes
    out: bytes
    at: float  # monotonic: when the read arrived
    events: int = 0
    broke: StreamBreak | None = None
    usage: dict[str, Any] | None = None  # the answer's final usage as the client's stream states it, once parsed


@dataclass(slots=True)
class Break:
    """A stream that broke after its response headers: the error, the replica it broke on, and why in one word.
    ``silent``: the leg had relayed no event yet (an idle timeout then means no first byte: a long prefill, or a
    hung engine)."""

    error: BaseException
    replica: str
    reason: str  # appliance.gateway.migration's break reasons
    at: float  # monotonic
    silent: bool = False


@dataclass(slots=True)
class Resolution:
    """A hook's answer to a break: bytes for the client (they flow through the hooks after it), and either the
    stream's end (``outcome``, ``status``) or ``resumed``: a new upstream leg is in place and relaying goes on."""

    out: bytes = b""
    outcome: Outcome = Outcome.FAILURE
    status: int = 502
    resumed: bool = False


@dataclass(slots=True)
class End:
    """How a request ended, for the decision group: the status the client got, the outcome the replica was judged
    on, and whether an engine answered at all (False: refused, queued out, left before an answer)."""

    status: int
    outcome: Outcome
    answered: bool
    at: float  # monotonic


class RequestHook:
    """One concern's part in one request's life. Every method is a no-op here: a hook overrides what it needs, and
    the chain calls a relay method only on the hooks that override it (``HookChain``)."""

    __slots__ = ()
    frames = False  # the relay must cut the stream into whole events for this hook

    # -- decisions ------------------------------------------------------------------------------------------------

    def arrived(self) -> Awaitable[None] | None:
        """Every hook has started: check the request before it queues (raise ``APIError`` to refuse it). A check
        that needs a round trip (a shared quota store) returns an awaitable instead, which may raise likewise: the
        chain awaits it before the next hook's ``arrived``, so the order holds; a hook that returns None costs no
        coroutine."""
        return None

    def queued(self, seconds: float) -> None:
        """The request waited ``seconds`` for a slot (whether it got one or not)."""

    def admitted(self, attempt: Attempt) -> None:
        """A replica took the request (an attempt begins; ``attempt.decision`` says why that one)."""

    def sending(self, attempt: Attempt, headers: dict[str, str]) -> None:
        """The attempt's request is about to go out: add headers (trace context)."""

    def responding(self, attempt: Attempt, headers: dict[str, str]) -> None:
        """The engine answered and the client's response is about to be built: add response headers."""

    def attempt_ended(self, attempt: Attempt) -> None:
        """An attempt ended without an answer for the client (``attempt.outcome``, ``attempt.reason``)."""

    def judge_error(self, attempt: Attempt) -> APIError | None:
        """The engine answered the attempt with an error of its own (``attempt.outcome`` is SERVER_ERROR: a 500 it
        raised for this request), which the engine or the input may have caused. Return the error that ends the
        request when the input is at fault (it is tried nowhere else); None: not known to be the input. Only when
        some hook overrides this does the transport try such a request once more elsewhere, to tell."""
        return None

    def finished(self, end: End) -> None:
        """The request is over: counted once, whatever happened."""

    # -- relay ----------------------------------------------------------------------------------------------------

    def relayed(self, block: Block) -> None:
        """A block on its way to the client: read it, rewrite ``block.out``, or set ``block.broke``."""

    def leg_closed(self) -> None:
        """The upstream leg ended cleanly: raise ``StreamBreak`` if it was not whole after all."""

    def held(self) -> bytes:
        """Bytes this hook still holds back (the stream ends or breaks here)."""
        return b""

    async def broke(self, brk: Break) -> Resolution | None:
        """The stream broke: resolve it (continue it elsewhere, close it, end it with an error) or pass (None)."""
        return None


RELAY_METHODS = ("relayed", "leg_closed", "held", "broke")


_OVERRIDES: dict[type, frozenset[str]] = {}


def _overrides(hook: RequestHook, method: str) -> bool:
    """Whether ``hook``'s class overrides a relay method (looked up once per class: a chain is built per
    request)."""
    cls = type(hook)
    found = _OVERRIDES.get(cls)
    if found is None:
        found = _OVERRIDES[cls] = frozenset(m for m in RELAY_METHODS
                                            if getattr(cls, m) is not getattr(RequestHook, m))
    return method in found


class HookChain:
    """One request's hooks, in the composition root's order (the response's side in reverse). Each relay method
    runs only the hooks that override it, so a feature that does not touch a request costs it nothing per event."""

    __slots__ = ("hooks", "frames", "_response", "_relayers", "_closers", "_holders", "_breakers", "_judges")

    def __init__(self, hooks: Sequence[RequestHook]) -> None:
        self.hooks = tuple(hooks)
        self.frames = any(h.frames for h in self.hooks)
        self._judges = tuple(h for h in self.hooks if type(h).judge_error is not RequestHook.judge_error)
        self._response = self.hooks[::-1]
        self._relayers = tuple(h for h in self._response if _overrides(h, "relayed"))
        self._closers = tuple(h for h in self._response if _overrides(h, "leg_closed"))
        self._holders = tuple(h for h in self._response if _overrides(h, "held"))
        self._breakers = tuple(h for h in self._response if _overrides(h, "broke"))

    def arrived(self) -> Awaitable[None] | None:
        """Each hook's check in list order; None when every hook decided at once (no coroutine made), else the
        awaitable that finishes the first pending check and runs the hooks after it."""
        for index, hook in enumerate(self.hooks):
            pending = hook.arrived()
            if pending is not None:
                return self._arrive_after(pending, index + 1)
        return None

    async def _arrive_after(self, pending: Awaitable[None], start: int) -> None:
        await pending
        for hook in self.hooks[start:]:
            more = hook.arrived()
            if more is not None:
                await more

    def queued(self, seconds: float) -> None:
        for hook in self.hooks:
            hook.queued(seconds)

    def admitted(self, attempt: Attempt) -> None:
        for hook in self.hooks:
            hook.admitted(attempt)

    def sending(self, attempt: Attempt, headers: dict[str, str]) -> None:
        for hook in self.hooks:
            hook.sending(attempt, headers)

    def responding(self, attempt: Attempt, headers: dict[str, str]) -> None:
        for hook in self.hooks:
            hook.responding(attempt, headers)

    def attempt_ended(self, attempt: Attempt) -> None:
        for hook in self.hooks:
            hook.attempt_ended(attempt)

    @property
    def judges_errors(self) -> bool:
        """Whether a hook judges the engines' error answers (``judge_error``)."""
        return bool(self._judges)

    def judge_error(self, attempt: Attempt) -> APIError | None:
        """The first hook's error that blames the input, in list order; None when none does."""
        for hook in self._judges:
            error = hook.judge_error(attempt)
            if error is not None:
                return error
        return None

    def finished(self, end: End) -> None:
        for hook in self._response:
            hook.finished(end)

    def relayed(self, block: Block) -> None:
        for hook in self._relayers:
            hook.relayed(block)

    def leg_closed(self) -> None:
        for hook in self._closers:
            hook.leg_closed()

    def held(self) -> bytes:
        return b"".join(hook.held() for hook in self._holders)

    async def broke(self, brk: Break) -> Resolution | None:
        """The first resolution on the response's side; its bytes then pass the relay hooks after that hook."""
        for hook in self._breakers:
            resolution = await hook.broke(brk)
            if resolution is None:
                continue
            if resolution.out:
                block = Block(b"", resolution.out, brk.at)
                after = self._response.index(hook) + 1
                for later in self._response[after:]:
                    if later in self._relayers:
                        later.relayed(block)
                resolution.out = block.out
            return resolution
        return None

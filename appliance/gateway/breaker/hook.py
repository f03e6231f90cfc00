"""The shape breaker on the request path: the hook nearest the engine but for revocation, so that it judges an
engine's error event and a silent idle timeout before migration would continue the stream elsewhere.

Per request (``GuardedRequest``):

- ``arrived``: while any shape is remembered, the request's shape is computed and an open breaker refuses it: 422
  ``request_fails_reproducibly``, before any queueing (``Breaker.admit``).
- An error answer of the engine's own (``Outcome.SERVER_ERROR``: a 500, from the transport's ``attempt_ended``;
  a 5xx error event, at the break) is recorded against the shape and the replica, and its verdict waits: the
  replica's slot was given back without counting it (``Router.server_errors_judged``). When the shape's breaker
  is open by then (the request failed on another healthy replica too, or others of its shape did), the input is
  at fault: the request ends with the 422 at once (``judge_error``; a stream's break is resolved with it), is tried
  nowhere else, and none of its failures on healthy replicas counts. Otherwise the transport or migration tries it
  once more elsewhere, which tells. At ``finished`` every verdict still waiting is given: the input's, or the
  engine's (``Router.engine_failed``: it counts toward ejection, as every failure did before).
- A stream that a hook does not frame (migration refused it, or is off) relays an engine's error event as it comes
  and ends as a success; the hook still finds the event in the bytes (one substring test per read) and records the
  failure against the shape (the slot was counted as served, as before: nothing to judge), so that a shape that
  fails that way opens its breaker too.
- A stream broken by the idle timeout before its first event (``Break.silent``): the hook asks the engine's /health.
  An engine that answers is working on a prefill longer than the timeout (a long prompt, or a queue inside the
  engine): the request's own length, like the whole-request timeout. It is not counted toward ejection and not
  sent again elsewhere (the prefill would be as long there); the client gets 504 ``upstream_timeout`` saying so.
  An engine that does not answer failed, as before. (The alternative, an idle timeout before the first byte that
  grows with the prompt, needs the hardware's prefill speed as a setting, and a wrong one counts long prefills
  again; /health needs nothing. What /health cannot tell is an engine core stuck with its server alive: its streams
  that had begun still time out mid-way and count, and its progress monitor flags it, appliance_replica_hung.)

Why 422: the request is well-formed, but it cannot be processed, on any replica, while those replicas serve other
requests: the input is at fault, as vLLM's own 422 (UnprocessableEntityError) says of inputs it understands but
cannot process. A 4xx is not retried by clients and SDKs (the OpenAI SDK retries 5xx and 429 twice by default: a
500 would make every client send the poison three times), and does not spend the appliance's availability budget
(5xx) on a client's input. Not 400 (nothing is malformed), not 429 (waiting does not help: the same input fails
again), not 503 (it tells clients and balancers to try again elsewhere). No Retry-After: the message says when
the breaker closes, but retrying the same input is not advised.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Protocol

from appliance.engine.contract import Replica
from appliance.gateway.breaker.circuit import Breaker
from appliance.gateway.breaker.shape import shape_of
from appliance.gateway.decisions import RoutingState
from appliance.gateway.migration.ledger import IDLE_TIMEOUT
from appliance.gateway.routing.router import Outcome
from appliance.gateway.upstream.exchange import Exchange
from appliance.gateway.upstream.failures import ENGINE_ERROR_REASON, error_answer, error_event, failure_outcome
from appliance.gateway.upstream.hook import Attempt, Block, Break, End, RequestHook, Resolution, StreamBreak
from appliance.http.errors import APIError

log = logging.getLogger(__name__)

REFUSED_CODE = "request_fails_reproducibly"
ERROR_MARK = b'data: {"error": '  # vLLM's stream error event (json.dumps' separators); never inside a JSON string
MAX_ERROR_EVENT = 65536  # bytes of an error event split across reads that are kept to read its code
FAULTS = ("input", "engine", "long_prefill")  # appliance_breaker_verdicts_total's labels


class HealthProbe(Protocol):
    """What the hook asks of the transport: whether an engine answers /health (the transport owns the pool)."""

    async def answers_health(self, replica: Replica, timeout_seconds: float) -> bool: ...


class ShapeBreaker:
    """The hook: built once with the breakers (None: ``breaker.enabled`` is off, only the long-prefill verdict
    runs), the router (the replicas, and where a verdict against an engine counts) and the health probe's limit."""

    name = "breaker"

    def __init__(self, breaker: Breaker | None, router: RoutingState, *, long_prefill: bool,
                 health_timeout_seconds: float, idle_timeout_seconds: float | None) -> None:
        self.breaker = breaker
        self.router = router
        self.long_prefill = long_prefill
        self.health_timeout_seconds = health_timeout_seconds
        self.idle_timeout_seconds = idle_timeout_seconds
        self.probe: HealthProbe | None = None  # the transport, once built (it takes the hooks first)
        self.verdicts = dict.fromkeys(FAULTS, 0)

    def start(self, exchange: Exchange) -> PrefillGuard | None:
        if self.breaker is not None:
            return GuardedRequest(self, exchange, self.breaker)
        return PrefillGuard(self, exchange) if self.long_prefill and exchange.stream else None

    def counted(self) -> Iterable[tuple[str, int]]:
        return self.verdicts.items()

    def judged(self, fault: str) -> None:
        self.verdicts[fault] += 1

    def replica(self, name: str) -> Replica | None:
        return next((r for r in self.router.replicas() if r.name == name), None)

    def refusal(self, seconds: float, failed: str | None = None) -> APIError:
        """The error a request of a shape at fault gets (``failed``: what the engine answered this one)."""
        assert self.breaker is not None
        settings = self.breaker.settings
        answered = f" (it answered: {failed})" if failed else ""
        return APIError(422, f"this request makes the model server fail{answered} on {settings.replicas} replicas "
                             "that serve other requests well; the same request (model, prompt or messages, sampling "
                             f"parameters) is refused for the next {seconds:.0f} s without reaching an engine. "
                             "Retrying it unchanged will not help: change the request, or report it to the operator "
                             "with its x-appliance-request-id.", code=REFUSED_CODE)


class PrefillGuard(RequestHook):
    """One stream's long-prefill verdict (all a request gets with ``breaker.enabled`` off)."""

    __slots__ = ("owner", "exchange")

    def __init__(self, owner: ShapeBreaker, exchange: Exchange) -> None:
        self.owner = owner
        self.exchange = exchange

    async def broke(self, brk: Break) -> Resolution | None:
        if brk.silent and brk.reason == IDLE_TIMEOUT and self.owner.long_prefill:
            return await self._silent_break(brk)
        return None

    async def _silent_break(self, brk: Break) -> Resolution | None:
        """No first byte within the idle timeout: a long prefill when the engine answers /health."""
        owner, replica = self.owner, self.owner.replica(brk.replica)
        if replica is None or owner.probe is None:
            return None
        if not await owner.probe.answers_health(replica, owner.health_timeout_seconds):
            return None
        owner.judged("long_prefill")
        log.warning("%s sent no first byte within the idle timeout but answers /health: a long prefill, not counted "
                    "against it", brk.replica)
        self.exchange.settle(Outcome.TIMED_OUT)
        self.exchange.end_attempt(Outcome.TIMED_OUT, "long prefill: no first byte within the idle timeout")
        timeout = f" ({owner.idle_timeout_seconds:g} s)" if owner.idle_timeout_seconds else ""
        error = APIError(504, f"the model server sent no first token within gateway.upstream_idle_timeout_seconds"
                              f"{timeout} while it answered its health check: a prefill this long is the request's "
                              "own length, so it is neither held against the replica nor sent again elsewhere; "
                              "shorten the prompt, or ask the operator to raise the timeout", code="upstream_timeout")
        return Resolution(error_event(error, error.message), Outcome.TIMED_OUT, 504)


class GuardedRequest(PrefillGuard):
    """One request's shape, its error answers awaiting a verdict, and whether it is a half-open trial."""

    __slots__ = ("breaker", "_shape", "pending", "trial", "errored", "partial", "failed_with")

    def __init__(self, owner: ShapeBreaker, exchange: Exchange, breaker: Breaker) -> None:
        super().__init__(owner, exchange)
        self.breaker = breaker
        self._shape: bytes | None = None  # computed when first needed
        self.pending: list[Attempt] = []  # attempts whose SERVER_ERROR awaits a verdict
        self.trial = False  # let through as its shape's half-open trial
        self.errored = False  # an engine's error answer or event was seen: the request was not served in full
        self.partial: bytes | None = None  # the start of an error event split across reads
        self.failed_with: str | None = None  # what the engine last answered, for the client's error

    # -- decisions ------------------------------------------------------------------------------------------------

    def arrived(self) -> None:
        if not self.breaker.watching:
            return
        shape = self.shape()
        if shape is None:
            return
        admission = self.breaker.admit(shape)
        if admission.refused_for is not None:
            raise self.owner.refusal(admission.refused_for)
        self.trial = admission.trial

    def attempt_ended(self, attempt: Attempt) -> None:
        if attempt.outcome is Outcome.SERVER_ERROR:
            if attempt.reason and attempt.reason.startswith(ENGINE_ERROR_REASON):
                self.failed_with = attempt.reason.removeprefix(ENGINE_ERROR_REASON)
            self.failed(attempt)

    def judge_error(self, attempt: Attempt) -> APIError | None:
        return self.blamed(attempt.replica)

    def finished(self, end: End) -> None:
        """Every verdict still waiting is given; a request served in full is evidence for its replica's health
        and clears its shape; a trial that ended with neither lets the next one try."""
        breaker, owner = self.breaker, self.owner
        for attempt in self.pending:
            if self._shape is not None and breaker.at_fault(self._shape, attempt.replica):
                owner.judged("input")
            else:
                owner.judged("engine")
                owner.router.engine_failed(attempt.replica)
        attempts = self.exchange.attempts
        if end.status == 200 and end.outcome is Outcome.SUCCESS and not self.errored and attempts:
            breaker.served(attempts[-1].replica, self.shape() if breaker.watching else None)
        elif self.trial and self._shape is not None:
            breaker.trial_ended(self._shape)

    # -- relay ----------------------------------------------------------------------------------------------------

    def relayed(self, block: Block) -> None:
        """Finds an engine's error event in the bytes: in a stream no hook frames for a break it is the only
        trace of one (one substring test per read)."""
        raw = block.raw
        if self.partial is not None:
            raw, self.partial = self.partial + raw, None
        elif ERROR_MARK not in raw:
            return
        start = raw.find(ERROR_MARK)
        while start >= 0:
            end = raw.find(b"\n\n", start)
            if end < 0:
                if len(raw) - start <= MAX_ERROR_EVENT:
                    self.partial = raw[start:]
                return
            self._error_event(raw[start + len(b"data: "):end])
            start = raw.find(ERROR_MARK, end)

    async def broke(self, brk: Break) -> Resolution | None:
        exc = brk.error
        if isinstance(exc, StreamBreak) and failure_outcome(exc) is Outcome.SERVER_ERROR:
            return self._error_break(exc)
        return await super().broke(brk)

    # -- inside ---------------------------------------------------------------------------------------------------

    def shape(self) -> bytes | None:
        if self._shape is None:
            body = self.exchange.parsed()
            if body is not None:
                self._shape = shape_of(self.exchange.route, body)
        return self._shape

    def failed(self, attempt: Attempt) -> None:
        """An attempt's SERVER_ERROR: recorded against the shape; its verdict waits (once per attempt)."""
        self.errored = True
        if any(a is attempt for a in self.pending):
            return
        self.pending.append(attempt)
        self._record(attempt.replica)

    def blamed(self, replica: str) -> APIError | None:
        """The error that ends the request when its input is at fault for its failure on ``replica``."""
        breaker, shape = self.breaker, self._shape
        if shape is None or not breaker.at_fault(shape, replica):
            return None
        log.warning("a request failed on %s with an error its input causes on %d replicas; its shape is refused",
                    replica, breaker.settings.replicas)
        return self.owner.refusal(breaker.settings.cooldown_seconds, self.failed_with)

    def _record(self, replica: str) -> None:
        shape = self.shape()
        if shape is not None:
            self.breaker.failed(shape, replica)

    def _error_event(self, data: bytes) -> None:
        """One error event of the engine's in a stream: an error answer of its own is recorded against the shape
        (where migration frames the stream, its break is then judged too)."""
        try:
            error = json.loads(data).get("error")
        except (ValueError, AttributeError):
            return
        if not isinstance(error, dict):
            return
        message, status = str(error.get("message")), error.get("code")
        if isinstance(status, int) and error_answer(status, message) and self.exchange.attempts:
            self.errored = True
            self.failed_with = f"HTTP {status}, {message[:200]}"
            self._record(self.exchange.attempt.replica)

    def _error_break(self, exc: StreamBreak) -> Resolution | None:
        """A stream the engine ended with an error event of its own: when the input is at fault it ends with the
        422 (not continued elsewhere); else migration may continue it, which tells."""
        attempt = self.exchange.attempt
        self.failed_with = f"HTTP {exc.status}, {exc.detail[:200]}"
        self.failed(attempt)
        error = self.blamed(attempt.replica)
        if error is None:
            return None
        self.exchange.settle(Outcome.SERVER_ERROR)
        return Resolution(error_event(error, error.message), Outcome.CLIENT_ERROR, error.status)

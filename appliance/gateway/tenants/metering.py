"""Tenant metering as a hook around a request's life: the quota's reservation before it queues, the engines' usage
asked for and hidden, and the tenant's answer and usage counted, and its reservation settled, at the end.

The tenant's quotas reserve the request's worst case before it queues (``quota.Reservation``; 400 when it could
never fit, 429 with Retry-After when it does not fit now); with several gateways the buckets are in a shared
store (``quota_store``), reached by a round trip the hook chain awaits, and settled off the response path.
Streams ask the engine for usage on every chunk and at the end (``usage.usage_options``) and the relay hides what
the client did not ask for, so the client's bytes are those it would have had. At the end, what the request used
is settled:

- the engines' final usage, every leg of a continued stream;
- a leg that ended without one (its client left, its engine broke off, a continuation took over): the last
  running usage the engine sent, and, when the client left, the tokens the engine made between the last chunk the
  gateway read and the abort (``tail_tokens``: the leg's own rate over that gap);
- a non-streaming request that reached an engine but got no answer because its client left or it timed out: its
  engine's progress cannot be seen, so its prompt (the gateway's estimate, scaled as engines counted the prompts it
  estimated before) and what its replica's recent streams say the engine made in the time it had
  (``progress.EngineProgress``), within its reservation; its whole reservation when no stream ran there lately
  (docs/tenants.md says why). The same for each leg of one whose connection dropped after it was sent (its
  engine died, or a drain outlasted its timeout; vLLM sends a non-streaming answer's headers with its body, so
  that is before any answer) and that ran again: the dead leg's work was done, and no report of it will come. A
  leg that dropped within ``STALE_SECONDS`` is not: a pooled connection its engine had closed fails as the
  request is written, before any engine saw it;
- a request that never reached an engine: nothing, and its reservation goes back whole.

Each replica's share of what was charged (every leg's report goes to the replica that did that leg, with the
sequences its engine finished) is told to the reconciliation (``tenants.reconcile``), which compares it with that
engine's own counters. So is the estimate, on the replica of the leg it stands for: the reconciliation charges it
to the tenant, as estimated or, once that replica comes to rest, as its share of what the engine counted
(``tenants.settlement``).

Engine-reported tokens count as ``prompt`` / ``completion``; the work no engine reported (the tail, a
non-streaming request's estimate or reservation, the prompt of a stream left before its first chunk) as
``estimated``. The quota is settled to the reports plus the estimate at the request's end, fair share is charged
the same.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from appliance.gateway.decisions import AdmissionState, ChargeLedger, Held, QuotaStore
from appliance.gateway.routing.router import Outcome
from appliance.gateway.tenants.accounting import TenantAccounting
from appliance.gateway.tenants.cost import request_cost
from appliance.gateway.tenants.fingerprint import EngineKey, Fingerprint, Fingerprints, engine_key
from appliance.gateway.tenants.progress import EngineProgress
from appliance.gateway.tenants.quota import Cost, Quotas, Refusal
from appliance.gateway.tenants.quota_store import StoreUnavailable, limits_of
from appliance.gateway.tenants.reconcile import Reconciliation
from appliance.gateway.tenants.usage import (
    FINAL_USAGE,
    HiddenUsage,
    RunningUsage,
    Usage,
    UsagePlan,
    body_usage,
    events_usage,
    final_usage,
    strip_running_usage,
    usage_options,
)
from appliance.gateway.upstream.exchange import Exchange
from appliance.gateway.upstream.hook import Attempt, Block, End, RequestHook
from appliance.gateway.upstream.sse import split_events
from appliance.http.errors import APIError

CLIENT_GONE = 499  # the transport's status for a client that left
UNSEEN_STATUSES = (CLIENT_GONE, 504)  # a non-streaming answer whose progress the gateway never saw: left, timed out
STALE_SECONDS = 0.05  # a dropped leg shorter than this never reached an engine that worked on it


class Metering:
    """The hook: built once with the tenants' accounting, quotas and the admission queue's fair share, and the
    model's context length (the worst case of a request without ``max_tokens``)."""

    name = "metering"

    def __init__(self, accounting: TenantAccounting, quotas: Quotas, admission: AdmissionState,
                 max_model_len: int | None = None, reconciliation: ChargeLedger | None = None,
                 shared: QuotaStore | None = None, progress: EngineProgress | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``shared``: quota buckets outside this process, the store shared by several gateways or a worker's
        decider (None: ``quotas``, this process's buckets). ``clock``: monotonic seconds, as attempts' starts."""
        self.accounting = accounting
        self.quotas = quotas
        self.shared = shared
        self.admission = admission
        # What each engine writes as its fingerprint: its streams' finishing chunks need not wait for the usage event
        self.fingerprints = Fingerprints(lambda: [replica.name for replica in admission.router.replicas()])
        self.max_model_len = max_model_len
        self.reconciliation = (reconciliation if reconciliation is not None
                               else Reconciliation(accounting.estimated))
        # What the streams show of each replica's progress, for the non-streaming answers that show none
        self.progress = progress if progress is not None else EngineProgress()
        self.clock = clock

    def start(self, exchange: Exchange) -> MeteredRequest:
        body = exchange.parsed()
        cost = request_cost(exchange.route, body, exchange.routing.prompt, self.max_model_len)
        plan = usage_options(body.get("stream_options")) if exchange.stream and body is not None else None
        if plan is not None:
            exchange.override("stream_options", plan.options)
        return MeteredRequest(self, exchange, cost, plan)


def tail_tokens(running: RunningUsage, closed_at: float, room: int) -> int:
    """What an engine generated of a stream after the last chunk the gateway read, until the connection closed
    and the engine aborted it: the leg's own rate over that gap (tokens the relay had not read yet: in the
    socket's buffers while the client was slow to take them), never more than the ``room`` its reservation had
    left. (vLLM aborts a request within a step of its connection closing: measured on a real engine, under 0.2
    tokens a stream beyond what the gateway had read, so no step is added.)"""
    if not running.seen or running.last_at is None:
        return 0
    rate = running.rate() or 0.0
    gap = max(0.0, closed_at - running.last_at)
    return max(0, min(room, round(rate * gap)))


def _give_back(reserving: asyncio.Future[Held | Refusal | None]) -> None:
    """A reservation taken for a request that is gone: refunded (a refusal or a failure took nothing)."""
    if reserving.cancelled() or reserving.exception() is not None:
        return
    held = reserving.result()
    if held is not None and not isinstance(held, Refusal):
        held.refund()


class MeteredRequest(RequestHook):
    """One request's metering."""

    __slots__ = ("meter", "exchange", "cost", "plan", "hidden", "reservation", "running", "legs", "first",
                 "frames", "leg", "placed", "engine", "finished_on", "broken")

    def __init__(self, meter: Metering, exchange: Exchange, cost: Cost, plan: UsagePlan | None) -> None:
        self.meter = meter
        self.exchange = exchange
        self.cost = cost  # the worst case: what the quota reserves
        self.plan = plan  # the usage the gateway asked the engine for and the client did not (streams)
        self.hidden = HiddenUsage() if plan is not None and plan.hide_final else None
        self.engine: EngineKey | None = None  # the engine of the current leg
        self.reservation: Held | None = None
        self.running: RunningUsage | None = RunningUsage(cost.requests) if exchange.stream else None
        self.legs = Usage()  # running usage of legs that ended without a final report
        self.first: float | None = None  # when the first event was relayed
        self.frames = exchange.stream  # reading the usage events, and hiding them, needs whole events
        self.leg: str | None = None  # the replica of the leg ``running`` reads
        self.placed: dict[str, Usage] = {}  # replica -> the usage reported (or run) there, every leg
        self.finished_on: dict[str, int] = {}  # replica -> sequences its engine finished (their usage came back)
        self.broken: list[tuple[str, Usage]] = []  # replica, estimate: non-streaming legs whose connection dropped

    # -- decisions ------------------------------------------------------------------------------------------------

    def arrived(self) -> Awaitable[None] | None:
        """The tenant's quotas, before the request queues: its worst case reserved, or refused. With a shared
        store, a round trip (awaited by the hook chain); a tenant without a quota makes none."""
        shared = self.meter.shared
        if shared is None:
            self._hold(self.meter.quotas.reserve(self.exchange.tenant, self.cost))
            return None
        if not any(limits_of(self.exchange.tenant)):
            return None
        return self._reserve_shared(shared)

    async def _reserve_shared(self, shared: QuotaStore) -> None:
        """The shared store's answer; when it has none, the direction the operator chose: admitted unchecked
        (open) or refused 503 (closed), counted either way. A request cancelled while the store answers (the
        gateway shutting down) gives back whatever the store took for it once the answer comes."""
        reserving = asyncio.ensure_future(shared.reserve(self.exchange.tenant, self.cost))
        try:
            held = await asyncio.shield(reserving)
        except asyncio.CancelledError:
            reserving.add_done_callback(_give_back)
            raise
        except StoreUnavailable as exc:
            if shared.fails_open:
                shared.count_unchecked("open")
                if exc.unsent:  # the store took nothing: what the request uses is charged at its end
                    self.reservation = shared.admit_unchecked(self.exchange.tenant, self.cost)
                return
            shared.count_unchecked("closed")
            raise APIError(503, "the quota store is unreachable, so this request's quota cannot be checked; retry "
                           f"in {shared.retry_after_seconds} s", code="quota_store_unavailable",
                           headers={"Retry-After": str(shared.retry_after_seconds)}) from None
        self._hold(held)

    def _hold(self, held: Held | Refusal | None) -> None:
        """The reservation kept, or the refusal raised: 400 when it can never fit, else 429 with Retry-After."""
        tenant = self.exchange.tenant
        if not isinstance(held, Refusal):
            self.reservation = held
            return
        if held.never:
            raise APIError(400, held.message, param="max_tokens" if held.limit == "tokens" else "n",
                           code="exceeds_quota")
        self.meter.accounting.limited(tenant.name, held.limit)
        raise APIError(429, held.message, code="rate_limit_exceeded", headers={"Retry-After": str(held.retry_after)})

    def queued(self, seconds: float) -> None:
        self.meter.accounting.queue_wait.labels(self.exchange.tenant.name).observe(seconds)

    def admitted(self, attempt: Attempt) -> None:
        """A new leg begins: the last one's running usage, if it never reported, is what it used."""
        self._close_leg()
        self.leg = attempt.replica
        self.engine = engine_key(self.exchange.replica)
        if self.hidden is not None:  # a continuation's chunks are the gateway's rewrite: no fingerprint to add
            self.hidden.expected = (None if attempt.kind == "continuation"
                                    else self.meter.fingerprints.known(self.engine))

    def attempt_ended(self, attempt: Attempt) -> None:
        """A non-streaming leg whose connection dropped after it was sent: what its engine's pace says it made
        from its dispatch until now, estimated on its replica (a stream's legs show their own progress)."""
        seconds = self.meter.clock() - attempt.started
        if attempt.dropped and not self.exchange.stream and seconds >= STALE_SECONDS:
            self.broken.append((attempt.replica, self._unseen_leg(attempt.replica, seconds)))

    def finished(self, end: End) -> None:
        """The tenant's answer and usage; the reservation settled to what was used (refunded whole when no
        engine was reached); fair share charged the same."""
        meter, exchange, tenant = self.meter, self.exchange, self.exchange.tenant
        meter.accounting.answered(tenant.name, end.status)
        if end.outcome is Outcome.SUCCESS and self.first is not None and exchange.stream:
            meter.accounting.ttft.labels(tenant.name).observe(self.first - exchange.arrived)
        if not exchange.attempts and exchange.usage is None:  # refused, queued out: no engine did anything
            if self.reservation is not None:
                self.reservation.refund()
            return
        unreported = self._unreported(end)
        estimated = (unreported.total if unreported is not None else 0) + sum(leg.total for _, leg in self.broken)
        self._close_leg()
        reported = (exchange.usage or Usage()) + self.legs
        if reported.total or reported.cached_prompt:
            meter.accounting.used(tenant.name, reported)
        if len(exchange.attempts) == 1:  # a continuation's prompt holds the tokens sent: not the one estimated
            meter.progress.prompt_counted(self.cost.prompt, reported.prompt)
        used = reported.total + estimated
        if self.reservation is not None:
            self.reservation.settle(used)
        if used:
            meter.admission.charge(tenant, used)
        self._reconcile(unreported, reported)

    def _reconcile(self, unreported: Usage | None, reported: Usage) -> None:
        """Each replica's share of the reports, its prompts once per sequence as its engine counts them, and the
        sequences it finished; the estimate goes to the last leg's replica, the one whose work it stands for,
        which charges the tenant (``reconcile.Reconciliation.unseen``)."""
        n, ledger = self._n(), self.meter.reconciliation
        for replica in self.placed.keys() | self.finished_on.keys():
            usage = self.placed.get(replica, Usage())
            ledger.charged(replica, usage.prompt * n, usage.completion, self.finished_on.get(replica, 0))
        tenant = self.exchange.tenant.name
        for replica, leg in self.broken:
            ledger.unseen(replica, tenant, n, leg.prompt * n, leg.completion, self.cost.completion)
        if unreported is None:
            return
        if self.leg is None:
            self.meter.accounting.estimated(tenant, unreported.total)
            return
        room = max(unreported.completion, self.cost.completion - reported.completion)
        ledger.unseen(self.leg, tenant, n, unreported.prompt * n, unreported.completion, room)

    def _place(self, replica: str | None, usage: Usage | None) -> None:
        if replica is not None and usage is not None and usage.total:
            placed = self.placed.get(replica)
            self.placed[replica] = usage if placed is None else placed + usage

    def _finished(self) -> None:
        """The current leg's engine finished its sequences (its usage came back): the reconciliation checks the
        engine counted those and no others before trusting its counters for unseen work."""
        if self.leg is not None:
            self.finished_on[self.leg] = self.finished_on.get(self.leg, 0) + self.cost.requests

    def _learn(self, running: RunningUsage) -> None:
        """A stream leg's progress, told to the estimate of answers that show none (one sequence's rate)."""
        rate = running.rate()
        if self.leg is not None and rate is not None and running.first_at is not None:
            self.meter.progress.learned(self.leg, rate / max(1, running.sequences),
                                        running.first_at - self.exchange.dispatched)

    def _close_leg(self) -> None:
        running = self.running
        if running is not None and running.seen:
            self._learn(running)
            leg = running.usage(self._n())
            self.legs = self.legs + leg
            self._place(self.leg, leg)
            self.running = RunningUsage(self.cost.requests)

    def _unreported(self, end: End) -> Usage | None:
        """The gateway's estimate of work no engine reported, as prompt and completion: None where the engine
        reported all of it; an estimate (0 where nothing shows) where it may have done more than it said."""
        exchange = self.exchange
        if not exchange.stream:
            if exchange.usage is not None or end.status not in UNSEEN_STATUSES:
                return None
            return self._unseen_leg(self.leg, end.at - exchange.dispatched)
        if end.status != CLIENT_GONE:
            return None
        running = self.running
        if running is None or not running.seen:
            if exchange.usage is not None:
                return None  # left after its engine's final report: nothing unseen
            return Usage() if self.legs.total else Usage(self.meter.progress.prompt(self.cost.prompt))
        done = (exchange.usage or Usage()).completion + self.legs.completion + running.usage(self._n()).completion
        return Usage(completion=tail_tokens(running, end.at, max(0, self.cost.completion - done)))

    def _unseen_leg(self, replica: str | None, seconds: float) -> Usage:
        """A non-streaming leg that ran ``seconds`` on ``replica`` and never answered: its prompt and what the
        replica's recent streams say it made in that time, within the reservation (all of it, with no stream)."""
        made = None if replica is None else self.meter.progress.completion(replica, self.cost.requests, seconds)
        return Usage(self.meter.progress.prompt(self.cost.prompt),
                     self.cost.completion if made is None else min(self.cost.completion, made))

    def _n(self) -> int:
        body = self.exchange.parsed()
        n = body.get("n") if body is not None else None
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1

    # -- relay ----------------------------------------------------------------------------------------------------

    def relayed(self, block: Block) -> None:
        if block.events and self.first is None:
            self.first = block.at
        if not self.exchange.stream:
            usage = body_usage(block.raw) if block.usage is None else block.usage
            block.usage = usage
            self.exchange.reported(usage)
            self._place(self.leg, Usage.of(usage))
            if usage is not None:
                self._finished()
            return
        raw = block.raw
        if FINAL_USAGE in raw:
            for event in split_events(raw):
                if (final := final_usage(event)) is not None:
                    self.exchange.reported(final["usage"])  # as the engine reported it, every leg
                    self._place(self.leg, Usage.of(final["usage"]))
                    self._finished()
                    if self.engine is not None:
                        self.meter.fingerprints.learn(self.engine, Fingerprint.of(final))
                    if self.running is not None:
                        self._learn(self.running)
                    self.running = RunningUsage(self.cost.requests)  # this leg is accounted for
                    raw = b""
        if raw and self.running is not None:
            self.running.feed(raw, block.at)
        if self.plan is None:
            return
        if self.plan.strip_running:
            block.out = strip_running_usage(block.out)
        if self.hidden is not None:
            if FINAL_USAGE in block.out and block.usage is None:
                block.usage = events_usage(block.out)  # what the client's answer states, before it is hidden
            block.out = self.hidden.feed(block.out)

    def held(self) -> bytes:
        return b"" if self.hidden is None else self.hidden.flush()

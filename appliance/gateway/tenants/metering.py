"""Tenant metering as a hook around a request's life: the quota check before it queues, charges while it streams,
the engines' usage asked for and hidden, and the tenant's answer and usage counted at the end.

The tenant's quotas are checked before the request queues (429 ``rate_limit_exceeded`` with Retry-After); the
prompt's estimate is charged then, and a stream's completion tokens one per event as they are relayed, so a long
stream spends its quota while it runs. At the end the engines' usage (every leg of a continued stream) corrects the
quota's and fair share's charges. A stream whose client did not ask for usage asks the engine for it anyway, and
the relay hides that event, so the client's bytes are those it would have had.
"""

from __future__ import annotations

from appliance.gateway.admission.queue import Admission
from appliance.gateway.routing.router import Outcome
from appliance.gateway.tenants.accounting import TenantAccounting
from appliance.gateway.tenants.quota import Quotas, estimate_prompt_tokens
from appliance.gateway.tenants.usage import USAGE, HiddenUsage, ask_for_usage, body_usage, events_usage, final_usage
from appliance.gateway.upstream.exchange import Exchange
from appliance.gateway.upstream.hook import Block, End, RequestHook
from appliance.gateway.upstream.sse import split_events
from appliance.http.errors import APIError


class Metering:
    """The hook: built once with the tenants' accounting, quotas and the admission queue's fair share."""

    name = "metering"

    def __init__(self, accounting: TenantAccounting, quotas: Quotas, admission: Admission) -> None:
        self.accounting = accounting
        self.quotas = quotas
        self.admission = admission

    def start(self, exchange: Exchange) -> MeteredRequest:
        hidden = _ask_for_usage(exchange) if exchange.stream else None
        return MeteredRequest(self, exchange, hidden)


def _ask_for_usage(exchange: Exchange) -> HiddenUsage | None:
    """A stream whose client did not ask for usage asks the engine for it (accounting counts what the engine
    reports); the relay then hides it from the client."""
    body = exchange.parsed()
    if body is None:
        return None
    asked = ask_for_usage(exchange.body, body)
    if asked is None:
        return None
    exchange.body = asked
    return HiddenUsage()


class MeteredRequest(RequestHook):
    """One request's metering."""

    __slots__ = ("meter", "exchange", "hidden", "charged", "first", "frames")

    def __init__(self, meter: Metering, exchange: Exchange, hidden: HiddenUsage | None) -> None:
        self.meter = meter
        self.exchange = exchange
        self.hidden = hidden  # the usage event the gateway asked for and the client did not
        self.charged = 0  # tokens charged to the tenant's quota so far (estimate, then one per streamed event)
        self.first: float | None = None  # when the first event was relayed
        self.frames = exchange.stream  # reading the usage event, and hiding it, needs whole events

    def arrived(self) -> None:
        """The tenant's quotas, before the request queues: a 429 with Retry-After when spent; else one request
        taken and the prompt's estimate charged (the engine's usage corrects it at the end)."""
        tenant = self.exchange.tenant
        estimate = estimate_prompt_tokens(self.exchange.routing.prompt or None)
        refusal = self.meter.quotas.admit(tenant, estimate)
        if refusal is None:
            self.charged = estimate
            return
        self.meter.accounting.limited(tenant.name, refusal.limit)
        raise APIError(429, refusal.message, code="rate_limit_exceeded",
                       headers={"Retry-After": str(refusal.retry_after)})

    def queued(self, seconds: float) -> None:
        self.meter.accounting.queue_wait.labels(self.exchange.tenant.name).observe(seconds)

    def relayed(self, block: Block) -> None:
        if block.events:  # completion tokens as they stream, one per event
            if self.first is None:
                self.first = block.at
            self.meter.quotas.charge(self.exchange.tenant, block.events)
            self.charged += block.events
        if not self.exchange.stream:
            usage = body_usage(block.raw) if block.usage is None else block.usage
            block.usage = usage
            self.exchange.reported(usage)
            return
        if USAGE in block.raw:
            for event in split_events(block.raw):
                if (final := final_usage(event)) is not None:
                    self.exchange.reported(final["usage"])  # as the engine reported it, every leg
        if self.hidden is not None:
            if USAGE in block.out and block.usage is None:
                block.usage = events_usage(block.out)  # what the client's answer states, before it is hidden
            block.out = self.hidden.feed(block.out)

    def held(self) -> bytes:
        return b"" if self.hidden is None else self.hidden.flush()

    def finished(self, end: End) -> None:
        """The tenant's answer and usage; its quota and fair-share charges corrected to what the engines
        reported (a usage never reported leaves the charges as they were: the estimate and the events
        streamed)."""
        meter, tenant, usage = self.meter, self.exchange.tenant, self.exchange.usage
        meter.accounting.answered(tenant.name, end.status)
        if end.outcome is Outcome.SUCCESS and self.first is not None and self.exchange.stream:
            meter.accounting.ttft.labels(tenant.name).observe(self.first - self.exchange.arrived)
        if usage is None:
            return
        meter.accounting.used(tenant.name, usage)
        meter.quotas.charge(tenant, usage.total - self.charged)
        self.charged = usage.total
        meter.admission.charge(tenant, usage.total)


"""The tenant's priority inside the engine: the gateway writes each request's vLLM ``priority``.

Why: the gateway's fair share orders its own queue, but every request it has dispatched waits in the engine's
queue in arrival order (vLLM's default, ``fcfs``) whenever the engine holds more requests than it runs at once
(``engine.max_num_seqs``), and under KV-cache pressure the engine preempts the latest arrival, whoever it is.
With ``engine.scheduling_policy: priority`` vLLM orders its waiting requests by ``priority`` (lower first, then
arrival) and preempts the highest number first, so the gateway sets it: the tenant's priority first, then its
fair-share standing, so a tenant over its share goes behind one under it at the same priority:

    priority = (9 - tenant.priority) * 2 + (1 if the tenant is over its fair share else 0)

(``Admission.over_share``: its served tokens by weight ahead of the least served active tenant of its priority.)
Batch work (``Exchange.background``: appliance.batch) gets ``BACKGROUND``, behind every interactive request of any
tenant, so a batch line already inside the engine never holds back an interactive one, and is the first preempted
under KV-cache pressure.
It is decided for each attempt, when a replica takes the request, and only for a replica whose engine said it
schedules by priority (the engine's guard reports the policy vLLM runs on its ``/metrics`` answers, read by the
load poll). An engine that does not (``fcfs``, or one the appliance does not run, which says nothing) gets no
priority: vLLM versions differ on a priority they do not use (0.32 ignores it, earlier ones refuse the request),
and the gateway's own fair share, which always applies, is then the only one. A client never sets its own: a
``priority`` in its body is replaced by the gateway's, or by 0 where the engine does not schedule by it (and
vLLM's ``X-Vllm-Priority`` header is not forwarded, as no client header is but the content type and request id).

The same hook tells admission when each attempt's first token comes back (``Lease.first_token``): the engine's
other scheduling lever the gateway holds is how many of an over-share tenant's requests are in prefill at once
(``admission.over_share_prefills``), since priority orders only requests that wait inside the engine. A
non-streaming answer shows no first token: it is not counted as in prefill at all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from appliance.engine.load import EngineLoad
from appliance.gateway.decisions import AdmissionState
from appliance.gateway.tenants.directory import Tenant
from appliance.gateway.upstream.exchange import Exchange
from appliance.gateway.upstream.hook import Attempt, Block, RequestHook

FIELD = "priority"
PRIORITY = "priority"  # the policy that reads the field
MAX_TENANT_PRIORITY = 9  # tenants' priority is 0-9, higher first (tenants/settings.py)
BACKGROUND = (MAX_TENANT_PRIORITY + 1) * 2  # batch work: after the last interactive priority (19)


def reported_policy(loads: Callable[[], Mapping[str, EngineLoad]]) -> Callable[[str], str | None]:
    """Replica name -> the scheduling policy its engine last reported (its last /metrics reading; None: unknown)."""

    def policy_of(name: str) -> str | None:
        load = loads().get(name)
        return None if load is None else load.scheduling_policy

    return policy_of


def engine_priority(tenant: Tenant, over_share: bool, background: bool = False) -> int:
    """vLLM's priority (lower first) for a request of ``tenant`` (``background``: batch work, last of all)."""
    if background:
        return BACKGROUND
    return (MAX_TENANT_PRIORITY - tenant.priority) * 2 + (1 if over_share else 0)


class EnginePriority:
    """The hook: each attempt's ``priority``, for the replica that took it."""

    name = "engine_priority"

    def __init__(self, admission: AdmissionState, policy_of: Callable[[str], str | None]) -> None:
        self.admission = admission
        self.policy_of = policy_of  # replica name -> the scheduling policy its engine reported (None: unknown)

    def start(self, exchange: Exchange) -> PrioritizedRequest | None:
        body = exchange.parsed()
        if body is None:
            return None
        return PrioritizedRequest(self, exchange, FIELD in body)


class PrioritizedRequest(RequestHook):
    """One request's engine priority, set again for every replica that takes it."""

    __slots__ = ("hook", "exchange", "written", "prefilling")

    def __init__(self, hook: EnginePriority, exchange: Exchange, written: bool) -> None:
        self.hook = hook
        self.exchange = exchange
        self.written = written  # the body holds a priority (the client's, or one the gateway wrote)
        self.prefilling = False  # the current attempt's lease awaits its first token

    def admitted(self, attempt: Attempt) -> None:
        hook, exchange = self.hook, self.exchange
        self.prefilling = exchange.stream
        if not exchange.stream and exchange.lease is not None:
            exchange.lease.first_token()
        if hook.policy_of(attempt.replica) == PRIORITY:
            over = not exchange.background and hook.admission.over_share(exchange.tenant)
            exchange.override(FIELD, engine_priority(exchange.tenant, over, exchange.background))
            self.written = True
        elif self.written:
            self.exchange.override(FIELD, 0)  # vLLM's default: no priority where the engine does not use it

    def relayed(self, block: Block) -> None:
        """The attempt's first event is its first token: its lease leaves prefill."""
        if self.prefilling and block.events:
            self.prefilling = False
            lease = self.exchange.lease
            if lease is not None:
                lease.first_token()

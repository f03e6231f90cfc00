"""What the request path asks of the state that decides: the contract between the hooks and transport and the
parts that own admission, routing, quotas, the engines' reconciliation and the request records.

In one process those are the parts themselves (``Admission`` and its ``Router``, ``SharedQuotas``,
``Reconciliation``, ``RequestRecords``). In a worker (``appliance.gateway.workers``) they are the decider's, asked
over a socket (``appliance.gateway.workers.remote``), so the request path is written once against this contract
and runs the same in both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from appliance.engine.contract import Replica
from appliance.gateway.admission.slots import Lease
from appliance.gateway.routing.request import RoutingRequest
from appliance.gateway.tenants.directory import Tenant
from appliance.gateway.tenants.quota import Cost, Refusal


class RoutingState(Protocol):
    """The replicas as the request path sees them, and what it tells the router."""

    def replicas(self) -> Sequence[Replica]: ...

    def any_eligible(self, exclude: frozenset[str] | set[str] = frozenset()) -> bool:
        """Whether a replica not in ``exclude`` could take a request now."""
        ...

    def note_relayed(self, replica: Replica) -> None:
        """Bytes from ``replica`` just reached the gateway (progress)."""
        ...

    def engine_failed(self, name: str) -> None:
        """An engine error answer was judged the engine's fault (it counts toward ejection)."""
        ...


class AdmissionState(Protocol):
    """Slots under each replica's limit, the queue and the tenants' fair share."""

    @property
    def router(self) -> RoutingState: ...

    @property
    def queue_timeout_seconds(self) -> float: ...

    async def acquire(self, exclude: frozenset[str] = frozenset(), request: RoutingRequest | None = None, *,
                      tenant: Tenant = ...) -> Lease: ...

    def acquire_idle(self, exclude: frozenset[str], request: RoutingRequest | None, *,
                     tenant: Tenant = ...) -> Lease: ...

    def over_share(self, tenant: Tenant) -> bool: ...

    def charge(self, tenant: Tenant, tokens: int) -> None: ...


class Held(Protocol):
    """A quota reservation, settled once to what the request used, or refunded whole."""

    def settle(self, used: float) -> None: ...

    def refund(self) -> None: ...


class QuotaStore(Protocol):
    """Quota buckets held outside this process (a Redis shared by several gateways, or a worker's decider): a
    reservation takes a round trip, and the store may be unreachable (``StoreUnavailable``)."""

    @property
    def fails_open(self) -> bool: ...

    @property
    def retry_after_seconds(self) -> int: ...

    def count_unchecked(self, direction: str) -> None:
        """A request admitted (``open``) or refused (``closed``) because the store did not answer."""
        ...

    async def reserve(self, tenant: Tenant, cost: Cost) -> Held | Refusal | None: ...

    def admit_unchecked(self, tenant: Tenant, cost: Cost) -> Held: ...


class ChargeLedger(Protocol):
    """Where the tokens charged per replica go, to be reconciled with the engines' own counters."""

    def charged(self, name: str, prompt: int, completion: int, finished: int = 0) -> None:
        """Tokens an engine reported for a tenant's work on replica ``name`` (prompt once per sequence), and the
        sequences among them it finished."""
        ...

    def unseen(self, name: str, tenant: str, n: int, prompt: int, completion: int, room: int) -> None:
        """Work on replica ``name`` no engine reported, as the gateway estimated it, to be charged to ``tenant``
        (as estimated, or as the engine counted it once the replica comes to rest)."""
        ...


class RecordSink(Protocol):
    """Where finished requests' records go (``gateway.request_records``)."""

    @property
    def enabled(self) -> bool: ...

    def add(self, record: Any) -> None: ...

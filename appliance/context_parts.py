"""The running appliance's parts as its context (``appliance.context``) names them: by what their readers use, as
Protocols, never by their classes.

The context sits at the bottom of the layers, below the parts it holds; so does this module, which imports nothing
of the appliance, not even for the type checker: every package, the gateway's lowest modules included, may use
both, and no import points up from them. The parts satisfy the Protocols by their shape; mypy checks that where
``create_app`` builds the context. Code that reads a new part through the context adds what it reads to the
Protocol here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, Self

from fastapi import Request
from fastapi.responses import Response

# -- the replicas ---------------------------------------------------------------------------------------------------


class ReplicaView(Protocol):
    """A replica as it is read through the context (``appliance.engine.contract.Replica`` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def url(self) -> str: ...

    @property
    def routable(self) -> bool: ...


class FleetLife(Protocol):
    """Replicas whose life the app owns (``appliance.engine.contract.Fleet``): started with it, stopped after it."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


# -- the live settings ----------------------------------------------------------------------------------------------


class EngineFacts(Protocol):
    """What the routes read of the engine section (``appliance.engine.settings.EngineSettings``)."""

    @property
    def max_model_len(self) -> int | None: ...

    @property
    def advertise_host(self) -> str | None: ...


class MonitoringFacts(Protocol):
    """What the routes read of the monitoring section (``appliance.monitoring.settings.MonitoringSettings``)."""

    @property
    def assets_dir(self) -> Path | None: ...


class LiveSettings(Protocol):
    """What is read of the running settings through the context (``appliance.settings.Settings`` is them)."""

    @property
    def served_model_name(self) -> str | None: ...

    @property
    def role(self) -> str: ...

    @property
    def engine(self) -> EngineFacts: ...

    @property
    def monitoring(self) -> MonitoringFacts: ...

    @property
    def credentials(self) -> Any:
        """The ``appliance.http.credentials.Credentials`` the auth checks take. Not named: appliance.http reads this
        context, so naming its type here would make a circle."""
        ...

    def replaced(self, values: Mapping[str, Any]) -> Self:
        """A copy with each key (top-level or ``section.key``) set to its value: how a hot reload makes the next
        live settings."""
        ...


# -- the data path --------------------------------------------------------------------------------------------------


class HealthView(Protocol):
    """The router's bookkeeping of one replica's health (``appliance.gateway.ejection.ReplicaHealth``)."""

    @property
    def ejected(self) -> bool: ...


class LoadView(Protocol):
    """An engine's own load reading (``appliance.engine.load.EngineLoad``)."""

    @property
    def read_at(self) -> float: ...

    @property
    def running(self) -> float | None: ...

    @property
    def waiting(self) -> float | None: ...


class RoutingFacts(Protocol):
    """What is read of the routing section the router runs on."""

    @property
    def metrics_stale_seconds(self) -> float: ...


class RouterView(Protocol):
    """The router (``appliance.gateway.router.Router``) as the health routes and the drain read it."""

    @property
    def routing(self) -> RoutingFacts: ...

    def eligible(self) -> Sequence[ReplicaView]:
        """The replicas a request could be sent to now."""
        ...

    def health_of(self, name: str) -> HealthView: ...

    def panic(self) -> bool: ...

    def in_flight(self, name: str | None = None) -> int:
        """Requests holding a slot at ``name``, or at every replica."""
        ...

    def loads(self) -> Mapping[str, LoadView]: ...


class SlotAuditView(Protocol):
    """Admission's check of its slots against what the engines report (``appliance.gateway.slots.SlotAudit``)."""

    def wedged(self) -> bool: ...

    def drifted(self, name: str) -> bool: ...


class AdmissionView(Protocol):
    """Admission control (``appliance.gateway.admission.Admission``): its queue and its slot audit."""

    @property
    def audit(self) -> SlotAuditView: ...

    @property
    def queue_length(self) -> int: ...


class UpstreamView(Protocol):
    """The forwarding side of the gateway: the OpenAI routes' one call, and what the drain waits for and cuts."""

    async def forward(self, request: Request, route: str, path: str, body: bytes, *, stream: bool, arrived: float,
                      prompt: str | None = None, parsed: dict[str, Any] | None = None) -> Response: ...

    def open_requests(self) -> int: ...

    async def cut_streams(self) -> int: ...


class TenantLookup(Protocol):
    """The tenant directory: whose a bearer key is (the tenant, kept on the request; None: not a key)."""

    def identify(self, key: str | None) -> object | None: ...


class RecordsView(Protocol):
    """The last requests' records (``appliance.gateway.records.RequestRecords``), JSON-ready."""

    @property
    def capacity(self) -> int: ...

    def __len__(self) -> int: ...

    def recent(self, limit: int = 50, tenant: str | None = None, replica: str | None = None,
               min_seconds: float | None = None, status: str | None = None) -> list[dict[str, Any]]: ...

    def get(self, id: str) -> dict[str, Any] | None: ...


class GatewayParts(Protocol):
    """The data path (``appliance.gateway.core.Gateway``) as it is read through the context."""

    @property
    def router(self) -> RouterView: ...

    @property
    def admission(self) -> AdmissionView: ...

    @property
    def upstream(self) -> UpstreamView: ...

    @property
    def tenants(self) -> TenantLookup: ...

    @property
    def records(self) -> RecordsView: ...

    def quota_store_state(self) -> dict[str, Any]: ...


# -- maintenance ----------------------------------------------------------------------------------------------------


class ControllerView(Protocol):
    """The one way in for maintenance actions (``appliance.maintenance.controller.MaintenanceController``)."""

    def drain(self, name: str, trigger: str) -> ReplicaView: ...

    def undrain(self, name: str, trigger: str) -> ReplicaView: ...

    def start_restart(self, name: str, trigger: str, reason: str = "") -> object:
        """Start one replica's restart in the background (the task is not awaited by the routes)."""
        ...

    def start_rolling_restart(self, trigger: str, reason: str = "") -> object: ...

    def replicas(self) -> Sequence[ReplicaView]: ...


class ReloadOutcome(Protocol):
    """What ``appliance reload`` answers (``appliance.maintenance.reload.ReloadResult``)."""

    @property
    def rolling_restart(self) -> bool: ...

    def as_dict(self) -> dict[str, Any]: ...


class ReloaderView(Protocol):
    def reload(self) -> ReloadOutcome: ...


class HandledAlerts(Protocol):
    """What the webhook did with one payload (``appliance.maintenance.webhook.Handled``)."""

    @property
    def ignored(self) -> int: ...

    @property
    def decisions(self) -> Sequence[object]: ...


class AlertHandler(Protocol):
    def handle(self, payload: Any) -> HandledAlerts:
        """``payload``: an ``appliance.maintenance.webhook.AlertmanagerPayload``, which maintenance's own route
        parses; the context only carries it."""
        ...


class ProgressView(Protocol):
    def is_hung(self, name: str) -> bool: ...


class MaintenanceParts(Protocol):
    """Maintenance (``appliance.maintenance.service.Maintenance``) as it is read through the context."""

    @property
    def controller(self) -> ControllerView: ...

    @property
    def reloader(self) -> ReloaderView: ...

    @property
    def alerts(self) -> AlertHandler: ...

    @property
    def progress(self) -> ProgressView: ...

    @property
    def leases(self) -> object | None:
        """Role gateway: maintenance's own ``LeaseBoard``, which its routes use as that class; None elsewhere."""
        ...


# -- the Batch API -------------------------------------------------------------------------------------------------


class BatchAPI(Protocol):
    """OpenAI's Files and Batches APIs (``appliance.batch.service.BatchService``): what the routes in
    ``appliance/gateway/routes/batches.py`` call. Per tenant (a tenant's name); ``tenant`` None on the batch calls is
    every tenant's, and ``operator`` names each batch's tenant (the admin routes). Answers are JSON-ready OpenAI
    objects; refusals are ``APIError``s."""

    async def upload(self, tenant: str, purpose: str, filename: str, data: bytes) -> dict[str, Any]: ...

    async def files(self, tenant: str, *, purpose: str | None = None, after: str | None = None, limit: int = 100,
                    order: str = "desc") -> dict[str, Any]: ...

    async def file(self, tenant: str, file_id: str) -> dict[str, Any]: ...

    async def content(self, tenant: str, file_id: str) -> bytes: ...

    async def delete_file(self, tenant: str, file_id: str) -> dict[str, Any]: ...

    async def create(self, tenant: str, *, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict[str, str] | None = None) -> dict[str, Any]: ...

    async def batch(self, tenant: str | None, batch_id: str, *, operator: bool = False) -> dict[str, Any]: ...

    async def batches(self, tenant: str | None, *, after: str | None = None, limit: int = 20,
                      status: str | None = None, operator: bool = False) -> dict[str, Any]: ...

    async def cancel(self, tenant: str | None, batch_id: str, *, operator: bool = False) -> dict[str, Any]: ...


# -- above the gateway and maintenance ------------------------------------------------------------------------------


class StatusView(Protocol):
    """The operator's view of the fleet (``appliance.status.FleetStatus``, which sits above the gateway and
    maintenance and so cannot be imported here): what the admin routes answer with."""

    def fleet(self, draining: bool) -> dict[str, Any]:
        """/admin/status: the whole fleet."""
        ...

    def replica(self, replica: Any) -> dict[str, Any]:
        """One replica's row, as the drain, undrain and restart routes answer: ``replica`` is the
        ``appliance.engine.contract.Replica`` the maintenance controller answered with, passed on as it is."""
        ...


class BodyBudgetView(Protocol):
    """The global budget of request-body bytes being received (``appliance.gateway.limits.BodyBudget``)."""

    @property
    def in_flight(self) -> int: ...


class KeyringView(Protocol):
    """The live credentials with the secrets a reload replaced, inside their overlap window
    (``appliance.http.credentials.Keyring``)."""

    def current(self) -> Any:
        """The ``appliance.http.credentials.Credentials`` to check a request against now."""
        ...


class ClientPathParts(Protocol):
    """What the OpenAI routes and their key check use of the gateway: the forwarding side and the tenants."""

    @property
    def upstream(self) -> UpstreamView: ...

    @property
    def tenants(self) -> TenantLookup: ...

"""The data path assembled: router, admission, the upstream proxy, the engine-load poller, request metrics, the
event-loop lag probe, the last requests' records (``records``) and the tenants (their directory, quotas and
accounting; ``update_tenants`` applies a reloaded configuration at once).

It knows replicas only through ``appliance.engine.contract.Replica`` and knows nothing of maintenance; the
composition root (``appliance.app``) builds it and hands the pieces maintenance needs as plain callables.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.trace import TracerProvider

from appliance.engine.load import EngineLoadPoller
from appliance.gateway.admission.queue import Admission
from appliance.gateway.observation.event_loop import EventLoopLag
from appliance.gateway.observation.metrics import CLIENT_ROUTES, COUNTED, RequestMetrics
from appliance.gateway.observation.records import RequestRecords
from appliance.gateway.routing.kv_events.hub import KvEventsHub
from appliance.gateway.routing.router import Router
from appliance.gateway.tenants.accounting import TenantAccounting
from appliance.gateway.tenants.directory import TenantDirectory
from appliance.gateway.tenants.quota import Quotas
from appliance.gateway.tenants.quota_store import SharedQuotas
from appliance.gateway.tenants.reconcile import Reconciliation
from appliance.gateway.tenants.revocation import Revocation
from appliance.gateway.tenants.settings import TenantSettings
from appliance.gateway.upstream.transport import Upstream

log = logging.getLogger(__name__)


@dataclass
class Gateway:
    router: Router
    admission: Admission
    upstream: Upstream
    poller: EngineLoadPoller
    metrics: RequestMetrics
    tracer_provider: TracerProvider
    tenants: TenantDirectory
    accounting: TenantAccounting
    quotas: Quotas
    event_loop: EventLoopLag
    records: RequestRecords  # the last requests' records (GET /admin/requests): gateway.request_records

    reconciliation: Reconciliation | None = None  # the tenants' charges against the engines' own counters
    revocation: Revocation | None = None  # the hook that ends a removed tenant's streams
    kv_events: KvEventsHub | None = None  # the engines' KV-cache event subscriptions (precise prefix routing)
    quota_store: SharedQuotas | None = None  # the quota buckets shared with other gateways (None: ``quotas``)

    def quota_store_state(self) -> dict[str, Any]:
        """Where the quotas live and, for a shared store, whether it answers: for health and status."""
        return {"kind": "memory"} if self.quota_store is None else self.quota_store.state()

    def update_tenants(self, tenants: Iterable[TenantSettings], flat_keys: Iterable[str], *,
                       overlap_seconds: float = 0.0) -> list[str]:
        """A new tenant configuration, applied at once (``appliance reload``): keys, priorities, weights and quota
        rates; every bucket's level is kept, a removed tenant's too (it gets it back if added again). A key a
        tenant no longer has stays valid for ``overlap_seconds``; a removed tenant's keys are revoked at once and
        its requests ended: queued ones answered 401, streams ended with an error event. Returns the removed
        tenants' names."""
        before = {tenant.name for tenant in self.tenants.tenants()}
        self.tenants.update(tenants, flat_keys, overlap_seconds=overlap_seconds)
        configured = self.tenants.tenants()
        self.quotas.update(configured)
        self.accounting.configure(tenant.name for tenant in configured)
        removed = sorted(before - {tenant.name for tenant in configured})
        self.admission.readmit(tenant.name for tenant in configured)
        if removed:
            queued = self.admission.revoke(removed)
            streams = self.revocation.revoke(removed) if self.revocation is not None else 0
            log.warning("tenants removed by a reload: %s; their keys are revoked (%d queued request(s) and %d "
                        "stream(s) ended)", ", ".join(removed), queued, streams)
        return removed

    def count_unproxied(self, path: str, scope: MutableMapping[str, Any], status: int) -> None:
        """An answer the proxy never saw (validation, auth, drain...): the fleet's count, and the tenant's when
        its key was already identified."""
        first = path in CLIENT_ROUTES and not scope.get(COUNTED)
        self.metrics.count_unproxied(path, scope, status)
        tenant = (scope.get("state") or {}).get("tenant")
        if first and tenant is not None:
            self.accounting.answered(tenant.name, status)

"""The fleet as an operator sees it: what /admin/status returns and `appliance status` prints.

It is the one view that joins the data path (routing, admission, engine readings) with maintenance (hung
replicas, restarts), so it lives above both, next to the composition root.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends

from appliance.context import Context
from appliance.engine.contract import Replica
from appliance.gateway.core import Gateway
from appliance.http.guards import require_admin
from appliance.maintenance.service import Maintenance
from appliance.settings import Settings

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], tags=["admin"])


@dataclass
class FleetStatus:
    settings: Settings
    gateway: Gateway
    maintenance: Maintenance

    def fleet(self, draining: bool) -> dict[str, Any]:
        router = self.gateway.router
        replicas = list(router.replicas())
        return {
            "model": self.settings.served_model_name,
            "kv_cache_dtype": self.settings.engine.kv_cache_dtype,
            "draining": draining,
            "ready_replicas": sum(1 for r in replicas if r.routable),
            "queue_length": self.gateway.admission.queue_length,
            "in_flight": router.in_flight(),
            "replicas": [self.replica(r) for r in replicas],
            "tenants": self.tenants(),
            "quota_store": self.gateway.quota_store_state(),
            "maintenance": self.maintenance.status(),
        }

    def tenants(self) -> list[dict[str, Any]]:
        """Every tenant, the heaviest first (prompt + completion tokens since start), with what it holds now:
        who is using the engines, and who waits."""
        admission = self.gateway.admission
        return [{**row, "in_flight": admission.tenant_in_flight(row["tenant"]),
                 "queued": admission.tenant_queued(row["tenant"])} for row in self.gateway.accounting.summary()]

    def replica(self, replica: Replica) -> dict[str, Any]:
        router = self.gateway.router
        status = replica.status
        health = router.health_of(replica.name)
        load = router.load.get(replica.name)
        return {
            "name": replica.name,
            "url": replica.url,
            "state": status.state.value,
            "placement": replica.placement.describe() if replica.placement else None,
            "pid": status.pid,
            "outstanding": router.in_flight(replica.name),
            "concurrency_limit": self.gateway.admission.limit_of(replica.name),
            "ejected": health.ejected,
            "ejection_reason": health.reason or None,
            "kv_cache_usage": load.kv_cache_usage if load else None,
            "engine_waiting": load.waiting if load else None,
            "engine_running": load.running if load else None,
            "scheduling_policy": load.scheduling_policy if load else None,  # None: the engine did not say
            "restarts": status.restarts,
            "crashes": status.crashes,
            "spawn_failures": status.spawn_failures,
            "last_error": status.last_error,
            "model_load_seconds": status.load_seconds,
            "last_start_time": status.last_start_time,
            "starts": status.starts,
            "planned_restart": status.planned_restart,
            "hung": self.maintenance.progress.is_hung(replica.name),
            "last_maintenance_restart": self.maintenance.controller.last_restart.get(replica.name),
        }


@router.get("/status")
async def status(ctx: Context) -> dict[str, Any]:
    return ctx.fleet_status.fleet(ctx.live.draining)

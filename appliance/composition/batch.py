"""The Batch API built from the settings: the batch section, the state folder, the served model, and the gateway
whose request path its lines take (``appliance.batch``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from appliance.batch.metrics import BatchMetrics
from appliance.batch.postgres import PostgresBatchStore
from appliance.batch.runner import BatchRunner
from appliance.batch.service import BatchService, Storage
from appliance.batch.settings import UPLOAD_FRAMING_BYTES, BatchSettings
from appliance.batch.store import BatchStore
from appliance.batch.submit import GatewaySubmitter
from appliance.gateway.core import Gateway
from appliance.gateway.intake.limits import BodyLimit
from appliance.settings import Settings

UPLOAD_PATH = "/v1/files"


@dataclass(frozen=True)
class Batch:
    """The running Batch API: the service the routes call, the runner that sends the lines, their storage."""

    service: BatchService
    runner: BatchRunner
    storage: Storage

    def start(self) -> None:
        self.runner.start()

    async def stop(self) -> None:
        """Before the engines stop: lines in flight are given back (they run again after the next start)."""
        await self.runner.stop()
        self.storage.close()


def build_batch(settings: Settings, gateway: Gateway, registry: CollectorRegistry,
                draining: Callable[[], bool]) -> Batch | None:
    """None where the Batch API is off, or on a node pod (which serves no /v1)."""
    section = settings.batch
    if not section.enabled or settings.role == "node":
        return None
    root = settings.state_dir / "batch"
    storage = Storage(_database(section, root), section.files_dir or root / "files")
    service = BatchService(section, storage, served_model=settings.served_model_name,
                           max_model_len=settings.engine.max_model_len)
    admission = gateway.admission
    admission.idle_headroom = section.headroom_fraction
    runner = BatchRunner(section, storage, GatewaySubmitter(gateway.upstream, admission, gateway.tenants.get),
                         admission, tenant_known=lambda name: gateway.tenants.get(name) is not None,
                         draining=draining)
    runner.metrics = BatchMetrics(registry, lambda: runner.summary, runner.in_flight)
    service.on_change = runner.wake
    admission.on_wait = runner.preempt  # an interactive request queues: batch work gives its slots back
    admission.on_arrival = runner.yield_to_interactive  # an interactive request arrives: no new line for a while
    return Batch(service, runner, storage)


def _database(section: BatchSettings, root: Path) -> Path | Callable[[], BatchStore]:
    """The SQLite file, or, with ``batch.database_url``, what opens the PostgreSQL store every gateway shares."""
    if section.database_url is None:
        return section.database or root / "batch.sqlite3"
    url, password = section.database_url, section.database_password
    return lambda: PostgresBatchStore(url, password=password, schema=section.database_schema,
                                      claim_seconds=section.claim_seconds,
                                      connect_timeout_seconds=section.database_connect_timeout_seconds)


def upload_limits(settings: Settings) -> dict[str, BodyLimit]:
    """The intake's body limit for uploads: a batch file is larger than any request (gateway.max_request_bytes),
    and no body can be larger than the whole body budget (intake.body_budget_bytes), which then names the limit."""
    if not settings.batch.enabled:
        return {}
    wanted, budget = settings.batch.max_file_bytes + UPLOAD_FRAMING_BYTES, settings.intake.body_budget_bytes
    limit = BodyLimit(wanted, "batch.max_file_bytes") if wanted <= budget else BodyLimit(budget,
                                                                                         "intake.body_budget_bytes")
    return {UPLOAD_PATH: limit}

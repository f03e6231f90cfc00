"""The Batch API's metrics as a scrape reads them: every series is the runner's last reading of the store, and a
batch's series go when it ends (the ``batch`` label stays bounded)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from appliance.batch.metrics import BatchMetrics
from appliance.batch.model import BatchRecord, Status, Summary


def _batch(id_: str, tenant: str, expires_at: int, *, total: int, completed: int, failed: int) -> BatchRecord:
    return BatchRecord(id=id_, tenant=tenant, endpoint="/v1/chat/completions", input_file_id="file-x",
                       completion_window="24h", status=Status.IN_PROGRESS, created_at=expires_at - 86_400,
                       expires_at=expires_at, total=total, completed=completed, failed=failed)


def test_each_running_batch_exports_its_deadline_beside_its_pending_lines() -> None:
    """What ApplianceBatchWindowMissed sets against each other: the lines still pending and when the batch
    expires, under the same tenant and batch labels."""
    summary = Summary({("team-a", "in_progress"): 2, ("team-a", "expired"): 1},
                      [_batch("batch_1", "team-a", 1_800_000_000, total=10, completed=4, failed=1),
                       _batch("batch_2", "team-a", 1_800_003_600, total=5, completed=0, failed=0)])
    registry = CollectorRegistry()
    BatchMetrics(registry, lambda: summary, dict)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("appliance_batch_expiry_timestamp_seconds", tenant="team-a", batch="batch_1") == 1_800_000_000
    assert value("appliance_batch_expiry_timestamp_seconds", tenant="team-a", batch="batch_2") == 1_800_003_600
    assert value("appliance_batch_lines", tenant="team-a", batch="batch_1", state="pending") == 5
    assert value("appliance_batches", tenant="team-a", status="expired") == 1
    assert value("appliance_batches", tenant="team-a", status="completed") == 0  # every status of the tenant


def test_an_ended_batch_leaves_no_deadline_series() -> None:
    summaries = [Summary({("team-a", "in_progress"): 1},
                         [_batch("batch_1", "team-a", 1_800_000_000, total=1, completed=0, failed=0)]),
                 Summary({("team-a", "completed"): 1}, [])]
    registry = CollectorRegistry()
    BatchMetrics(registry, lambda: summaries[0], dict)
    assert registry.get_sample_value("appliance_batch_expiry_timestamp_seconds",
                                     {"tenant": "team-a", "batch": "batch_1"}) == 1_800_000_000
    summaries.pop(0)
    assert registry.get_sample_value("appliance_batch_expiry_timestamp_seconds",
                                     {"tenant": "team-a", "batch": "batch_1"}) is None

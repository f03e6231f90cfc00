"""Forward-progress liveness: running requests and a standing token counter for hung_after_seconds = hung."""

from prometheus_client import CollectorRegistry, generate_latest

from appliance.engine.load import EngineLoad
from appliance.maintenance.metrics import MaintenanceCollector
from appliance.maintenance.progress import ProgressMonitor


def monitor(loads: dict) -> ProgressMonitor:
    return ProgressMonitor(lambda: ["replica-0", "replica-1"], lambda: loads, hung_after_seconds=30)


def test_running_without_new_tokens_is_hung_and_progress_clears_it():
    loads = {"replica-0": EngineLoad(running=2, generation_tokens_total=100, read_at=0),
             "replica-1": EngineLoad(running=2, generation_tokens_total=100, read_at=0)}
    progress = monitor(loads)
    for t in range(0, 31, 5):
        loads["replica-0"] = EngineLoad(running=2, generation_tokens_total=100, read_at=t)
        loads["replica-1"] = EngineLoad(running=2, generation_tokens_total=100 + t, read_at=t)
        progress.check(t)
    assert progress.hung() == ["replica-0"]
    loads["replica-0"] = EngineLoad(running=2, generation_tokens_total=101, read_at=35)
    assert progress.check(35) == []


def test_idle_replicas_and_missing_or_stale_readings_are_not_hung():
    loads = {"replica-0": EngineLoad(running=0, generation_tokens_total=5, read_at=0)}
    progress = monitor(loads)
    for t in range(0, 100, 10):
        loads["replica-0"] = EngineLoad(running=0, generation_tokens_total=5, read_at=t)
        progress.check(t)
    assert progress.hung() == []  # replica-1 has no reading at all
    loads["replica-0"] = EngineLoad(running=3, generation_tokens_total=5, read_at=100)
    progress.check(100)
    progress.check(200)  # the reading is now 100 s old: unknown, not hung
    assert progress.hung() == []


def test_hung_gauge():
    loads = {"replica-0": EngineLoad(running=1, generation_tokens_total=1, read_at=0)}
    progress = monitor(loads)
    progress.check(0)
    loads["replica-0"] = EngineLoad(running=1, generation_tokens_total=1, read_at=40)
    progress.check(40)
    registry = CollectorRegistry()
    registry.register(MaintenanceCollector(progress.names, progress.is_hung, lambda: None))
    page = generate_latest(registry).decode()
    assert 'appliance_replica_hung{replica="replica-0"} 1.0' in page
    assert 'appliance_replica_hung{replica="replica-1"} 0.0' in page
    assert "appliance_maintenance_next_window_timestamp_seconds" not in page  # disabled: absent

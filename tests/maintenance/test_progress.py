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


def test_a_gauge_that_reads_idle_does_not_hide_a_hung_replica_the_gateway_has_requests_at():
    """On a loaded host vLLM's running gauge can read 0 while requests run: the gateway's own in-flight count says
    the replica is busy, and a standing counter then means hung."""
    loads = {"replica-0": EngineLoad(running=0, generation_tokens_total=100, read_at=0)}
    progress = ProgressMonitor(lambda: ["replica-0"], lambda: loads, hung_after_seconds=30,
                               in_flight=lambda name: 2)
    for t in range(0, 31, 5):
        loads["replica-0"] = EngineLoad(running=0, generation_tokens_total=100, read_at=t)
        progress.check(t)
    assert progress.hung() == ["replica-0"]


def test_bytes_relayed_from_a_replica_are_progress_when_its_counter_lags():
    """A generation counter that stands still while the gateway relays the replica's stream is a lagging counter,
    not a hung engine; once the bytes stop too, the standing counter counts again."""
    loads = {"replica-0": EngineLoad(running=2, generation_tokens_total=100, read_at=0)}
    relayed = {"replica-0": 0.0}
    progress = ProgressMonitor(lambda: ["replica-0"], lambda: loads, hung_after_seconds=30,
                               relayed_at=relayed.get)
    for t in range(0, 61, 5):
        relayed["replica-0"] = t - 0.5  # a chunk just before each check
        loads["replica-0"] = EngineLoad(running=2, generation_tokens_total=100, read_at=t)
        progress.check(t)
    assert progress.hung() == []
    for t in range(65, 100, 5):  # the stream stops; the counter still stands
        loads["replica-0"] = EngineLoad(running=2, generation_tokens_total=100, read_at=t)
        progress.check(t)
    assert progress.hung() == ["replica-0"]
